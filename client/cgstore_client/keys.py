"""The ck1 key derivation: one implementation, shared by the worker and the store.

A compiled-graph key is ``graph x envelope x sm x toolchain`` (docs/design.md, "Key
derivation"). Each axis is canonicalized into a small JSON document, hashed,
and the four hashes are hashed once more::

    ck1 = "ck1-" + blake3(canonical({"v":1,"graph":G,"envelope":digest(E),
                                      "sm":S,"toolchain":digest(T)})).hexdigest()[:56]

Membership axiom: the key moves exactly when something that requires
recompiling moves. Hence guidance ``7`` and ``7.0`` are one value, lists are
sets, and the model libraries (diffusers, transformers, peft) are recorded but
never hashed: what they do reaches the key through the traced graph.

Hashed documents contain only strings, integers, lists and objects, so that
no float formatting or bool/int confusion can ever make two implementations
disagree. ``tests/vectors/ck1.json`` (the reference vectors, docs/design.md)
pins the exact bytes.

Public API::

    canonical_json(doc, *, hashed=True) -> bytes
    digest(doc) -> "blake3:<64 hex>"
    Envelope(shapes, text_len, guidance=(), batch_sizes=(1,))
    Envelope.from_dict(mapping) / Envelope.from_document(doc)
    Envelope.admits(request=None, **fields) -> Admission
    Request(width, height, text_len=None, guidance=None, batch_size=1)
    Toolchain(components)
    ck1(graph_digest, envelope, sm, toolchain) -> "ck1-<56 hex>"
    validate_key(key) / is_key(key)
    validate_digest(s) / is_digest(s)
    validate_sm(sm) / is_sm(sm) / cpu_sm(machine, isa_tokens)
    canonical_guidance(value) -> str
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any

import blake3

from cgstore_client.errors import DigestInvalid, EnvelopeError, KeyInvalid, ToolchainError

__all__ = [
    "Admission",
    "CK1_RE",
    "DIGEST_RE",
    "Envelope",
    "KEY_MAX_BYTES",
    "KEY_RE",
    "OUT_OF_ENVELOPE_REASON",
    "RECORDED_ONLY_COMPONENTS",
    "Request",
    "SM_RE",
    "Toolchain",
    "canonical_guidance",
    "canonical_json",
    "ck1",
    "cpu_sm",
    "digest",
    "is_digest",
    "is_key",
    "is_sm",
    "validate_digest",
    "validate_key",
    "validate_sm",
]

# --------------------------------------------------------------------------
# Canonical JSON and digests
# --------------------------------------------------------------------------

#: ``blake3:`` followed by exactly 64 lowercase hex digits. Uppercase is refused,
#: never lowered: one digest has one spelling.
DIGEST_RE = re.compile(r"\Ablake3:[0-9a-f]{64}\Z")


def strict_json_loads(text: str | bytes) -> Any:
    """Decode JSON refusing what two parsers could read differently: duplicate keys, NaN/Infinity.

    Raises ``ValueError`` (``json.JSONDecodeError`` included) or ``RecursionError``.
    """
    return json.loads(text, object_pairs_hook=_refuse_duplicate_keys, parse_constant=_refuse_constant)


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            # Parsers disagree on which copy of a duplicated key wins; a record
            # that means two things to two readers is refused.
            raise ValueError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def canonical_json(doc: object, *, hashed: bool = True) -> bytes:
    """Serialize ``doc`` the one way every implementation agrees on.

    ``hashed=True`` (the default, and the only mode used for key material)
    admits only ``str``, ``int``, ``list``/``tuple`` and ``dict`` with string
    keys: floats, bools and ``None`` are refused because their spelling is a
    matter of taste across languages. ``hashed=False`` additionally admits
    bools, ``None`` and finite floats, for documents that are written
    byte-reproducibly but never hashed into a key (compiled-graph metadata).
    """
    _check_canonical_types(doc, hashed=hashed, path="$")
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("utf-8")


def _check_canonical_types(value: object, *, hashed: bool, path: str) -> None:
    # bool is a subclass of int, so it must be ruled out before the int check.
    if isinstance(value, bool) or value is None:
        if hashed:
            raise TypeError(f"{path}: {value!r} is not allowed in a hashed document (only str, int, list, dict)")
        return
    if isinstance(value, (str, int)):
        return
    if isinstance(value, float):
        if hashed:
            raise TypeError(
                f"{path}: float {value!r} is not allowed in a hashed document; spell it as a decimal string"
            )
        if not math.isfinite(value):
            raise ValueError(f"{path}: non-finite float {value!r}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_canonical_types(item, hashed=hashed, path=f"{path}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: object key {key!r} is not a string")
            _check_canonical_types(item, hashed=hashed, path=f"{path}.{key}")
        return
    raise TypeError(f"{path}: {type(value).__name__} is not a JSON type")


def digest(doc: object) -> str:
    """``"blake3:" + blake3(canonical_json(doc)).hexdigest()``."""
    return "blake3:" + blake3.blake3(canonical_json(doc)).hexdigest()


def is_digest(value: object) -> bool:
    """True when ``value`` is a ``blake3:<64 lowercase hex>`` string."""
    return isinstance(value, str) and DIGEST_RE.match(value) is not None


def validate_digest(value: object, *, what: str = "digest") -> str:
    """Return ``value`` if it is a well-formed digest, else raise :class:`DigestInvalid`."""
    if not is_digest(value):
        raise DigestInvalid(f"{what} must be 'blake3:' + 64 lowercase hex digits, got {value!r}")
    return value  # type: ignore[return-value]


# --------------------------------------------------------------------------
# sm: the architecture axis
# --------------------------------------------------------------------------

# GPU: ``sm_`` + the compute capability's major and minor digits, no leading
# zero, no arch-specific suffix ("sm_90a"): the package's compute capability
# (9, 0) spells ``sm_90``, and a second spelling would split one key in two.
_GPU_SM = r"sm_[1-9][0-9]{1,2}"
# CPU: ``cpu-<machine>-<isa>[+<isa>...]`` from AOTI_MACHINE and AOTI_CPU_ISA,
# lowercased. The ISA tokens must additionally be sorted and unique (checked
# in code, not expressible in the regex) so one host has one spelling.
_CPU_TOKEN = r"[a-z0-9][a-z0-9_]*"
_CPU_SM = rf"cpu-{_CPU_TOKEN}-{_CPU_TOKEN}(?:\+{_CPU_TOKEN})*"
SM_RE = re.compile(rf"\A(?:{_GPU_SM}|{_CPU_SM})\Z")
_SM_MAX_LEN = 128


def is_sm(value: object) -> bool:
    """True when ``value`` is a canonical sm string (see :data:`SM_RE`)."""
    if not isinstance(value, str) or len(value) > _SM_MAX_LEN or SM_RE.match(value) is None:
        return False
    if value.startswith("cpu-"):
        isa_tokens = value.split("-", 2)[2].split("+")
        return isa_tokens == sorted(set(isa_tokens))
    return True


def validate_sm(value: object) -> str:
    """Return ``value`` if it is a canonical sm, else raise :class:`KeyInvalid`."""
    if not is_sm(value):
        raise KeyInvalid(
            f"sm must be 'sm_<major><minor>' (e.g. sm_90) or 'cpu-<machine>-<isa>+<isa>' with "
            f"lowercase ISA tokens sorted and unique (e.g. cpu-x86_64-avx512+avx512_vnni), got {value!r}"
        )
    return value  # type: ignore[return-value]


def cpu_sm(machine: str, isa_tokens: Iterable[str]) -> str:
    """Build the canonical CPU sm from AOTI's ``AOTI_MACHINE`` and ``AOTI_CPU_ISA`` tokens."""
    tokens = sorted({token.strip().lower() for token in isa_tokens if token.strip()})
    return validate_sm(f"cpu-{machine.strip().lower()}-{'+'.join(tokens)}")


