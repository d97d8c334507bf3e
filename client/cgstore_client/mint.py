"""Mint: compile an ExportedProgram with AOTInductor and package an admissible, reproducible ``.pt2``.

Needs the ``torch`` extra; torch is imported inside the functions that use it
(importing this module stays cheap).

Public API::

    package_compiled_graph(program, path, *, metadata=None, model_name="model",
                           inductor_configs=None, build_dir=None) -> MintResult
    compile_configs(inductor_configs=None) -> dict          # the compile policy, merged
    settings_digest(inductor_configs=None, settings=None) -> "blake3:<hex>"
    COMPILE_POLICY, ARCHIVE_ROOT, MintError, MintResult

This environment's ``sm`` and toolchain (what a worker declares, what a mint stamps) are
``cgstore_client.environment``'s; the policy and its digest ``cgstore_client.policy``'s.

The archive is written with torch's ``PT2ArchiveWriter`` (not ``package_pt2``,
which would add the program's weights and pickled sample inputs) and holds
exactly: the AOTI files (``data/aotinductor/<model>/``), the serialized
program (``models/<model>.json``, node debug metadata stripped), the compiled-graph
metadata (``extra/metadata.json``, canonical JSON) and torch's bookkeeping
records. It is weight-free and pickle-free, and the mint reads it back with
:func:`cgstore_client.archive.inspect` before returning, so it can never
publish what the store would refuse.

Reproducibility: two mints of one program on one machine (any process, any
``TORCHINDUCTOR_CACHE_DIR``/``TRITON_CACHE_DIR``/``TMPDIR``/cwd, any output
file name) write byte-identical archives. Every source of difference found
on torch 2.13, and how it is closed:

- the inductor cache path is written into the generated sources (compile
  command comments), into the ``.so``'s ``.rodata`` (``__FILE__`` of the
  wrapper) and into its DWARF line tables: compilation runs in a fixed build
  directory (``build_dir``, default ``/tmp/cgstore-mint-<uid>``, private,
  wiped before each mint, held under a file lock) by pointing
  ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` at it for the
  duration of the compile;
- precompiled headers live under a ``TMPDIR``/user-dependent directory
  whose path lands in the sources: ``aot_inductor.precompile_headers=False``;
- a warm cache could hand back artifacts built elsewhere (another path,
  another toolchain): the build directory starts empty, in-memory caches are
  cleared on entry, and remote caches are off. ``force_disable_caches`` is
  pinned *off*: it compiles into a ``mkdtemp`` directory under the cache dir,
  whose random name lands in the sources and the ``.so``;
- mmapped weights get a random magic number: ``force_mmap_weights=False``
  and no constants in the ``.so`` (``package_constants_in_so=False``);
- environment knobs that flip compile options (``AOT_INDUCTOR_DEBUG_SYMBOLS``,
  ``AOT_INDUCTOR_ENABLE_LINE_TABLES``, ``TORCHINDUCTOR_FREEZING``, ...) are
  overridden by the pinned policy; the ones that override a patch
  (``TORCHINDUCTOR_FORCE_DISABLE_CACHES``) or that torch's C++ builder reads
  outside its config (``TORCHINDUCTOR_DEBUG_COMPILE``,
  ``TORCHINDUCTOR_DEBUG_SYMBOL``) make the mint refuse, before compiling;
- the archive's root folder follows the output file name: the archive is
  written through a file object, for which torch names the root
  ``archive``, then renamed into place;
- ``data/sample_inputs`` (pickled example inputs) and weights are never written;
- entry order is fixed (torch records, program, metadata, AOTI files sorted
  by name) and torch's zip writer stamps no clock;
- the serialized program's node metadata holds absolute source paths and
  source text (``stack_trace``, with ``<ipython-input-N>`` counters in a
  notebook) and the model class's import path (``nn_module_stack``,
  ``torch_fn``: ``__main__.Model`` when the minting script runs directly):
  nodes keep only ``custom`` annotations;
- the metadata is canonical JSON without wall clocks (the schema refuses them).

Generated file and kernel names are content hashes and the GNU build id a
hash of the linked bytes, so they follow once the inputs above are fixed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import blake3
from filelock import FileLock

from cgstore_client.archive import ArchiveError, ArchiveReport, inspect
from cgstore_client.archive.device import DeviceFacts, device_facts_from_aoti_metadata
from cgstore_client.archive.graph import (
    graph_digest_from_program,
    program_document_from_program,
    program_ties,
    strip_debug_metadata,
)
from cgstore_client.components import save_tensors
from cgstore_client.environment import environment_sm
from cgstore_client.errors import MetadataError, MintError
from cgstore_client.metadata import CompiledGraphMetadata, build_metadata, parse_metadata
from cgstore_client.policy import COMPILE_POLICY, compile_configs, settings_digest

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torch.export import ExportedProgram

__all__ = [
    "ARCHIVE_ROOT",
    "COMPILE_POLICY",
    "MintError",
    "MintResult",
    "compile_configs",
    "default_build_dir",
    "derived_constants_path",
    "package_compiled_graph",
    "settings_digest",
]

#: The root folder torch's writer gives an archive written through a file object.
ARCHIVE_ROOT = "archive"


# Read by torch's C++ builder straight from the environment at compile time,
# outside any config the policy could pin.
_REFUSED_ENVIRONMENT = ("TORCHINDUCTOR_DEBUG_COMPILE", "TORCHINDUCTOR_DEBUG_SYMBOL")
_MODEL_NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
# One mint at a time per process: the compile points process-wide environment
# variables at the build directory (the file lock serializes processes).
_PROCESS_LOCK = threading.Lock()


@dataclass(frozen=True)
class MintResult:
    """A written archive: where, its content digest and size, and the reader's report of it."""

    path: str
    digest: str
    size: int
    report: ArchiveReport
    #: The derived constants (see :func:`derived_constants_path`), or None when the program has none.
    constants_path: str | None = None

    @property
    def graph_digest(self) -> str:
        return self.report.graph_digest

    def __repr__(self) -> str:
        # One short line: the report (its whole binding table) is there to read, not to print.
        return (
            f"MintResult(path={self.path!r}, digest={self.digest!r}, size={self.size}, "
            f"graph_digest={self.graph_digest!r}, constants={len(self.report.binding_table)}, "
            f"constants_path={self.constants_path!r})"
        )


