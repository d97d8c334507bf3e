"""Kernel lanes: the fit rule at mint (:func:`choose_lane`) and its re-application at serve (:func:`resolve_lane`).

A lane is ``<linear>+<modulation>`` (``baseline+packed``, ``fused+dense``...).
Which lane is fastest is a per-card fact measured at mint; whether a lane
FITS is a per-device fact re-checked at serve, because one key (keyed on sm,
not on the card) spans very different cards.

The rule, ``fit-constrained-speed/1``:

1. Quantize every measured peak UP to 256 MiB (reproducible across mints).
2. A lane fits a device when ``quantized_peak * 1.2 + 1 GiB <= device_total_bytes``
   (+20% for activation spikes and resolution variance, +1 GiB fragmentation).
3. Among fitting lanes the FASTEST wins. VRAM is a constraint, not an
   objective: it breaks a tie only among fitting lanes whose step time is
   within 5% of the fastest (``t <= fastest * 1.05``), where the smallest
   quantized peak wins, then the lane name (so the verdict is total).
4. If nothing fits, the smallest quantized peak wins (then the lane name):
   it is the smallest ask, and serving would make the same choice.

All comparisons are exact (``fractions.Fraction``), so the same numbers give
the same verdict on every machine.

The recorded fallback ``order`` is the rule applied repeatedly: the fitting
lanes in the order the rule would pick them (winner first, then the rule's
choice among the rest, ...), then the non-fitting lanes by quantized peak.
Serving walks it when the winner does not fit its device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from cgstore_client.errors import LaneError, MetadataError
from cgstore_client.metadata import (
    ACTIVATION_SPIKE_FRACTION,
    BINDING_FIT,
    BINDING_NO_FIT,
    BINDING_ONLY_CANDIDATE,
    BINDING_SPEED,
    BINDING_VRAM_TIEBREAK,
    FRAGMENTATION_HEADROOM_BYTES,
    MARGIN_FRACTION,
    RULE_FIT_CONSTRAINED_SPEED,
    CompiledGraphMetadata,
    FitBlock,
    KernelLane,
    is_lane,
    parse_metadata,
    quantize_up,
)

__all__ = [
    "DEFAULT_LANE",
    "KERNEL_LANE_FIT_UNVERIFIED",
    "KERNEL_LANE_NO_COMPILED_GRAPH",
    "KERNEL_LANE_REFIT_LOCAL",
    "KERNEL_LANE_REFIT_NO_FIT",
    "KERNEL_LANE_UNKNOWN_LANE",
    "KERNEL_LANE_VERDICT_ABSENT",
    "KERNEL_LANE_VERDICT_ADOPTED",
    "KERNEL_LANE_VERDICT_UNREADABLE",
    "LaneMeasurement",
    "LaneResolution",
    "LaneVerdict",
    "choose_lane",
    "fit_requirement_bytes",
    "fits",
    "resolve_lane",
]

#: The declared conservative default when no verdict can be used.
DEFAULT_LANE = "baseline+dense"

KERNEL_LANE_VERDICT_ADOPTED = "kernel_lane_verdict_adopted"
KERNEL_LANE_REFIT_LOCAL = "kernel_lane_refit_local"
KERNEL_LANE_REFIT_NO_FIT = "kernel_lane_refit_no_fit"
KERNEL_LANE_FIT_UNVERIFIED = "kernel_lane_fit_unverified"
KERNEL_LANE_VERDICT_ABSENT = "kernel_lane_verdict_absent"
KERNEL_LANE_VERDICT_UNREADABLE = "kernel_lane_verdict_unreadable"
KERNEL_LANE_UNKNOWN_LANE = "kernel_lane_unknown_lane"
KERNEL_LANE_NO_COMPILED_GRAPH = "kernel_lane_no_compiled_graph"

# Exact forms of the rule's constants: Fraction("0.2") is 1/5, not the binary float.
_SPIKE = Fraction(repr(ACTIVATION_SPIKE_FRACTION))
_MARGIN = Fraction(repr(MARGIN_FRACTION))


# --------------------------------------------------------------------------
# The fit test (shared by mint and serve)
# --------------------------------------------------------------------------


def _check_device_total(device_total_bytes: object) -> int:
    if isinstance(device_total_bytes, bool) or not isinstance(device_total_bytes, numbers.Integral):
        raise LaneError(f"device_total_bytes must be an integer, got {device_total_bytes!r}")
    if device_total_bytes <= 0:
        raise LaneError(f"device_total_bytes must be positive, got {device_total_bytes}")
    return int(device_total_bytes)


def fit_requirement_bytes(peak_bytes: int) -> int:
    """Bytes a lane asks of a device: ``ceil(quantize_up(peak) * 1.2) + 1 GiB``."""
    allowance = Fraction(quantize_up(peak_bytes)) * (1 + _SPIKE)
    return math.ceil(allowance) + FRAGMENTATION_HEADROOM_BYTES


def fits(peak_bytes: int, device_total_bytes: int) -> bool:
    """Does a lane with this (raw or quantized) peak fit a device of this total size?"""
    return fit_requirement_bytes(peak_bytes) <= _check_device_total(device_total_bytes)


# --------------------------------------------------------------------------
# Mint side: choose_lane
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneMeasurement:
    """One candidate measured at mint: median step time and peak device bytes (raw)."""

    lane: str
    step_seconds: float
    peak_bytes: int

    def __post_init__(self) -> None:
        if not is_lane(self.lane):
            raise LaneError(f"lane must be '<linear>+<modulation>' ([a-z][a-z0-9_]* each), got {self.lane!r}")
        seconds = self.step_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
            raise LaneError(f"{self.lane}: step_seconds must be a finite number, got {seconds!r}")
        if seconds <= 0:
            raise LaneError(f"{self.lane}: step_seconds must be positive, got {seconds!r}")
        peak = self.peak_bytes
        if isinstance(peak, bool) or not isinstance(peak, numbers.Integral) or peak <= 0:
            raise LaneError(f"{self.lane}: peak_bytes must be a positive integer, got {peak!r}")

    @property
    def quantized_peak_bytes(self) -> int:
        return quantize_up(int(self.peak_bytes))

    @property
    def _exact_seconds(self) -> Fraction:
        return Fraction(self.step_seconds)


@dataclass(frozen=True)
class LaneVerdict:
    """The outcome of :func:`choose_lane`.

    ``winner``, ``binding``, ``candidates`` (sorted), ``peaks`` (quantized) and
    ``order`` are discrete and go into the archive via :meth:`to_metadata`;
    ``evidence`` holds the raw timings and peaks and goes on the published
    record (``kernel_lane_evidence``), never into the archive.
    """

    winner: str
    binding: str
    candidates: tuple[str, ...]
    peaks: Mapping[str, int]
    order: tuple[str, ...]
    evidence: Mapping[str, Any] = field(compare=False)

    def to_metadata(self) -> KernelLane:
        """The ``kernel_lane`` block for :func:`cgstore_client.metadata.build_metadata`."""
        return KernelLane(
            winner=self.winner,
            candidates=self.candidates,
            binding=self.binding,
            fit=FitBlock(peaks=dict(self.peaks), order=self.order),
        )


def _coerce_measurements(
    measurements: Mapping[str, Any] | Iterable[LaneMeasurement],
) -> list[LaneMeasurement]:
    """Accept ``[LaneMeasurement, ...]`` or ``{lane: LaneMeasurement | (step_seconds, peak_bytes)}``."""
    if isinstance(measurements, Mapping):
        coerced = []
        for lane, value in measurements.items():
            if isinstance(value, LaneMeasurement):
                if value.lane != lane:
                    raise LaneError(f"measurement keyed {lane!r} is for lane {value.lane!r}")
                coerced.append(value)
            else:
                step_seconds, peak_bytes = value
                coerced.append(LaneMeasurement(lane, step_seconds, peak_bytes))
    else:
        coerced = list(measurements)
        for item in coerced:
            if not isinstance(item, LaneMeasurement):
                raise LaneError(f"expected LaneMeasurement, got {type(item).__name__}")
    if not coerced:
        raise LaneError("choose_lane needs at least one measured candidate")
    lanes = [m.lane for m in coerced]
    if len(set(lanes)) != len(lanes):
        raise LaneError(f"a lane was measured twice: {sorted(lanes)}")
    return coerced


def _within_margin(measurement: LaneMeasurement, fastest: LaneMeasurement) -> bool:
    return measurement._exact_seconds <= fastest._exact_seconds * (1 + _MARGIN)


def _pick_by_rule(fitting: list[LaneMeasurement]) -> tuple[LaneMeasurement, bool]:
    """The rule's pick among fitting lanes, and whether the VRAM tie-break was needed."""
    fastest = min(fitting, key=lambda m: (m._exact_seconds, m.lane))
    tied = [m for m in fitting if _within_margin(m, fastest)]
    if len(tied) == 1:
        return fastest, False
    # Inside the margin speed is noise: the smaller ask wins, then the name.
    return min(tied, key=lambda m: (m.quantized_peak_bytes, m.lane)), True


