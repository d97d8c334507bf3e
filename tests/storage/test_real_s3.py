"""What only a real S3 refuses: the production configuration against Ceph's RADOS Gateway (issue 28).

moto accepts any key and any presigned URL, tampered or expired, so none of
these could fail against it: S3 itself must refuse a URL whose key, expiry or
signature was changed, and one that has expired (403); and a store whose S3
secret is wrong must say so in ``/readyz`` rather than pass for ready.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest

from cgstore.storage.hashing import blake3_digest
from cgstore.storage.s3.driver import sign_payloads
from tests.support.live_store import running_store, settings_for
from tests.support.storage_fixtures import build_storage_case

MiB = 1 << 20
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def write_blob(storage, data: bytes) -> str:
    digest = blake3_digest(data)
    with storage.writer(digest, len(data)) as writer:
        writer.write(data)
        writer.commit()
    return digest


def with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True)) | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def flipped_signature(url: str) -> str:
    signature = dict(parse_qsl(urlsplit(url).query))["X-Amz-Signature"]
    return with_query(url, **{"X-Amz-Signature": signature[:-1] + ("0" if signature[-1] != "0" else "1")})


@pytest.fixture
def s3_case(s3_server, tmp_path):
    return build_storage_case("s3", tmp_path, s3_server)


def test_every_presigned_url_of_a_batch_is_accepted_and_a_tampered_one_refused_by_s3(s3_case):
    storage = s3_case.storage
    blobs = {
        write_blob(storage, f"blob {i} of the batch".encode()): f"blob {i} of the batch".encode() for i in range(4)
    }
    # botocore signs the first URL of a batch, the store's own SigV4 code the others.
    urls = storage.presigned_urls(list(blobs), 60)
    for digest, url in urls.items():
        assert httpx.get(url, timeout=30).content == blobs[digest]

    url, other = list(urls.values())[:2]
    other_path = urlsplit(other).path
    tampered = {
        "signature": flipped_signature(url),
        "key": urlunsplit(urlsplit(url)._replace(path=other_path)),  # another blob, the same signature
        "expiry": with_query(url, **{"X-Amz-Expires": "604800"}),  # a week instead of a minute
    }
    for what, bad in tampered.items():
        answer = httpx.get(bad, timeout=30)
        assert answer.status_code == 403, (what, answer.status_code, answer.text[:200])
        assert b"blob " not in answer.content, what


def test_an_expired_presigned_url_is_refused_by_s3(s3_case):
    storage = s3_case.storage
    digest = write_blob(storage, b"short-lived")
    url = storage.presigned_url(digest, 2)
    assert httpx.get(url, timeout=30).status_code == 200
    time.sleep(4)  # SigV4 expiry is X-Amz-Date + X-Amz-Expires, to the second
    answer = httpx.get(url, timeout=30)
    assert answer.status_code == 403
    assert re.search(r"<Code>AccessDenied</Code>|expired", answer.text, re.IGNORECASE), answer.text[:300]


def test_a_store_with_a_wrong_s3_secret_is_not_ready_and_says_why(
    s3_server, pg_url, session_bucket, tmp_path, monkeypatch
):
    settings = settings_for("production", tmp_path, pg_url=pg_url, s3=s3_server, bucket=session_bucket)
    # The store reads its keys from the environment when it opens its storage.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + s3_server.secret_key)
    with running_store(settings, "production") as live:
        answer = httpx.get(f"{live.base_url}/readyz", timeout=60)
    assert answer.status_code == 503
    body = answer.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["storage"].startswith("unavailable: S3 refused the store's credentials"), body
    assert "403" in body["checks"]["storage"]
    assert s3_server.secret_key not in answer.text and s3_server.access_key not in answer.text


@pytest.mark.parametrize(
    ("mode", "endpoint", "signed"),
    [
        ("auto", "http://10.0.0.5:7480", True),  # plain HTTP on a wire: nothing else checks the bytes
        ("auto", "http://rgw.internal:7480", True),  # a name may resolve anywhere
        ("auto", "http://127.0.0.1:7480", False),  # loopback: no wire
        ("auto", "http://localhost:7480", False),
        ("auto", "http://[::1]:7480", False),
        ("auto", "https://rgw.internal", False),  # TLS authenticates every byte
        ("auto", None, False),  # AWS, over HTTPS
        ("always", "https://rgw.internal", True),
        ("never", "http://10.0.0.5:7480", False),
    ],
)
def test_payload_signing_follows_the_setting_and_the_endpoint(mode, endpoint, signed):
    assert sign_payloads(mode, endpoint) is signed


@pytest.mark.parametrize("mode", ["always", "never"])
def test_rgw_takes_parts_and_puts_signed_or_not_and_the_staged_blob_verifies(s3_server, tmp_path, mode):
    case = build_storage_case("s3", tmp_path, s3_server, s3_payload_signing=mode)
    sent: list[str] = []

    def capture(request, **_) -> None:  # what went on the wire for each body-carrying write
        sent.append(request.headers["X-Amz-Content-SHA256"].decode())

    for operation in ("UploadPart", "PutObject"):
        case.storage.client.meta.events.register(f"before-send.s3.{operation}", capture)
    data = os.urandom(12 * MiB + 1234)  # two parts and a tail
    staged = case.storage.stage_append(case.storage.stage_begin(uuid.uuid4().hex), iter([data]))
    digest = blake3_digest(data)
    assert case.storage.stage_commit(staged, digest) == len(data)
    assert b"".join(case.storage.read(digest)) == data
    assert write_blob(case.storage, data[:1000]) == blake3_digest(data[:1000])
    bodies = [value for value in sent if value != EMPTY_SHA256]  # claims: empty bodies
    assert len(bodies) >= 4  # two parts, the tail, the small blob
    if mode == "never":
        assert set(bodies) == {"UNSIGNED-PAYLOAD"}
    else:
        assert all(re.fullmatch(r"[0-9a-f]{64}", value) for value in bodies)