# --------------------------------------------------------------------------
# Envelope: the declared serving region
# --------------------------------------------------------------------------

#: The reason every out-of-envelope admission carries, verbatim.
OUT_OF_ENVELOPE_REASON = "request out of declared envelope, serving eager"

_MAX_DIM = 65536
_MAX_TEXT_LEN = 1 << 20
_MAX_BATCH = 65536
_MAX_LIST = 1024
_MAX_GUIDANCE_MAGNITUDE = Decimal(10) ** 6
_MAX_GUIDANCE_CHARS = 40
_ENVELOPE_KEYS = frozenset({"v", "shapes", "text_len", "guidance", "batch_sizes"})


def _strict_int(value: object, *, what: str, low: int, high: int) -> int:
    # Integral covers numpy integers; bool and float (even 1024.0) are refused
    # because accepting them would give one envelope several spellings.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise EnvelopeError(f"{what} must be an integer, got {value!r}")
    number = int(value)
    if not low <= number <= high:
        raise EnvelopeError(f"{what} must be in [{low}, {high}], got {number}")
    return number


def _bounded_list(values: object, *, what: str) -> list[Any]:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise EnvelopeError(f"{what} must be a list, got {values!r}")
    items = list(values)
    if len(items) > _MAX_LIST:
        raise EnvelopeError(f"{what} has {len(items)} entries; at most {_MAX_LIST} are allowed")
    return items


