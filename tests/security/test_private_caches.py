"""Private tenant caches (visibility ``principal``): another principal's records and blobs are absent to you.

In a ``principal`` repo each principal reads only what it published or
uploaded. Another holder of a read (or write) grant on the same repo gets, in
resolve, record reads, listings and blob HEAD/GET, the very answer a key or
digest that does not exist gets: each request is sent before the owner's
publish (truly absent) and after it (hidden), and the two answers must match
in status, body and headers (``date`` aside). Every hidden read is audited as
the denial it is. Both configurations (``store``).
"""

from __future__ import annotations

import jwt
import pytest

from tests.compiled_graphs.support import (
    CONSTANTS_A,
    FAMILY,
    error_code,
    publication,
    publish,
    safetensors_bytes,
    upload_all,
)
from tests.support.archives import archive_report
from tests.support.audit import audited
from tests.support.live_store import unique_repo

#: Headers that legitimately differ between two sends of one request.
VOLATILE = {"date"}


@pytest.fixture
def cache(store, pt2_archive):
    """A ``principal`` repo; alice and bob may write it, carol only read it; alice's publication (not yet sent)."""
    name = unique_repo("private")
    manager = store.mint("ops", f"acme/{name}:admin")
    with store.client(manager) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code == 201
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    return {
        "name": name, "pub": pub, "manager": manager,
        "alice": store.mint("alice", f"acme/{name}:read,write"),
        "bob": store.mint("bob", f"acme/{name}:read,write"),
        "carol": store.mint("carol", f"acme/{name}:read"),
    }


def reads(store, token: str, name: str, pub) -> dict[str, tuple]:
    """Every read a reader can make of ``pub`` in ``acme/<name>``: status, body and headers of each."""
    base = f"/v1/repos/acme/{name}"
    component = pub.components["consts"].digest
    requests = {
        "record": ("GET", pub.path("acme", name), None),
        "list": ("GET", f"{base}/compiled-graphs", None),
        "list by family": ("GET", f"{base}/compiled-graphs?family={FAMILY}", None),
        "resolve": ("POST", "/v1/compiled-graphs:resolve", {"family": FAMILY, "keys": [pub.key]}),
        "artifact head": ("HEAD", f"{base}/blobs/{pub.artifact.digest}", None),
        "artifact get": ("GET", f"{base}/blobs/{pub.artifact.digest}", None),
        "component head": ("HEAD", f"{base}/blobs/{component}", None),
        "component get": ("GET", f"{base}/blobs/{component}", None),
    }
    answers = {}
    with store.client(token, follow_redirects=False) as client:
        for what, (method, path, body) in requests.items():
            answer = client.request(method, path, json=body)
            headers = tuple(sorted((k, v) for k, v in answer.headers.items() if k not in VOLATILE))
            answers[what] = (answer.status_code, answer.content, headers)
    return answers


def jti_of(token: str) -> str:
    return jwt.decode(token, options={"verify_signature": False})["jti"]


def test_another_principal_s_records_and_blobs_answer_exactly_as_absent_ones(store, cache):
    name, pub = cache["name"], cache["pub"]
    absent = {who: reads(store, cache[who], name, pub) for who in ("bob", "carol")}
    assert absent["bob"]["record"][0] == 404 and absent["bob"]["artifact head"][0] == 404

    with store.client(cache["alice"]) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    mine = reads(store, cache["alice"], name, pub)
    assert mine["record"][0] == 200 and mine["artifact head"][0] == 200 and mine["component head"][0] == 200
    assert b'"status":"hit"' in mine["resolve"][1] and pub.key.encode() in mine["list"][1]

    for who in ("bob", "carol"):
        hidden = reads(store, cache[who], name, pub)
        for what in hidden:
            assert hidden[what] == absent[who][what], f"{who}'s {what} tells alice's apart from an absent one"
    # The hidden reads are audited as denials under the reader; the absent ones were not.
    for who in ("bob", "carol"):
        assert len(audited(store, "NAME_UNKNOWN", target=pub.path("acme", name), jti=jti_of(cache[who]))) == 1
        assert len(audited(store, "BLOB_UNKNOWN", target=pub.artifact.digest, jti=jti_of(cache[who]))) == 2

    # The rule is the visibility's: the same repo made ``owner`` shows bob alice's record.
    with store.client(cache["manager"]) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "owner"}).status_code == 200
    assert reads(store, cache["bob"], name, pub)["record"][0] == 200


def test_a_second_tenant_with_the_same_bytes_has_a_cache_of_its_own(store, cache):
    """Bob mints the very same archive: his publish is a 201 of his own, telling nothing of alice's."""
    name, pub = cache["name"], cache["pub"]
    receipts = {}
    for who in ("alice", "bob"):
        with store.client(cache[who]) as client:
            created = publish(client, "acme", name, pub)
            assert created.status_code == 201, created.text
            receipts[who] = created.json()["receipt"]
            record = client.get(pub.path("acme", name))
            assert record.json()["publisher"]["principal"] == who
            assert client.head(f"/v1/repos/acme/{name}/blobs/{pub.artifact.digest}").status_code == 200
            resolved = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key]})
            (hit,) = resolved.json()["answers"]
            assert hit["receipt"] == receipts[who]
    for who, receipt in receipts.items():
        assert jwt.decode(receipt, options={"verify_signature": False})["publisher"] == who
    with store.client(cache["carol"]) as client:
        listing = client.get(f"/v1/repos/acme/{name}/compiled-graphs")
    assert listing.status_code == 200 and listing.json()["records"] == []


def test_knowing_a_digest_grants_nothing_in_a_private_cache(store, cache):
    """Bob names alice's blobs without sending them: they are absent for his publish, his check, his mount."""
    name, pub = cache["name"], cache["pub"]
    digests = [pub.artifact.digest, pub.components["consts"].digest]
    with store.client(cache["alice"]) as client:
        upload_all(client, "acme", name, pub)
        assert client.post(f"/v1/repos/acme/{name}/blobs:missing", json={"digests": digests}).json()["missing"] == []
    with store.client(cache["bob"]) as client:
        assert client.post(f"/v1/repos/acme/{name}/blobs:missing", json={"digests": digests}).json() == {
            "missing": digests
        }
        refused = client.put(pub.path("acme", name), json=pub.manifest)
        assert refused.status_code == 400 and error_code(refused) == "BLOB_UNKNOWN"
        assert sorted(refused.json()["error"]["detail"]["missing"]) == sorted(digests)

    own = unique_repo("bob-own")
    bob_everywhere = store.mint("bob", f"acme/{name}:read,write", f"acme/{own}:read,write")
    with store.client(bob_everywhere) as client:
        hidden = client.post(f"/v1/repos/acme/{own}/blobs/{pub.artifact.digest}:mount?from=acme/{name}")
        absent = client.post(f"/v1/repos/acme/{own}/blobs/{'blake3:' + '0' * 64}:mount?from=acme/{name}")
        assert hidden.status_code == absent.status_code == 404 and error_code(hidden) == "BLOB_UNKNOWN"
        assert client.head(f"/v1/repos/acme/{own}/blobs/{pub.artifact.digest}").status_code == 404
