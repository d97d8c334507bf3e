"""Compiled-graph metadata: the schema of ``<root>/extra/metadata.json`` in a ``.pt2``.

The metadata travels inside the archive, so it obeys the archive's rule: a
double mint must be byte-identical. It therefore holds only DISCRETE facts
(format, kind, sm, the kernel-lane verdict and its quantized fit block, policy
flags) and never a wall clock or a raw timing; timings
(``kernel_lane_evidence``, ``mint_phases``) ride the published record instead.

Document shape (``to_document()``; written with ``canonical_json(..., hashed=False)``)::

    {
      "compiled_graph_format": "cgstore.compiled-graph/1",
      "kind": "aot-inductor",
      "sm": "sm_100",
      "package_constants_in_so": false,
      "constant_folding_fenced": true,
      "kernel_lane": null | {
        "winner": "baseline+packed",
        "rule": "fit-constrained-speed/1",
        "binding": "only-candidate" | "fit" | "speed" | "vram-tiebreak" | "no-fit",
        "margin_fraction": 0.05,
        "candidates": ["baseline+dense", "baseline+packed", ...],   # sorted
        "fit": null | {
          "quantum_bytes": 268435456,
          "activation_spike_fraction": 0.2,
          "fragmentation_headroom_bytes": 1073741824,
          "peaks": {"<lane>": <bytes, a multiple of quantum_bytes>, ...},
          "order": ["<lane>", ...]     # fallback order, winner first
        }
      },
      "ties": [["lm_head.weight", "transformer.wte.weight"], ...],   # only when something is tied
      ...harmless extras...
    }

``ties`` lists the fully-qualified names that share one storage in the live
program (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``), recorded by
the mint: AOTI keeps only one of them, and a tie-deduplicated checkpoint holds
only the other, so the loader needs to know they are one tensor. Ties change the
compiled program, so the graph digest accounts for them
(:func:`cgstore_client.archive.graph.tied_graph_digest`).

``binding`` names the term of the fit rule that decided the winner:

- ``only-candidate``: one candidate was measured (and fits); nothing was compared.
  (One candidate that does not fit is ``no-fit``.)
- ``fit``: several candidates were measured and exactly one fits the mint card:
  the fit constraint decided.
- ``speed``: several candidates fit; the winner is the fastest and no other
  fitting candidate was within the margin.
- ``vram-tiebreak``: several fitting candidates were within the margin of the
  fastest; the smallest quantized peak won (then lane name). This is the
  binding whenever the margin held more than one lane, even if the fastest
  also had the smallest peak: a binding that depended on which lane measured
  fastest inside the margin would let timing noise change the archive bytes.
- ``no-fit``: no candidate fits the mint card; the smallest quantized peak won.

``fit`` is ``null`` when no peaks were recorded (serving adopts the winner and
marks it ``kernel_lane_fit_unverified``). When present, ``peaks`` covers every
candidate exactly and ``order`` is a permutation of the candidates that
starts with the winner. The rule name pins the fit constants: a document
whose fit block states other constants under ``fit-constrained-speed/1`` is
refused rather than silently re-interpreted.

Extras: unknown TOP-LEVEL keys are kept in ``CompiledGraphMetadata.extra``
(so an older reader can carry a newer minter's harmless facts) and written
back verbatim, but only if they are harmless: a lowercase snake-case name
that does not look like a wall clock, values made of strings, ints, bools,
nulls, lists and objects (no floats: an unknown float is most likely a
measurement, and measurements are not reproducible), no string that parses as
an ISO-8601 date/time or an epoch timestamp, and known timing evidence
(``kernel_lane_evidence``, ``mint_phases``) refused by name. Unknown keys
inside the known blocks (``kernel_lane``, ``fit``) are refused: those blocks
are closed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from cgstore_client.errors import MetadataError
from cgstore_client.keys import canonical_json, is_sm, strict_json_loads

__all__ = [
    "ACTIVATION_SPIKE_FRACTION",
    "BINDINGS",
    "BINDING_FIT",
    "BINDING_NO_FIT",
    "BINDING_ONLY_CANDIDATE",
    "BINDING_SPEED",
    "BINDING_VRAM_TIEBREAK",
    "COMPILED_GRAPH_FORMAT",
    "CompiledGraphMetadata",
    "FRAGMENTATION_HEADROOM_BYTES",
    "FitBlock",
    "GIB",
    "KIND_AOT_INDUCTOR",
    "KIND_RETIRED_INDUCTOR_CACHE",
    "KernelLane",
    "LANE_RE",
    "MARGIN_FRACTION",
    "MAX_DEPTH",
    "MIB",
    "QUANTUM_BYTES",
    "RULE_FIT_CONSTRAINED_SPEED",
    "build_metadata",
    "is_lane",
    "looks_like_wall_clock_key",
    "looks_like_wall_clock_value",
    "parse_kernel_lane",
    "parse_metadata",
    "parse_metadata_json",
    "quantize_up",
]

COMPILED_GRAPH_FORMAT = "cgstore.compiled-graph/1"
KIND_AOT_INDUCTOR = "aot-inductor"
#: The retired kind, refused by name so its refusal is readable.
KIND_RETIRED_INDUCTOR_CACHE = "torch-inductor-cache"

MIB = 1 << 20
GIB = 1 << 30
#: Peaks are quantized UP to this many bytes, which makes them reproducible across mints.
QUANTUM_BYTES = 256 * MIB
#: Allowance for activation spikes and resolution variance, on top of the quantized peak.
ACTIVATION_SPIKE_FRACTION = 0.20
#: Allowance for allocator fragmentation, on top of the spike allowance.
FRAGMENTATION_HEADROOM_BYTES = 1 * GIB
#: Inside this fraction of the fastest time, VRAM (smaller peak) breaks the tie.
MARGIN_FRACTION = 0.05
#: The only fit rule this reader understands; its name pins the four constants above.
RULE_FIT_CONSTRAINED_SPEED = "fit-constrained-speed/1"

BINDING_SPEED = "speed"
BINDING_VRAM_TIEBREAK = "vram-tiebreak"
BINDING_ONLY_CANDIDATE = "only-candidate"
BINDING_FIT = "fit"
BINDING_NO_FIT = "no-fit"
BINDINGS = frozenset({BINDING_ONLY_CANDIDATE, BINDING_FIT, BINDING_SPEED, BINDING_VRAM_TIEBREAK, BINDING_NO_FIT})

#: A kernel lane: ``<linear>+<modulation>``, each part ``[a-z][a-z0-9_]*``.
LANE_RE = re.compile(r"\A[a-z][a-z0-9_]*\+[a-z][a-z0-9_]*\Z")
_LANE_MAX_LEN = 64
_MAX_CANDIDATES = 64
#: No single card is anywhere near a pebibyte; a larger "peak" is corruption.
_MAX_PEAK_BYTES = 1 << 50
#: Maximum nesting of the whole document (the top-level object is depth 1).
MAX_DEPTH = 8

_TOP_LEVEL_KEYS = (
    "compiled_graph_format",
    "kind",
    "sm",
    "package_constants_in_so",
    "constant_folding_fenced",
    "kernel_lane",
    "ties",
)
#: Bounds on a ``ties`` block: groups, and names per group.
_MAX_TIE_GROUPS = 4096
_MAX_TIE_NAMES = 64
_KERNEL_LANE_KEYS = frozenset({"winner", "rule", "binding", "margin_fraction", "candidates", "fit"})
_FIT_KEYS = frozenset({"quantum_bytes", "activation_spike_fraction", "fragmentation_headroom_bytes", "peaks", "order"})


def quantize_up(num_bytes: int) -> int:
    """Round ``num_bytes`` up to the next multiple of :data:`QUANTUM_BYTES` (0 stays 0)."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
        raise TypeError(f"bytes must be an int, got {num_bytes!r}")
    if num_bytes < 0:
        raise ValueError(f"bytes must be >= 0, got {num_bytes}")
    return -(-num_bytes // QUANTUM_BYTES) * QUANTUM_BYTES


def is_lane(value: object) -> bool:
    """True when ``value`` is a lane name ``<linear>+<modulation>``."""
    return isinstance(value, str) and len(value) <= _LANE_MAX_LEN and LANE_RE.match(value) is not None


# --------------------------------------------------------------------------
# Strict field readers: every one names the offending path
# --------------------------------------------------------------------------


def _require_str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise MetadataError(f"{path} must be a string, got {_describe(value)}")
    return value


def _require_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise MetadataError(f"{path} must be true or false, got {_describe(value)}")
    return value


def _require_int(value: object, path: str) -> int:
    # bool is an int subclass and 268435456.0 is a float: both are refused.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MetadataError(f"{path} must be an integer, got {_describe(value)}")
    return value


def _require_mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise MetadataError(f"{path} must be an object, got {_describe(value)}")
    for key in value:
        if not isinstance(key, str):
            raise MetadataError(f"{path} has a non-string key {key!r}")
    return value


def _require_list(value: object, path: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise MetadataError(f"{path} must be a list, got {_describe(value)}")
    return value


def _require_lane(value: object, path: str) -> str:
    if not is_lane(value):
        raise MetadataError(f"{path} must be a lane '<linear>+<modulation>' ([a-z][a-z0-9_]* each), got {value!r}")
    return value  # type: ignore[return-value]


def _require_constant(value: object, expected: float | int, path: str) -> None:
    """A fit constant must equal the rule's own: the rule name versions them."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetadataError(f"{path} must be a number, got {_describe(value)}")
    if isinstance(expected, int) and not isinstance(value, int):
        raise MetadataError(f"{path} must be an integer, got {_describe(value)}")
    if value != expected:
        raise MetadataError(f"{path} is {value!r}, but {RULE_FIT_CONSTRAINED_SPEED} states {expected!r}")


def _refuse_unknown_keys(mapping: Mapping[str, Any], allowed: frozenset[str], path: str) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise MetadataError(f"{path} has unknown keys {unknown}; allowed: {sorted(allowed)}")


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


# --------------------------------------------------------------------------
# The dataclasses (each validates its own invariants, whoever builds it)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class FitBlock:
    """The fit evidence of a kernel-lane verdict: quantized peaks and the fallback order."""

    peaks: Mapping[str, int]
    order: tuple[str, ...]
    quantum_bytes: int = QUANTUM_BYTES
    activation_spike_fraction: float = ACTIVATION_SPIKE_FRACTION
    fragmentation_headroom_bytes: int = FRAGMENTATION_HEADROOM_BYTES

    def __post_init__(self) -> None:
        _require_constant(self.quantum_bytes, QUANTUM_BYTES, "kernel_lane.fit.quantum_bytes")
        _require_constant(
            self.activation_spike_fraction, ACTIVATION_SPIKE_FRACTION, "kernel_lane.fit.activation_spike_fraction"
        )
        _require_constant(
            self.fragmentation_headroom_bytes,
            FRAGMENTATION_HEADROOM_BYTES,
            "kernel_lane.fit.fragmentation_headroom_bytes",
        )
        peaks = _require_mapping(self.peaks, "kernel_lane.fit.peaks")
        if not peaks:
            raise MetadataError(
                "kernel_lane.fit.peaks is empty; record no fit block (null) when no peaks were measured"
            )
        for lane, peak in peaks.items():
            self._check_peak(lane, peak)
        order = tuple(_require_list(self.order, "kernel_lane.fit.order"))
        for index, lane in enumerate(order):
            _require_lane(lane, f"kernel_lane.fit.order[{index}]")
        if len(set(order)) != len(order):
            raise MetadataError(f"kernel_lane.fit.order repeats a lane: {list(order)}")
        object.__setattr__(self, "peaks", MappingProxyType(dict(sorted(peaks.items()))))
        object.__setattr__(self, "order", order)

    @staticmethod
    def _check_peak(lane: str, peak: object) -> None:
        _require_lane(lane, "kernel_lane.fit.peaks key")
        path = f"kernel_lane.fit.peaks[{lane!r}]"
        peak = _require_int(peak, path)
        if not 0 < peak <= _MAX_PEAK_BYTES:
            raise MetadataError(f"{path} must be in (0, {_MAX_PEAK_BYTES}], got {peak}")
        if peak % QUANTUM_BYTES:
            raise MetadataError(
                f"{path} = {peak} is not quantized: peaks are rounded up to multiples of {QUANTUM_BYTES} bytes"
            )

    def to_document(self) -> dict[str, object]:
        return {
            "quantum_bytes": self.quantum_bytes,
            "activation_spike_fraction": self.activation_spike_fraction,
            "fragmentation_headroom_bytes": self.fragmentation_headroom_bytes,
            "peaks": dict(self.peaks),
            "order": list(self.order),
        }


@dataclass(frozen=True)
class KernelLane:
    """The discrete kernel-lane verdict recorded at mint: EVIDENCE, not an instruction."""

    winner: str
    candidates: tuple[str, ...]
    binding: str
    fit: FitBlock | None = None
    rule: str = RULE_FIT_CONSTRAINED_SPEED
    margin_fraction: float = MARGIN_FRACTION

    def __post_init__(self) -> None:
        if self.rule != RULE_FIT_CONSTRAINED_SPEED:
            raise MetadataError(
                f"kernel_lane.rule {self.rule!r} is not understood; known: {RULE_FIT_CONSTRAINED_SPEED!r}"
            )
        _require_constant(self.margin_fraction, MARGIN_FRACTION, "kernel_lane.margin_fraction")
        if self.binding not in BINDINGS:
            raise MetadataError(f"kernel_lane.binding must be one of {sorted(BINDINGS)}, got {self.binding!r}")
        _require_lane(self.winner, "kernel_lane.winner")
        candidates = self._canonical_candidates(self.candidates)
        if self.winner not in candidates:
            raise MetadataError(f"kernel_lane.winner {self.winner!r} is not among candidates {list(candidates)}")
        if self.binding == BINDING_ONLY_CANDIDATE and len(candidates) != 1:
            raise MetadataError(f"kernel_lane.binding 'only-candidate' with {len(candidates)} candidates")
        if len(candidates) == 1 and self.binding not in (BINDING_ONLY_CANDIDATE, BINDING_NO_FIT):
            raise MetadataError(f"kernel_lane.binding {self.binding!r} needs several candidates; there is one")
        if self.fit is not None:
            self._check_fit_against(candidates)
        object.__setattr__(self, "candidates", candidates)

    @staticmethod
    def _canonical_candidates(candidates: object) -> tuple[str, ...]:
        items = _require_list(candidates, "kernel_lane.candidates")
        if not items:
            raise MetadataError("kernel_lane.candidates is empty")
        if len(items) > _MAX_CANDIDATES:
            raise MetadataError(f"kernel_lane.candidates has more than {_MAX_CANDIDATES} lanes")
        for index, lane in enumerate(items):
            _require_lane(lane, f"kernel_lane.candidates[{index}]")
        if len(set(items)) != len(items):
            raise MetadataError(f"kernel_lane.candidates repeats a lane: {list(items)}")
        return tuple(sorted(items))  # a set: sorted so two mints write the same bytes

    def _check_fit_against(self, candidates: tuple[str, ...]) -> None:
        fit = self.fit
        if not isinstance(fit, FitBlock):
            raise MetadataError(f"kernel_lane.fit must be a FitBlock or null, got {_describe(fit)}")
        stray = sorted(set(fit.peaks) - set(candidates))
        if stray:
            raise MetadataError(f"kernel_lane.fit.peaks names lanes that are not candidates: {stray}")
        missing = sorted(set(candidates) - set(fit.peaks))
        if missing:
            raise MetadataError(f"kernel_lane.fit.peaks has no peak for candidates {missing}")
        if sorted(fit.order) != list(candidates):
            raise MetadataError(f"kernel_lane.fit.order {list(fit.order)} is not a permutation of the candidates")
        if fit.order[0] != self.winner:
            raise MetadataError(
                f"kernel_lane.fit.order must start with the winner {self.winner!r}, got {fit.order[0]!r}"
            )

    def to_document(self) -> dict[str, object]:
        return {
            "winner": self.winner,
            "rule": self.rule,
            "binding": self.binding,
            "margin_fraction": self.margin_fraction,
            "candidates": list(self.candidates),
            "fit": None if self.fit is None else self.fit.to_document(),
        }


@dataclass(frozen=True)
class CompiledGraphMetadata:
    """The parsed, validated ``extra/metadata.json`` of a compiled graph.

    ``package_constants_in_so`` and ``constant_folding_fenced`` are recorded
    as the mint's compile policy declared them; whether an archive with
    ``package_constants_in_so=True`` is admissible is the archive reader's
    call (it also sees the payload), not this schema's.
    """

    sm: str
    package_constants_in_so: bool
    constant_folding_fenced: bool
    kernel_lane: KernelLane | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: Fully-qualified names that share one storage in the live program (tied weights), canonical order.
    ties: tuple[tuple[str, ...], ...] = ()
    kind: str = KIND_AOT_INDUCTOR
    compiled_graph_format: str = COMPILED_GRAPH_FORMAT

    def __post_init__(self) -> None:
        _check_format(self.compiled_graph_format)
        _check_kind(self.kind)
        if not is_sm(self.sm):
            raise MetadataError(f"sm must be a canonical sm (e.g. sm_90, cpu-x86_64-avx512), got {self.sm!r}")
        _require_bool(self.package_constants_in_so, "package_constants_in_so")
        _require_bool(self.constant_folding_fenced, "constant_folding_fenced")
        object.__setattr__(self, "ties", canonical_ties(self.ties))
        if self.kernel_lane is not None and not isinstance(self.kernel_lane, KernelLane):
            raise MetadataError(f"kernel_lane must be a KernelLane or null, got {_describe(self.kernel_lane)}")
        extra = _require_mapping(self.extra, "extra")
        for key, value in extra.items():
            _check_extra(key, value)
        _check_depth(dict(extra), "extra")  # extras are merged into the top-level object (depth 1)
        # A JSON round trip deep-copies the extras (callers cannot mutate them
        # afterwards) and turns tuples into lists, so equality survives re-reading.
        copied = json.loads(json.dumps(dict(extra), sort_keys=True))
        object.__setattr__(self, "extra", MappingProxyType(copied))

    def to_document(self) -> dict[str, object]:
        """The canonical document; :meth:`to_json_bytes` writes it reproducibly."""
        document: dict[str, object] = dict(self.extra)
        document.update(
            {
                "compiled_graph_format": self.compiled_graph_format,
                "kind": self.kind,
                "sm": self.sm,
                "package_constants_in_so": self.package_constants_in_so,
                "constant_folding_fenced": self.constant_folding_fenced,
                "kernel_lane": None if self.kernel_lane is None else self.kernel_lane.to_document(),
            }
        )
        if self.ties:  # absent when nothing is tied: untied archives read exactly as before
            document["ties"] = [list(group) for group in self.ties]
        return document

    def to_json_bytes(self) -> bytes:
        """The bytes the mint writes to ``extra/metadata.json``: canonical, so two mints agree."""
        return canonical_json(self.to_document(), hashed=False)


def canonical_ties(value: object) -> tuple[tuple[str, ...], ...]:
    """Tie groups in canonical form: each group sorted, groups sorted; a name in two groups is refused."""
    groups = _require_list(value, "ties")
    if len(groups) > _MAX_TIE_GROUPS:
        raise MetadataError(f"ties: at most {_MAX_TIE_GROUPS} groups")
    canonical, seen = [], set()
    for i, group in enumerate(groups):
        names = [_require_str(name, f"ties[{i}]") for name in _require_list(group, f"ties[{i}]")]
        if not 2 <= len(set(names)) == len(names) <= _MAX_TIE_NAMES:
            raise MetadataError(f"ties[{i}]: a tie is 2 to {_MAX_TIE_NAMES} distinct names, got {names!r}")
        if seen.intersection(names):
            raise MetadataError(f"ties[{i}]: {sorted(seen.intersection(names))} already tied in another group")
        seen.update(names)
        canonical.append(tuple(sorted(names)))
    return tuple(sorted(canonical))


def _check_format(value: object) -> None:
    if value != COMPILED_GRAPH_FORMAT:
        raise MetadataError(f"compiled_graph_format must be {COMPILED_GRAPH_FORMAT!r}, got {value!r}")


def _check_kind(value: object) -> None:
    if value == KIND_RETIRED_INDUCTOR_CACHE:
        raise MetadataError(
            f"kind {KIND_RETIRED_INDUCTOR_CACHE!r} is retired and refused; only {KIND_AOT_INDUCTOR!r} is accepted"
        )
    if value != KIND_AOT_INDUCTOR:
        raise MetadataError(f"kind {value!r} is not supported; only {KIND_AOT_INDUCTOR!r} is accepted")


# --------------------------------------------------------------------------
# The wall-clock screen for extras
# --------------------------------------------------------------------------

_EXTRA_KEY_RE = re.compile(r"\A[a-z][a-z0-9_]*\Z")
_EXTRA_KEY_MAX = 64
#: Timing evidence that belongs on the published record, never in the archive.
_TIMING_KEYS = frozenset({"kernel_lane_evidence", "mint_phases"})
# Substrings that mark a wall clock wherever they appear in a key ("mtime",
# "build_timestamp", "created_by", "wallclock", "last_updated").
_CLOCK_SUBSTRINGS = ("time", "clock", "wall", "created", "updated", "modified", "stamp")
# Whole words (between "_" separators) that mark a wall clock. "date" is a word
# rather than a substring so that "candidates" and "validated" stay readable.
_CLOCK_WORDS = frozenset({"at", "date", "dated", "day", "epoch", "ts", "when", "utc"})
_ISO_DATE_RE = re.compile(
    r"\A\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}(?::?\d{2})?)?)?\Z"
)
_ISO_COMPACT_RE = re.compile(r"\A\d{8}T\d{4,6}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2})?\Z")
_DECIMAL_RE = re.compile(r"\A\d+(?:\.\d+)?\Z")
# Epoch seconds between 2001-09-09 and ~2103, and the same span in ms, us, ns.
_EPOCH_SPANS = tuple((Decimal(10) ** (9 + 3 * k), Decimal("4.3") * Decimal(10) ** (9 + 3 * k)) for k in range(4))


def looks_like_wall_clock_key(key: str) -> bool:
    """True for keys such as ``created_at``, ``mtime``, ``build_date``, ``timestamp``."""
    lowered = key.lower()
    if any(part in lowered for part in _CLOCK_SUBSTRINGS):
        return True
    return any(word in _CLOCK_WORDS for word in re.split(r"[^a-z0-9]+", lowered))


def looks_like_wall_clock_value(value: str) -> bool:
    """True for ISO-8601 dates/datetimes and decimal strings in an epoch-timestamp range."""
    text = value.strip()
    if _ISO_DATE_RE.match(text) or _ISO_COMPACT_RE.match(text):
        return _parses_as_datetime(text)
    if _DECIMAL_RE.match(text):
        number = Decimal(text)
        return any(low <= number < high for low, high in _EPOCH_SPANS)
    return False


def _parses_as_datetime(text: str) -> bool:
    try:
        datetime.fromisoformat(text.replace(",", "."))
    except ValueError:
        return False
    return True


def _check_extra(key: object, value: object) -> None:
    if not isinstance(key, str) or len(key) > _EXTRA_KEY_MAX or not _EXTRA_KEY_RE.match(key):
        raise MetadataError(f"unknown key {key!r} is not a lowercase snake_case name")
    if key in _TIMING_KEYS:
        raise MetadataError(f"{key!r} is timing evidence: it rides the published record, never the archive")
    if looks_like_wall_clock_key(key):
        raise MetadataError(f"key {key!r} looks like a wall clock; metadata must be reproducible across mints")
    _check_extra_value(value, key)


def _check_extra_value(value: object, path: str) -> None:
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        raise MetadataError(f"{path} is a float ({value!r}): unknown measurements are not reproducible")
    if isinstance(value, str):
        if looks_like_wall_clock_value(value):
            raise MetadataError(f"{path} = {value!r} looks like a wall clock; metadata must be reproducible")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_extra_value(item, f"{path}[{index}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MetadataError(f"{path} has a non-string key {key!r}")
            if key in _TIMING_KEYS or looks_like_wall_clock_key(key):
                raise MetadataError(f"{path}.{key} looks like a wall clock or timing; metadata must be reproducible")
            _check_extra_value(item, f"{path}.{key}")
        return
    raise MetadataError(f"{path} is a {type(value).__name__}, which is not a JSON type")


def _check_depth(value: object, path: str, depth: int = 1) -> None:
    """Refuse documents nested deeper than :data:`MAX_DEPTH` (the top-level object is depth 1)."""
    if isinstance(value, (Mapping, list, tuple)):
        if depth > MAX_DEPTH:
            raise MetadataError(f"{path} is nested deeper than {MAX_DEPTH} levels")
        children: Iterable[object] = value.values() if isinstance(value, Mapping) else value
        for child in children:
            _check_depth(child, path, depth + 1)


# --------------------------------------------------------------------------
# Parsing (reader side) and building (mint side)
# --------------------------------------------------------------------------


def parse_metadata(doc: object) -> CompiledGraphMetadata:
    """Validate a decoded ``metadata.json`` document and return its dataclass.

    Raises :class:`MetadataError` naming the first offending field.
    """
    _check_depth(doc, "metadata")
    document = _require_mapping(doc, "metadata")
    for key in ("compiled_graph_format", "kind"):
        if key not in document:
            raise MetadataError(f"metadata has no {key!r}")
    # Format and kind first: a retired or foreign artifact is named as such,
    # not reported as whatever field it happens to lack.
    _check_format(document["compiled_graph_format"])
    _check_kind(document["kind"])
    for key in ("sm", "package_constants_in_so", "constant_folding_fenced"):
        if key not in document:
            raise MetadataError(f"metadata has no {key!r}")
    extra = {key: value for key, value in document.items() if key not in _TOP_LEVEL_KEYS}
    return CompiledGraphMetadata(
        compiled_graph_format=document["compiled_graph_format"],
        kind=document["kind"],
        sm=_require_str(document["sm"], "sm"),
        package_constants_in_so=_require_bool(document["package_constants_in_so"], "package_constants_in_so"),
        constant_folding_fenced=_require_bool(document["constant_folding_fenced"], "constant_folding_fenced"),
        kernel_lane=parse_kernel_lane(document.get("kernel_lane")),
        extra=extra,
        ties=canonical_ties(document.get("ties", [])),
    )


def parse_kernel_lane(value: object) -> KernelLane | None:
    """Validate a ``kernel_lane`` block (``None`` stays ``None``)."""
    if value is None:
        return None
    block = _require_mapping(value, "kernel_lane")
    _refuse_unknown_keys(block, _KERNEL_LANE_KEYS, "kernel_lane")
    for key in ("winner", "rule", "binding", "margin_fraction", "candidates"):
        if key not in block:
            raise MetadataError(f"kernel_lane has no {key!r}")
    return KernelLane(
        winner=_require_str(block["winner"], "kernel_lane.winner"),
        rule=_require_str(block["rule"], "kernel_lane.rule"),
        binding=_require_str(block["binding"], "kernel_lane.binding"),
        margin_fraction=block["margin_fraction"],
        candidates=tuple(_require_list(block["candidates"], "kernel_lane.candidates")),
        fit=_parse_fit(block.get("fit")),
    )


def _parse_fit(value: object) -> FitBlock | None:
    if value is None:
        return None
    block = _require_mapping(value, "kernel_lane.fit")
    _refuse_unknown_keys(block, _FIT_KEYS, "kernel_lane.fit")
    for key in sorted(_FIT_KEYS):
        if key not in block:
            raise MetadataError(f"kernel_lane.fit has no {key!r}")
    return FitBlock(
        quantum_bytes=block["quantum_bytes"],
        activation_spike_fraction=block["activation_spike_fraction"],
        fragmentation_headroom_bytes=block["fragmentation_headroom_bytes"],
        peaks=_require_mapping(block["peaks"], "kernel_lane.fit.peaks"),
        order=tuple(_require_list(block["order"], "kernel_lane.fit.order")),
    )


def parse_metadata_json(data: bytes | str) -> CompiledGraphMetadata:
    """Decode ``metadata.json`` bytes strictly (no NaN, no duplicate keys) and parse them."""
    try:
        document = strict_json_loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MetadataError(f"metadata.json is not valid JSON: {exc}") from None
    return parse_metadata(document)


def build_metadata(
    *,
    sm: str,
    kernel_lane: KernelLane | Mapping[str, Any] | None = None,
    package_constants_in_so: bool = False,
    constant_folding_fenced: bool = True,
    extra: Mapping[str, Any] | None = None,
    ties: object = (),
) -> CompiledGraphMetadata:
    """Mint side: assemble metadata with the admissible policy as defaults.

    ``kernel_lane`` may be a :class:`KernelLane` (e.g. ``LaneVerdict.to_metadata()``)
    or a ``kernel_lane`` document. The result is round-tripped through
    :func:`parse_metadata`, so the mint can never write what a reader refuses.
    """
    if isinstance(kernel_lane, Mapping):
        kernel_lane = parse_kernel_lane(kernel_lane)
    metadata = CompiledGraphMetadata(
        sm=sm,
        package_constants_in_so=package_constants_in_so,
        constant_folding_fenced=constant_folding_fenced,
        kernel_lane=kernel_lane,
        extra=dict(extra or {}),
        ties=ties,
    )
    reparsed = parse_metadata_json(metadata.to_json_bytes())
    if reparsed != metadata:  # a guard on this module's own round trip, not on the caller
        raise MetadataError("metadata does not survive its own round trip")
    return metadata
