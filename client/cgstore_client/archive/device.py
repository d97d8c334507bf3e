"""Device facts: what AOTInductor recorded about the machine it compiled for, and the ``sm`` it implies.

AOTI writes ``<wrapper>_metadata.json`` (and a copy per kernel source) into
``data/aotinductor/<model>/`` with ``AOTI_DEVICE_KEY`` (``cpu``/``cuda``),
``AOTI_PLATFORM``, ``AOTI_MACHINE``, ``AOTI_CPU_ISA`` (the vector ISA inductor
picked, e.g. ``"AVX512 AVX512_VNNI AMX_TILE"``) and
``AOTI_COMPUTE_CAPABILITY`` (``"90"`` for a CUDA 9.0 card, empty on CPU);
user metadata from ``aot_inductor.metadata`` rides along in the same file.

``sm`` (docs/design.md, "Vocabulary"): ``sm_<cc>`` for CUDA, and for CPU
``cpu-<machine>-<ISA tokens lowercased, sorted, joined by +>`` through
:func:`cgstore_client.keys.cpu_sm`, so the mint (which asks torch) and the
store (which reads the archive) spell one host one way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cgstore_client.archive.errors import DeviceFactsInvalid
from cgstore_client.errors import KeyInvalid
from cgstore_client.keys import cpu_sm, validate_sm

__all__ = ["AOTI_FACT_KEYS", "DeviceFacts", "device_facts_from_aoti_metadata", "sm_for_device"]

#: The keys AOTI itself writes; anything else in the file is user metadata.
AOTI_FACT_KEYS = ("AOTI_DEVICE_KEY", "AOTI_PLATFORM", "AOTI_MACHINE", "AOTI_CPU_ISA", "AOTI_COMPUTE_CAPABILITY")


@dataclass(frozen=True)
class DeviceFacts:
    """The device an archive was compiled for, as AOTI recorded it, and its canonical ``sm``."""

    device_key: str
    platform: str
    machine: str
    cpu_isa: tuple[str, ...]
    compute_capability: str
    sm: str

    def to_document(self) -> dict[str, object]:
        return {
            "device_key": self.device_key,
            "platform": self.platform,
            "machine": self.machine,
            "cpu_isa": list(self.cpu_isa),
            "compute_capability": self.compute_capability,
            "sm": self.sm,
        }


def sm_for_device(device_key: str, *, machine: str, cpu_isa: Sequence[str], compute_capability: str) -> str:
    """The canonical ``sm`` for a device; :class:`DeviceFactsInvalid` when the facts spell no known one."""
    if device_key == "cuda":
        if not compute_capability.isdigit():
            # ROCm records a gfx name here; the store has no sm spelling for it.
            raise DeviceFactsInvalid(f"CUDA compute capability {compute_capability!r} is not a number")
        try:
            return validate_sm(f"sm_{int(compute_capability)}")
        except KeyInvalid as exc:
            raise DeviceFactsInvalid(str(exc)) from None
    if device_key == "cpu":
        try:
            return cpu_sm(machine, cpu_isa)
        except KeyInvalid as exc:
            raise DeviceFactsInvalid(f"CPU facts machine={machine!r} isa={list(cpu_isa)!r}: {exc}") from None
    raise DeviceFactsInvalid(f"device key {device_key!r} has no sm spelling (only 'cuda' and 'cpu')")


def _fact(document: Mapping[str, object], key: str, where: str) -> str:
    value = document.get(key, "")
    if not isinstance(value, str):
        raise DeviceFactsInvalid(f"{where}: {key} must be a string, got {type(value).__name__}")
    return value


def device_facts_from_aoti_metadata(documents: Mapping[str, object]) -> DeviceFacts:
    """Device facts from every AOTI ``*_metadata.json`` of one model (``{entry name: decoded JSON}``).

    All files must agree on every AOTI fact: one archive, one device.
    """
    if not documents:
        raise DeviceFactsInvalid("the archive has no AOTI *_metadata.json: its device is unknown")
    facts: dict[str, str] | None = None
    first_name = ""
    for name, document in sorted(documents.items()):
        if not isinstance(document, Mapping):
            raise DeviceFactsInvalid(f"{name} must be a JSON object")
        these = {key: _fact(document, key, name) for key in AOTI_FACT_KEYS}
        if facts is None:
            facts, first_name = these, name
        elif these != facts:
            raise DeviceFactsInvalid(f"{name} and {first_name} record different devices: {these} vs {facts}")
    assert facts is not None
    if not facts["AOTI_DEVICE_KEY"]:
        raise DeviceFactsInvalid(f"{first_name} has no AOTI_DEVICE_KEY")
    isa = tuple(facts["AOTI_CPU_ISA"].split())
    return DeviceFacts(
        device_key=facts["AOTI_DEVICE_KEY"],
        platform=facts["AOTI_PLATFORM"],
        machine=facts["AOTI_MACHINE"],
        cpu_isa=isa,
        compute_capability=facts["AOTI_COMPUTE_CAPABILITY"],
        sm=sm_for_device(
            facts["AOTI_DEVICE_KEY"],
            machine=facts["AOTI_MACHINE"],
            cpu_isa=isa,
            compute_capability=facts["AOTI_COMPUTE_CAPABILITY"],
        ),
    )