def _canonical_shape(value: object) -> tuple[int, int]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise EnvelopeError(f"a shape must be a (width, height) pair, got {value!r}")
    pair = list(value)
    if len(pair) != 2:
        raise EnvelopeError(f"a shape must be a (width, height) pair, got {value!r}")
    width = _strict_int(pair[0], what="shape width", low=1, high=_MAX_DIM)
    height = _strict_int(pair[1], what="shape height", low=1, high=_MAX_DIM)
    return width, height


def canonical_guidance(value: object) -> str:
    """Spell one guidance value as its canonical decimal string.

    Shortest round-trip form, positional notation, no trailing ``.0``:
    ``3.5 -> "3.5"``, ``7.0 -> "7"``, ``10 -> "10"``, ``Decimal("3.50") -> "3.5"``.
    Floats are spelled by ``repr`` (Python's shortest round-trip), so
    ``float(canonical_guidance(x)) == x`` for every finite float. Decimal
    strings are accepted so canonical documents parse back.
    """
    number = _guidance_decimal(value)
    if number.is_zero():
        return "0"  # -0.0 and 0 are one value
    if number.adjusted() < -_MAX_GUIDANCE_CHARS:
        # Checked before formatting: a tiny exponent would expand into a huge string.
        raise EnvelopeError(f"guidance {value!r} needs more than {_MAX_GUIDANCE_CHARS} characters")
    # No normalize(): it rounds to the context precision and could merge distinct values.
    text = format(number, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if len(text) > _MAX_GUIDANCE_CHARS:
        raise EnvelopeError(f"guidance {value!r} needs more than {_MAX_GUIDANCE_CHARS} characters")
    return text


def _guidance_decimal(value: object) -> Decimal:
    if isinstance(value, bool):
        raise EnvelopeError(f"guidance must be a number, got {value!r}")
    if isinstance(value, numbers.Integral):
        number = Decimal(int(value))
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise EnvelopeError(f"guidance must be finite, got {value!r}")
        number = Decimal(repr(value))  # repr is the shortest string that round-trips
    elif isinstance(value, (Decimal, str)):
        if isinstance(value, str) and len(value) > _MAX_GUIDANCE_CHARS:
            raise EnvelopeError(f"guidance {value[:50]!r} is longer than {_MAX_GUIDANCE_CHARS} characters")
        try:
            number = Decimal(value.strip() if isinstance(value, str) else value)
        except InvalidOperation:
            raise EnvelopeError(f"guidance must be a decimal number, got {value!r}") from None
        if not number.is_finite():
            raise EnvelopeError(f"guidance must be finite, got {value!r}")
    else:
        raise EnvelopeError(f"guidance must be a number, got {type(value).__name__} {value!r}")
    if len(number.as_tuple().digits) > _MAX_GUIDANCE_CHARS:
        raise EnvelopeError(f"guidance {value!r} has more than {_MAX_GUIDANCE_CHARS} digits")
    # copy_abs, not abs(): abs() rounds in the decimal context and raises decimal.Overflow
    # for an exponent past its range ("1e999999999"); copy_abs and the comparison are exact.
    if number.copy_abs() > _MAX_GUIDANCE_MAGNITUDE:
        raise EnvelopeError(f"guidance {value!r} is out of range (|g| <= {_MAX_GUIDANCE_MAGNITUDE})")
    return number


@dataclass(frozen=True)
class Admission:
    """The verdict of :meth:`Envelope.admits`: truthy when admitted.

    When refused, ``axis`` names the first axis that fell outside the envelope
    (``"shape"``, ``"text_len"``, ``"guidance"`` or ``"batch_size"``) and
    ``reason`` is exactly :data:`OUT_OF_ENVELOPE_REASON`; ``detail`` is for humans.
    """

    admitted: bool
    axis: str | None = None
    reason: str | None = None
    detail: str = ""

    def __bool__(self) -> bool:
        return self.admitted


_ADMITTED = Admission(admitted=True)


def _refused(axis: str, detail: str) -> Admission:
    return Admission(admitted=False, axis=axis, reason=OUT_OF_ENVELOPE_REASON, detail=detail)


@dataclass(frozen=True)
class Request:
    """What :meth:`Envelope.admits` asks about one request.

    ``width``/``height`` are the output resolution; ``text_len`` is the
    request's token length (``None`` or ``0`` for no text conditioning);
    ``guidance`` is the guidance value (``None`` = not given); ``batch_size``
    defaults to 1. Build one directly, or with :meth:`of` from a mapping that
    may spell the resolution as ``shape=(w, h)`` instead.
    """

    width: int
    height: int
    text_len: int | None = None
    guidance: object = None
    batch_size: int = 1

    def __post_init__(self) -> None:
        _strict_int(self.width, what="request width", low=1, high=_MAX_DIM)
        _strict_int(self.height, what="request height", low=1, high=_MAX_DIM)
        if self.text_len is not None:
            _strict_int(self.text_len, what="request text_len", low=0, high=_MAX_TEXT_LEN)
        if self.guidance is not None:
            _guidance_decimal(self.guidance)
        _strict_int(self.batch_size, what="request batch_size", low=1, high=_MAX_BATCH)

    @classmethod
    def of(cls, fields: Mapping[str, object]) -> Request:
        """Build a request from a mapping with ``width``/``height`` or ``shape``."""
        fields = dict(fields)
        if "shape" in fields:
            if "width" in fields or "height" in fields:
                raise EnvelopeError("give either shape or width/height, not both")
            width, height = _canonical_shape(fields.pop("shape"))
            fields["width"], fields["height"] = width, height
        unknown = set(fields) - {"width", "height", "text_len", "guidance", "batch_size"}
        if unknown:
            raise EnvelopeError(f"unknown request fields: {sorted(unknown)}")
        if "width" not in fields or "height" not in fields:
            raise EnvelopeError("a request needs width and height (or shape)")
        return cls(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True, init=False)
class Envelope:
    """The declared serving region, canonicalized on construction.

    ``shapes``: (width, height) pairs of positive ints, sorted and de-duplicated.
    ``text_len``: mandatory; ``0`` declares no text conditioning, a positive
    value pins the token length. ``guidance``: numbers, spelled as canonical
    decimal strings, sorted by numeric value, de-duplicated (``7 == 7.0``); an
    empty list declares that the graph does not specialize on guidance.
    ``batch_sizes``: positive ints, sorted, de-duplicated, default ``(1,)``.
    Two envelopes that declare the same region compare equal and digest equal.
    """

    shapes: tuple[tuple[int, int], ...]
    text_len: int
    guidance: tuple[str, ...]
    batch_sizes: tuple[int, ...]

    def __init__(
        self,
        shapes: Iterable[Iterable[int]],
        text_len: int,
        guidance: Iterable[object] = (),
        batch_sizes: Iterable[int] = (1,),
    ) -> None:
        object.__setattr__(self, "shapes", self._canonical_shapes(shapes))
        object.__setattr__(self, "text_len", self._canonical_text_len(text_len))
        object.__setattr__(self, "guidance", self._canonical_guidance_list(guidance))
        object.__setattr__(self, "batch_sizes", self._canonical_batch_sizes(batch_sizes))

    @staticmethod
    def _canonical_shapes(shapes: object) -> tuple[tuple[int, int], ...]:
        pairs = {_canonical_shape(shape) for shape in _bounded_list(shapes, what="shapes")}
        if not pairs:
            raise EnvelopeError("an envelope declares at least one shape")
        return tuple(sorted(pairs))

    @staticmethod
    def _canonical_text_len(text_len: object) -> int:
        if text_len is None:
            raise EnvelopeError(
                "text_len is mandatory: a positive value pins the token length, 0 declares no text conditioning"
            )
        return _strict_int(text_len, what="text_len", low=0, high=_MAX_TEXT_LEN)

    @staticmethod
    def _canonical_guidance_list(guidance: object) -> tuple[str, ...]:
        spelled = {canonical_guidance(value) for value in _bounded_list(guidance, what="guidance")}
        return tuple(sorted(spelled, key=Decimal))

    @staticmethod
    def _canonical_batch_sizes(batch_sizes: object) -> tuple[int, ...]:
        sizes = {
            _strict_int(size, what="batch size", low=1, high=_MAX_BATCH)
            for size in _bounded_list(batch_sizes, what="batch_sizes")
        }
        if not sizes:
            raise EnvelopeError("batch_sizes must not be empty (omit it for the default [1])")
        return tuple(sorted(sizes))

    # -- construction from documents -----------------------------------------

    @classmethod
    def from_dict(cls, fields: Mapping[str, object]) -> Envelope:
        """Build from a caller's mapping; ``text_len`` must be present, ``v`` (if given) must be 1."""
        if not isinstance(fields, Mapping):
            raise EnvelopeError(f"an envelope must be a mapping, got {type(fields).__name__}")
        unknown = set(fields) - _ENVELOPE_KEYS
        if unknown:
            raise EnvelopeError(f"unknown envelope fields: {sorted(map(str, unknown))}")
        if "v" in fields and (isinstance(fields["v"], bool) or fields["v"] != 1):
            raise EnvelopeError(f"unsupported envelope version {fields['v']!r}")
        if "shapes" not in fields:
            raise EnvelopeError("an envelope declares shapes")
        if "text_len" not in fields:
            raise EnvelopeError(
                "text_len is mandatory: a positive value pins the token length, 0 declares no text conditioning"
            )
        return cls(
            shapes=fields["shapes"],  # type: ignore[arg-type]
            text_len=fields["text_len"],  # type: ignore[arg-type]
            guidance=fields.get("guidance", ()),  # type: ignore[arg-type]
            batch_sizes=fields.get("batch_sizes", (1,)),  # type: ignore[arg-type]
        )

    @classmethod
    def from_document(cls, doc: Mapping[str, object]) -> Envelope:
        """Build from an envelope document (``{"v":1, ...}``); ``v`` is required here."""
        if not isinstance(doc, Mapping) or "v" not in doc:
            raise EnvelopeError("an envelope document carries 'v': 1")
        return cls.from_dict(doc)

    # -- the canonical document ----------------------------------------------

    @property
    def document(self) -> dict[str, object]:
        """The canonical envelope document that :attr:`digest` hashes."""
        return {
            "v": 1,
            "shapes": [[width, height] for width, height in self.shapes],
            "text_len": self.text_len,
            "guidance": list(self.guidance),
            "batch_sizes": list(self.batch_sizes),
        }

    @property
    def digest(self) -> str:
        return digest(self.document)

    # -- admission -----------------------------------------------------------

    def admits(self, request: Request | Mapping[str, object] | None = None, /, **fields: object) -> Admission:
        """Is ``request`` inside the declared region?

        Pass a :class:`Request`, a mapping (see :meth:`Request.of`) or keyword
        fields. Axes are checked in the order shape, text_len, guidance,
        batch_size; the first one outside the envelope is named. A malformed
        request (e.g. a negative width) raises :class:`EnvelopeError`: that is
        a caller bug, not an out-of-envelope request.
        """
        request = self._coerce_request(request, fields)
        if (request.width, request.height) not in self.shapes:
            return _refused("shape", f"{request.width}x{request.height} is not a declared shape")
        if not self._admits_text_len(request.text_len):
            return _refused("text_len", f"text_len {request.text_len!r} vs declared {self.text_len}")
        if not self._admits_guidance(request.guidance):
            return _refused("guidance", f"guidance {request.guidance!r} is not among {list(self.guidance)}")
        if request.batch_size not in self.batch_sizes:
            return _refused("batch_size", f"batch size {request.batch_size} is not among {list(self.batch_sizes)}")
        return _ADMITTED

    @staticmethod
    def _coerce_request(request: Request | Mapping[str, object] | None, fields: Mapping[str, object]) -> Request:
        if request is not None and fields:
            raise EnvelopeError("give a request or keyword fields, not both")
        if isinstance(request, Request):
            return request
        if request is None:
            return Request.of(fields)
        if isinstance(request, Mapping):
            return Request.of(request)
        raise EnvelopeError(f"a request is a Request or a mapping, got {type(request).__name__}")

    def _admits_text_len(self, text_len: int | None) -> bool:
        if self.text_len == 0:
            # Declared no text conditioning: only a request without text fits.
            return text_len is None or text_len == 0
        return text_len == self.text_len  # a positive text_len pins the length exactly

    def _admits_guidance(self, guidance: object) -> bool:
        if not self.guidance:
            return True  # the graph does not specialize on guidance
        if guidance is None:
            # The pipeline's default guidance is unknown here; serving eager is the safe answer.
            return False
        return canonical_guidance(guidance) in self.guidance


# --------------------------------------------------------------------------
# Toolchain: the compiler stack
# --------------------------------------------------------------------------

#: Components recorded for forensics but never hashed: they run at trace time
#: only, and what they do reaches the key through the graph digest.
RECORDED_ONLY_COMPONENTS = frozenset({"diffusers", "transformers", "peft"})

# Component names: lowercase ASCII, digits and ``._+-``, starting with a letter
# or digit (PyPI-normalized names such as ``nvidia-cuda-runtime-cu12`` plus
# the store's own ``settings`` / ``native_manifest``). Never normalized: an
# uppercase name is refused, not lowered.
_COMPONENT_NAME_RE = re.compile(r"\A[a-z0-9][a-z0-9._+-]*\Z")
_COMPONENT_NAME_MAX = 128
# Values: a version or a digest; printable ASCII without whitespace.
_COMPONENT_VALUE_RE = re.compile(r"\A[\x21-\x7e]+\Z")
_COMPONENT_VALUE_MAX = 256
_MAX_COMPONENTS = 256


class Toolchain:
    """The compiler stack as ``name -> version-or-digest``.

    Components named in :data:`RECORDED_ONLY_COMPONENTS` are split off into
    :attr:`recorded`; every other component, including ones this code has
    never heard of, is keyed (fail toward recompiling). ``torch`` is required.
    """

    __slots__ = ("_components", "_recorded")

    def __init__(self, components: Mapping[str, str]) -> None:
        if not isinstance(components, Mapping):
            raise ToolchainError(f"toolchain components must be a mapping, got {type(components).__name__}")
        if len(components) > _MAX_COMPONENTS:
            raise ToolchainError(f"a toolchain has at most {_MAX_COMPONENTS} components")
        keyed: dict[str, str] = {}
        recorded: dict[str, str] = {}
        for name, value in components.items():
            self._validate_component(name, value)
            (recorded if name in RECORDED_ONLY_COMPONENTS else keyed)[name] = value
        if "torch" not in keyed:
            raise ToolchainError("a toolchain must name its 'torch' component")
        self._components = MappingProxyType(dict(sorted(keyed.items())))
        self._recorded = MappingProxyType(dict(sorted(recorded.items())))

    @staticmethod
    def _validate_component(name: object, value: object) -> None:
        if not isinstance(name, str) or len(name) > _COMPONENT_NAME_MAX or not _COMPONENT_NAME_RE.match(name):
            raise ToolchainError(f"component name must match [a-z0-9][a-z0-9._+-]* (<= 128 chars), got {name!r}")
        if not isinstance(value, str) or len(value) > _COMPONENT_VALUE_MAX or not _COMPONENT_VALUE_RE.match(value):
            raise ToolchainError(
                f"component {name!r} must be a non-empty printable-ASCII version or digest without spaces, got {value!r}"
            )

    @property
    def components(self) -> Mapping[str, str]:
        """The keyed components (read-only)."""
        return self._components

    @property
    def recorded(self) -> Mapping[str, str]:
        """The recorded-only components (read-only): kept for forensics, never hashed."""
        return self._recorded

    @property
    def document(self) -> dict[str, object]:
        return {"v": 1, "components": dict(self._components)}

    @property
    def digest(self) -> str:
        return digest(self.document)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Toolchain):
            return NotImplemented
        return self._components == other._components and self._recorded == other._recorded

    def __hash__(self) -> int:
        return hash((tuple(self._components.items()), tuple(self._recorded.items())))

    def __repr__(self) -> str:
        return f"Toolchain(components={dict(self._components)!r}, recorded={dict(self._recorded)!r})"


