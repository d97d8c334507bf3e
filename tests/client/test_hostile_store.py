"""The client as a victim (issue 30 §4): a store, or a man in the middle, that is hostile.

Against :class:`~tests.support.hostile_store.HostileStore`, a real loopback HTTP
server whose every byte the test controls: answers naming another host, answers
trickled a byte at a time, a blob served a byte per connection, answers without
end, receipts signed by keys a worker does not trust. Short client limits make
each bound trip in seconds. (The trust pin against the real store, in both
configurations: ``test_trust_pin.py``.)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cgstore_client import Client, CompiledRequired, Loaded, Want
from cgstore_client.errors import ConfigError, DeadlineExceeded, Refused, TooLarge
from cgstore_client.limits import Limits
from cgstore_client.receipts import TrustPin, jwk_thumbprint
from cgstore_client.worker.http import Retry
from cgstore_client.worker.outcomes import Eager
from tests.client.test_client_blobs import cache_files
from tests.support.hostile_store import FAMILY, KEY, REPO, Answer, HostileStore, json_answer

FAST = Retry(attempts=3, base_s=0.01, cap_s=0.05)
BLOB = os.urandom(2048)


@pytest.fixture
def hostile():
    with HostileStore() as store:
        yield store


@pytest.fixture
def sink():
    """Another host: nothing of the client's may ever reach it."""
    with HostileStore() as other:
        yield other


def client_of(store: HostileStore, tmp_path, **options) -> Client:
    options.setdefault("retry", FAST)
    return Client(store.url, "secret-token", cache_dir=tmp_path / "cache", **options)


# --- the token stays on the store's origin ----------------------------------------------------------


def test_a_record_href_naming_another_host_gets_no_request_and_no_token(hostile, sink, tmp_path):
    hostile.serve_record(BLOB, href=f"{sink.url}/steal")
    with client_of(hostile, tmp_path) as client:
        (loaded,) = client.load(FAMILY, [KEY])
    assert isinstance(loaded, Loaded) and loaded.artifact_path.read_bytes() == BLOB
    assert sink.log == []  # not a request, let alone the token
    ((_, _, headers),) = hostile.requests_to(f"/v1/repos/{REPO}/compiled-graphs/{KEY}")
    assert headers["Authorization"] == "Bearer secret-token"  # the record, read where the client says


@pytest.mark.parametrize("where", ["absolute", "scheme-relative"])
def test_the_transport_sends_nothing_off_the_stores_origin(hostile, sink, tmp_path, where):
    """Whatever a path or an upload's Location names, the token only goes to the store's origin."""
    target = f"{sink.url}/v1/keys" if where == "absolute" else f"//{sink.url.removeprefix('http://')}/v1/keys"
    hostile.routes[("POST", f"/v1/repos/{REPO}/uploads")] = Answer(status=202, headers={"Location": target})
    with client_of(hostile, tmp_path, chunked_threshold=0) as client:
        with pytest.raises(Refused, match="not the store's origin"):
            client.transport.request("GET", target)
        blob = tmp_path / "blob"
        blob.write_bytes(b"x" * 10)
        with pytest.raises(Refused, match="not the store's origin"):
            client.upload_blob(REPO, blob)
    assert sink.log == []
    assert hostile.requests_to(f"/v1/repos/{REPO}/uploads")  # the store itself was asked


@pytest.mark.torch
def test_a_miss_diagnosis_reads_the_nearest_record_on_the_store_whatever_the_answer_names(hostile, sink, tmp_path):
    """The tensors of a miss are diagnosed from the nearest record, read at the path the client builds from
    its repo and key: a candidate's ``href`` naming another host (the discover answers one, too) is never asked."""
    from tests.support.archives import tiny_model

    digest = hostile.serve_record(BLOB)
    decoy = {**hostile.hit(digest, len(BLOB), f"{sink.url}/steal"), "binding_signature": "bs1:other"}
    miss = {
        "detail": f"1 record of {FAMILY} in {REPO}; nearest differs in binding_signature",
        "records": 1,
        "repos": [REPO],
        "nearest": {
            "key": KEY,
            "repo": REPO,
            "differences": [{"axis": "binding_signature", "here": "bs1:mine", "recorded": "bs1:other"}],
        },
    }

    def discover(body: bytes, headers) -> Answer:  # nothing binds these tensors; without them, the decoy does
        asked = json.loads(body)
        return json_answer(
            {"candidates": [], "miss": miss} if asked.get("binding_signature") else {"candidates": [decoy]}
        )

    hostile.routes[("POST", "/v1/compiled-graphs:discover")] = discover
    with client_of(hostile, tmp_path) as client:
        booted = client.boot(
            FAMILY, tiny_model(), envelope={"shapes": [[64, 64]], "text_len": 0, "batch_sizes": [1]}, code=False
        )
    assert not booted.compiled and booted.reason.startswith(f"miss: {miss['detail']} ({KEY}: ")
    assert [r[:2] for r in hostile.requests_to(f"/v1/repos/{REPO}/compiled-graphs/")] == [
        ("GET", f"/v1/repos/{REPO}/compiled-graphs/{KEY}")
    ]  # the diagnosis read the record, on the store
    assert sink.log == []