def _smallest_ask(measurements: Iterable[LaneMeasurement]) -> list[LaneMeasurement]:
    return sorted(measurements, key=lambda m: (m.quantized_peak_bytes, m.lane))


def _fallback_order(fitting: list[LaneMeasurement], unfitting: list[LaneMeasurement]) -> tuple[str, ...]:
    remaining = list(fitting)
    order = []
    while remaining:
        pick, _ = _pick_by_rule(remaining)
        order.append(pick.lane)
        remaining.remove(pick)
    order.extend(m.lane for m in _smallest_ask(unfitting))
    return tuple(order)


def choose_lane(
    measurements: Mapping[str, Any] | Iterable[LaneMeasurement],
    device_total_bytes: int,
) -> LaneVerdict:
    """Apply ``fit-constrained-speed/1`` to the lanes measured on the mint card."""
    total = _check_device_total(device_total_bytes)
    measured = _coerce_measurements(measurements)
    fitting = [m for m in measured if fits(m.peak_bytes, total)]
    unfitting = [m for m in measured if m not in fitting]

    if not fitting:
        winner, binding = _smallest_ask(measured)[0], BINDING_NO_FIT
    elif len(measured) == 1:
        winner, binding = fitting[0], BINDING_ONLY_CANDIDATE
    elif len(fitting) == 1:
        winner, binding = fitting[0], BINDING_FIT
    else:
        winner, tie_broken = _pick_by_rule(fitting)
        binding = BINDING_VRAM_TIEBREAK if tie_broken else BINDING_SPEED

    return LaneVerdict(
        winner=winner.lane,
        binding=binding,
        candidates=tuple(sorted(m.lane for m in measured)),
        peaks={m.lane: m.quantized_peak_bytes for m in sorted(measured, key=lambda m: m.lane)},
        order=_fallback_order(fitting, unfitting),
        evidence=_evidence(measured, total, fitting),
    )


