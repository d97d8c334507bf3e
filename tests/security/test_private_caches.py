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
        "name": name,
        "pub": pub,
        "manager": manager,
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

    # The rule is the visibility's: the same repo made ``owner`` (by the platform: a repo-scoped
    # admin never flips a visibility) shows bob alice's record.
    with store.client(store.mint("platform-ops", f"acme/{name}:admin", platform=True)) as client:
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


def test_only_the_owner_s_holder_or_the_platform_flips_a_cache_s_visibility(store):
    """A repo-scoped admin creates a cache but never exposes it; the owner's holder or the platform may."""
    owner, name = unique_repo("vis"), "cache"
    path = f"/v1/repos/{owner}/{name}"
    holder = store.mint(f"holder-{owner}", f"{owner}/*:read,write,owner:create")
    with store.client(holder) as client:
        assert client.post("/v1/owners", json={"slug": owner}).status_code == 201
    repo_admin = store.mint("ops", f"{owner}/{name}:admin")
    with store.client(repo_admin) as client:
        assert client.put(path, json={"visibility": "principal"}).status_code == 201
        refused = client.put(path, json={"visibility": "owner"})
        assert refused.status_code == 403 and error_code(refused) == "DENIED"
        assert client.put(path, json={"visibility": "principal"}).json()["visibility"] == "principal"  # no change
    assert audited(store, "DENIED", target=f"{owner}/{name}")
    with store.client(holder) as client:
        assert client.put(path, json={"visibility": "owner"}).json()["visibility"] == "owner"
    platform = store.mint("platform-ops", f"{owner}/{name}:admin", platform=True)
    with store.client(platform) as client:
        assert client.put(path, json={"visibility": "principal"}).json()["visibility"] == "principal"


def test_a_yank_names_whose_record_it_yanks(store, cache):
    """Alice and bob each hold a record of one key: the admin names bob's, and the answer says it was bob's."""
    name, pub = cache["name"], cache["pub"]
    for who in ("alice", "bob"):
        with store.client(cache[who]) as client:
            assert publish(client, "acme", name, pub).status_code == 201
    url = f"{pub.path('acme', name)}:yank"
    with store.client(store.mint("store-admin", "*/*:admin")) as client:
        own = client.post(url, json={"reason": "the admin has no record of its own here"})
        assert own.status_code == 404 and error_code(own) == "NAME_UNKNOWN"
        yanked = client.post(url, json={"reason": "bad numerics", "publisher": "bob"})
    assert yanked.status_code == 200, yanked.text
    record = yanked.json()
    assert (record["repo"], record["key"], record["publisher"]["principal"]) == (f"acme/{name}", pub.key, "bob")
    answers = {}
    for who in ("alice", "bob"):
        with store.client(cache[who]) as client:
            resolved = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key]})
            answers[who] = resolved.json()["answers"][0]["status"]
    assert answers == {"alice": "hit", "bob": "miss"}
    last = max(audited(store, "ok", target=f"acme/{name}:{pub.key}"), key=lambda row: row.id)
    assert last.action == "compiled_graph.yank" and last.detail["publisher"] == "bob"
