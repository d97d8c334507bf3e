"""This environment, as a key states it: the ``sm`` it compiles for and its toolchain.

What a worker declares at boot (``client.boot`` by declaration) and what a mint stamps are
the same two facts, read the same way: the ``sm`` as AOTI records it in a package, the
toolchain as the compiler stack that would build one here. Needs torch (imported inside
the functions).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from cgstore_client.archive.device import device_facts_from_aoti_metadata
from cgstore_client.errors import MintError
from cgstore_client.keys import Toolchain, validate_digest
from cgstore_client.policy import settings_digest

_PTXAS_VERSION_RE = re.compile(r"V(\d+\.\d+\.\d+)")


_RECORDED_LIBRARIES = ("diffusers", "transformers", "peft")


_TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _nvidia_wheels() -> dict[str, str]:
    wheels = {}
    for distribution in importlib.metadata.distributions():
        name = (distribution.metadata["Name"] or "").strip().lower().replace("_", "-")
        if name.startswith("nvidia-"):
            wheels[name] = distribution.version
    return dict(sorted(wheels.items()))


def _ptxas_path() -> str | None:
    """The ptxas triton would run: ``TRITON_PTXAS_PATH``, triton's bundled one, then ``PATH``."""
    explicit = os.environ.get("TRITON_PTXAS_PATH")
    if explicit and os.path.isfile(explicit):
        return explicit
    spec = importlib.util.find_spec("triton")
    for location in (spec.submodule_search_locations or []) if spec else []:
        bundled = os.path.join(location, "backends", "nvidia", "bin", "ptxas")
        if os.path.isfile(bundled):
            return bundled
    return shutil.which("ptxas")


def _ptxas_version() -> str | None:
    path = _ptxas_path()
    if path is None:
        return None
    try:
        output = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise MintError(f"ptxas at {path} does not report a version: {exc}") from None
    match = _PTXAS_VERSION_RE.search(output)
    if not match:
        raise MintError(f"ptxas at {path} reports no version in {output[:200]!r}")
    return match.group(1)


def environment_toolchain(
    *,
    inductor_configs: Mapping[str, object] | None = None,
    settings: Mapping[str, Any] | None = None,
    native_manifest: str | None = None,
) -> Toolchain:
    """This environment's compiler stack as a :class:`~cgstore_client.keys.Toolchain`.

    Keyed: ``torch`` (its full version, local build tag included),
    ``triton``, ``ptxas`` and every ``nvidia-*`` wheel when present, the
    settings-declaration digest (compile policy + caller options + declared
    settings) and the native manifest digest when given. Recorded only:
    diffusers, transformers and peft (trace-time libraries).
    """
    import torch

    components: dict[str, str] = {"torch": str(torch.__version__)}
    if (triton := _distribution_version(*_TRITON_DISTRIBUTIONS)) is not None:
        components["triton"] = triton
    if (ptxas := _ptxas_version()) is not None:
        components["ptxas"] = ptxas
    components.update(_nvidia_wheels())
    components["settings"] = settings_digest(inductor_configs, settings)
    if native_manifest is not None:
        components["native_manifest"] = validate_digest(native_manifest, what="native_manifest")
    for library in _RECORDED_LIBRARIES:
        if (version := _distribution_version(library)) is not None:
            components[library] = version
    return Toolchain(components)


def environment_sm(device: str | None = None) -> str:
    """The ``sm`` this environment compiles for, computed the way AOTI records it.

    ``device`` is ``"cuda"``, ``"cuda:N"`` or ``"cpu"``; ``None`` means CUDA
    when available, else CPU. Uses torch's own ``get_device_information``
    (the function that fills ``AOTI_*`` in a package's metadata), so the
    result equals what :func:`cgstore_client.archive.inspect` derives from an
    archive minted here.
    """
    import torch
    from torch._inductor.codecache import get_device_information

    target = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if target.type == "cuda":
        with torch.cuda.device(target):  # capability of that card, without changing the current device
            information = get_device_information("cuda")
    else:
        information = get_device_information(target.type)
    facts = {"AOTI_DEVICE_KEY": target.type, **information}
    return device_facts_from_aoti_metadata({"environment": facts}).sm
