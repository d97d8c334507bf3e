"""The client's bounds against a slow or hostile store: how long a call may take, how slowly a download may
go, how large an answer or a blob may be.

A store (or a man in the middle) that trickles an answer a byte at a time, serves a blob a byte per
connection, or answers without end meets these bounds and the caller gets a typed error
(:class:`~cgstore_client.errors.DeadlineExceeded`, :class:`~cgstore_client.errors.TooLarge`); a boot
serves eager and says why. Each bound is a :class:`Limits` field: ``Client(limits=Limits(...))``, else
its ``CGSTORE_*`` environment variable (:data:`ENVIRONMENT`), else its default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from cgstore_client.errors import ConfigError

#: Limits field -> the environment variable that sets it.
ENVIRONMENT = {
    "call_deadline_s": "CGSTORE_CALL_DEADLINE_S",
    "max_answer_bytes": "CGSTORE_MAX_ANSWER_BYTES",
    "min_bytes_per_s": "CGSTORE_MIN_BYTES_PER_S",
    "throughput_window_s": "CGSTORE_THROUGHPUT_WINDOW_S",
    "max_blob_bytes": "CGSTORE_MAX_BLOB_BYTES",
}


@dataclass(frozen=True)
class Limits:
    """Bounds on what the client waits for and reads.

    - ``call_deadline_s``: one API call (resolve, discover, a record, the JWKS...) from its first
      connection to the last byte of its answer, every retry included. A call uploading N bytes
      gets N / ``min_bytes_per_s`` seconds more.
    - ``max_answer_bytes``: one API answer's body (JSON), read as a stream and cut at the bound.
    - ``min_bytes_per_s`` over each ``throughput_window_s``: a blob download's floor, counting
      every connection and reconnect of the blob (a server sending a byte per connection makes
      progress, so retries alone would follow it forever). A connection silent for a window is dropped.
    - ``max_blob_bytes``: a blob whose size the caller does not state (``fetch_blob(size=None)``);
      a stated size is itself the bound.
    """

    call_deadline_s: float = 120.0
    max_answer_bytes: int = 32 << 20
    min_bytes_per_s: int = 64 << 10
    throughput_window_s: float = 30.0
    max_blob_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{ENVIRONMENT[field.name]} ({field.name}) must be a positive number, not {value!r}")

    @classmethod
    def from_env(cls, **given: float | int) -> Limits:
        """The given fields, the others from the environment or their defaults."""
        values: dict[str, float | int] = {}
        for field in dataclasses.fields(cls):
            if field.name in given:
                values[field.name] = given.pop(field.name)
            elif raw := os.environ.get(ENVIRONMENT[field.name], "").strip():
                values[field.name] = _number(ENVIRONMENT[field.name], raw, float if field.name.endswith("_s") else int)
        if given:
            raise TypeError(f"unknown limits: {sorted(given)}")
        return cls(**values)


def _number(env: str, raw: str, kind: type) -> float | int:
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{env} must be a {'number' if kind is float else 'whole number'}, not {raw!r}") from None
