"""Request-time admission (envelope + the contract's dim ranges) and receipt verification."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from cgstore_client.keys import OUT_OF_ENVELOPE_REASON, Envelope
from cgstore_client.receipts import RECEIPT_AUDIENCE, RECEIPT_TYP, ReceiptInvalid, proves_root, verify_jws_receipt
from cgstore_client.worker.outcomes import Loaded

ENVELOPE = Envelope(shapes=[(512, 512)], text_len=0, batch_sizes=[1, 2, 65])


def test_a_batch_outside_the_declared_range_is_served_eager_naming_the_axis(pt2_report):
    assert pt2_report.input_contract["dims"] == {"s0": {"min": 1, "max": 64}}
    record = {"manifest": {"axes": {"envelope": ENVELOPE.document}}, "input_contract": pt2_report.input_contract}
    loaded = Loaded(key="ck1-" + "0" * 56, artifact_path=Path("unused"), record=record)
    assert loaded.admits(shape=(512, 512), batch_size=2, inputs={"inputs_x": (2, 8), "inputs_y": (2, 4)})
    # The envelope allows 65 but the program was exported for [1, 64]; AOTI would run it anyway.
    verdict = loaded.admits(shape=(512, 512), batch_size=65, inputs={"args[0]['x']": (65, 8)})
    assert not verdict and verdict.axis == "inputs_x[0]" and verdict.reason == OUT_OF_ENVELOPE_REASON
    assert "declared [1, 64]" in verdict.detail
    assert loaded.admits(shape=(512, 512), inputs={"inputs_x": (2, 9)}).axis == "inputs_x[1]"  # a static dim
    outside = loaded.admits(shape=(768, 768))
    assert not outside and outside.axis == "shape" and outside.reason == OUT_OF_ENVELOPE_REASON


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jws(key: Ed25519PrivateKey, kid: str, payload: dict, typ: str = RECEIPT_TYP) -> str:
    head = _b64(json.dumps({"alg": "EdDSA", "kid": kid, "typ": typ}).encode())
    body = _b64(json.dumps(payload).encode())
    return f"{head}.{body}.{_b64(key.sign(f'{head}.{body}'.encode()))}"


def test_a_receipt_vouches_for_exactly_its_record():
    key = Ed25519PrivateKey.generate()
    x = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    jwks = {"keys": [{"kty": "OKP", "crv": "Ed25519", "x": _b64(x), "kid": "k1", "alg": "EdDSA"}]}
    entry = {
        "key": "ck1-" + "1" * 56,
        "repo": "acme/models",
        "artifact": {"digest": "blake3:" + "a" * 64, "size": 3},
        "components": [{"name": "derived-constants", "digest": "blake3:" + "b" * 64, "size": 1}],
    }
    signed = {
        "iss": "cgstore",
        "aud": RECEIPT_AUDIENCE,
        "iat": int(time.time()),
        "repo": "acme/models",
        "key": entry["key"],
        "artifact": entry["artifact"]["digest"],
        "components": {"derived-constants": "blake3:" + "b" * 64},
        "graph": "blake3:" + "c" * 64,
        "publisher": "minter",
    }
    receipt = _jws(key, "k1", signed)
    assert verify_jws_receipt(entry, receipt, jwks) == signed
    tampered = {**entry, "artifact": {"digest": "blake3:" + "c" * 64, "size": 3}}
    with pytest.raises(ReceiptInvalid, match="vouches for"):
        verify_jws_receipt(tampered, receipt, jwks)
    with pytest.raises(ReceiptInvalid, match="vouches for"):
        verify_jws_receipt({**entry, "components": []}, receipt, jwks)
    with pytest.raises(ReceiptInvalid, match="vouches for"):  # a tenant's receipt on an entry labelled root's
        verify_jws_receipt({**entry, "repo": "root/models"}, receipt, jwks)
    with pytest.raises(ReceiptInvalid, match="names no repo"):
        verify_jws_receipt({k: v for k, v in entry.items() if k != "repo"}, receipt, jwks)
    with pytest.raises(ReceiptInvalid, match="unknown key"):
        verify_jws_receipt(entry, _jws(key, "k2", signed), jwks)
    forged = _jws(Ed25519PrivateKey.generate(), "k1", signed)
    with pytest.raises(ReceiptInvalid, match="does not verify"):
        verify_jws_receipt(entry, forged, jwks)
    with pytest.raises(ReceiptInvalid, match="not a receipt"):  # a cap-token's typ, signed by the same key
        verify_jws_receipt(entry, _jws(key, "k1", signed, typ="JWT"), jwks)
    with pytest.raises(ReceiptInvalid, match="Audience"):
        verify_jws_receipt(entry, _jws(key, "k1", {**signed, "aud": "cgstore"}), jwks)
    with pytest.raises(ReceiptInvalid, match="publisher"):
        verify_jws_receipt(entry, _jws(key, "k1", {k: v for k, v in signed.items() if k != "publisher"}), jwks)
    with pytest.raises(ReceiptInvalid):
        verify_jws_receipt(entry, "not-a-jws", jwks)


def test_only_a_platform_claim_on_a_root_repo_proves_a_root_record():
    assert proves_root({"repo": "root/models", "plt": True})
    assert not proves_root({"repo": "root/models"})  # no claim: a receipt of before, or forged into root's name
    assert not proves_root({"repo": "root/models", "plt": "true"})
    assert not proves_root({"repo": "platform/models", "plt": True})  # reserved, but not root
    assert not proves_root({"repo": "acme/models", "plt": True})
    assert not proves_root(None)  # a pluggable verifier that returns nothing proves nothing
