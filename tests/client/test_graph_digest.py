"""The graph digest: invariant to everything but the computation, sensitive to every part of it."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from cgstore_client.archive import (
    ArchiveReport,
    ProgramView,
    graph_digest_from_archive,
    graph_digest_from_document,
    graph_digest_from_program,
    inspect,
)
from cgstore_client.archive.graph import strip_debug_metadata
from tests.hostile.corpus import rewrite
from tests.support.archives import REPO, tiny_program

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def program_document(pt2_archive: Path) -> dict[str, Any]:
    with zipfile.ZipFile(pt2_archive) as archive:
        return json.loads(archive.read("archive/models/model.json"))


@pytest.fixture(scope="module")
def traced_document() -> dict[str, Any]:
    """The program as torch serializes it in memory: stack traces, module stacks and hints included."""
    from cgstore_client.archive.graph import program_document_from_program

    return json.loads(program_document_from_program(tiny_program(0)))


def _digest(document: dict[str, Any]) -> str:
    return graph_digest_from_document(document)


def _nodes(document: dict[str, Any]) -> list[dict[str, Any]]:
    return document["graph_module"]["graph"]["nodes"]


# --------------------------------------------------------------------------
# Invariance
# --------------------------------------------------------------------------


def test_weights_do_not_move_the_digest(pt2_report: ArchiveReport, pt2_archive_reweighted: Path) -> None:
    reweighted = inspect(pt2_archive_reweighted)
    assert reweighted.graph_digest == pt2_report.graph_digest
    assert graph_digest_from_program(tiny_program(seed=7)) == pt2_report.graph_digest


def test_the_archive_root_folder_does_not_move_the_digest(
    pt2_archive: Path, pt2_report: ArchiveReport, tmp_path: Path
) -> None:
    renamed = rewrite(pt2_archive, tmp_path / "renamed.pt2", rename_root="some-other-root")
    report = inspect(renamed)
    assert report.root == "some-other-root"
    assert report.graph_digest == pt2_report.graph_digest


def test_the_in_memory_program_digests_like_its_archive(pt2_report: ArchiveReport) -> None:
    assert graph_digest_from_program(tiny_program(0)) == pt2_report.graph_digest


def test_debug_metadata_does_not_move_the_digest(traced_document: dict[str, Any], pt2_report: ArchiveReport) -> None:
    assert any("stack_trace" in node["metadata"] for node in _nodes(traced_document))
    assert _digest(traced_document) == _digest(strip_debug_metadata(traced_document)) == pt2_report.graph_digest  # type: ignore[arg-type]
    edited = copy.deepcopy(traced_document)
    for node in _nodes(edited):
        node["metadata"] = {"stack_trace": 'File "/elsewhere/model.py", line 1', "nn_module_stack": "other"}
    assert _digest(edited) == pt2_report.graph_digest


def test_symbol_names_do_not_move_the_digest(program_document: dict[str, Any], pt2_report: ArchiveReport) -> None:
    (symbol,) = program_document["range_constraints"]
    renamed = json.loads(re.sub(rf"\b{symbol}\b", "s97", json.dumps(program_document)))
    assert renamed != program_document
    assert _digest(renamed) == pt2_report.graph_digest


def test_value_names_do_not_move_the_digest(program_document: dict[str, Any], pt2_report: ArchiveReport) -> None:
    text = json.dumps(program_document)
    for node in _nodes(program_document):
        text = re.sub(rf'"{re.escape(node["name"])}"', f'"{node["name"]}_renamed_7"', text)
    renamed = json.loads(text)
    assert renamed != program_document
    assert _digest(renamed) == pt2_report.graph_digest


def test_example_values_and_training_flags_do_not_move_the_digest(
    program_document: dict[str, Any], pt2_report: ArchiveReport
) -> None:
    edited = copy.deepcopy(program_document)
    tensors = edited["graph_module"]["graph"]["tensor_values"]
    tensors["inputs_x"]["sizes"][0]["as_expr"]["hint"] = {"as_int": 33}
    tensors["p_lin_weight"]["requires_grad"] = not tensors["p_lin_weight"]["requires_grad"]
    edited["torch_version"] = "9.9.9"
    edited["schema_version"] = {"major": 99, "minor": 0}
    assert _digest(edited) == pt2_report.graph_digest


def test_a_second_process_computes_the_same_digest(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    probe = (
        "import sys, json;"
        "from cgstore_client.archive import graph_digest_from_archive, graph_digest_from_program;"
        "from tests.support.archives import tiny_program;"
        "print(json.dumps([graph_digest_from_archive(sys.argv[1]), graph_digest_from_program(tiny_program(0))]))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe, str(pt2_archive)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    from_archive, from_program = json.loads(completed.stdout.strip().splitlines()[-1])
    assert from_archive == from_program == pt2_report.graph_digest


# --------------------------------------------------------------------------
# Sensitivity: real programs
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({"activation": "sigmoid"}, id="changed-op"),
        pytest.param({"literal": 0.25}, id="changed-inlined-literal"),
        pytest.param({"hidden": 5}, id="changed-static-shape"),
        pytest.param({"batch_max": 32}, id="changed-symbolic-range"),
        pytest.param({"keys": ("a", "b")}, id="changed-input-structure"),
    ],
)
def test_a_changed_computation_moves_the_digest(variant: dict[str, Any], pt2_report: ArchiveReport) -> None:
    assert graph_digest_from_program(tiny_program(0, **variant)) != pt2_report.graph_digest


def test_a_changed_dtype_moves_the_digest(pt2_report: ArchiveReport) -> None:
    import torch

    assert graph_digest_from_program(tiny_program(0, dtype=torch.float64)) != pt2_report.graph_digest


# --------------------------------------------------------------------------
# Sensitivity: one field of the document at a time
# --------------------------------------------------------------------------


def _edit_target(document: dict[str, Any]) -> None:
    node = next(node for node in _nodes(document) if node["target"] == "torch.ops.aten.relu.default")
    node["target"] = "torch.ops.aten.gelu.default"


def _edit_dtype(document: dict[str, Any]) -> None:
    document["graph_module"]["graph"]["tensor_values"]["offset"]["dtype"] = 6


def _edit_static_size(document: dict[str, Any]) -> None:
    document["graph_module"]["graph"]["tensor_values"]["offset"]["sizes"][0] = {"as_int": 5}


def _edit_stride(document: dict[str, Any]) -> None:
    document["graph_module"]["graph"]["tensor_values"]["p_lin_weight"]["strides"] = [{"as_int": 1}, {"as_int": 4}]


def _edit_range(document: dict[str, Any]) -> None:
    (bounds,) = document["range_constraints"].values()
    bounds["max_val"] = 65


def _edit_float_literal(document: dict[str, Any]) -> None:
    for node in _nodes(document):
        for argument in node["inputs"]:
            if "as_float" in argument["arg"]:
                argument["arg"]["as_float"] = 0.5000000000000001


def _edit_parameter_name(document: dict[str, Any]) -> None:
    spec = document["graph_module"]["signature"]["input_specs"][0]
    spec["parameter"]["parameter_name"] = "linear.weight"


def _edit_buffer_persistence(document: dict[str, Any]) -> None:
    spec = document["graph_module"]["signature"]["input_specs"][2]
    spec["buffer"]["persistent"] = False


def _edit_in_spec(document: dict[str, Any]) -> None:
    signature = document["graph_module"]["module_call_graph"][0]["signature"]
    signature["in_spec"] = signature["in_spec"].replace('\\"x\\", \\"y\\"', '\\"y\\", \\"x\\"')


def _edit_output(document: dict[str, Any]) -> None:
    graph = document["graph_module"]["graph"]
    graph["outputs"] = [{"as_tensor": {"name": _nodes(document)[-2]["name"]}}]


def _edit_argument_wiring(document: dict[str, Any]) -> None:
    add = next(node for node in _nodes(document) if node["target"] == "torch.ops.aten.add.Tensor")
    add["inputs"][0], add["inputs"][1] = add["inputs"][1], add["inputs"][0]


def _edit_guards(document: dict[str, Any]) -> None:
    document["guards_code"] = [*document.get("guards_code", []), "L['offset'].size()[0] == 4"]


@pytest.mark.parametrize(
    "edit",
    [
        _edit_target,
        _edit_dtype,
        _edit_static_size,
        _edit_stride,
        _edit_range,
        _edit_float_literal,
        _edit_parameter_name,
        _edit_buffer_persistence,
        _edit_in_spec,
        _edit_output,
        _edit_argument_wiring,
        _edit_guards,
    ],
    ids=lambda edit: edit.__name__.removeprefix("_edit_"),
)
def test_every_part_of_the_computation_is_in_the_digest(
    edit: Any, program_document: dict[str, Any], pt2_report: ArchiveReport
) -> None:
    edited = copy.deepcopy(program_document)
    edit(edited)
    assert edited != program_document
    assert _digest(edited) != pt2_report.graph_digest


def test_the_projection_spells_floats_as_shortest_round_trip_strings(program_document: dict[str, Any]) -> None:
    projection = ProgramView(program_document).projection
    literals = [
        argument["arg"]["as_float"]
        for node in projection["graph"]["nodes"]
        for argument in node["inputs"]
        if "as_float" in argument["arg"]
    ]
    assert literals == ["0.5"]


def test_the_projection_renames_symbols_from_the_first_input(program_document: dict[str, Any]) -> None:
    view = ProgramView(program_document)
    assert list(view.symbols.values()) == ["s0"]
    assert list(view.projection["range_constraints"]) == ["s0"]


def test_graph_digest_from_archive_reads_any_torch_written_pt2(pt2_archive: Path, tmp_path: Path) -> None:
    # Weights and all: a package_pt2-style archive still has a measurable graph.
    with_weights = rewrite(
        pt2_archive, tmp_path / "with-weights.pt2", add=[("archive/data/weights/weight_0", b"0" * 64)]
    )
    assert graph_digest_from_archive(with_weights) == graph_digest_from_archive(pt2_archive)
