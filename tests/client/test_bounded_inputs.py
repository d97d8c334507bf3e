"""The client's own parsing is bounded too (issue 15 §2): envelope numbers and the free-form limits.

``Envelope.from_dict`` on ``"1e999999999"`` used to raise ``decimal.Overflow``
(``abs()`` rounds in the decimal context); every such number must be the typed
``EnvelopeError``. ``unservable`` is the one check of what a record may store.
"""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from cgstore_client.errors import EnvelopeError
from cgstore_client.keys import Envelope, Request, canonical_guidance
from cgstore_client.wire.records import MAX_FREE_FORM_BYTES, MAX_FREE_FORM_DEPTH, unservable

HUGE = ["1e999999999", "-1E+999999999", "1e-999999999", Decimal("1e999999999"), Decimal("1." + "1" * 60), 10**50]


@pytest.mark.parametrize("guidance", HUGE, ids=repr)
def test_envelope_numbers_past_the_bounds_raise_the_typed_error(guidance):
    with pytest.raises(EnvelopeError):
        Envelope.from_dict({"shapes": [[64, 64]], "text_len": 77, "guidance": [guidance]})
    with pytest.raises(EnvelopeError):
        canonical_guidance(guidance)


@pytest.mark.parametrize("guidance", ["1e999999999", "-1E+999999999", Decimal("1e999999999")], ids=repr)
def test_request_guidance_past_the_bounds_raises_the_typed_error(guidance):
    with pytest.raises(EnvelopeError):
        Request(64, 64, guidance=guidance)


def test_numbers_inside_the_bounds_still_spell_canonically():
    assert canonical_guidance("1e6") == "1000000"
    assert canonical_guidance(Decimal("-1E+6")) == "-1000000"
    assert canonical_guidance("3.50") == "3.5"


def _nested(depth: int):
    document: object = 1
    for _ in range(depth):
        document = [document]
    return document


def test_unservable_bounds_depth_size_and_unicode():
    assert unservable(_nested(MAX_FREE_FORM_DEPTH)) is None
    assert "deeper" in unservable(_nested(MAX_FREE_FORM_DEPTH + 1))
    assert "deeper" in unservable(_nested(100_000))  # iterative: no RecursionError
    fits = {"x": "a" * (MAX_FREE_FORM_BYTES - len('{"x":""}'))}
    assert unservable(fits) is None
    assert "larger" in unservable({"x": fits["x"] + "a"})
    surrogate = json.loads('"\\udc00"')
    assert "Unicode" in unservable({"k": ["ok", surrogate]})
    assert "Unicode" in unservable({surrogate: 1})
    assert unservable({"k": "zürich ✓ 𝄞"}) is None