def _evidence(measured: list[LaneMeasurement], total: int, fitting: list[LaneMeasurement]) -> dict[str, Any]:
    return {
        "rule": RULE_FIT_CONSTRAINED_SPEED,
        "device_total_bytes": total,
        "measurements": {
            m.lane: {
                "step_seconds": float(m.step_seconds),
                "peak_bytes": int(m.peak_bytes),
                "quantized_peak_bytes": m.quantized_peak_bytes,
                "fits": m in fitting,
            }
            for m in sorted(measured, key=lambda m: m.lane)
        },
    }


# --------------------------------------------------------------------------
# Serve side: resolve_lane
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneResolution:
    """The lane to pin before ``setup()`` runs, and the typed reason it was chosen."""

    lane: str
    reason: str
    detail: str = ""

    @property
    def linear(self) -> str:
        """The linear axis projected out of the pin (e.g. ``baseline``)."""
        return self.lane.split("+", 1)[0]

    @property
    def modulation(self) -> str:
        """The modulation axis projected out of the pin (e.g. ``packed``)."""
        return self.lane.split("+", 1)[1]


def _default(reason: str, detail: str) -> LaneResolution:
    return LaneResolution(DEFAULT_LANE, reason, detail)


def resolve_lane(
    metadata_or_none: CompiledGraphMetadata | Mapping[str, Any] | None,
    device_total_bytes: int,
    *,
    known_lanes: Collection[str] | None = None,
) -> LaneResolution:
    """Re-apply the fit rule to a recorded verdict against THIS device's total bytes.

    ``metadata_or_none`` is the parsed metadata, the raw ``metadata.json``
    document (parsed here; malformed means ``kernel_lane_verdict_unreadable``),
    or ``None`` when there is no compiled graph. ``known_lanes``, when given,
    is the set of lanes this worker can build: a recorded winner outside it is
    ``kernel_lane_unknown_lane``, and re-fits only consider lanes inside it.
    Never raises for bad metadata; raises :class:`LaneError` only for a bad
    ``device_total_bytes`` (a caller bug).
    """
    total = _check_device_total(device_total_bytes)
    if metadata_or_none is None:
        return _default(KERNEL_LANE_NO_COMPILED_GRAPH, "no compiled graph")
    metadata = _read_metadata(metadata_or_none)
    if isinstance(metadata, LaneResolution):
        return metadata
    verdict = metadata.kernel_lane
    if verdict is None:
        return _default(KERNEL_LANE_VERDICT_ABSENT, "compiled graph records no kernel-lane verdict")
    if known_lanes is not None and verdict.winner not in known_lanes:
        return _default(
            KERNEL_LANE_UNKNOWN_LANE, f"recorded winner {verdict.winner!r} is not a lane this worker builds"
        )
    if verdict.fit is None:
        return LaneResolution(verdict.winner, KERNEL_LANE_FIT_UNVERIFIED, "no recorded peaks")
    return _refit(verdict.winner, verdict.fit, total, known_lanes)


