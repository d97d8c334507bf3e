"""Batch presigning: every hand-signed URL is exactly the one botocore would sign."""

from __future__ import annotations

import time
from urllib.parse import parse_qsl, urlsplit

import boto3
import pytest
from botocore.config import Config

from cgstore.storage.presign import SIGNER_REUSE_S, BatchPresigner, presign_many


def _parsed(url: str) -> tuple[str, str, dict[str, str]]:
    parts = urlsplit(url)
    return parts.netloc, parts.path, dict(parse_qsl(parts.query))


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9000", "https://s3.example.com", None])
@pytest.mark.parametrize("token", [None, "session/token+="])
def test_hand_signed_urls_equal_botocores(endpoint, token):
    session = boto3.session.Session(
        aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="wJal/rXU+tnF", aws_session_token=token
    )
    client = session.client(
        "s3", endpoint_url=endpoint, region_name="eu-west-1", config=Config(signature_version="s3v4")
    )
    keys = [f"prefix/blobs/{i:02x}/{i:064x}" for i in range(40)]
    for _ in range(3):  # botocore stamps the current second: compare within one second
        urls = presign_many(client, session.get_credentials(), "bucket", keys, 300)
        expected = [
            client.generate_presigned_url("get_object", Params={"Bucket": "bucket", "Key": k}, ExpiresIn=300)
            for k in keys
        ]
        if _parsed(urls[0])[2]["X-Amz-Date"] == _parsed(expected[-1])[2]["X-Amz-Date"]:
            break
    assert [_parsed(url) for url in urls] == [_parsed(url) for url in expected]
    assert len({_parsed(url)[2]["X-Amz-Signature"] for url in urls}) == len(keys)


def test_an_unknown_signing_configuration_falls_back_to_botocore():
    session = boto3.session.Session(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret")
    client = session.client(
        "s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1", config=Config(signature_version="s3")
    )  # SigV2 query auth: not hand-signed
    urls = presign_many(client, session.get_credentials(), "bucket", ["a/1", "a/2"], 300)
    assert all("Signature=" in url and "X-Amz-Signature" not in url for url in urls)
    assert presign_many(client, session.get_credentials(), "bucket", [], 300) == []


def test_a_checked_signer_is_reused_for_a_second_then_checked_again():
    session = boto3.session.Session(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="wJal/rXU+tnF")
    client = session.client(
        "s3", endpoint_url="http://127.0.0.1:9000", region_name="eu-west-1", config=Config(signature_version="s3v4")
    )
    now = [100.0]
    presigner = BatchPresigner(client, session.get_credentials(), "bucket", clock=lambda: now[0])
    first = presigner.urls(["a/1", "a/2"], 300)
    now[0] += SIGNER_REUSE_S / 2
    again = presigner.urls(["a/2", "a/3"], 300)
    # Reused: the same date, so the same URL for the same key, and the new key signed like botocore would.
    assert again[0] == first[1]
    date = _parsed(again[1])[2]["X-Amz-Date"]
    reference = presign_many(client, session.get_credentials(), "bucket", ["a/3"], 300)
    if _parsed(reference[0])[2]["X-Amz-Date"] == date:
        assert _parsed(again[1]) == _parsed(reference[0])
    assert presigner.urls(["a/1"], 60) != [first[0]]  # another ttl: its own signer
    now[0] += SIGNER_REUSE_S
    time.sleep(1.05)  # botocore stamps the wall clock's second
    assert _parsed(presigner.urls(["a/1"], 300)[0])[2]["X-Amz-Date"] != _parsed(first[0])[2]["X-Amz-Date"]
