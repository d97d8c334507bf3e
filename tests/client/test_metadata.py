"""Compiled-graph metadata (extra/metadata.json): schema, refusals, reproducible bytes."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgstore_client.errors import MetadataError
from cgstore_client.metadata import (
    ACTIVATION_SPIKE_FRACTION,
    COMPILED_GRAPH_FORMAT,
    FRAGMENTATION_HEADROOM_BYTES,
    GIB,
    LANE_RE,
    MARGIN_FRACTION,
    MIB,
    QUANTUM_BYTES,
    CompiledGraphMetadata,
    FitBlock,
    KernelLane,
    build_metadata,
    is_lane,
    looks_like_wall_clock_key,
    looks_like_wall_clock_value,
    parse_metadata,
    parse_metadata_json,
    quantize_up,
)

Q = QUANTUM_BYTES


def _verdict_document() -> dict:
    return {
        "winner": "baseline+packed",
        "rule": "fit-constrained-speed/1",
        "binding": "vram-tiebreak",
        "margin_fraction": 0.05,
        "candidates": ["baseline+packed", "baseline+dense"],
        "fit": {
            "quantum_bytes": Q,
            "activation_spike_fraction": 0.2,
            "fragmentation_headroom_bytes": GIB,
            "peaks": {"baseline+packed": 53 * Q, "baseline+dense": 92 * Q},
            "order": ["baseline+packed", "baseline+dense"],
        },
    }


def _document() -> dict:
    return {
        "compiled_graph_format": COMPILED_GRAPH_FORMAT,
        "kind": "aot-inductor",
        "sm": "sm_100",
        "package_constants_in_so": False,
        "constant_folding_fenced": True,
        "kernel_lane": _verdict_document(),
    }


def _refused(document, match: str) -> None:
    with pytest.raises(MetadataError, match=match):
        parse_metadata(document)


# --------------------------------------------------------------------------
# Constants and helpers
# --------------------------------------------------------------------------


def test_constants():
    assert COMPILED_GRAPH_FORMAT == "cgstore.compiled-graph/1"
    assert QUANTUM_BYTES == 256 * MIB == 268435456
    assert ACTIVATION_SPIKE_FRACTION == 0.20
    assert FRAGMENTATION_HEADROOM_BYTES == GIB == 1073741824
    assert MARGIN_FRACTION == 0.05


@pytest.mark.parametrize("raw, quantized", [(0, 0), (1, Q), (Q - 1, Q), (Q, Q), (Q + 1, 2 * Q), (23 * GIB, 23 * GIB)])
def test_quantize_up(raw, quantized):
    assert quantize_up(raw) == quantized


@given(st.integers(min_value=0, max_value=1 << 48))
def test_quantize_up_is_the_smallest_covering_multiple(raw):
    quantized = quantize_up(raw)
    assert quantized % Q == 0 and raw <= quantized < raw + Q
    assert quantize_up(quantized) == quantized


@pytest.mark.parametrize("raw, error", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("1", TypeError)])
def test_quantize_up_refuses(raw, error):
    with pytest.raises(error):
        quantize_up(raw)


@pytest.mark.parametrize("lane", ["baseline+packed", "fused+dense", "a+b", "w4a4_v2+dense_2"])
def test_lane_names(lane):
    assert is_lane(lane) and LANE_RE.match(lane)


@pytest.mark.parametrize(
    "lane", ["baseline", "baseline+", "+dense", "Baseline+dense", "a+b+c", "1a+b", "base-line+dense", "a+b\n", "", None]
)
def test_not_lane_names(lane):
    assert not is_lane(lane)


# --------------------------------------------------------------------------
# Round trip and reproducible bytes
# --------------------------------------------------------------------------


def test_parse_round_trips_a_valid_document():
    metadata = parse_metadata(_document())
    assert metadata.kind == "aot-inductor"
    assert metadata.sm == "sm_100"
    assert metadata.kernel_lane.winner == "baseline+packed"
    assert metadata.kernel_lane.candidates == ("baseline+dense", "baseline+packed")  # sorted: a set
    assert metadata.kernel_lane.fit.order == ("baseline+packed", "baseline+dense")  # kept: a preference
    assert parse_metadata(metadata.to_document()) == metadata
    assert parse_metadata_json(metadata.to_json_bytes()) == metadata


def test_two_mints_write_identical_bytes():
    verdict = parse_metadata(_document()).kernel_lane
    first = build_metadata(sm="sm_100", kernel_lane=verdict, extra={"family": "flux2-klein-4b"})
    shuffled = _verdict_document()
    shuffled["candidates"].reverse()
    shuffled["fit"]["peaks"] = dict(reversed(list(shuffled["fit"]["peaks"].items())))
    second = build_metadata(sm="sm_100", kernel_lane=shuffled, extra={"family": "flux2-klein-4b"})
    assert first.to_json_bytes() == second.to_json_bytes()


def test_golden_bytes():
    metadata = build_metadata(sm="sm_100", kernel_lane=parse_metadata(_document()).kernel_lane)
    assert metadata.to_json_bytes() == (
        b'{"compiled_graph_format":"cgstore.compiled-graph/1","constant_folding_fenced":true,'
        b'"kernel_lane":{"binding":"vram-tiebreak","candidates":["baseline+dense","baseline+packed"],'
        b'"fit":{"activation_spike_fraction":0.2,"fragmentation_headroom_bytes":1073741824,'
        b'"order":["baseline+packed","baseline+dense"],"peaks":{"baseline+dense":24696061952,'
        b'"baseline+packed":14227079168},"quantum_bytes":268435456},"margin_fraction":0.05,'
        b'"rule":"fit-constrained-speed/1","winner":"baseline+packed"},"kind":"aot-inductor",'
        b'"package_constants_in_so":false,"sm":"sm_100"}'
    )


def test_build_metadata_defaults_to_the_admissible_policy():
    metadata = build_metadata(sm="cpu-x86_64-avx512+avx512_vnni")
    assert metadata.package_constants_in_so is False
    assert metadata.constant_folding_fenced is True
    assert metadata.kernel_lane is None
    assert metadata.to_document()["kernel_lane"] is None


def test_kernel_lane_may_be_absent_or_null():
    document = _document()
    del document["kernel_lane"]
    assert parse_metadata(document).kernel_lane is None
    document["kernel_lane"] = None
    assert parse_metadata(document).kernel_lane is None


def test_fit_may_be_null_when_no_peaks_were_recorded():
    document = _document()
    document["kernel_lane"]["fit"] = None
    assert parse_metadata(document).kernel_lane.fit is None
    del document["kernel_lane"]["fit"]
    assert parse_metadata(document).kernel_lane.fit is None


def test_package_constants_in_so_is_recorded_as_declared():
    document = _document()
    document["package_constants_in_so"] = True
    assert parse_metadata(document).package_constants_in_so is True


def test_metadata_is_frozen():
    metadata = parse_metadata(_document())
    with pytest.raises(dataclasses.FrozenInstanceError):
        metadata.sm = "sm_90"  # type: ignore[misc]
    with pytest.raises(TypeError):
        metadata.kernel_lane.fit.peaks["baseline+dense"] = Q  # type: ignore[index]


# --------------------------------------------------------------------------
# Top-level refusals
# --------------------------------------------------------------------------


def test_retired_kind_is_refused_by_name():
    document = _document()
    document["kind"] = "torch-inductor-cache"
    _refused(document, "'torch-inductor-cache' is retired")


def test_retired_kind_is_named_before_missing_fields():
    _refused({"compiled_graph_format": COMPILED_GRAPH_FORMAT, "kind": "torch-inductor-cache"}, "retired")


@pytest.mark.parametrize("kind", ["aot_inductor", "AOT-INDUCTOR", "onnx", "", None, 1])
def test_other_kinds_are_unsupported(kind):
    document = _document()
    document["kind"] = kind
    _refused(document, "not supported")


@pytest.mark.parametrize("fmt", ["cgstore.compiled-graph/2", "", None])
def test_unknown_format(fmt):
    document = _document()
    document["compiled_graph_format"] = fmt
    _refused(document, "compiled_graph_format")


@pytest.mark.parametrize(
    "missing", ["compiled_graph_format", "kind", "sm", "package_constants_in_so", "constant_folding_fenced"]
)
def test_required_fields(missing):
    document = _document()
    del document[missing]
    _refused(document, f"no '{missing}'")


@pytest.mark.parametrize("sm", ["sm90", "SM_90", "cpu-x86_64-avx512_vnni+avx512", 90, None])
def test_sm_must_be_canonical(sm):
    document = _document()
    document["sm"] = sm
    _refused(document, "sm")


@pytest.mark.parametrize("flag", ["package_constants_in_so", "constant_folding_fenced"])
@pytest.mark.parametrize("value", [0, 1, "false", None])
def test_policy_flags_are_bools(flag, value):
    document = _document()
    document[flag] = value
    _refused(document, f"{flag} must be true or false")


@pytest.mark.parametrize("document", [[], "metadata", None, 7, b"{}"])
def test_metadata_must_be_an_object(document):
    _refused(document, "must be an object")


# --------------------------------------------------------------------------
# Kernel-lane refusals
# --------------------------------------------------------------------------


def _with_verdict(**changes) -> dict:
    document = _document()
    document["kernel_lane"].update(changes)
    return document


def _with_fit(**changes) -> dict:
    document = _document()
    document["kernel_lane"]["fit"].update(changes)
    return document


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(winner="fused+dense"), "not among candidates"),
        (dict(winner="baseline"), "lane"),
        (dict(winner=7), "winner must be a string"),
        (dict(candidates=["baseline+packed", "baseline"]), r"candidates\[1\]"),
        (dict(candidates=["baseline+packed", "baseline+packed"]), "repeats"),
        (dict(candidates=[]), "empty"),
        (dict(candidates="baseline+packed"), "must be a list"),
        (dict(binding="fastest"), "binding"),
        (dict(rule="fit-constrained-speed/2"), "not understood"),
        (dict(margin_fraction=0.1), "margin_fraction"),
        (dict(margin_fraction=True), "margin_fraction"),
        (dict(margin_fraction="0.05"), "margin_fraction"),
        (dict(evidence={"baseline+packed": 1}), "unknown keys"),
        (dict(step_seconds=0.228), "unknown keys"),
    ],
)
def test_verdict_refusals(changes, match):
    _refused(_with_verdict(**changes), match)


@pytest.mark.parametrize("missing", ["winner", "rule", "binding", "margin_fraction", "candidates"])
def test_verdict_required_fields(missing):
    document = _document()
    del document["kernel_lane"][missing]
    _refused(document, f"no '{missing}'")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(peaks={"baseline+packed": 53 * Q + 1, "baseline+dense": 92 * Q}), "not quantized"),
        (dict(peaks={"baseline+packed": 13 * GIB + 12345, "baseline+dense": 92 * Q}), "not quantized"),
        (dict(peaks={"baseline+packed": float(53 * Q), "baseline+dense": 92 * Q}), "must be an integer"),
        (dict(peaks={"baseline+packed": True, "baseline+dense": 92 * Q}), "must be an integer"),
        (dict(peaks={"baseline+packed": 0, "baseline+dense": 92 * Q}), "must be in"),
        (dict(peaks={"baseline+packed": -Q, "baseline+dense": 92 * Q}), "must be in"),
        (dict(peaks={"baseline+packed": 1 << 60, "baseline+dense": 92 * Q}), "must be in"),
        (dict(peaks={"baseline+packed": 53 * Q, "baseline+dense": 92 * Q, "fused+dense": Q}), "not candidates"),
        (dict(peaks={"baseline+packed": 53 * Q}), "no peak for candidates"),
        (dict(peaks={"baseline+packed": 53 * Q, "Baseline+dense": 92 * Q}), "lane"),
        (dict(peaks={}), "empty"),
        (dict(peaks=[53 * Q, 92 * Q]), "must be an object"),
        (dict(order=["baseline+packed"]), "not a permutation"),
        (dict(order=["baseline+packed", "baseline+dense", "fused+dense"]), "not a permutation"),
        (dict(order=["baseline+packed", "baseline+packed"]), "repeats"),
        (dict(order=["baseline+dense", "baseline+packed"]), "start with the winner"),
        (dict(order="baseline+packed"), "must be a list"),
        (dict(quantum_bytes=128 * MIB), "quantum_bytes"),
        (dict(quantum_bytes=float(Q)), "quantum_bytes must be an integer"),
        (dict(activation_spike_fraction=0.25), "activation_spike_fraction"),
        (dict(fragmentation_headroom_bytes=2 * GIB), "fragmentation_headroom_bytes"),
        (dict(fragmentation_headroom_bytes=float(GIB)), "must be an integer"),
        (dict(measured_at="x"), "unknown keys"),
    ],
)
def test_fit_refusals(changes, match):
    _refused(_with_fit(**changes), match)


@pytest.mark.parametrize(
    "missing", ["quantum_bytes", "activation_spike_fraction", "fragmentation_headroom_bytes", "peaks", "order"]
)
def test_fit_required_fields(missing):
    document = _document()
    del document["kernel_lane"]["fit"][missing]
    _refused(document, f"no '{missing}'")


def test_bindings_agree_with_candidate_count():
    single = {
        "winner": "baseline+dense",
        "rule": "fit-constrained-speed/1",
        "margin_fraction": 0.05,
        "candidates": ["baseline+dense"],
        "fit": None,
    }
    assert parse_metadata({**_document(), "kernel_lane": {**single, "binding": "only-candidate"}})
    assert parse_metadata({**_document(), "kernel_lane": {**single, "binding": "no-fit"}})
    _refused({**_document(), "kernel_lane": {**single, "binding": "speed"}}, "needs several candidates")
    _refused(_with_verdict(binding="only-candidate"), "only-candidate")


def test_dataclasses_validate_whoever_builds_them():
    with pytest.raises(MetadataError, match="not quantized"):
        FitBlock(peaks={"a+b": Q + 1}, order=("a+b",))
    with pytest.raises(MetadataError, match="not among candidates"):
        KernelLane(winner="a+b", candidates=("c+d",), binding="only-candidate")
    with pytest.raises(MetadataError, match="retired"):
        CompiledGraphMetadata(
            sm="sm_90", package_constants_in_so=False, constant_folding_fenced=True, kind="torch-inductor-cache"
        )
    with pytest.raises(MetadataError, match="kernel_lane must be"):
        CompiledGraphMetadata(
            sm="sm_90", package_constants_in_so=False, constant_folding_fenced=True, kernel_lane=_verdict_document()
        )


# --------------------------------------------------------------------------
# Wall clocks, timings and extras
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "created_at",
        "created",
        "timestamp",
        "build_time",
        "mtime",
        "minted_at",
        "date",
        "build_date",
        "wallclock",
        "wall",
        "clock",
        "compile_seconds_timestamp",
        "last_updated",
        "epoch",
        "ts",
    ],
)
def test_wall_clock_keys_are_refused(key):
    assert looks_like_wall_clock_key(key)
    _refused({**_document(), key: "x"}, "wall clock")


@pytest.mark.parametrize("key", ["kernel_lane_evidence", "mint_phases"])
def test_timing_evidence_is_refused_by_name(key):
    _refused({**_document(), key: {"baseline+dense": 1}}, "published record")


@pytest.mark.parametrize(
    "value",
    [
        "2024-12-02",
        "2024-12-02T10:11:12",
        "2024-12-02T10:11:12Z",
        "2024-12-02 10:11:12.123456+00:00",
        "2024-12-02T10:11+01:00",
        "20241202T101112Z",
        "1733155200",
        "1733155200.25",
        "1733155200123",
        " 1733155200.5 ",
    ],
)
def test_wall_clock_values_are_refused(value):
    assert looks_like_wall_clock_value(value)
    _refused({**_document(), "note": value}, "wall clock")
    _refused({**_document(), "provenance": {"steps": ["trace", value]}}, "wall clock")


@pytest.mark.parametrize(
    "value", ["2.13.0", "12.8.93", "flux2-klein-4b", "blake3:" + "1" * 64, "0.35.1", "2024", "123456", "9999-99-99"]
)
def test_ordinary_strings_are_not_wall_clocks(value):
    assert not looks_like_wall_clock_value(value)


def test_harmless_extras_are_kept_and_written_back():
    extras = {
        "family": "flux2-klein-4b",
        "layout": {"topology": "sdxl.diffusers@1", "quant": "cozy.fp8-rowwise@1"},
        "validated_candidates": ["baseline+dense"],
        "shards": 4,
        "fused": None,
        "checked": True,
    }
    metadata = parse_metadata({**_document(), **extras})
    assert dict(metadata.extra) == extras
    assert {k: metadata.to_document()[k] for k in extras} == extras
    assert parse_metadata_json(metadata.to_json_bytes()) == metadata


def test_extras_are_copied_and_normalized():
    extras = {"shards": (1, 2), "layout": {"parts": ["a"]}}
    metadata = build_metadata(sm="sm_90", extra=extras)
    extras["layout"]["parts"].append("b")
    assert dict(metadata.extra) == {"shards": [1, 2], "layout": {"parts": ["a"]}}
    assert parse_metadata_json(metadata.to_json_bytes()) == metadata


@pytest.mark.parametrize(
    "extras, match",
    [
        ({"step_ms": 228.4}, "float"),
        ({"stats": {"median": 0.228}}, "float"),
        ({"Family": "x"}, "snake_case"),
        ({"family-name": "x"}, "snake_case"),
        ({"provenance": {"created_by": "ci"}}, "wall clock"),
        ({"provenance": {"mint_phases": []}}, "timing"),
    ],
)
def test_harmful_extras_are_refused(extras, match):
    _refused({**_document(), **extras}, match)


def _nested(levels: int) -> object:
    value: object = "leaf"
    for _ in range(levels):
        value = {"n": value}
    return value


def test_nesting_depth_limit():
    # The document is depth 1, so an extra holding 7 nested objects reaches depth 8.
    assert parse_metadata({**_document(), "deep": _nested(7)})
    _refused({**_document(), "deep": _nested(8)}, "deeper than 8")
    _refused({**_document(), "deep": [[[[[[[["x"]]]]]]]]}, "deeper than 8")


def test_deeply_nested_json_is_refused_without_crashing():
    _refused({**_document(), "deep": _nested(5000)}, "deeper than 8")
    with pytest.raises(MetadataError):
        parse_metadata_json(b'{"a":' * 100000 + b"1" + b"}" * 100000)


# --------------------------------------------------------------------------
# JSON decoding
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, match",
    [
        (b'{"kind":"aot-inductor","kind":"aot-inductor"}', "duplicate key"),
        (b'{"x": NaN}', "not valid JSON"),
        (b'{"x": Infinity}', "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_parse_metadata_json_is_strict(data, match):
    with pytest.raises(MetadataError, match=match):
        parse_metadata_json(data)


def test_parse_metadata_json_accepts_the_written_bytes():
    metadata = parse_metadata(_document())
    assert parse_metadata_json(metadata.to_json_bytes().decode()) == metadata
    assert parse_metadata_json(json.dumps(_document(), indent=2).encode()) == metadata


# --------------------------------------------------------------------------
# Property: any valid metadata survives its own bytes
# --------------------------------------------------------------------------

lane_parts = st.sampled_from(["baseline", "fused", "w4a4", "packed", "dense", "tiled_v2"])
lanes = st.builds(lambda a, b: f"{a}+{b}", lane_parts, lane_parts)


@st.composite
def kernel_lanes(draw):
    candidates = draw(st.lists(lanes, min_size=1, max_size=6, unique=True))
    winner = draw(st.sampled_from(candidates))
    if len(candidates) == 1:
        binding = draw(st.sampled_from(["only-candidate", "no-fit"]))
    else:
        binding = draw(st.sampled_from(["fit", "speed", "vram-tiebreak", "no-fit"]))
    fit = None
    if draw(st.booleans()):
        rest = draw(st.permutations([lane for lane in candidates if lane != winner]))
        peaks = {lane: draw(st.integers(min_value=1, max_value=400)) * Q for lane in candidates}
        fit = {
            "quantum_bytes": Q,
            "activation_spike_fraction": 0.2,
            "fragmentation_headroom_bytes": GIB,
            "peaks": peaks,
            "order": [winner, *rest],
        }
    return {
        "winner": winner,
        "rule": "fit-constrained-speed/1",
        "binding": binding,
        "margin_fraction": 0.05,
        "candidates": draw(st.permutations(candidates)),
        "fit": fit,
    }


@given(kernel_lanes(), st.sampled_from(["sm_90", "sm_120", "cpu-x86_64-avx2"]), st.booleans(), st.booleans())
def test_valid_metadata_survives_its_own_bytes(verdict, sm, in_so, fenced):
    document = {
        "compiled_graph_format": COMPILED_GRAPH_FORMAT,
        "kind": "aot-inductor",
        "sm": sm,
        "package_constants_in_so": in_so,
        "constant_folding_fenced": fenced,
        "kernel_lane": verdict,
    }
    metadata = parse_metadata(copy.deepcopy(document))
    written = metadata.to_json_bytes()
    reread = parse_metadata_json(written)
    assert reread == metadata
    assert reread.to_json_bytes() == written


def test_ties_are_canonical_and_refused_when_malformed() -> None:
    from cgstore_client.metadata import canonical_ties

    assert canonical_ties([["wte.weight", "lm_head.weight"], ["b", "a"]]) == (
        ("a", "b"),
        ("lm_head.weight", "wte.weight"),
    )
    for bad in ([["only"]], [["a", "a"]], [["a", "b"], ["b", "c"]], [[1, 2]], "ab"):
        with pytest.raises(MetadataError):
            canonical_ties(bad)
    tied = build_metadata(sm="sm_90", ties=[["wte.weight", "lm_head.weight"]])
    assert tied.to_document()["ties"] == [["lm_head.weight", "wte.weight"]]
    assert parse_metadata_json(tied.to_json_bytes()) == tied
    assert "ties" not in build_metadata(sm="sm_90").to_document()  # untied metadata reads as before
