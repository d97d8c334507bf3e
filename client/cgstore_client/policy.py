"""The compile policy every mint compiles under, and the settings digest that keys it.

The policy is what makes an archive weight-free (constants bound by name at load) and
reproducible; its digest is the toolchain's ``settings`` component, so a worker states it
(``cgstore_client.environment.environment_toolchain``) without compiling anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import blake3

from cgstore_client.errors import MintError
from cgstore_client.keys import canonical_json

#: The inductor options every mint compiles under. A caller's ``inductor_configs``
#: may add options but never change these: they are what makes the archive
#: weight-free (constants bound by name at load, never value-specialized) and
#: reproducible. The policy is part of the toolchain's settings digest.
COMPILE_POLICY: Mapping[str, object] = MappingProxyType(
    {
        "aot_inductor.package": True,
        "aot_inductor.package_cpp_only": False,
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.package_constants_on_disk_format": None,
        "aot_inductor.use_runtime_constant_folding": False,
        "aot_inductor.force_mmap_weights": False,
        "aot_inductor.precompile_headers": False,
        "aot_inductor.debug_compile": False,
        "aot_inductor.debug_symbols": False,
        "aot_inductor.enable_line_tables": True,
        "always_keep_tensor_constants": True,
        "freezing": False,
        "force_disable_caches": False,
        "fx_graph_remote_cache": False,
        "autotune_remote_cache": False,
        "bundled_autotune_remote_cache": False,
    }
)


def compile_configs(inductor_configs: Mapping[str, object] | None = None) -> dict[str, object]:
    """The caller's options merged under :data:`COMPILE_POLICY`; a conflicting option is a :class:`MintError`."""
    merged = dict(inductor_configs or {})
    for key, value in COMPILE_POLICY.items():
        if key in merged and merged[key] != value:
            raise MintError(f"inductor option {key}={merged[key]!r} conflicts with the mint policy ({key}={value!r})")
        merged[key] = value
    if "aot_inductor.output_path" in merged:
        raise MintError("inductor option 'aot_inductor.output_path' is the mint's to choose: pass path instead")
    if "aot_inductor.metadata" in merged:
        # It lands unchecked in AOTI's *_metadata.json: a wall clock there would break reproducibility.
        raise MintError("inductor option 'aot_inductor.metadata' is refused: pass metadata (validated) instead")
    return dict(sorted(merged.items()))


def settings_digest(
    inductor_configs: Mapping[str, object] | None = None, settings: Mapping[str, Any] | None = None
) -> str:
    """The settings-declaration digest: the compile policy (with the caller's options) and declared settings."""
    document = {"v": 1, "compile_policy": compile_configs(inductor_configs), "settings": dict(settings or {})}
    try:
        encoded = canonical_json(document, hashed=False)
    except (TypeError, ValueError) as exc:
        raise MintError(f"settings must be JSON (strings, ints, bools, null, finite floats): {exc}") from None
    return "blake3:" + blake3.blake3(encoded).hexdigest()
