"""The mint: reproducible, admissible archives, and the environment facts a key is derived from."""

from __future__ import annotations

import importlib.metadata
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import blake3
import pytest

from cgstore_client.archive import ArchiveReport, inspect
from cgstore_client.environment import environment_sm, environment_toolchain
from cgstore_client.keys import Toolchain, is_digest
from cgstore_client.metadata import build_metadata
from cgstore_client.mint import (
    ARCHIVE_ROOT,
    COMPILE_POLICY,
    MintError,
    compile_configs,
    package_compiled_graph,
    settings_digest,
)
from tests.support.archives import REPO, BuiltArchives, tiny_inputs, tiny_model, tiny_program

pytestmark = pytest.mark.torch


def _blake3(path: Path) -> str:
    return "blake3:" + blake3.blake3(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------
# Reproducibility
# --------------------------------------------------------------------------


def test_two_mints_in_two_processes_are_byte_identical(pt2_archive: Path, pt2_archive_second_mint: Path) -> None:
    # The second mint ran in a subprocess with its own TORCHINDUCTOR_CACHE_DIR,
    # TRITON_CACHE_DIR, TMPDIR, working directory and output file name.
    assert pt2_archive.name != pt2_archive_second_mint.name
    assert pt2_archive.read_bytes() == pt2_archive_second_mint.read_bytes()
    assert _blake3(pt2_archive) == _blake3(pt2_archive_second_mint)


def test_weights_never_reach_the_archive_bytes(pt2_archive: Path, pt2_archive_reweighted: Path) -> None:
    # Other weights, other file name, same bytes: the archive is checkpoint-agnostic.
    assert pt2_archive.read_bytes() == pt2_archive_reweighted.read_bytes()


def test_the_session_compiled_at_most_five_archives(built_archives: BuiltArchives) -> None:
    assert built_archives.record["compiles"] <= 5


# --------------------------------------------------------------------------
# What the archive holds
# --------------------------------------------------------------------------


def test_the_archive_holds_exactly_the_admissible_entries(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    with zipfile.ZipFile(pt2_archive) as archive:
        names = archive.namelist()
        metadata_bytes = archive.read(f"{ARCHIVE_ROOT}/extra/metadata.json")
        program = json.loads(archive.read(f"{ARCHIVE_ROOT}/models/model.json"))
    torch_records = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
    expected = {f"{ARCHIVE_ROOT}/{name}" for name in torch_records}
    expected |= {f"{ARCHIVE_ROOT}/models/model.json", f"{ARCHIVE_ROOT}/extra/metadata.json"}
    expected |= {f"{ARCHIVE_ROOT}/{name}" for name in pt2_report.aoti_files}
    assert set(names) == expected and len(names) == len(expected)
    assert not [
        name for name in names if "/data/weights" in name or "/data/constants" in name or "sample_inputs" in name
    ]
    assert metadata_bytes == pt2_report.metadata.to_json_bytes()
    node_metadata_keys = {key for node in program["graph_module"]["graph"]["nodes"] for key in node["metadata"]}
    assert node_metadata_keys <= {"custom"}


def test_the_minted_archive_runs_once_its_constants_are_bound(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    import torch

    program = tiny_program(seed=3)  # weights the archive has never seen
    values = {**program.state_dict, **program.constants}
    constants = {row["load_name"]: values[row["fqn"]] for row in pt2_report.binding_table}
    compiled = torch._inductor.aoti_load_package(str(pt2_archive))
    assert sorted(compiled.get_constant_fqns()) == sorted(constants)
    compiled.load_constants(constants, check_full_update=True)
    eager = tiny_model(seed=3)
    for batch in (2, 5, 64):
        inputs, offset = tiny_inputs(batch)
        assert torch.equal(compiled(inputs, offset), eager(inputs, offset))


# --------------------------------------------------------------------------
# Refusals (all before any compile)
# --------------------------------------------------------------------------


def _program():
    return tiny_program(0)


def test_the_policy_cannot_be_overridden() -> None:
    with pytest.raises(MintError, match="package_constants_in_so"):
        compile_configs({"aot_inductor.package_constants_in_so": True})
    with pytest.raises(MintError, match="always_keep_tensor_constants"):
        compile_configs({"always_keep_tensor_constants": False})
    merged = compile_configs({"max_autotune": False})
    assert merged["max_autotune"] is False
    assert {key: merged[key] for key in COMPILE_POLICY} == dict(COMPILE_POLICY)


def test_a_metadata_sm_for_another_device_is_refused_before_compiling(tmp_path: Path) -> None:
    out = tmp_path / "never.pt2"
    with pytest.raises(MintError, match="sm_90"):
        package_compiled_graph(_program(), out, metadata=build_metadata(sm="sm_90"))
    assert not out.exists()


def test_metadata_claiming_constants_in_the_so_is_refused(tmp_path: Path) -> None:
    metadata = build_metadata(sm=environment_sm("cpu"), package_constants_in_so=True)
    with pytest.raises(MintError, match="package_constants_in_so"):
        package_compiled_graph(_program(), tmp_path / "never.pt2", metadata=metadata)


def test_invalid_metadata_documents_are_refused(tmp_path: Path) -> None:
    document = {**build_metadata(sm=environment_sm("cpu")).to_document(), "minted_at": "2025-01-01T00:00:00Z"}
    with pytest.raises(MintError, match="metadata"):
        package_compiled_graph(_program(), tmp_path / "never.pt2", metadata=document)


def test_only_exported_programs_and_plain_model_names_are_minted(tmp_path: Path) -> None:
    with pytest.raises(MintError, match="ExportedProgram"):
        package_compiled_graph(tiny_model(0), tmp_path / "never.pt2")  # type: ignore[arg-type]
    with pytest.raises(MintError, match="model name"):
        package_compiled_graph(_program(), tmp_path / "never.pt2", model_name="../escape")


def test_a_debug_build_environment_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # torch's C++ builder reads this at compile time, outside any config the policy could pin.
    monkeypatch.setenv("TORCHINDUCTOR_DEBUG_COMPILE", "1")
    with pytest.raises(MintError, match="TORCHINDUCTOR_DEBUG_COMPILE"):
        package_compiled_graph(_program(), tmp_path / "never.pt2")


def test_an_environment_forced_cache_bypass_is_refused(tmp_path: Path) -> None:
    # TORCHINDUCTOR_FORCE_DISABLE_CACHES overrides config patches (torch reads it at import, hence a
    # subprocess) and compiles into a mkdtemp directory whose random name would reach the bytes.
    probe = (
        "import sys;"
        "from cgstore_client.mint import MintError, package_compiled_graph;"
        "from tests.support.archives import tiny_program\n"
        "try:\n"
        "    package_compiled_graph(tiny_program(0), sys.argv[1])\n"
        "except MintError as exc:\n"
        "    print('refused:', exc)\n"
    )
    environment = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    out = tmp_path / "never.pt2"
    completed = subprocess.run(
        [sys.executable, "-c", probe, str(out)], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr
    assert "refused:" in completed.stdout and "force_disable_caches" in completed.stdout
    assert not out.exists()


def test_a_shared_build_directory_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared-build"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert stat.S_IMODE(shared.stat().st_mode) & 0o077
    with pytest.raises(MintError, match="0700"):
        package_compiled_graph(_program(), tmp_path / "never.pt2", build_dir=shared)


# --------------------------------------------------------------------------
# Environment facts
# --------------------------------------------------------------------------


def test_environment_sm_spells_this_cpu_like_aoti_records_it(pt2_report: ArchiveReport) -> None:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    tokens = sorted(str(pick_vec_isa()).lower().split())
    assert environment_sm("cpu") == f"cpu-{pt2_report.device.machine}-{'+'.join(tokens)}" == pt2_report.sm


def test_environment_toolchain_keys_the_compiler_stack() -> None:
    import torch

    toolchain = environment_toolchain()
    assert isinstance(toolchain, Toolchain)
    components = dict(toolchain.components)
    assert components["torch"] == torch.__version__
    assert components["settings"] == settings_digest()
    nvidia = {
        (dist.metadata["Name"] or "").lower().replace("_", "-")
        for dist in importlib.metadata.distributions()
        if (dist.metadata["Name"] or "").lower().startswith("nvidia")
    }
    assert {name for name in components if name.startswith("nvidia-")} == nvidia
    assert not {"diffusers", "transformers", "peft"} & set(components)


def test_the_settings_digest_moves_with_the_compile_policy_and_settings() -> None:
    base = settings_digest()
    assert is_digest(base)
    assert settings_digest({"max_autotune": True}) != base
    assert settings_digest(settings={"attention": "sdpa"}) != base
    assert settings_digest() == base


def test_a_native_manifest_digest_is_keyed_and_validated() -> None:
    manifest = "blake3:" + "2" * 64
    assert environment_toolchain(native_manifest=manifest).components["native_manifest"] == manifest
    with pytest.raises(ValueError):
        environment_toolchain(native_manifest="sha256:abc")


def test_the_archive_inspects_cleanly_after_minting(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    assert inspect(pt2_archive) == pt2_report


def test_a_mint_results_repr_is_one_short_line(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    from cgstore_client.mint import MintResult

    shown = repr(MintResult(str(pt2_archive), "blake3:" + "a" * 64, 1234, pt2_report))
    assert len(shown) < 400 and "\n" not in shown and pt2_report.graph_digest in shown
    assert not any(row["fqn"] in shown for row in pt2_report.binding_table)