def _read_metadata(value: object) -> CompiledGraphMetadata | LaneResolution:
    """Parse raw metadata, or name why it cannot be used (a resolution with a default lane)."""
    if isinstance(value, CompiledGraphMetadata):
        return value
    if not isinstance(value, Mapping):
        return _default(KERNEL_LANE_VERDICT_UNREADABLE, f"metadata is a {type(value).__name__}, not an object")
    raw_verdict = value.get("kernel_lane")
    if isinstance(raw_verdict, Mapping):
        winner = raw_verdict.get("winner")
        # A well-formed string that is no lane name is a lane this code does not
        # know (named as such); anything else malformed is merely unreadable.
        if isinstance(winner, str) and not is_lane(winner):
            return _default(KERNEL_LANE_UNKNOWN_LANE, f"recorded winner {winner!r} is not a lane name")
    try:
        return parse_metadata(value)
    except MetadataError as exc:
        return _default(KERNEL_LANE_VERDICT_UNREADABLE, str(exc))


def _refit(winner: str, fit: FitBlock, total: int, known_lanes: Collection[str] | None) -> LaneResolution:
    if fits(fit.peaks[winner], total):
        return LaneResolution(winner, KERNEL_LANE_VERDICT_ADOPTED, f"{winner} fits {total} bytes")
    usable = [lane for lane in fit.order if known_lanes is None or lane in known_lanes]
    for lane in usable:  # the recorded order is fastest-first under the rule
        if fits(fit.peaks[lane], total):
            return LaneResolution(lane, KERNEL_LANE_REFIT_LOCAL, f"{winner} does not fit {total} bytes; {lane} does")
    # Nothing fits: pin the smallest ask, never the (denser, larger) declared default.
    smallest = min(usable, key=lambda lane: (fit.peaks[lane], usable.index(lane)))
    return LaneResolution(smallest, KERNEL_LANE_REFIT_NO_FIT, f"no recorded lane fits {total} bytes")
