"""ck1 key derivation: reference vectors, the membership axiom, canonicalization properties, admission, grammar."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgstore_client.errors import DigestInvalid, EnvelopeError, KeyInvalid, ToolchainError
from cgstore_client.keys import (
    OUT_OF_ENVELOPE_REASON,
    Envelope,
    Request,
    Toolchain,
    canonical_guidance,
    canonical_json,
    ck1,
    cpu_sm,
    digest,
    is_digest,
    is_key,
    is_sm,
    validate_digest,
    validate_key,
    validate_sm,
)

VECTORS_PATH = Path(__file__).resolve().parents[1] / "vectors" / "ck1.json"
VECTORS = json.loads(VECTORS_PATH.read_text())["vectors"]
CK1_RE = re.compile(r"\Ack1-[0-9a-f]{56}\Z")
DIGEST_RE = re.compile(r"\Ablake3:[0-9a-f]{64}\Z")

G0 = "blake3:" + "0" * 64
G1 = "blake3:" + "1" * 64


def _envelope_from_input(given_input: dict) -> Envelope:
    return Envelope(
        given_input["shapes"],
        given_input["text_len"],
        guidance=given_input["guidance"],
        batch_sizes=given_input["batch_sizes"],
    )


# --------------------------------------------------------------------------
# Reference vectors
# --------------------------------------------------------------------------


def test_vector_file_covers_at_least_twenty_vectors():
    assert len(VECTORS) >= 20


@pytest.mark.parametrize("vector", VECTORS, ids=[v.get("name", f"shared-{i}") for i, v in enumerate(VECTORS)])
def test_vector(vector):
    given_input = vector["input"]
    envelope = _envelope_from_input(given_input)
    toolchain = Toolchain(given_input["components"])

    assert envelope.document == vector["envelope_document"]
    assert envelope.digest == vector["envelope_digest"]
    assert digest(vector["envelope_document"]) == vector["envelope_digest"]
    assert toolchain.document == vector["toolchain_document"]
    assert toolchain.digest == vector["toolchain_digest"]
    assert digest(vector["toolchain_document"]) == vector["toolchain_digest"]
    assert ck1(given_input["graph"], envelope, given_input["sm"], toolchain) == vector["key"]
    validate_key(vector["key"])


@pytest.mark.parametrize("vector", VECTORS, ids=[v.get("name", f"shared-{i}") for i, v in enumerate(VECTORS)])
def test_vector_documents_parse_back_to_themselves(vector):
    envelope = Envelope.from_document(vector["envelope_document"])
    assert envelope.document == vector["envelope_document"]
    # The caller's mapping form (no "v") derives the same key.
    given_input = vector["input"]
    from_mapping = {k: given_input[k] for k in ("shapes", "text_len", "guidance", "batch_sizes")}
    assert ck1(given_input["graph"], from_mapping, given_input["sm"], given_input["components"]) == vector["key"]


def test_vector_documents_are_canonical_bytes():
    for vector in VECTORS:
        for name in ("envelope_document", "toolchain_document"):
            encoded = canonical_json(vector[name])
            assert canonical_json(json.loads(encoded)) == encoded


# --------------------------------------------------------------------------
# Membership axiom: key only on what requires recompiling
# --------------------------------------------------------------------------

FULL_STACK = {
    "torch": "2.13.0",
    "triton": "3.6.0",
    "ptxas": "12.8.93",
    "nvidia-cuda-runtime-cu12": "12.8.90",
    "settings": "blake3:" + "1" * 64,
    "native_manifest": "blake3:" + "2" * 64,
    "diffusers": "0.35.1",
    "transformers": "4.56.0",
    "peft": "0.17.0",
}
ENVELOPE = Envelope([(1024, 1024), (768, 768)], 512, guidance=[3.5, 7], batch_sizes=[1, 2])


def _key(components=FULL_STACK, envelope=ENVELOPE, sm="sm_100", graph=G0) -> str:
    return ck1(graph, envelope, sm, Toolchain(components))


@pytest.mark.parametrize("library", ["diffusers", "transformers", "peft"])
def test_bumping_a_model_library_moves_no_key(library):
    bumped = {**FULL_STACK, library: "99.0.0"}
    assert _key(bumped) == _key()


@pytest.mark.parametrize("library", ["diffusers", "transformers", "peft"])
def test_model_libraries_are_recorded_not_keyed(library):
    toolchain = Toolchain(FULL_STACK)
    assert toolchain.recorded[library] == FULL_STACK[library]
    assert library not in toolchain.components
    assert library not in toolchain.document["components"]
    without = {k: v for k, v in FULL_STACK.items() if k != library}
    assert _key(without) == _key()


@pytest.mark.parametrize(
    "component, new_value",
    [
        ("torch", "2.13.1"),
        ("triton", "3.6.1"),
        ("ptxas", "12.9.41"),
        ("nvidia-cuda-runtime-cu12", "12.9.37"),
        ("settings", "blake3:" + "3" * 64),
        ("native_manifest", "blake3:" + "4" * 64),
    ],
)
def test_bumping_a_compiler_component_moves_the_key(component, new_value):
    assert _key({**FULL_STACK, component: new_value}) != _key()


def test_adding_an_unclassified_component_moves_the_key():
    extended = {**FULL_STACK, "nvidia-cudnn-cu12": "9.10.2.21"}
    assert "nvidia-cudnn-cu12" in Toolchain(extended).components
    assert _key(extended) != _key()


def test_removing_a_compiler_component_moves_the_key():
    assert _key({k: v for k, v in FULL_STACK.items() if k != "triton"}) != _key()


def test_graph_sm_and_envelope_are_key_axes():
    assert _key(graph=G1) != _key()
    assert _key(sm="sm_120") != _key()
    widened = Envelope([(1024, 1024), (768, 768), (512, 512)], 512, guidance=[3.5, 7], batch_sizes=[1, 2])
    assert _key(envelope=widened) != _key()
    assert _key(envelope=Envelope([(1024, 1024), (768, 768)], 256, [3.5, 7], [1, 2])) != _key()
    assert _key(envelope=Envelope([(1024, 1024), (768, 768)], 512, [3.5], [1, 2])) != _key()
    assert _key(envelope=Envelope([(1024, 1024), (768, 768)], 512, [3.5, 7], [1])) != _key()


def test_reordering_lists_and_dicts_moves_nothing():
    reordered_envelope = Envelope([(768, 768), (1024, 1024)], 512, guidance=[7.0, 3.5], batch_sizes=[2, 1])
    reordered_stack = dict(reversed(list(FULL_STACK.items())))
    assert reordered_envelope == ENVELOPE
    assert _key(reordered_stack, reordered_envelope) == _key()


def test_width_and_height_are_not_interchangeable():
    assert Envelope([(1024, 768)], 77).digest != Envelope([(768, 1024)], 77).digest


# --------------------------------------------------------------------------
# Envelope validation
# --------------------------------------------------------------------------


def test_missing_text_len_is_an_error():
    with pytest.raises(EnvelopeError, match="text_len is mandatory"):
        Envelope.from_dict({"shapes": [[1024, 1024]]})
    with pytest.raises(EnvelopeError, match="text_len is mandatory"):
        Envelope.from_document({"v": 1, "shapes": [[1024, 1024]], "guidance": [], "batch_sizes": [1]})
    with pytest.raises(EnvelopeError, match="text_len is mandatory"):
        Envelope([(1024, 1024)], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Envelope([(1024, 1024)])  # type: ignore[call-arg]
    with pytest.raises(EnvelopeError, match="text_len is mandatory"):
        ck1(G0, {"shapes": [[1024, 1024]]}, "sm_90", {"torch": "2.13.0"})


def test_text_len_zero_is_a_declaration_not_a_default():
    assert Envelope([(512, 512)], 0).document["text_len"] == 0
    assert Envelope([(512, 512)], 0).digest != Envelope([(512, 512)], 1).digest


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(shapes=[], text_len=0), "at least one shape"),
        (dict(shapes=[(0, 512)], text_len=0), "width"),
        (dict(shapes=[(512, -1)], text_len=0), "height"),
        (dict(shapes=[(65537, 512)], text_len=0), "width"),
        (dict(shapes=[(True, 512)], text_len=0), "integer"),
        (dict(shapes=[(512.0, 512)], text_len=0), "integer"),
        (dict(shapes=[(512, 512, 3)], text_len=0), "pair"),
        (dict(shapes=["512x512"], text_len=0), "pair"),
        (dict(shapes=[(512, 512)] * 1025, text_len=0), "at most 1024"),
        (dict(shapes=[(512, 512)], text_len=-1), "text_len"),
        (dict(shapes=[(512, 512)], text_len=True), "integer"),
        (dict(shapes=[(512, 512)], text_len=77.0), "integer"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[float("nan")]), "finite"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[float("inf")]), "finite"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[True]), "number"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=["seven"]), "decimal"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[None]), "number"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[5e-324]), "characters"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[1e7]), "out of range"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=[Decimal("1e-999999")]), "characters"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=["0." + "0" * 100 + "1"]), "characters"),
        (dict(shapes=[(512, 512)], text_len=0, guidance=7), "list"),
        (dict(shapes=[(512, 512)], text_len=0, batch_sizes=[]), "must not be empty"),
        (dict(shapes=[(512, 512)], text_len=0, batch_sizes=[0]), "batch size"),
        (dict(shapes=[(512, 512)], text_len=0, batch_sizes=[True]), "integer"),
        (dict(shapes=[(512, 512)], text_len=0, batch_sizes=[2.0]), "integer"),
    ],
)
def test_envelope_refuses(kwargs, message):
    with pytest.raises(EnvelopeError, match=message):
        Envelope(**kwargs)


def test_envelope_from_dict_refuses_unknown_fields_and_versions():
    with pytest.raises(EnvelopeError, match="unknown envelope fields"):
        Envelope.from_dict({"shapes": [[1, 1]], "text_len": 0, "lane": "baseline+dense"})
    with pytest.raises(EnvelopeError, match="version"):
        Envelope.from_dict({"v": 2, "shapes": [[1, 1]], "text_len": 0})
    with pytest.raises(EnvelopeError, match="'v'"):
        Envelope.from_document({"shapes": [[1, 1]], "text_len": 0})


def test_batch_sizes_default_to_one():
    assert Envelope([(64, 64)], 0).document["batch_sizes"] == [1]
    assert Envelope.from_dict({"shapes": [[64, 64]], "text_len": 0}).batch_sizes == (1,)


@pytest.mark.parametrize(
    "value, spelled",
    [
        (3.5, "3.5"),
        (7.0, "7"),
        (10, "10"),
        (-0.0, "0"),
        (0, "0"),
        (0.1, "0.1"),
        (1e-05, "0.00001"),
        (1000.0, "1000"),
        (Decimal("3.50"), "3.5"),
        (Decimal("1E+1"), "10"),
        (Decimal("1.00000000000000000000000000001"), "1.00000000000000000000000000001"),
        ("2.500", "2.5"),
        ("7.0", "7"),
        ("4", "4"),
        (-1.5, "-1.5"),
    ],
)
def test_guidance_spelling(value, spelled):
    assert canonical_guidance(value) == spelled


def test_guidance_sorted_by_numeric_value_not_text():
    assert Envelope([(1, 1)], 0, guidance=[10, 9, 2.5, 100]).guidance == ("2.5", "9", "10", "100")


# --------------------------------------------------------------------------
# Toolchain validation
# --------------------------------------------------------------------------


def test_toolchain_requires_torch():
    with pytest.raises(ToolchainError, match="torch"):
        Toolchain({"triton": "3.6.0"})
    with pytest.raises(ToolchainError, match="torch"):
        Toolchain({"torch_": "2.13.0", "diffusers": "0.35.1"})


@pytest.mark.parametrize(
    "components",
    [
        {"torch": ""},
        {"torch": "2.13 .0"},
        {"torch": 2.13},
        {"torch": None},
        {"torch": "2.13.0", "Triton": "3.6.0"},
        {"torch": "2.13.0", "-triton": "3.6.0"},
        {"torch": "2.13.0", "tri ton": "3.6.0"},
        {"torch": "2.13.0", "tritön": "3.6.0"},
        {"torch": "2.13.0", 7: "3.6.0"},
        {"torch": "2.13.0", "x" * 129: "1"},
    ],
)
def test_toolchain_refuses_malformed_components(components):
    with pytest.raises(ToolchainError):
        Toolchain(components)


def test_toolchain_refuses_non_mappings():
    with pytest.raises(ToolchainError, match="mapping"):
        Toolchain([("torch", "2.13.0")])  # type: ignore[arg-type]


def test_toolchain_splits_and_sorts():
    toolchain = Toolchain({"triton": "3.6.0", "peft": "0.17.0", "torch": "2.13.0"})
    assert list(toolchain.components) == ["torch", "triton"]
    assert dict(toolchain.recorded) == {"peft": "0.17.0"}
    assert toolchain == Toolchain({"torch": "2.13.0", "peft": "0.17.0", "triton": "3.6.0"})
    with pytest.raises(TypeError):
        toolchain.components["torch"] = "9"  # type: ignore[index]


# --------------------------------------------------------------------------
# sm, digests, keys
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sm",
    [
        "sm_90",
        "sm_100",
        "sm_120",
        "sm_86",
        "cpu-x86_64-avx512+avx512_vnni",
        "cpu-aarch64-neon+sve256",
        "cpu-x86_64-avx2",
    ],
)
def test_valid_sm(sm):
    assert is_sm(sm) and validate_sm(sm) == sm


@pytest.mark.parametrize(
    "sm",
    [
        "sm90",
        "SM_90",
        "sm_9",
        "sm_090",
        "sm_90a",
        "sm_1000",
        "cpu",
        "cpu-x86_64",
        "cpu-x86_64-",
        "cpu-X86_64-avx2",
        "cpu-x86_64-AVX2",
        "cpu-x86_64-avx512_vnni+avx512",  # unsorted
        "cpu-x86_64-avx2+avx2",  # duplicated
        "cpu-x86_64-avx2+",
        "cpu-x86-64-avx2",
        "sm_90\n",
        "",
        None,
        90,
    ],
)
def test_invalid_sm(sm):
    assert not is_sm(sm)
    with pytest.raises(KeyInvalid):
        validate_sm(sm)
    with pytest.raises(KeyInvalid):
        ck1(G0, ENVELOPE, sm, FULL_STACK)


def test_cpu_sm_builds_the_canonical_spelling():
    assert cpu_sm("x86_64", ["AVX512_VNNI", "avx512", "avx512"]) == "cpu-x86_64-avx512+avx512_vnni"


@pytest.mark.parametrize(
    "graph",
    [
        "blake3:" + "0" * 63,
        "blake3:" + "A" * 64,
        "sha256:" + "0" * 64,
        "0" * 64,
        "blake3:" + "0" * 65,
        None,
        b"blake3:",
    ],
)
def test_ck1_refuses_a_malformed_graph_digest(graph):
    assert not is_digest(graph)
    with pytest.raises(KeyInvalid, match="graph digest"):
        ck1(graph, ENVELOPE, "sm_90", FULL_STACK)
    with pytest.raises(DigestInvalid):
        validate_digest(graph)


def test_validate_digest_returns_a_valid_digest():
    assert validate_digest(G0) == G0


@pytest.mark.parametrize(
    "key",
    ["ck1-" + "0" * 56, "ck1-" + "0123456789abcdef" * 3 + "01234567", "a", "0", "family-flux2.klein_4b", "x" * 96],
)
def test_valid_keys(key):
    assert is_key(key) and validate_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "-abc",
        ".abc",
        "_abc",
        "Abc",
        "a b",
        "a/b",
        "a+b",
        "abc\n",
        "x" * 97,
        "ck1-" + "0" * 55,
        "ck1-" + "0" * 57,
        "ck1-" + "A" * 56,
        "ck1-" + "g" * 56,
        "ck1-",
        "rооt",  # Cyrillic o's
        None,
        42,
    ],
)
def test_invalid_keys(key):
    assert not is_key(key)
    with pytest.raises(KeyInvalid):
        validate_key(key)


# --------------------------------------------------------------------------
# canonical_json and digest
# --------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1.5, True, False, None, {"a": [1, 2.0]}, {"a": None}, {1: "a"}, {"a": b"x"}])
def test_hashed_documents_refuse_floats_bools_none(value):
    with pytest.raises(TypeError):
        canonical_json(value)
    with pytest.raises(TypeError):
        digest(value)


def test_written_documents_admit_bools_none_and_finite_floats():
    assert canonical_json({"b": True, "a": None, "c": 0.05}, hashed=False) == b'{"a":null,"b":true,"c":0.05}'
    with pytest.raises(ValueError):
        canonical_json({"a": float("nan")}, hashed=False)


def test_canonical_json_spelling():
    assert canonical_json({"b": [1, "é"], "a": {"d": 1, "c": 2}}) == b'{"a":{"c":2,"d":1},"b":[1,"\\u00e9"]}'


json_documents = st.recursive(
    st.one_of(st.text(max_size=8), st.integers(min_value=-(2**70), max_value=2**70)),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_documents)
def test_canonical_json_is_idempotent_and_stable(doc):
    encoded = canonical_json(doc)
    assert canonical_json(json.loads(encoded)) == encoded
    assert canonical_json(doc) == encoded
    encoded.decode("ascii")  # ensure_ascii: canonical bytes are pure ASCII


@given(json_documents)
def test_digest_format(doc):
    assert DIGEST_RE.match(digest(doc))
    assert digest(doc) == digest(json.loads(canonical_json(doc)))


@given(st.dictionaries(st.text(max_size=6), st.integers(), max_size=8))
def test_canonical_json_ignores_dict_insertion_order(mapping):
    assert canonical_json(dict(reversed(list(mapping.items())))) == canonical_json(mapping)


# --------------------------------------------------------------------------
# Canonicalization properties of the envelope
# --------------------------------------------------------------------------

finite_guidance_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False).filter(
    lambda x: x == 0 or abs(x) >= 1e-6
)
guidance_values = st.one_of(st.integers(min_value=-1000, max_value=1000), finite_guidance_floats)
shape_pairs = st.tuples(st.integers(min_value=1, max_value=65536), st.integers(min_value=1, max_value=65536))


@st.composite
def envelope_inputs(draw):
    return {
        "shapes": draw(st.lists(shape_pairs, min_size=1, max_size=8)),
        "text_len": draw(st.integers(min_value=0, max_value=4096)),
        "guidance": draw(st.lists(guidance_values, max_size=6)),
        "batch_sizes": draw(st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=6)),
    }


@given(envelope_inputs(), st.randoms(use_true_random=False))
def test_envelope_is_invariant_under_permutation_and_duplication(fields, rng):
    shuffled = {}
    for name in ("shapes", "guidance", "batch_sizes"):
        items = list(fields[name]) + [value for value in fields[name] if rng.random() < 0.5]
        rng.shuffle(items)
        shuffled[name] = items
    shuffled["text_len"] = fields["text_len"]
    original, permuted = Envelope.from_dict(fields), Envelope.from_dict(shuffled)
    assert permuted == original
    assert canonical_json(permuted.document) == canonical_json(original.document)
    assert permuted.digest == original.digest


@given(envelope_inputs())
def test_envelope_document_is_canonical_and_round_trips(fields):
    envelope = Envelope.from_dict(fields)
    document = envelope.document
    assert [tuple(s) for s in document["shapes"]] == sorted(set(map(tuple, document["shapes"])))
    assert document["batch_sizes"] == sorted(set(document["batch_sizes"]))
    numeric = [Decimal(g) for g in document["guidance"]]
    assert numeric == sorted(set(numeric))
    assert Envelope.from_document(json.loads(canonical_json(document))) == envelope


@given(finite_guidance_floats)
def test_guidance_float_round_trips_through_its_spelling(value):
    spelled = canonical_guidance(value)
    assert float(spelled) == value
    assert canonical_guidance(spelled) == spelled
    assert "e" not in spelled.lower()
    assert not spelled.endswith(".0") and not spelled.endswith(".")
    if value == int(value):
        assert "." not in spelled


@given(st.integers(min_value=-1000, max_value=1000))
def test_integral_guidance_is_one_value_as_int_float_or_string(value):
    assert canonical_guidance(value) == canonical_guidance(float(value)) == canonical_guidance(f"{value}.0")
    assert Envelope([(1, 1)], 0, [value, float(value)]).guidance == (str(value),)


# --------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------


def test_admits_a_request_inside_the_envelope():
    verdict = ENVELOPE.admits(width=1024, height=1024, text_len=512, guidance=7.0, batch_size=2)
    assert verdict and verdict.admitted and verdict.axis is None and verdict.reason is None


@pytest.mark.parametrize(
    "request_fields, axis",
    [
        (dict(width=512, height=512, text_len=512, guidance=3.5), "shape"),
        (dict(width=768, height=1024, text_len=512, guidance=3.5), "shape"),
        (dict(width=1024, height=1024, text_len=77, guidance=3.5), "text_len"),
        (dict(width=1024, height=1024, text_len=None, guidance=3.5), "text_len"),
        (dict(width=1024, height=1024, text_len=0, guidance=3.5), "text_len"),
        (dict(width=1024, height=1024, text_len=512, guidance=5), "guidance"),
        (dict(width=1024, height=1024, text_len=512, guidance=None), "guidance"),
        (dict(width=1024, height=1024, text_len=512, guidance=3.5, batch_size=4), "batch_size"),
    ],
)
def test_out_of_envelope_names_its_axis(request_fields, axis):
    verdict = ENVELOPE.admits(**request_fields)
    assert not verdict
    assert verdict.axis == axis
    assert verdict.reason == OUT_OF_ENVELOPE_REASON == "request out of declared envelope, serving eager"


def test_first_failing_axis_is_named():
    verdict = ENVELOPE.admits(width=1, height=1, text_len=1, guidance=1, batch_size=64)
    assert verdict.axis == "shape"


def test_text_len_zero_admits_only_requests_without_text():
    envelope = Envelope([(512, 512)], 0)
    assert envelope.admits(width=512, height=512)
    assert envelope.admits(width=512, height=512, text_len=0)
    assert envelope.admits(width=512, height=512, text_len=None)
    assert envelope.admits(width=512, height=512, text_len=77).axis == "text_len"


def test_positive_text_len_pins_exactly():
    envelope = Envelope([(512, 512)], 77)
    assert envelope.admits(width=512, height=512, text_len=77)
    assert envelope.admits(width=512, height=512, text_len=76).axis == "text_len"
    assert envelope.admits(width=512, height=512, text_len=78).axis == "text_len"


def test_empty_guidance_declares_no_guidance_specialization():
    envelope = Envelope([(512, 512)], 0)
    assert envelope.admits(width=512, height=512, guidance=None)
    assert envelope.admits(width=512, height=512, guidance=12.5)


def test_guidance_admission_compares_values_not_spellings():
    assert ENVELOPE.admits(width=768, height=768, text_len=512, guidance="7")
    assert ENVELOPE.admits(width=768, height=768, text_len=512, guidance=Decimal("3.50"))
    assert ENVELOPE.admits(width=768, height=768, text_len=512, guidance=7)


def test_admits_accepts_a_request_a_mapping_or_keywords():
    as_request = Request(width=768, height=768, text_len=512, guidance=3.5)
    as_mapping = {"shape": (768, 768), "text_len": 512, "guidance": 3.5}
    assert ENVELOPE.admits(as_request)
    assert ENVELOPE.admits(as_mapping)
    assert ENVELOPE.admits(Request.of(as_mapping))
    assert ENVELOPE.admits(shape=(768, 768), text_len=512, guidance=3.5)


@pytest.mark.parametrize(
    "fields",
    [
        dict(width=0, height=512),
        dict(width=True, height=512),
        dict(width=512.0, height=512),
        dict(width=512),
        dict(width=512, height=512, batch_size=0),
        dict(width=512, height=512, text_len=-1),
        dict(width=512, height=512, guidance=float("nan")),
        dict(width=512, height=512, colour="blue"),
        dict(shape=(512, 512), width=512),
    ],
)
def test_malformed_requests_raise(fields):
    with pytest.raises(EnvelopeError):
        ENVELOPE.admits(**fields)


def test_admits_refuses_a_request_and_keywords_together():
    with pytest.raises(EnvelopeError):
        ENVELOPE.admits({"width": 768, "height": 768}, text_len=512)


@settings(max_examples=200)
@given(envelope_inputs())
def test_every_declared_point_is_admitted(fields):
    envelope = Envelope.from_dict(fields)
    guidance = fields["guidance"][0] if fields["guidance"] else None
    text_len = envelope.text_len or None
    for width, height in fields["shapes"]:
        for batch_size in fields["batch_sizes"]:
            assert envelope.admits(
                width=width, height=height, text_len=text_len, guidance=guidance, batch_size=batch_size
            )