# --------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------


def _refuse_debug_environment() -> None:
    for name in _REFUSED_ENVIRONMENT:
        if os.environ.get(name, "0") != "0":
            raise MintError(f"{name} is set: it changes the compiled bytes outside the mint policy; unset it to mint")


def _config_value(root: object, dotted: str) -> object:
    value = root
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _require_policy_in_effect(configs: Mapping[str, object]) -> None:
    """Refuse when the environment forces an option over the patch (torch's ``env_name_force`` options)."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(dict(configs)):
        for key, wanted in COMPILE_POLICY.items():
            actual = _config_value(inductor_config, key)
            if actual != wanted:
                raise MintError(
                    f"inductor option {key} is {actual!r} despite the mint policy's {wanted!r}: "
                    "an environment variable forces it (e.g. TORCHINDUCTOR_FORCE_DISABLE_CACHES); unset it to mint"
                )


# --------------------------------------------------------------------------
# The build directory: fixed path, private, fresh, locked
# --------------------------------------------------------------------------


def default_build_dir() -> str:
    """``$CGSTORE_MINT_BUILD_DIR``, else ``/tmp/cgstore-mint-<uid>``.

    Not ``tempfile.gettempdir()``: the path is compiled into the archive, so
    it must not follow ``TMPDIR``. Two mints are byte-identical only when they
    use the same build directory.
    """
    return os.environ.get("CGSTORE_MINT_BUILD_DIR") or f"/tmp/cgstore-mint-{os.getuid()}"


def _ensure_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    # Compiled artifacts are code: a directory another user can write to (or
    # a symlink planted at the fixed path) could swap sources under the compiler.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise MintError(f"build directory {path!r} must be a directory owned by this user with mode 0700")


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _fresh_build_dir(build_dir: str | os.PathLike[str] | None) -> Iterator[str]:
    """Hold the build directory exclusively, empty, with inductor's and triton's caches pointed into it."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    base = os.path.abspath(os.fspath(build_dir or default_build_dir()))
    _ensure_private_dir(base)
    with _PROCESS_LOCK, FileLock(os.path.join(base, ".lock")):
        work = os.path.join(base, "work")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(os.path.join(work, "triton"), mode=0o700)
        inductor = os.path.join(work, "inductor")
        os.makedirs(inductor, mode=0o700)
        try:
            with _environment(TRITON_CACHE_DIR=os.path.join(work, "triton")), temporary_cache_dir(inductor):
                yield inductor
        finally:
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------
# Compile and collect
# --------------------------------------------------------------------------


def _compile(program: ExportedProgram, configs: Mapping[str, object]) -> list[str]:
    import torch

    if program.example_inputs is None:
        raise MintError("the ExportedProgram has no example_inputs; AOTInductor needs them to compile")
    module = program.module(check_guards=False)
    args, kwargs = program.example_inputs
    files = torch._inductor.aot_compile(module, args, kwargs, options=dict(configs))
    if not isinstance(files, list):
        raise MintError(f"AOTInductor returned {type(files).__name__}, not a package file list")
    return _checked_files(files)


