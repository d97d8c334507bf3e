"""What a worker asks for at boot, and what it gets back: ``Want`` in, ``Loaded`` or ``Eager`` out.

``Loaded.admits(**request)`` is the request-time check: the envelope (the
declared serving region) and the input contract's dim ranges together. AOTI
does not enforce declared ranges at run time (a batch of 65 ran on a package
declared ``[1, 64]``), so a request outside them must be routed eager before
it reaches the compiled graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cgstore_client.errors import CgstoreError, DeadlineExceeded, IntegrityError, NotFound, Offline
from cgstore_client.keys import OUT_OF_ENVELOPE_REASON, Admission, Envelope, validate_key

#: What ``Loaded.admits`` answers (the envelope's own verdict type).
Verdict = Admission

# Reasons a want is served eager; each ``Eager.reason`` starts with one of these.
MISS = "miss"
OFFLINE_NOT_CACHED = "offline and not cached"
RECEIPT_INVALID = "receipt invalid"
NOT_ROOT = "not a root record"
INTEGRITY = "artifact failed verification"
UNAVAILABLE = "store unavailable"
#: Past the client's call deadline or below its download throughput (``cgstore_client.limits``).
TOO_SLOW = "store too slow"


def exact_miss(family: str, key: str) -> str:
    """Why an exact key missed, in the key's terms: all the store's answer tells (a bare ``miss``), so nothing
    about records this token cannot read. A ck1 key names one graph, envelope, sm and toolchain together:
    which axis differs is a declaration's question (``boot``, ``cgstore-client discover --explain``)."""
    return (
        f"{MISS}: no live record of {key} in family {family!r} that this token can read "
        "(a ck1 key is exact: another graph, envelope, sm or toolchain is another key)"
    )


def reason_for(error: CgstoreError) -> str:
    """The reason a want is served eager because fetching it raised ``error``."""
    if isinstance(error, Offline):
        return f"{OFFLINE_NOT_CACHED}: {error}"
    if isinstance(error, IntegrityError):
        return f"{INTEGRITY}: {error}"
    if isinstance(error, NotFound):
        return f"{MISS}: {error}"  # yanked or gone between the resolve and the download
    if isinstance(error, DeadlineExceeded):
        return f"{TOO_SLOW}: {error}"
    return f"{UNAVAILABLE}: {error}"


@dataclass(frozen=True)
class Want:
    """One key the worker would like to serve compiled; ``mandatory`` ones never fall back to eager.

    ``root_only``: serve only a record whose verified receipt proves it is the
    platform's, under ``root/`` (``receipts.proves_root``); anything else is
    served eager (``not a root record: ...``), like a miss.
    """

    key: str
    mandatory: bool = False
    root_only: bool = False

    def __post_init__(self) -> None:
        validate_key(self.key)


@dataclass(frozen=True)
class Eager:
    """A want served eager, and why (``miss: no live record of ck1-… …``, ``offline and not cached: ...``, ``receipt invalid: ...``,
    ``not a root record: ...``, ``store unavailable: ...``, ``store too slow: ...``)."""

    key: str
    reason: str


@dataclass(frozen=True)
class Loaded:
    """A want served compiled: verified files on local disk and the record they came from."""

    key: str
    artifact_path: Path
    component_paths: Mapping[str, Path] = field(default_factory=dict)
    # The record and its receipt are long: kept out of the repr (``print(loaded)`` is one line).
    record: Mapping[str, Any] = field(default_factory=dict, repr=False)
    repo: str | None = None
    lane: str | None = None
    lane_reason: str | None = None
    receipt: object = field(default=None, repr=False)

    @property
    def input_contract(self) -> Mapping[str, Any]:
        return self.record.get("input_contract") or {}

    @property
    def binding_table(self) -> list[Mapping[str, Any]]:
        return list(self.record.get("binding_table") or [])

    @property
    def manifest(self) -> Mapping[str, Any]:
        return self.record.get("manifest") or {}

    @property
    def envelope(self) -> Envelope:
        return Envelope.from_document(self.manifest["axes"]["envelope"])

    def admits(self, *, inputs: Mapping[str, object] | None = None, **request: object) -> Verdict:
        """Is this request inside the envelope and the contract's dim ranges?

        ``request`` holds the envelope fields (``width``/``height`` or ``shape``,
        ``text_len``, ``guidance``, ``batch_size``); ``inputs`` maps contract
        input names (``inputs_x``) or paths (``args[0]['x']``) to shapes or tensors.
        """
        verdict = self.envelope.admits(**request)
        if not verdict:
            return verdict
        return admits_contract(self.input_contract, inputs or {})


def _shape(value: object) -> tuple[int, ...]:
    shape = getattr(value, "shape", value)
    return tuple(int(d) for d in shape)  # type: ignore[union-attr]


def admits_contract(contract: Mapping[str, Any], inputs: Mapping[str, object]) -> Verdict:
    """Check given input shapes against the contract's declared dims (static sizes and symbol ranges)."""
    dims = contract.get("dims") or {}
    for spec in contract.get("inputs") or []:
        given = inputs.get(spec["name"], inputs.get(spec.get("path", ""), None))
        if given is None:
            continue
        shape = _shape(given)
        declared = spec.get("shape") or []
        if len(shape) != len(declared):
            return _refused(spec["name"], f"{spec['name']} has rank {len(shape)}, declared {len(declared)}")
        for axis, (size, want) in enumerate(zip(shape, declared, strict=True)):
            if isinstance(want, int):
                if size != want:
                    return _refused(f"{spec['name']}[{axis}]", f"{spec['name']} dim {axis} is {size}, declared {want}")
            elif want in dims:
                low, high = dims[want].get("min"), dims[want].get("max")
                if (low is not None and size < low) or (high is not None and size > high):
                    return _refused(
                        f"{spec['name']}[{axis}]",
                        f"{spec['name']} dim {axis} ({want}) is {size}, declared [{low}, {high}]",
                    )
    return Admission(admitted=True)


def _refused(axis: str, detail: str) -> Verdict:
    return Admission(admitted=False, axis=axis, reason=OUT_OF_ENVELOPE_REASON, detail=detail)
