"""Binding by name (torch extra): a loaded compiled graph plus a checkpoint becomes a callable.

:func:`load_compiled` opens the verified archive with torch's own
``aoti_load_package`` and gives every constant AOTI asks for a value before
anything can call it (called with unbound constants, a package crashes the
process):

- from a named component (a safetensors file published with the artifact,
  e.g. the mint's derived constants: non-persistent buffers, lifted literals),
- else from the checkpoint by fully-qualified name,
- else, for a tied weight, from whichever of its tied names the checkpoint
  holds (a checkpoint saved the usual way keeps one name of a tie; AOTI may
  keep the other).

Every constant is checked for presence, dtype and shape first; all gaps are
reported at once in one :class:`BindingError`. A checkpoint whose tied names
hold different values (an untied fine-tune) is refused by name: the artifact
was compiled with them shared. Binding-table rows AOTI needs no value for
(dead parameters) are neither required nor refused. The ties and the binding
table come from a static read of the archive itself (the same reader as the
store), so they are as trusted as its verified digest.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from cgstore_client.archive import inspect
from cgstore_client.errors import CgstoreError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

Checkpoint = Mapping[str, "torch.Tensor"] | str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


class BindingError(CgstoreError):
    """Constants the compiled graph needs that cannot be bound as declared; ``gaps`` names each."""

    def __init__(self, gaps: list[str]) -> None:
        super().__init__("cannot bind the compiled graph's constants: " + "; ".join(gaps))
        self.gaps = gaps


class Bindable(Protocol):
    """What :func:`load_compiled` needs of a load: ``Loaded`` has it."""

    artifact_path: os.PathLike[str] | str
    component_paths: Mapping[str, os.PathLike[str] | str]


#: Loggers that warn about every weight-free archive (see ``_quiet``).
_TORCH_PACKAGE_LOGGERS = ("torch.export.pt2_archive._package", "torch._inductor.package.package")


@contextmanager
def _as_pt2(path: str | os.PathLike[str]) -> Iterator[str]:
    """``path`` under a name torch accepts as a package: it takes a file for one only by its
    ``.pt2`` suffix, and a cached blob is named by its digest. A symlink, never a copy."""
    path = os.fspath(path)
    if path.endswith(".pt2"):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="cgstore-load-") as scratch:
        link = os.path.join(scratch, "model.pt2")
        os.symlink(os.path.abspath(path), link)
        yield link  # torch has extracted what it runs by the time the link goes


@contextmanager
def _quiet(names: Iterable[str]) -> Iterator[None]:
    """Silence torch's package warnings for one load.

    The mint's archives deliberately hold no weights and no sample inputs, so
    torch's full-program loader fails on them and falls back to loading the
    AOTI runner alone, which is all a worker needs, warning "Loading outdated
    pt2 file" each time. Errors still surface.
    """
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _open_tensors(paths: Iterable[os.PathLike[str] | str], stack: ExitStack) -> dict[str, Any]:
    """name -> a lazy handle per tensor across safetensors files (values read only when bound)."""
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    for path in paths:
        opened = stack.enter_context(safe_open(os.fspath(path), framework="pt", device="cpu"))
        handles.update({name: opened for name in opened.keys()})
    return handles


def _checkpoint_tensors(checkpoint: Checkpoint, stack: ExitStack) -> Mapping[str, Any]:
    if isinstance(checkpoint, Mapping):
        return checkpoint
    paths = [checkpoint] if isinstance(checkpoint, (str, os.PathLike)) else list(checkpoint)
    handles = _open_tensors(paths, stack)
    return _Lazy(handles)


class _Lazy(Mapping):
    """A read-only mapping over safetensors handles that reads a tensor on access."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self._handles = handles

    def __getitem__(self, name: str):
        return self._handles[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._handles

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def _partners(ties: tuple[tuple[str, ...], ...]) -> dict[str, tuple[str, ...]]:
    return {name: group for group in ties for name in group}


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _Binder:
    def __init__(self, table: list[dict[str, Any]], ties, components: Mapping[str, Any], checkpoint: Mapping[str, Any]):
        self.rows = {row.get("load_name", row["fqn"]): row for row in table}
        self.partners = _partners(ties)
        self.ties = ties
        self.components = components
        self.checkpoint = checkpoint
        self.gaps: list[str] = []

    def bind(self, needed: Iterable[str]) -> dict[str, torch.Tensor]:
        constants = {}
        for name in sorted(needed):
            value = self._value(name)
            if value is not None:
                constants[name] = value
        self._refuse_untied()
        if self.gaps:
            raise BindingError(self.gaps)
        return constants

    def _value(self, name: str):
        row = self.rows.get(name)
        if row is None:
            self.gaps.append(f"{name}: the compiled graph needs it but the binding table has no row for it")
            return None
        fqn = row["fqn"]
        names = [fqn, *(n for n in self.partners.get(fqn, ()) if n != fqn)]
        for source in (self.components, self.checkpoint):
            for candidate in names:
                if candidate in source:
                    return self._checked(name, row, candidate, source[candidate])
        tied = f" (or its tied names {names[1:]})" if len(names) > 1 else ""
        self.gaps.append(f"{fqn}: not in the checkpoint{tied} nor any component")
        return None

    def _checked(self, name: str, row: dict[str, Any], source_name: str, tensor):
        if _dtype_name(tensor) != row.get("dtype") or list(tensor.shape) != list(row.get("shape", [])):
            self.gaps.append(
                f"{row['fqn']}: declared {row.get('dtype')}{row.get('shape')}, "
                f"{source_name!r} is {_dtype_name(tensor)}{list(tensor.shape)}"
            )
            return None
        return tensor

    def _refuse_untied(self) -> None:
        import torch

        for group in self.ties:
            held = [name for name in group if name in self.checkpoint]
            if len(held) > 1:
                first = self.checkpoint[held[0]]
                if any(not torch.equal(first, self.checkpoint[other]) for other in held[1:]):
                    self.gaps.append(
                        f"tied names {held} hold different values in the checkpoint: the artifact was compiled "
                        "with them shared, binding them would compute something else"
                    )


def load_compiled(loaded: Bindable, checkpoint: Checkpoint, *, device: str = "cpu"):
    """The compiled graph of ``loaded`` with every constant bound by name; raises :class:`BindingError` first.

    ``checkpoint`` is a state dict (name -> tensor) or safetensors file path(s).
    """
    import torch

    report = inspect(loaded.artifact_path)
    with _as_pt2(loaded.artifact_path) as package, _quiet(_TORCH_PACKAGE_LOGGERS):
        compiled = torch._inductor.aoti_load_package(package)
    with ExitStack() as stack:
        components = _open_tensors(loaded.component_paths.values(), stack)
        binder = _Binder(
            report.binding_table, report.metadata.ties, _Lazy(components), _checkpoint_tensors(checkpoint, stack)
        )
        constants = binder.bind(compiled.get_constant_fqns())
        compiled.load_constants({name: value.to(device) for name, value in constants.items()}, check_full_update=True)
    return compiled