# --------------------------------------------------------------------------
# The key
# --------------------------------------------------------------------------

#: Key grammar shared by every key kind.
KEY_RE = re.compile(r"\A[a-z0-9][a-z0-9._-]*\Z")
KEY_MAX_BYTES = 96
#: A ck1 key: the prefix and the first 56 hex digits of the blake3 hash.
CK1_RE = re.compile(r"\Ack1-[0-9a-f]{56}\Z")
_CK1_HEX_CHARS = 56


def is_key(value: object) -> bool:
    """True when ``value`` satisfies the key grammar (see :func:`validate_key`)."""
    if not isinstance(value, str) or len(value.encode("utf-8")) > KEY_MAX_BYTES or not KEY_RE.match(value):
        return False
    return not value.startswith("ck1-") or CK1_RE.match(value) is not None


def validate_key(value: object) -> str:
    """Return ``value`` if it is a valid key, else raise :class:`KeyInvalid`.

    Grammar: ``^[a-z0-9][a-z0-9._-]*$``, at most 96 bytes; a key that starts
    with ``ck1-`` must be exactly ``ck1-`` + 56 lowercase hex digits.
    """
    if not is_key(value):
        raise KeyInvalid(
            f"key must match [a-z0-9][a-z0-9._-]* within {KEY_MAX_BYTES} bytes, and a ck1 key is "
            f"'ck1-' + {_CK1_HEX_CHARS} lowercase hex digits; got {value!r}"
        )
    return value  # type: ignore[return-value]


def ck1(
    graph_digest: str,
    envelope: Envelope | Mapping[str, object],
    sm: str,
    toolchain: Toolchain | Mapping[str, str],
) -> str:
    """Derive the ck1 key of ``graph x envelope x sm x toolchain``.

    ``envelope`` and ``toolchain`` may be given as their objects or as the
    mappings their constructors accept.
    """
    if not is_digest(graph_digest):
        raise KeyInvalid(f"graph digest must be 'blake3:' + 64 lowercase hex digits, got {graph_digest!r}")
    envelope = envelope if isinstance(envelope, Envelope) else Envelope.from_dict(envelope)
    toolchain = toolchain if isinstance(toolchain, Toolchain) else Toolchain(toolchain)
    document = {
        "v": 1,
        "graph": graph_digest,
        "envelope": envelope.digest,
        "sm": validate_sm(sm),
        "toolchain": toolchain.digest,
    }
    return "ck1-" + blake3.blake3(canonical_json(document)).hexdigest()[:_CK1_HEX_CHARS]