# --- deadlines and throughput ----------------------------------------------------------------------


def trickled_resolve(hostile: HostileStore, *, headers_too: bool) -> None:
    """A miss answered a byte every 0.2 s (its headers too, or the body alone): seconds per answer."""
    body = json.dumps({"answers": [{"key": KEY, "status": "miss"}]}).encode()
    hostile.routes[("POST", "/v1/compiled-graphs:resolve")] = lambda b, h: Answer(
        body, trickle_s=0.2, trickle_head=headers_too
    )


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "headers"])
def test_a_trickled_answer_ends_load_at_the_deadline_eager_and_named(hostile, tmp_path, headers_too):
    hostile.serve_record(BLOB)
    trickled_resolve(hostile, headers_too=headers_too)
    with client_of(hostile, tmp_path, limits=Limits(call_deadline_s=1.0)) as client:
        started = time.monotonic()
        (served,) = client.load(FAMILY, [KEY])
        took = time.monotonic() - started
        assert isinstance(served, Eager) and served.reason.startswith("store too slow:"), served
        assert "CGSTORE_CALL_DEADLINE_S" in served.reason and took < 3, took
        with pytest.raises(CompiledRequired, match="store too slow"):
            client.load(FAMILY, [Want(KEY, mandatory=True)])
        with pytest.raises(DeadlineExceeded) as slow:
            client.resolve(FAMILY, [KEY])
    assert slow.value.retryable


@pytest.mark.torch
def test_a_trickled_discover_answer_boots_eager_at_the_deadline(hostile, tmp_path):
    from tests.support.archives import tiny_model

    body = json.dumps({"candidates": []}).encode()
    hostile.routes[("POST", "/v1/compiled-graphs:discover")] = lambda b, h: Answer(body, trickle_s=0.2)
    envelope = {"shapes": [[64, 64]], "text_len": 0, "batch_sizes": [1]}
    with client_of(hostile, tmp_path, limits=Limits(call_deadline_s=1.0)) as client:
        started = time.monotonic()
        booted = client.boot(FAMILY, tiny_model(), envelope=envelope, code=False)
        assert time.monotonic() - started < 3
        with pytest.raises(CompiledRequired, match="store too slow"):
            client.boot(FAMILY, tiny_model(), envelope=envelope, code=False, mandatory=True, confirm="never")
    assert not booted.compiled and booted.reason.startswith("store too slow:"), booted.reason


def byte_per_connection(blob: bytes):
    """Honours Range, promises the rest, sends one byte and hangs up: progress on every connection."""

    def answer(body: bytes, headers: dict[str, str]) -> Answer:
        start = int(headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] or 0)
        span = {"Content-Range": f"bytes {start}-{len(blob) - 1}/{len(blob)}"} if start else {}
        return Answer(
            blob[start : start + 1],
            status=206 if start else 200,
            length=len(blob) - start,
            headers={"Content-Type": "application/octet-stream", **span},
        )

    return answer


def test_a_blob_served_a_byte_per_connection_ends_at_the_throughput_floor(hostile, tmp_path):
    digest = hostile.serve_record(BLOB)
    blob_path = f"/v1/repos/{REPO}/blobs/{digest}"
    hostile.routes[("GET", blob_path)] = byte_per_connection(BLOB)
    floor = Limits(min_bytes_per_s=4096, throughput_window_s=0.5)
    with client_of(hostile, tmp_path, limits=floor) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="below the client's minimum of 4096 bytes/s"):
            client.fetch_blob(REPO, digest, len(BLOB))
        assert time.monotonic() - started < 3
        (served,) = client.load(FAMILY, [KEY])
    assert isinstance(served, Eager) and served.reason.startswith("store too slow:"), served
    assert len(hostile.requests_to(blob_path)) < len(BLOB) // 2  # given up long before the last byte
    assert cache_files(tmp_path / "cache") == ["CACHEDIR.TAG", "keys.json"]