def _checked_files(files: list[object]) -> list[str]:
    """The generated files, refusing anything that would carry tensors or pickles into the archive."""
    checked = []
    for file in files:
        if not isinstance(file, str):
            raise MintError(
                f"AOTInductor produced an in-memory {type(file).__name__} (weights to pickle): not weight-free"
            )
        leaf = os.path.basename(file)
        if leaf.startswith("custom_obj") or leaf == "custom_objs_config.json":
            raise MintError(
                f"the program holds custom (torchbind) objects, which AOTI pickles ({leaf}): not pickle-free"
            )
        if leaf.endswith(("_weights.blob", "_serialized_weights.bin")):
            raise MintError(f"AOTInductor wrote a weights file ({leaf}): not weight-free")
        checked.append(file)
    return checked


def _aoti_entries(files: list[str], model_name: str) -> list[tuple[str, str]]:
    entries: dict[str, str] = {}
    for file in files:
        name = f"data/aotinductor/{model_name}/{os.path.basename(file)}"
        if name in entries:
            raise MintError(f"two generated files would both be packaged as {name}")
        entries[name] = file
    return sorted(entries.items())


def _device_of(files: list[str]) -> DeviceFacts:
    documents = {}
    for file in files:
        if file.endswith("_metadata.json"):
            with open(file, encoding="utf-8") as fh:
                documents[os.path.basename(file)] = json.load(fh)
    return device_facts_from_aoti_metadata(documents)


def _resolve_metadata(metadata: CompiledGraphMetadata | Mapping[str, Any] | None, sm: str) -> CompiledGraphMetadata:
    try:
        if metadata is None:
            resolved = build_metadata(sm=sm)
        elif isinstance(metadata, CompiledGraphMetadata):
            resolved = metadata
        else:
            resolved = parse_metadata(dict(metadata))
    except MetadataError as exc:
        raise MintError(f"metadata: {exc}") from exc
    if resolved.package_constants_in_so:
        raise MintError("metadata declares package_constants_in_so=true, but the mint never packages constants")
    if resolved.sm != sm:
        raise MintError(f"metadata says sm {resolved.sm!r} but this mint compiled for {sm!r}")
    return resolved


def _program_device(program: ExportedProgram) -> str | None:
    """The one device every tensor of the program (weights, constants, example inputs) lives on, if there is one."""
    import torch
    from torch.utils._pytree import tree_leaves

    tensors = [*program.state_dict.values(), *program.constants.values(), *tree_leaves(program.example_inputs)]
    devices = {str(value.device) for value in tensors if isinstance(value, torch.Tensor)}
    return devices.pop() if len(devices) == 1 else None


def _program_bytes(program: ExportedProgram) -> bytes:
    document = strip_debug_metadata(json.loads(program_document_from_program(program)))
    # torch's own spelling (json.dumps defaults, no NaN), so the record reads like the one torch writes.
    return json.dumps(document, allow_nan=False).encode("utf-8")


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def _write_archive(
    path: str,
    model_name: str,
    program_bytes: bytes,
    metadata: CompiledGraphMetadata,
    aoti_entries: list[tuple[str, str]],
) -> None:
    from torch.export.pt2_archive._package import PT2ArchiveWriter
    from torch.export.pt2_archive.constants import (
        ARCHIVE_FORMAT_PATH,
        ARCHIVE_FORMAT_VALUE,
        ARCHIVE_VERSION_PATH,
        ARCHIVE_VERSION_VALUE,
    )

    directory = os.path.dirname(path) or "."
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(8)}.part")
    # O_EXCL on a fresh random name; mode 0666 so the umask decides, as for any file the caller creates.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as fh:
            # A file object, not a path: torch then names the root folder
            # "archive" instead of after the output file.
            with PT2ArchiveWriter(fh) as writer:
                writer.write_string(ARCHIVE_FORMAT_PATH, ARCHIVE_FORMAT_VALUE)
                writer.write_string(ARCHIVE_VERSION_PATH, ARCHIVE_VERSION_VALUE)
                writer.write_bytes(f"models/{model_name}.json", program_bytes)
                writer.write_bytes("extra/metadata.json", metadata.to_json_bytes())
                for name, file in aoti_entries:
                    writer.write_file(name, file)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def derived_constants_path(archive_path: str | os.PathLike[str]) -> str:
    """Where the mint writes an archive's derived constants: ``model.pt2`` -> ``model.constants.safetensors``."""
    base = os.fspath(archive_path)
    return (base[: -len(".pt2")] if base.endswith(".pt2") else base) + ".constants.safetensors"


