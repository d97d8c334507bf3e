"""Discovery by declaration: the derivations a worker and the store compute identically (issue 16).

A worker booting without a ck1 key (which needs ``torch.export`` of the live
model, 0.5-1.8 s) declares what it will run and asks the store for the records
that match (``POST /v1/compiled-graphs:discover``). Three derivations make
that declaration, each computable without tracing:

``signature_from_table(binding_table, ties)`` / ``signature_from_module(module)``
    The binding signature ``bs1:<blake3 hex>``: which tensors the artifact
    binds from the checkpoint, by name, dtype and shape. From an archive's
    binding table it is the rows a ``state_dict`` holds (parameters and
    persistent buffers bound by name at load, as admission's binding policy
    says; components' derived constants, lifted literals and folded constants
    are the artifact's own); from a live module it is ``named_parameters`` plus
    persistent buffers, i.e. its ``state_dict``. Names that are one tensor (a
    tie) count once, under the smallest name, as the loader binds a tie from
    whichever name the checkpoint holds. The hashed document is the sorted
    list of ``[fqn, dtype, shape]``::

        bs1 = "bs1:" + blake3(canonical_json([[fqn, dtype, shape], ...])).hexdigest()

``code_fingerprint(model)``
    ``cf1:<blake3 hex>`` over the sorted blake3 digests of the source files
    defining the classes of ``model.modules()`` (content, not paths; classes
    without a source file, builtins and C++, are skipped).

``discovery_digest(family, envelope_digest, sm, toolchain_digest, recorded)``
    What discover matches on: the ck1 axes without the graph (which is what
    tracing would measure), plus the recorded versions of the model libraries
    (which reach a ck1 key only through the graph, so must be matched here).
    ``envelope_digest`` and ``toolchain_digest`` are ``Envelope.digest`` and
    ``Toolchain.digest``, the ck1 derivation's own; a library absent from
    ``recorded`` is absent from the document (hashed documents hold no null).

Pure Python: torch is imported only by :func:`signature_from_module`.
``tests/vectors/binding.json`` pins the exact bytes.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import blake3

from cgstore_client.keys import RECORDED_ONLY_COMPONENTS, canonical_json, digest

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = [
    "BINDING_SIGNATURE_PREFIX",
    "CODE_FINGERPRINT_PREFIX",
    "code_fingerprint",
    "discovery_digest",
    "fingerprint_from_digests",
    "is_binding_signature",
    "is_code_fingerprint",
    "is_release",
    "from_checkpoint",
    "signature_from_module",
    "signature_from_table",
]

BINDING_SIGNATURE_PREFIX = "bs1:"
CODE_FINGERPRINT_PREFIX = "cf1:"
_BINDING_SIGNATURE_RE = re.compile(r"\Abs1:[0-9a-f]{64}\Z")
_CODE_FINGERPRINT_RE = re.compile(r"\Acf1:[0-9a-f]{64}\Z")
#: A release label is a name, spelled like a repo name (never normalized), up to 128 characters.
_RELEASE_RE = re.compile(r"\A[a-z0-9][a-z0-9._-]{0,127}\Z", re.ASCII)
#: Constants whose value a ``state_dict`` checkpoint carries.
_CHECKPOINT_KINDS = frozenset({"PARAMETER", "BUFFER"})


def is_binding_signature(value: object) -> bool:
    return isinstance(value, str) and _BINDING_SIGNATURE_RE.match(value) is not None


def is_code_fingerprint(value: object) -> bool:
    return isinstance(value, str) and _CODE_FINGERPRINT_RE.match(value) is not None


def is_release(value: object) -> bool:
    return isinstance(value, str) and _RELEASE_RE.match(value) is not None


def from_checkpoint(row: Mapping[str, Any]) -> bool:
    """Is this binding-table row's value read from the checkpoint (the ``state_dict``)?

    Parameters and persistent buffers bound by name at load; a non-persistent
    buffer is not in a ``state_dict``, and a folded constant is the program's own.
    """
    return row["kind"] in _CHECKPOINT_KINDS and row.get("persistent", "true") == "true" and row["binding"] == "DYNAMIC"


def _signature(entries: Iterable[tuple[str, str, list[int]]], ties: Iterable[Iterable[str]]) -> str:
    """``bs1:`` over the sorted, de-duplicated ``[fqn, dtype, shape]`` with each tie under its smallest name."""
    folded = {name: min(group) for group in map(tuple, ties) for name in group}
    rows = {(folded.get(fqn, fqn), dtype, tuple(shape)) for fqn, dtype, shape in entries}
    document = [[fqn, dtype, list(shape)] for fqn, dtype, shape in sorted(rows)]
    return BINDING_SIGNATURE_PREFIX + blake3.blake3(canonical_json(document)).hexdigest()


def signature_from_table(binding_table: Iterable[Mapping[str, Any]], ties: Iterable[Iterable[str]]) -> str:
    """The binding signature of an archive: its binding table (``inspect(path).binding_table``) and ``ties``."""
    entries = [(row["fqn"], row["dtype"], list(row["shape"])) for row in binding_table if from_checkpoint(row)]
    return _signature(entries, ties)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _storage_identity(tensor: torch.Tensor) -> tuple[object, ...]:
    """Equal for two names of one tensor (as ``program_ties`` groups them); a meta or empty tensor has no
    storage address, so there only the object itself (a tied ``Parameter`` is one object) identifies it."""
    pointer = tensor.untyped_storage().data_ptr()
    if pointer == 0:
        return ("object", id(tensor))
    return (pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype))


def signature_from_module(module: torch.nn.Module) -> str:
    """The binding signature of a live module, without tracing: its ``state_dict``'s tensors, ties folded."""
    state = module.state_dict(keep_vars=True)  # every name of a tied tensor, persistent buffers only
    groups: dict[tuple[object, ...], list[str]] = {}
    for fqn, tensor in state.items():
        groups.setdefault(_storage_identity(tensor), []).append(fqn)
    ties = [names for names in groups.values() if len(names) > 1]
    entries = [(fqn, _dtype_name(tensor), list(tensor.shape)) for fqn, tensor in state.items()]
    return _signature(entries, ties)


def code_fingerprint(model: torch.nn.Module) -> str:
    """``cf1:`` over the sorted blake3 digests of the source files of ``model.modules()``'s classes."""
    files = set()
    for cls in {type(module) for module in model.modules()}:
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:  # a builtin or C++ class
            continue
        if path is not None:
            files.add(path)
    return fingerprint_from_digests(_file_digest(path) for path in files)


def fingerprint_from_digests(file_digests: Iterable[str]) -> str:
    """``cf1:`` over the sorted, de-duplicated ``blake3:<hex>`` digests of source files' contents."""
    return CODE_FINGERPRINT_PREFIX + blake3.blake3(canonical_json(sorted(set(file_digests)))).hexdigest()


def _file_digest(path: str) -> str:
    hasher = blake3.blake3()
    with open(path, "rb") as source:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            hasher.update(chunk)
    return "blake3:" + hasher.hexdigest()


def discovery_digest(
    family: str, envelope_digest: str, sm: str, toolchain_digest: str, recorded: Mapping[str, str]
) -> str:
    """The digest discover matches on (see the module docstring); ``recorded`` may hold other names: ignored."""
    libraries = {name: recorded[name] for name in sorted(RECORDED_ONLY_COMPONENTS) if name in recorded}
    return digest(
        {
            "v": 1,
            "family": family,
            "envelope": envelope_digest,
            "sm": sm,
            "toolchain": toolchain_digest,
            "recorded": libraries,
        }
    )
