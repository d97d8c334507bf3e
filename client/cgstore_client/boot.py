"""What a worker asks for at boot, and what it gets back: ``Want`` in, ``Loaded`` or ``Eager`` out."""

from __future__ import annotations

from dataclasses import dataclass

from cgstore_client.keys import validate_key


@dataclass(frozen=True)
class Want:
    """One key the worker would like to serve compiled; ``mandatory`` ones never fall back to eager."""

    key: str
    mandatory: bool = False

    def __post_init__(self) -> None:
        validate_key(self.key)
