"""``cgstore_client.archive.inspect`` on real minted archives: the report, the derived contracts, the limits."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgstore_client.archive import (
    DEFAULT_LIMITS,
    ArchiveError,
    ArchiveReport,
    ArchiveTooLarge,
    JsonTooLarge,
    Limits,
    graph_digest_from_archive,
    inspect,
    program_facts,
)
from cgstore_client.archive import errors as archive_errors
from cgstore_client.archive.contract import parse_aoti_constants
from cgstore_client.keys import canonical_json, is_digest, is_sm
from cgstore_client.metadata import build_metadata
from tests.support.archives import BATCH_MAX, BATCH_MIN, tiny_inputs, tiny_model

pytestmark = pytest.mark.torch

EXPECTED_CONTRACT = {
    "v": 1,
    "inputs": [
        {"name": "inputs_x", "path": "args[0]['x']", "dtype": "float32", "shape": ["s0", 8]},
        {"name": "inputs_y", "path": "args[0]['y']", "dtype": "float32", "shape": ["s0", 4]},
        {"name": "offset", "path": "args[1]", "dtype": "float32", "shape": [4]},
    ],
    "dims": {"s0": {"min": BATCH_MIN, "max": BATCH_MAX}},
    "tree": {
        "type": "builtins.tuple",
        "arity": 2,
        "children": [
            {
                "type": "builtins.tuple",
                "arity": 2,
                "children": [
                    {"type": "builtins.dict", "arity": 2, "keys": ["x", "y"], "children": ["tensor", "tensor"]},
                    "tensor",
                ],
            },
            {"type": "builtins.dict", "arity": 0, "keys": [], "children": []},
        ],
    },
}

EXPECTED_BINDINGS = [
    {
        "name": "p_lin_weight",
        "fqn": "lin.weight",
        "kind": "PARAMETER",
        "dtype": "float32",
        "shape": [4, 8],
        "nbytes": 128,
        "binding": "DYNAMIC",
        "load_name": "lin.weight",
        "packaged_bytes": 0,
    },
    {
        "name": "p_lin_bias",
        "fqn": "lin.bias",
        "kind": "PARAMETER",
        "dtype": "float32",
        "shape": [4],
        "nbytes": 16,
        "binding": "DYNAMIC",
        "load_name": "lin.bias",
        "packaged_bytes": 0,
    },
    {
        "name": "b_scale",
        "fqn": "scale",
        "kind": "BUFFER",
        "dtype": "float32",
        "shape": [4],
        "nbytes": 16,
        "persistent": "true",
        "binding": "DYNAMIC",
        "load_name": "scale",
        "packaged_bytes": 0,
    },
    {
        "name": "b_table",
        "fqn": "table",
        "kind": "BUFFER",
        "dtype": "float32",
        "shape": [3],
        "nbytes": 12,
        "persistent": "false",
        "binding": "DYNAMIC",
        "load_name": "table",
        "packaged_bytes": 0,
    },
    {
        # torch.tensor(...) in forward: a literal of the program, re-lifted by AOTI under another name.
        "name": "c_lifted_tensor_0",
        "fqn": "lifted_tensor_0",
        "kind": "CONSTANT_TENSOR",
        "dtype": "float32",
        "shape": [4],
        "nbytes": 16,
        "binding": "STATIC",
        "load_name": "_tensor_constant0",
        "packaged_bytes": 0,
    },
]


def test_report_identifies_an_admissible_compiled_graph(pt2_report: ArchiveReport) -> None:
    assert pt2_report.kind == "aot-inductor"
    assert pt2_report.format == "pt2"
    assert pt2_report.root == "archive"
    assert pt2_report.model_name == "model"
    assert pt2_report.archive_version == "0"
    assert is_digest(pt2_report.graph_digest)
    assert any(name.endswith(".so") for name in pt2_report.aoti_files)
    assert all(name.startswith("data/aotinductor/model/") for name in pt2_report.aoti_files)


def test_input_contract_matches_what_the_model_declares(pt2_report: ArchiveReport) -> None:
    assert pt2_report.input_contract == EXPECTED_CONTRACT


def test_binding_table_lists_every_constant_with_its_binding(pt2_report: ArchiveReport) -> None:
    assert pt2_report.binding_table == EXPECTED_BINDINGS


def test_derived_facts_agree_with_the_eager_model(pt2_report: ArchiveReport) -> None:
    model = tiny_model(0)
    declared = {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
    bound = {row["fqn"]: row for row in pt2_report.binding_table if row["kind"] in ("PARAMETER", "BUFFER")}
    assert sorted(bound) == sorted(declared)
    for fqn, tensor in declared.items():
        assert bound[fqn]["shape"] == list(tensor.shape)
        assert bound[fqn]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert bound[fqn]["nbytes"] == tensor.numel() * tensor.element_size()
    assert bound["table"]["persistent"] == "false"  # registered persistent=False
    inputs, offset = tiny_inputs()
    leaves = [inputs["x"], inputs["y"], offset]
    for entry, leaf in zip(pt2_report.input_contract["inputs"], leaves, strict=True):
        assert entry["dtype"] == str(leaf.dtype).removeprefix("torch.")
        assert [dim if isinstance(dim, int) else leaf.shape[index] for index, dim in enumerate(entry["shape"])] == list(
            leaf.shape
        )


def test_derived_documents_are_hashable_canonical_json(pt2_report: ArchiveReport) -> None:
    # Only strings, ints, lists and objects: the store can hash or compare them byte for byte.
    canonical_json(pt2_report.input_contract)
    canonical_json(pt2_report.binding_table)
    assert json.loads(json.dumps(pt2_report.to_document()))["graph_digest"] == pt2_report.graph_digest


def test_device_facts_and_sm_come_from_aoti_metadata(pt2_report: ArchiveReport, pt2_archive: Path) -> None:
    from cgstore_client.environment import environment_sm

    with zipfile.ZipFile(pt2_archive) as archive:
        recorded = next(
            json.loads(archive.read(name)) for name in archive.namelist() if name.endswith("wrapper_metadata.json")
        )
    tokens = sorted(token.lower() for token in recorded["AOTI_CPU_ISA"].split())
    assert pt2_report.device.device_key == recorded["AOTI_DEVICE_KEY"] == "cpu"
    assert pt2_report.device.machine == recorded["AOTI_MACHINE"]
    assert pt2_report.sm == f"cpu-{recorded['AOTI_MACHINE']}-{'+'.join(tokens)}"
    assert is_sm(pt2_report.sm)
    assert pt2_report.sm == environment_sm("cpu") == environment_sm()


def test_metadata_is_read_and_validated(pt2_report: ArchiveReport) -> None:
    assert pt2_report.metadata == build_metadata(sm=pt2_report.sm)
    assert pt2_report.metadata.package_constants_in_so is False


def test_report_is_frozen(pt2_report: ArchiveReport) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        pt2_report.graph_digest = "blake3:" + "0" * 64  # type: ignore[misc]


def test_inspect_accepts_str_and_path(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    assert inspect(str(pt2_archive)).graph_digest == pt2_report.graph_digest


def test_graph_digest_from_archive_agrees_with_inspect(pt2_archive: Path, pt2_report: ArchiveReport) -> None:
    assert graph_digest_from_archive(pt2_archive) == pt2_report.graph_digest


def test_limits_are_configurable(pt2_archive: Path) -> None:
    with pytest.raises(ArchiveTooLarge, match="entries"):
        inspect(pt2_archive, limits=Limits(max_entries=3))
    with pytest.raises(JsonTooLarge, match="models/model.json"):
        inspect(pt2_archive, limits=Limits(max_json_bytes=1024))
    with pytest.raises(ArchiveTooLarge, match="expands to"):
        inspect(pt2_archive, limits=Limits(max_entry_bytes=64 * 1024))
    assert DEFAULT_LIMITS.max_entries == 10_000 and DEFAULT_LIMITS.max_json_depth == 64


def test_limits_refuse_nonsense_bounds() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        Limits(max_entries=0)


def test_inspection_without_entry_verification_gives_the_same_report(
    pt2_archive: Path, pt2_report: ArchiveReport
) -> None:
    assert inspect(pt2_archive, limits=Limits(verify_entries=False)) == pt2_report


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (archive_errors.KindRetired, "KIND_RETIRED"),
        (archive_errors.KindUnsupported, "KIND_UNSUPPORTED"),
        (archive_errors.MetadataInvalid, "METADATA_INVALID"),
        (archive_errors.MetadataMissing, "METADATA_INVALID"),
        (archive_errors.SmMismatch, "SM_MISMATCH"),
        (archive_errors.ArchiveBomb, "ARTIFACT_INVALID"),
        (archive_errors.ArchivePathUnsafe, "ARTIFACT_INVALID"),
        (archive_errors.ArchiveNotWeightFree, "ARTIFACT_INVALID"),
        (archive_errors.ArchiveNotPickleFree, "ARTIFACT_INVALID"),
        (archive_errors.JsonTooDeep, "ARTIFACT_INVALID"),
        (archive_errors.ProgramInvalid, "ARTIFACT_INVALID"),
    ],
)
def test_every_refusal_carries_its_protocol_code(error: type[ArchiveError], code: str) -> None:
    assert issubclass(error, ArchiveError)
    assert error.code == code


def test_aoti_constants_table_is_read_from_generated_source() -> None:
    source = b"""
    constants_info_[0].name = "lin_weight";
    constants_info_[0].dtype = cached_torch_dtype_bfloat16;
    constants_info_[0].from_folded = false;
    constants_info_[0].type = static_cast<int32_t>(torch::aot_inductor::ConstantType::Parameter);
    constants_info_[0].shape = {4, 8};
    constants_info_[0].original_fqn = "lin.weight";
    constants_info_[1].name = "_FOLDED_CONST_0";
    constants_info_[1].dtype = cached_torch_dtype_float32;
    constants_info_[1].from_folded = true;
    constants_info_[1].type = static_cast<int32_t>(torch::aot_inductor::ConstantType::FoldedConstant);
    constants_info_[1].shape = {};
    constants_info_[1].original_fqn = "_FOLDED_CONST_0";
    """
    weight, folded = parse_aoti_constants(source.splitlines())
    assert (weight.name, weight.original_fqn, weight.dtype, weight.shape, weight.kind, weight.from_folded) == (
        "lin_weight",
        "lin.weight",
        "bfloat16",
        (4, 8),
        "PARAMETER",
        False,
    )
    assert (folded.kind, folded.shape, folded.from_folded) == ("FOLDED_CONSTANT", (), True)


def test_the_reader_imports_no_torch() -> None:
    # The store imports the reader; it must stay torch-free and small.
    probe = (
        "import sys, cgstore_client.archive, cgstore_client.archive.reader;"
        "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules), 'torch imported'"
    )
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr


def _paths(document: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every path into a JSON document (object keys and list indexes)."""
    found = [prefix]
    if isinstance(document, dict):
        for key, value in document.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += _paths(value, (*prefix, index))
    return found


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def archived_program(pt2_archive: Path) -> dict[str, object]:
    with zipfile.ZipFile(pt2_archive) as archive:
        return json.loads(archive.read("archive/models/model.json"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_off_schema_program_is_refused_by_name_never_crashes(
    archived_program: dict[str, object], data: st.DataObject
) -> None:
    import copy

    paths = _paths(archived_program)
    path = data.draw(st.sampled_from(paths[1:]), label="path")
    mutated = copy.deepcopy(archived_program)
    container: object = mutated
    for step in path[:-1]:
        container = container[step]  # type: ignore[index]
    container[path[-1]] = data.draw(_JSON, label="value")  # type: ignore[index]
    try:
        facts = program_facts(mutated)
    except ArchiveError as refused:
        assert refused.code == "ARTIFACT_INVALID"
    else:
        canonical_json(facts.input_contract)
        canonical_json(facts.binding_table)


def test_a_boolean_where_a_size_belongs_is_refused(archived_program: dict[str, object]) -> None:
    import copy

    mutated = copy.deepcopy(archived_program)
    mutated["graph_module"]["graph"]["tensor_values"]["offset"]["sizes"][0] = {"as_int": True}  # type: ignore[index]
    with pytest.raises(archive_errors.ProgramInvalid, match="size"):
        program_facts(mutated)