def _write_derived_constants(program: ExportedProgram, archive_path: str) -> str | None:
    """Write the program's constants that no checkpoint holds; returns the file, or None when there are none.

    ``program.constants`` holds exactly those: non-persistent buffers (HF BERT's
    ``position_ids``), which ``state_dict`` checkpoints omit, and lifted tensor
    literals. The archive is weight-free, so their values travel beside it as a
    named component (safetensors: read without unpickling), keyed by fqn.
    """

    path = derived_constants_path(archive_path)
    tensors = {
        fqn: value.clone() for fqn, value in sorted(program.constants.items()) if hasattr(value, "untyped_storage")
    }
    if not tensors:
        if os.path.exists(path):
            os.unlink(path)  # a stale file from an earlier mint to the same path would be bound by mistake
        return None
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(8)}.part"
    try:
        save_tensors(tensors, temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def _file_digest(path: str) -> tuple[str, int]:
    hasher = blake3.blake3()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            hasher.update(chunk)
            size += len(chunk)
    return "blake3:" + hasher.hexdigest(), size


def _read_back(path: str, expected_graph: str) -> ArchiveReport:
    """Inspect the written archive as the store will; an archive that fails its own mint is removed."""
    try:
        report = inspect(path)
        if report.graph_digest != expected_graph or report.root != ARCHIVE_ROOT:
            raise MintError(
                f"the written archive reads back as graph {report.graph_digest} under root {report.root!r}; "
                f"expected {expected_graph} under {ARCHIVE_ROOT!r}"
            )
    except (ArchiveError, MintError) as exc:
        os.unlink(path)
        raise MintError(f"the minted archive does not pass the reader: {exc}") from exc
    return report


def package_compiled_graph(
    program: ExportedProgram,
    path: str | os.PathLike[str],
    *,
    metadata: CompiledGraphMetadata | Mapping[str, Any] | None = None,
    model_name: str = "model",
    inductor_configs: Mapping[str, object] | None = None,
    build_dir: str | os.PathLike[str] | None = None,
) -> MintResult:
    """Compile ``program`` with AOTInductor under the mint policy and write an admissible archive to ``path``.

    ``metadata`` is the compiled-graph metadata (a
    :class:`~cgstore_client.metadata.CompiledGraphMetadata` or its document);
    ``None`` builds the policy default for the ``sm`` AOTI compiled for. A
    given ``sm`` must match that device. ``inductor_configs`` adds inductor
    options (never overriding :data:`COMPILE_POLICY`). ``build_dir`` is where
    compilation happens (see :func:`default_build_dir`); its path is part of
    the compiled bytes.

    Tied weights (names sharing one storage) are recorded in the metadata's
    ``ties``; the program's derived constants (non-persistent buffers, lifted
    literals: what no checkpoint holds) are written beside the archive
    (:func:`derived_constants_path`) for ``Client.publish`` to upload as a component.

    Returns the archive's path, blake3 digest, size, the reader's report and
    the derived constants' path; the report's graph digest equals
    :func:`graph_digest_from_program` of ``program``.
    """
    from torch.export import ExportedProgram

    if not isinstance(program, ExportedProgram):
        raise MintError(f"expected a torch.export.ExportedProgram, got {type(program).__name__}")
    if not _MODEL_NAME_RE.match(model_name):
        raise MintError(f"model name must match {_MODEL_NAME_RE.pattern}, got {model_name!r}")
    destination = os.path.abspath(os.fspath(path))
    configs = compile_configs(inductor_configs)
    _refuse_debug_environment()
    _require_policy_in_effect(configs)
    device_name = _program_device(program)
    if metadata is not None and device_name is not None:
        # Refuse a wrong sm before spending a compile on it; AOTI's own record is re-checked after.
        _resolve_metadata(metadata, environment_sm(device_name))
    with _fresh_build_dir(build_dir):
        files = _compile(program, configs)
        device = _device_of(files)
        # The mint measures ties itself: they are a fact of the live program, and part of its identity.
        resolved = replace(_resolve_metadata(metadata, device.sm), ties=program_ties(program))
        _write_archive(destination, model_name, _program_bytes(program), resolved, _aoti_entries(files, model_name))
    report = _read_back(destination, graph_digest_from_program(program))
    digest, size = _file_digest(destination)
    constants = _write_derived_constants(program, destination)
    return MintResult(path=destination, digest=digest, size=size, report=report, constants_path=constants)


# --------------------------------------------------------------------------
# The environment: toolchain and sm
# --------------------------------------------------------------------------
