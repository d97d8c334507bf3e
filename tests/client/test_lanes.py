"""Kernel lanes: the fit rule at mint (choose_lane) and its re-application at serve (resolve_lane)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgstore_client.errors import LaneError
from cgstore_client.lanes import (
    DEFAULT_LANE,
    KERNEL_LANE_FIT_UNVERIFIED,
    KERNEL_LANE_NO_COMPILED_GRAPH,
    KERNEL_LANE_REFIT_LOCAL,
    KERNEL_LANE_REFIT_NO_FIT,
    KERNEL_LANE_UNKNOWN_LANE,
    KERNEL_LANE_VERDICT_ABSENT,
    KERNEL_LANE_VERDICT_ADOPTED,
    KERNEL_LANE_VERDICT_UNREADABLE,
    LaneMeasurement,
    choose_lane,
    fit_requirement_bytes,
    fits,
    resolve_lane,
)
from cgstore_client.metadata import GIB, QUANTUM_BYTES, build_metadata, parse_metadata, parse_metadata_json

Q = QUANTUM_BYTES
GB = 10**9
B200_TOTAL = 178 * GIB  # what a B200 reports
PRO6000_TOTAL = 95 * GIB
RTX5090_TOTAL = 31 * GIB + 512 * 2**20
RTX4090_TOTAL = 23 * GIB + 600 * 2**20  # a "24 GB" card


def _metadata(verdict, sm="sm_100"):
    return build_metadata(sm=sm, kernel_lane=verdict.to_metadata())


# --------------------------------------------------------------------------
# The fit test
# --------------------------------------------------------------------------


def test_fit_requirement_is_quantized_peak_plus_spike_plus_headroom():
    assert fit_requirement_bytes(10 * GIB) == 12 * GIB + GIB
    assert fit_requirement_bytes(10 * GIB + 1) == math.ceil((10 * GIB + Q) * 6 / 5) + GIB
    assert fit_requirement_bytes(1) == math.ceil(Q * 6 / 5) + GIB


@given(st.integers(min_value=1, max_value=1 << 44))
def test_fits_boundary_is_exact(peak):
    requirement = fit_requirement_bytes(peak)
    assert fits(peak, requirement)
    assert not fits(peak, requirement - 1)


@pytest.mark.parametrize("total", [0, -1, 1.5, True, "80GB", None])
def test_device_total_must_be_a_positive_int(total):
    with pytest.raises(LaneError):
        fits(GIB, total)
    with pytest.raises(LaneError):
        choose_lane({"baseline+dense": (0.1, GIB)}, total)
    with pytest.raises(LaneError):
        resolve_lane(None, total)


# --------------------------------------------------------------------------
# choose_lane: the rule, with the design note's examples
# --------------------------------------------------------------------------


def test_b200_takes_the_baseline_linears_over_the_fused_ones():
    verdict = choose_lane(
        {"baseline+dense": (0.228, int(22.8 * GB)), "fused+dense": (0.350, int(22.8 * GB))}, B200_TOTAL
    )
    assert verdict.winner == "baseline+dense"
    assert verdict.binding == "speed"


def test_packed_modulation_wins_the_vram_tiebreak_at_equal_speed():
    verdict = choose_lane(
        {"baseline+dense": (0.228, int(22.8 * GB)), "baseline+packed": (0.228, int(13.3 * GB))}, B200_TOTAL
    )
    assert verdict.winner == "baseline+packed"
    assert verdict.binding == "vram-tiebreak"


def test_sm100_arrives_at_baseline_plus_packed_from_four_combinations():
    verdict = choose_lane(
        [
            LaneMeasurement("fused+dense", 0.350, int(22.8 * GB)),
            LaneMeasurement("fused+packed", 0.351, int(13.3 * GB)),
            LaneMeasurement("baseline+dense", 0.228, int(22.8 * GB)),
            LaneMeasurement("baseline+packed", 0.229, int(13.3 * GB)),
        ],
        B200_TOTAL,
    )
    assert verdict.winner == "baseline+packed"
    assert verdict.binding == "vram-tiebreak"
    assert verdict.candidates == ("baseline+dense", "baseline+packed", "fused+dense", "fused+packed")
    assert verdict.order == ("baseline+packed", "baseline+dense", "fused+packed", "fused+dense")


def test_a_24gb_card_excludes_a_lane_outright():
    measurements = {"baseline+dense": (0.200, int(22.8 * GB)), "baseline+packed": (0.300, int(13.3 * GB))}
    assert not fits(int(22.8 * GB), RTX4090_TOTAL)
    verdict = choose_lane(measurements, RTX4090_TOTAL)
    assert verdict.winner == "baseline+packed"  # 50% slower, but the only lane that fits
    assert verdict.binding == "fit"
    assert verdict.order == ("baseline+packed", "baseline+dense")
    # The same measurements on a card with room: speed decides.
    assert choose_lane(measurements, B200_TOTAL).winner == "baseline+dense"


def test_vram_breaks_a_tie_only_inside_the_margin():
    # 6% slower is outside the 5% margin: the faster, larger lane wins.
    verdict = choose_lane({"a+dense": (0.100, 20 * GIB), "a+packed": (0.106, 10 * GIB)}, B200_TOTAL)
    assert (verdict.winner, verdict.binding) == ("a+dense", "speed")
    # 4% slower is inside it: the smaller lane wins.
    verdict = choose_lane({"a+dense": (0.100, 20 * GIB), "a+packed": (0.104, 10 * GIB)}, B200_TOTAL)
    assert (verdict.winner, verdict.binding) == ("a+packed", "vram-tiebreak")


def test_margin_boundary_is_inclusive_and_exact():
    # 20 * 1.05 == 21 exactly; the comparison is on exact rationals, not floats.
    assert choose_lane({"a+dense": (20.0, 20 * GIB), "a+packed": (21.0, 10 * GIB)}, B200_TOTAL).winner == "a+packed"
    assert choose_lane({"a+dense": (20.0, 20 * GIB), "a+packed": (21.000001, 10 * GIB)}, B200_TOTAL).winner == "a+dense"


def test_the_margin_is_measured_from_the_fastest_fitting_lane():
    # fused+dense is fastest but does not fit a 24 GB card; among the rest the
    # fastest is baseline+dense, and baseline+packed is within 5% of it.
    verdict = choose_lane(
        {
            "fused+dense": (0.100, 30 * GIB),
            "baseline+dense": (0.200, 10 * GIB),
            "baseline+packed": (0.209, 8 * GIB),
        },
        RTX4090_TOTAL,
    )
    assert (verdict.winner, verdict.binding) == ("baseline+packed", "vram-tiebreak")
    assert verdict.order == ("baseline+packed", "baseline+dense", "fused+dense")


def test_peaks_inside_one_quantum_tie_and_the_name_decides():
    verdict = choose_lane({"b+packed": (0.1, 13 * GIB + 5), "a+packed": (0.1, 13 * GIB + 7)}, B200_TOTAL)
    assert verdict.peaks == {"a+packed": 13 * GIB + Q, "b+packed": 13 * GIB + Q}
    assert verdict.winner == "a+packed"


def test_a_single_candidate_is_the_only_candidate():
    verdict = choose_lane([LaneMeasurement("baseline+dense", 0.5, 10 * GIB)], B200_TOTAL)
    assert (verdict.winner, verdict.binding, verdict.order) == ("baseline+dense", "only-candidate", ("baseline+dense",))


def test_nothing_fits_picks_the_smallest_peak():
    verdict = choose_lane(
        {"fused+dense": (0.1, 40 * GIB), "baseline+packed": (0.5, 30 * GIB), "baseline+dense": (0.2, 40 * GIB)},
        RTX4090_TOTAL,
    )
    assert (verdict.winner, verdict.binding) == ("baseline+packed", "no-fit")
    assert verdict.order == ("baseline+packed", "baseline+dense", "fused+dense")
    single = choose_lane({"baseline+dense": (0.2, 40 * GIB)}, RTX4090_TOTAL)
    assert (single.winner, single.binding) == ("baseline+dense", "no-fit")


def test_verdict_metadata_carries_no_timings():
    verdict = choose_lane(
        {"baseline+dense": (0.228, int(22.8 * GB)), "fused+dense": (0.35, int(22.8 * GB))}, B200_TOTAL
    )
    block = verdict.to_metadata()
    written = build_metadata(sm="sm_100", kernel_lane=block).to_json_bytes()
    assert b"0.228" not in written and b"0.35" not in written and b"step" not in written
    assert all(peak % Q == 0 for peak in block.fit.peaks.values())
    assert block.fit.order[0] == block.winner == verdict.winner
    # The evidence holds what the archive must not.
    evidence = verdict.evidence
    assert evidence["rule"] == "fit-constrained-speed/1"
    assert evidence["device_total_bytes"] == B200_TOTAL
    assert evidence["measurements"]["baseline+dense"] == {
        "step_seconds": 0.228,
        "peak_bytes": int(22.8 * GB),
        "quantized_peak_bytes": verdict.peaks["baseline+dense"],
        "fits": True,
    }
    json.dumps(evidence)  # it rides a JSON record


def test_verdict_converts_to_valid_metadata_for_every_binding():
    cases = [
        ({"a+b": (0.1, GIB)}, "only-candidate"),
        ({"a+b": (0.1, 40 * GIB), "a+c": (0.2, GIB)}, "fit"),
        ({"a+b": (0.1, GIB), "a+c": (0.2, GIB)}, "speed"),
        ({"a+b": (0.1, 2 * GIB), "a+c": (0.1, GIB)}, "vram-tiebreak"),
        ({"a+b": (0.1, 40 * GIB), "a+c": (0.2, 30 * GIB)}, "no-fit"),
    ]
    for measurements, binding in cases:
        verdict = choose_lane(measurements, RTX4090_TOTAL)
        assert verdict.binding == binding
        metadata = _metadata(verdict)
        assert parse_metadata_json(metadata.to_json_bytes()).kernel_lane == verdict.to_metadata()


@pytest.mark.parametrize(
    "measurements, match",
    [
        ({}, "at least one"),
        ([], "at least one"),
        ({"baseline": (0.1, GIB)}, "lane must be"),
        ({"baseline+dense": (0.0, GIB)}, "positive"),
        ({"baseline+dense": (-0.1, GIB)}, "positive"),
        ({"baseline+dense": (float("nan"), GIB)}, "finite"),
        ({"baseline+dense": (float("inf"), GIB)}, "finite"),
        ({"baseline+dense": (True, GIB)}, "finite number"),
        ({"baseline+dense": ("0.1", GIB)}, "finite number"),
        ({"baseline+dense": (0.1, 0)}, "peak_bytes"),
        ({"baseline+dense": (0.1, 1.5 * GIB)}, "peak_bytes"),
        ({"baseline+dense": (0.1, True)}, "peak_bytes"),
        ({"baseline+dense": LaneMeasurement("fused+dense", 0.1, GIB)}, "keyed"),
        ([LaneMeasurement("a+b", 0.1, GIB), LaneMeasurement("a+b", 0.2, GIB)], "twice"),
        ([("a+b", 0.1, GIB)], "expected LaneMeasurement"),
    ],
)
def test_choose_lane_refuses_bad_measurements(measurements, match):
    with pytest.raises(LaneError, match=match):
        choose_lane(measurements, B200_TOTAL)


# --------------------------------------------------------------------------
# Determinism under timing noise
# --------------------------------------------------------------------------

# Each timing moves by at most 2%, so two equal-speed lanes stay within
# 1.02 / 0.98 < 1.05 of each other, and lanes 53% apart stay apart.
noise = st.floats(min_value=0.98, max_value=1.02)
# Raw peaks anywhere inside their top quantum quantize to the same bytes.
peak_jitter = st.integers(min_value=0, max_value=Q - 1)


@settings(max_examples=300)
@given(noise, noise, peak_jitter, peak_jitter)
def test_equal_speed_verdict_is_stable_under_noise(noise_packed, noise_dense, jitter_packed, jitter_dense):
    verdict = choose_lane(
        {
            "baseline+packed": (0.228 * noise_packed, 50 * Q - jitter_packed),
            "baseline+dense": (0.228 * noise_dense, 85 * Q - jitter_dense),
        },
        B200_TOTAL,
    )
    assert verdict.winner == "baseline+packed"
    assert verdict.binding == "vram-tiebreak"


def _sm100_reference():
    return choose_lane(
        {
            "fused+dense": (0.350, 85 * Q),
            "fused+packed": (0.350, 50 * Q),
            "baseline+dense": (0.228, 85 * Q),
            "baseline+packed": (0.228, 50 * Q),
        },
        B200_TOTAL,
    )


@settings(max_examples=300)
@given(st.lists(noise, min_size=4, max_size=4), st.lists(peak_jitter, min_size=4, max_size=4))
def test_metadata_bytes_are_stable_under_noise(noises, jitters):
    lanes = ["fused+dense", "fused+packed", "baseline+dense", "baseline+packed"]
    base = {
        "fused+dense": (0.350, 85),
        "fused+packed": (0.350, 50),
        "baseline+dense": (0.228, 85),
        "baseline+packed": (0.228, 50),
    }
    measurements = {lane: (base[lane][0] * noises[i], base[lane][1] * Q - jitters[i]) for i, lane in enumerate(lanes)}
    verdict = choose_lane(measurements, B200_TOTAL)
    reference = _sm100_reference()
    assert verdict == reference  # winner, binding, candidates, peaks, order (evidence excluded)
    assert _metadata(verdict).to_json_bytes() == _metadata(reference).to_json_bytes()


@settings(max_examples=200)
@given(st.permutations(["fused+dense", "fused+packed", "baseline+dense", "baseline+packed"]))
def test_verdict_ignores_measurement_order(order):
    by_lane = {
        "fused+dense": LaneMeasurement("fused+dense", 0.350, 85 * Q),
        "fused+packed": LaneMeasurement("fused+packed", 0.350, 50 * Q),
        "baseline+dense": LaneMeasurement("baseline+dense", 0.228, 85 * Q),
        "baseline+packed": LaneMeasurement("baseline+packed", 0.228, 50 * Q),
    }
    assert choose_lane([by_lane[lane] for lane in order], B200_TOTAL) == _sm100_reference()


# --------------------------------------------------------------------------
# resolve_lane: every reason
# --------------------------------------------------------------------------


def test_reason_strings():
    assert KERNEL_LANE_VERDICT_ADOPTED == "kernel_lane_verdict_adopted"
    assert KERNEL_LANE_REFIT_LOCAL == "kernel_lane_refit_local"
    assert KERNEL_LANE_REFIT_NO_FIT == "kernel_lane_refit_no_fit"
    assert KERNEL_LANE_FIT_UNVERIFIED == "kernel_lane_fit_unverified"
    assert KERNEL_LANE_VERDICT_ABSENT == "kernel_lane_verdict_absent"
    assert KERNEL_LANE_VERDICT_UNREADABLE == "kernel_lane_verdict_unreadable"
    assert KERNEL_LANE_UNKNOWN_LANE == "kernel_lane_unknown_lane"
    assert KERNEL_LANE_NO_COMPILED_GRAPH == "kernel_lane_no_compiled_graph"
    assert DEFAULT_LANE == "baseline+dense"


def _sm120_metadata():
    """Minted on a 96 GB PRO 6000: the fastest lane is also the biggest."""
    verdict = choose_lane(
        {
            "fused+dense": (1.063, 28 * GIB),  # fastest, largest
            "baseline+dense": (1.300, 20 * GIB),
            "baseline+packed": (1.500, 11 * GIB),
        },
        PRO6000_TOTAL,
    )
    assert verdict.winner == "fused+dense"
    assert verdict.order == ("fused+dense", "baseline+dense", "baseline+packed")
    return _metadata(verdict, sm="sm_120")


def test_adopted_when_the_recorded_winner_fits_here():
    resolution = resolve_lane(_sm120_metadata(), PRO6000_TOTAL)
    assert (resolution.lane, resolution.reason) == ("fused+dense", KERNEL_LANE_VERDICT_ADOPTED)


def test_refit_local_takes_the_fastest_recorded_lane_that_fits_here():
    on_5090 = resolve_lane(_sm120_metadata(), RTX5090_TOTAL)  # 28 GiB * 1.2 + 1 > 31.5 GiB
    assert (on_5090.lane, on_5090.reason) == ("baseline+dense", KERNEL_LANE_REFIT_LOCAL)
    on_16gb = resolve_lane(_sm120_metadata(), 16 * GIB)
    assert (on_16gb.lane, on_16gb.reason) == ("baseline+packed", KERNEL_LANE_REFIT_LOCAL)


def test_refit_no_fit_takes_the_smallest_recorded_peak_not_the_default():
    resolution = resolve_lane(_sm120_metadata(), 8 * GIB)
    assert (resolution.lane, resolution.reason) == ("baseline+packed", KERNEL_LANE_REFIT_NO_FIT)
    assert resolution.lane != DEFAULT_LANE


def test_fit_unverified_adopts_the_winner_without_peaks():
    document = _sm120_metadata().to_document()
    document["kernel_lane"]["fit"] = None
    resolution = resolve_lane(document, 1 * GIB)  # no peaks: nothing to check against
    assert (resolution.lane, resolution.reason) == ("fused+dense", KERNEL_LANE_FIT_UNVERIFIED)


def test_verdict_absent_is_the_conservative_default():
    resolution = resolve_lane(build_metadata(sm="sm_90"), B200_TOTAL)
    assert (resolution.lane, resolution.reason) == (DEFAULT_LANE, KERNEL_LANE_VERDICT_ABSENT)
    raw = build_metadata(sm="sm_90").to_document()
    del raw["kernel_lane"]  # a pre-verdict compiled graph
    assert resolve_lane(raw, B200_TOTAL).reason == KERNEL_LANE_VERDICT_ABSENT


def test_no_compiled_graph_is_the_conservative_default():
    resolution = resolve_lane(None, B200_TOTAL)
    assert (resolution.lane, resolution.reason) == (DEFAULT_LANE, KERNEL_LANE_NO_COMPILED_GRAPH)


def _raw_with(**kernel_lane_changes):
    document = _sm120_metadata().to_document()
    document["kernel_lane"].update(kernel_lane_changes)
    return document


@pytest.mark.parametrize(
    "raw",
    [
        [],
        "metadata",
        42,
        {},
        {**_sm120_metadata().to_document(), "kind": "torch-inductor-cache"},
        {**_sm120_metadata().to_document(), "created_at": "2024-12-02"},
        _raw_with(winner="baseline+packed"),  # not the head of the recorded order
        _raw_with(winner=7),
        _raw_with(candidates="fused+dense"),
        _raw_with(fit={"peaks": {"fused+dense": 1}}),
        _raw_with(rule="fit-constrained-speed/9"),
        {**_sm120_metadata().to_document(), "kernel_lane": "fused+dense"},
    ],
)
def test_unreadable_metadata_is_the_conservative_default(raw):
    resolution = resolve_lane(raw, B200_TOTAL)
    assert (resolution.lane, resolution.reason) == (DEFAULT_LANE, KERNEL_LANE_VERDICT_UNREADABLE)
    assert resolution.detail


@pytest.mark.parametrize("winner", ["turbo", "Fused+dense", "fused+dense+extra", ""])
def test_a_winner_that_is_no_lane_name_is_an_unknown_lane(winner):
    resolution = resolve_lane(_raw_with(winner=winner), B200_TOTAL)
    assert (resolution.lane, resolution.reason) == (DEFAULT_LANE, KERNEL_LANE_UNKNOWN_LANE)


def test_a_winner_this_worker_cannot_build_is_an_unknown_lane():
    resolution = resolve_lane(_sm120_metadata(), PRO6000_TOTAL, known_lanes={"baseline+dense", "baseline+packed"})
    assert (resolution.lane, resolution.reason) == (DEFAULT_LANE, KERNEL_LANE_UNKNOWN_LANE)


def test_refit_only_considers_lanes_this_worker_builds():
    known = {"fused+dense", "baseline+packed"}
    resolution = resolve_lane(_sm120_metadata(), RTX5090_TOTAL, known_lanes=known)
    assert (resolution.lane, resolution.reason) == ("baseline+packed", KERNEL_LANE_REFIT_LOCAL)


def test_raw_documents_resolve_like_parsed_ones():
    metadata = _sm120_metadata()
    for total in (PRO6000_TOTAL, RTX5090_TOTAL, 16 * GIB, 8 * GIB):
        assert resolve_lane(metadata.to_document(), total) == resolve_lane(metadata, total)
        assert resolve_lane(json.loads(metadata.to_json_bytes()), total) == resolve_lane(metadata, total)


def test_resolution_projects_each_axis():
    resolution = resolve_lane(_sm120_metadata(), RTX5090_TOTAL)
    assert (resolution.linear, resolution.modulation) == ("baseline", "dense")


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=25,
)


@settings(max_examples=300)
@given(json_values)
def test_resolve_lane_never_raises_on_hostile_metadata(raw):
    resolution = resolve_lane(raw, B200_TOTAL)
    defaults = {KERNEL_LANE_VERDICT_UNREADABLE, KERNEL_LANE_UNKNOWN_LANE, KERNEL_LANE_NO_COMPILED_GRAPH}
    assert resolution.reason in defaults
    assert resolution.lane == DEFAULT_LANE


@settings(max_examples=300)
@given(st.data())
def test_hostile_kernel_lane_blocks_never_raise(data):
    document = _sm120_metadata().to_document()
    document["kernel_lane"] = data.draw(json_values)
    resolution = resolve_lane(document, B200_TOTAL)
    assert resolution.lane == DEFAULT_LANE or resolution.reason == KERNEL_LANE_FIT_UNVERIFIED


lane_names = st.sampled_from(["baseline+dense", "baseline+packed", "fused+dense", "fused+packed", "w4a4+packed"])
measurement_sets = st.dictionaries(
    lane_names,
    st.tuples(st.floats(min_value=0.01, max_value=5.0), st.integers(min_value=1, max_value=120 * GIB)),
    min_size=1,
    max_size=5,
)
device_totals = st.integers(min_value=2 * GIB, max_value=200 * GIB)


@settings(max_examples=300)
@given(measurement_sets, device_totals)
def test_serving_on_the_mint_card_keeps_the_verdict(measurements, total):
    verdict = choose_lane(measurements, total)
    resolution = resolve_lane(_metadata(verdict), total)
    assert resolution.lane == verdict.winner
    expected = KERNEL_LANE_REFIT_NO_FIT if verdict.binding == "no-fit" else KERNEL_LANE_VERDICT_ADOPTED
    assert resolution.reason == expected


@settings(max_examples=300)
@given(measurement_sets, device_totals, device_totals)
def test_serving_pins_a_lane_that_fits_whenever_one_does(measurements, mint_total, serve_total):
    verdict = choose_lane(measurements, mint_total)
    resolution = resolve_lane(_metadata(verdict), serve_total)
    assert resolution.lane in verdict.candidates
    anything_fits = any(fits(peak, serve_total) for peak in verdict.peaks.values())
    assert fits(verdict.peaks[resolution.lane], serve_total) == anything_fits
    if not anything_fits:
        assert verdict.peaks[resolution.lane] == min(verdict.peaks.values())


def test_metadata_round_trip_through_parse_keeps_the_verdict():
    metadata = _sm120_metadata()
    assert parse_metadata(metadata.to_document()).kernel_lane == metadata.kernel_lane