def test_a_blob_waiting_for_a_connection_slot_is_not_judged_on_the_wait(hostile, tmp_path):
    """The floor counts time a blob holds a connection (or pauses to retry), not time queued behind another."""
    slow, quick = os.urandom(64 * 1024), os.urandom(2048)
    digests = [hostile.serve_record(blob) for blob in (slow, quick)]

    def steady() -> Iterator[bytes]:  # 32 KiB/s for 2 s: above the floor, and holding the only slot
        for i in range(8):
            time.sleep(0.25)
            yield slow[i * 8192 : (i + 1) * 8192]

    hostile.routes[("GET", f"/v1/repos/{REPO}/blobs/{digests[0]}")] = Answer(steady, length=len(slow))
    floor = Limits(min_bytes_per_s=8192, throughput_window_s=0.5)
    with client_of(hostile, tmp_path, limits=floor, download_connections=1) as client:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.fetch_blob, REPO, digests[0], len(slow))
            time.sleep(0.2)
            second = pool.submit(client.fetch_blob, REPO, digests[1], len(quick))  # waits ~2 s for the slot
            assert first.result().read_bytes() == slow and second.result().read_bytes() == quick


# --- bounds --------------------------------------------------------------------------------------------

MiB = 1 << 20


def endless(total: int, prefix: bytes = b""):
    """``total`` bytes (a JSON string that goes on), made as they are sent."""

    def chunks():
        yield prefix
        for _ in range((total - len(prefix)) // MiB):
            yield b"a" * MiB

    return chunks


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_an_answer_past_the_bound_is_refused_and_read_no_further(hostile, tmp_path, declared):
    total = 64 * MiB
    hostile.routes[("POST", "/v1/compiled-graphs:resolve")] = lambda b, h: Answer(
        endless(total, b'{"answers": [{"key": "'), length=total if declared else False
    )
    with client_of(hostile, tmp_path, limits=Limits(max_answer_bytes=MiB)) as client:
        with pytest.raises(TooLarge, match="CGSTORE_MAX_ANSWER_BYTES"):
            client.resolve(FAMILY, [KEY])
        with pytest.raises(TooLarge):
            client.load(FAMILY, [KEY])
    sent = hostile.sent_to("/v1/compiled-graphs:resolve", answers=2)
    assert sent < 2 * 16 * MiB  # both calls together: the socket buffers' worth past the bound, not 2 x 64 MiB


def test_a_head_declaring_a_length_past_the_answer_bound_is_not_a_body(hostile, tmp_path):
    digest = hostile.serve_record(BLOB)
    hostile.routes[("HEAD", f"/v1/repos/{REPO}/blobs/{digest}")] = Answer(b"", length=64 * MiB)
    with client_of(hostile, tmp_path, limits=Limits(max_answer_bytes=MiB)) as client:
        assert client.has_blob(REPO, digest)


@pytest.mark.parametrize("size", [None, len(BLOB)], ids=["unstated", "stated"])
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_a_blob_past_its_bound_stops_at_the_bound_and_leaves_nothing(hostile, tmp_path, size, declared):
    digest = hostile.serve_record(BLOB)
    total = 64 * MiB
    blob_path = f"/v1/repos/{REPO}/blobs/{digest}"
    hostile.routes[("GET", blob_path)] = lambda b, h: Answer(
        endless(total), length=total if declared else False, headers={"Content-Type": "application/octet-stream"}
    )
    with client_of(hostile, tmp_path, limits=Limits(max_blob_bytes=MiB)) as client:
        with pytest.raises(TooLarge):
            client.fetch_blob(REPO, digest, size)
    assert hostile.sent_to(blob_path) < 16 * MiB  # reading stopped at the bound
    assert cache_files(tmp_path / "cache") == ["CACHEDIR.TAG"]
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def test_limits_come_from_arguments_or_the_environment_and_a_bad_value_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CGSTORE_CALL_DEADLINE_S", "2.5")
    monkeypatch.setenv("CGSTORE_MAX_ANSWER_BYTES", "1000")
    with Client("http://127.0.0.1:9", "t", cache_dir=tmp_path) as client:
        limits = client.limits
    assert (limits.call_deadline_s, limits.max_answer_bytes, limits.min_bytes_per_s) == (2.5, 1000, 64 << 10)
    with Client("http://127.0.0.1:9", "t", cache_dir=tmp_path, limits=Limits(max_blob_bytes=5)) as client:
        assert (client.limits.max_blob_bytes, client.limits.call_deadline_s) == (5, 120.0)  # given: the whole set
    for bad in ("fast", "0", "-1"):
        monkeypatch.setenv("CGSTORE_MIN_BYTES_PER_S", bad)
        with pytest.raises(ConfigError, match="CGSTORE_MIN_BYTES_PER_S"):
            Client("http://127.0.0.1:9", "t", cache_dir=tmp_path)


# --- trust anchors -------------------------------------------------------------------------------------


def test_the_thumbprint_is_rfc_7638():
    """RFC 7638 section 3.1 (RSA) and RFC 8037 appendix A.3 (Ed25519) vectors."""
    rsa = {
        "kty": "RSA",
        "e": "AQAB",
        "kid": "2011-04-29",
        "n": (
            "0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhM"
            "stn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL"
            "5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDK"
            "gw"
        ),
    }
    assert jwk_thumbprint(rsa) == "NzbLsXh8uDCcd-6MNwXF4W_7noWXFZAfHkxZsRGC9Xs"
    ed = {"kty": "OKP", "crv": "Ed25519", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo", "kid": "any"}
    assert jwk_thumbprint(ed) == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"


def foreign_thumbprint() -> str:
    with HostileStore(kid="elsewhere") as other:
        return jwk_thumbprint(other.jwk("elsewhere"))


def test_a_store_signing_with_a_key_the_pin_does_not_list_is_not_trusted(hostile, tmp_path, monkeypatch):
    digest = hostile.serve_record(BLOB)
    monkeypatch.setenv("CGSTORE_TRUSTED_JWKS", foreign_thumbprint())
    with client_of(hostile, tmp_path) as client:
        (served,) = client.load(FAMILY, [KEY])
        with pytest.raises(CompiledRequired, match="receipt invalid.*does not trust"):
            client.load(FAMILY, [Want(KEY, mandatory=True)])
    assert isinstance(served, Eager), served
    assert served.reason.startswith("receipt invalid: receipt signed by the store's key 'hostile-1'")
    assert hostile.requests_to(f"/v1/repos/{REPO}/blobs/{digest}") == []  # nothing fetched for it


def test_a_pinned_key_verifies_and_a_rotation_is_adopted_only_once_pinned(hostile, tmp_path, monkeypatch):
    hostile.serve_record(BLOB)
    pinned = jwk_thumbprint(hostile.jwk("hostile-1"))
    pin_file = tmp_path / "trusted.json"
    pin_file.write_text(json.dumps({"keys": [hostile.jwk("hostile-1")]}))
    for pin in (pinned, f"{foreign_thumbprint()}, {pinned}", str(pin_file)):
        monkeypatch.setenv("CGSTORE_TRUSTED_JWKS", pin)
        with client_of(hostile, tmp_path / pin[:8]) as client:
            (served,) = client.load(FAMILY, [KEY])
        assert isinstance(served, Loaded), (pin, served)
    hostile.rotate("hostile-2")  # the store now signs with a key the pin does not list
    with client_of(hostile, tmp_path / "rotated") as client:
        (refused,) = client.load(FAMILY, [KEY])
    assert isinstance(refused, Eager) and "'hostile-2', which the trust pin" in refused.reason
    monkeypatch.setenv("CGSTORE_TRUSTED_JWKS", f"{pinned},{jwk_thumbprint(hostile.jwk('hostile-2'))}")
    with client_of(hostile, tmp_path / "rotated") as client:
        (adopted,) = client.load(FAMILY, [KEY])
    assert isinstance(adopted, Loaded), adopted


def test_without_a_pin_the_stores_own_keys_verify_and_a_bad_pin_is_a_config_error(hostile, tmp_path, monkeypatch):
    hostile.serve_record(BLOB)
    monkeypatch.delenv("CGSTORE_TRUSTED_JWKS", raising=False)
    with client_of(hostile, tmp_path) as client:
        assert client.trust is None and isinstance(client.load(FAMILY, [KEY])[0], Loaded)
    for bad in ("not-a-thumbprint", str(tmp_path / "absent.json")):
        monkeypatch.setenv("CGSTORE_TRUSTED_JWKS", bad)
        with pytest.raises(ConfigError, match="CGSTORE_TRUSTED_JWKS"):
            client_of(hostile, tmp_path)
    with pytest.raises(ConfigError, match="lists no keys"):
        TrustPin.parse({"keys": []})
