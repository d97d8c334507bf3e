"""Trust anchors against the real store in both configurations (issue 30 §4): with ``trusted_jwks``,
receipts verify only against the pinned keys, in ``load`` and in boot by declaration.

The pin is the store's own JWKS (a file, as an operator would save ``GET /v1/keys``) or the
RFC 7638 thumbprint of a key the store never held: the first serves compiled, the second serves
eager naming the untrusted key, raises ``CompiledRequired`` when mandatory, and fetches no blob.
"""

from __future__ import annotations

import json

import pytest
from cgstore_client import Client, CompiledRequired, Want
from cgstore_client.boot import Eager, Loaded
from cgstore_client.receipts import jwk_thumbprint
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from tests.client.test_boot import FAMILY, minted, published  # noqa: F401 (fixtures)
from tests.client.test_client_blobs import blob_gets
from tests.client.test_discover_boot import boot as boot_declared
from tests.client.test_discover_boot import declared  # noqa: F401 (fixture)
from tests.support.archives import tiny_model

pytestmark = pytest.mark.torch


def foreign_thumbprint() -> str:
    """The thumbprint of an Ed25519 key no store holds."""
    import base64

    raw = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return jwk_thumbprint({"kty": "OKP", "crv": "Ed25519", "x": base64.urlsafe_b64encode(raw).rstrip(b"=").decode()})


def saved_jwks(store, tmp_path):
    """The store's JWKS as an operator saves it, out of band, to pin it."""
    with store.client() as http:
        jwks = http.get("/v1/keys").json()
    path = tmp_path / "trusted-jwks.json"
    path.write_text(json.dumps(jwks))
    return path


def test_load_serves_only_records_whose_receipt_a_pinned_key_signed(store, published, tmp_path):
    repo, token, key = published
    gets = blob_gets(store)
    with Client(store.base_url, token, cache_dir=tmp_path / "foreign", trusted_jwks=[foreign_thumbprint()]) as client:
        (refused,) = client.load(FAMILY, [key])
        with pytest.raises(CompiledRequired, match="receipt invalid.*does not trust"):
            client.load(FAMILY, [Want(key, mandatory=True)])
    assert isinstance(refused, Eager), refused
    assert refused.reason.startswith("receipt invalid: receipt signed by the store's key")
    assert blob_gets(store) == gets  # refused before any download
    with Client(store.base_url, token, cache_dir=tmp_path / "pinned", trusted_jwks=saved_jwks(store, tmp_path)) as c:
        (served,) = c.load(FAMILY, [Want(key, mandatory=True)])
    assert isinstance(served, Loaded) and served.repo == repo


def test_boot_serves_only_candidates_whose_receipt_a_pinned_key_signed(store, declared, tmp_path, monkeypatch):  # noqa: F811
    _, token, key, _ = declared
    live = tiny_model(seed=3)
    monkeypatch.setenv("CGSTORE_TRUSTED_JWKS", foreign_thumbprint())
    with Client(store.base_url, token, cache_dir=tmp_path / "foreign") as client:
        refused = boot_declared(client, live)
        with pytest.raises(CompiledRequired, match="does not trust"):
            boot_declared(client, live, mandatory=True, confirm="never")
    assert not refused.compiled and refused.loaded is None
    assert f"{key}: receipt invalid: receipt signed by the store's key" in refused.reason
    monkeypatch.setenv("CGSTORE_TRUSTED_JWKS", str(saved_jwks(store, tmp_path)))
    with Client(store.base_url, token, cache_dir=tmp_path / "pinned") as client:
        served = boot_declared(client, live)
    assert served.compiled and served.loaded.key == key
