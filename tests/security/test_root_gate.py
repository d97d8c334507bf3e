"""The three gates of ``root/*``, each on its own, and the preflight answering exactly what a publish gets.

Every token below misses exactly the locks it names; the refusal lists exactly
those (``detail.missing``), is ``ROOT_RESERVED``, and is audited. The preflight
(gate a) must give the same status, code and missing locks as the real write.
"""

from __future__ import annotations

import blake3
import pytest

from cgstore.access import LOCK_GRANT, LOCK_PLATFORM, LOCK_PLT
from cgstore.owners.service import register_principal
from tests.compiled_graphs.support import CONSTANTS_A, publication, safetensors_bytes, unique_envelope
from tests.compiled_graphs.support import publish as publish_record
from tests.security.conftest import code
from tests.support.archives import archive_report
from tests.support.audit import audited
from tests.support.live_store import unique_repo

DATA = b"a compiled graph only the platform may publish"
DIGEST = "blake3:" + blake3.blake3(DATA).hexdigest()


def publish(store, token: str, name: str):
    with store.client(token) as client:
        return client.put(f"/v1/repos/root/{name}/blobs/{DIGEST}", content=DATA)


def preflight(store, token: str, name: str, min_ttl_s: int | None = None):
    params = {} if min_ttl_s is None else {"min_ttl_s": min_ttl_s}
    with store.client(token) as client:
        return client.post(f"/v1/repos/root/{name}/preflight", params=params)


def tenant_wildcard(store, name):
    return store.mint(f"tenant-{name}", "*/*:read,write")


def platform_with_wildcard(store, name):
    return store.mint(f"plat-{name}", "*/*:read,write", platform=True)


def tenant_literal(store, name):
    return store.mint(f"tenant-{name}", f"root/{name}:read,write")


def tenant_carrying_plt(store, name):
    # A plt token whose principal is not (any longer) registered as platform.
    token = store.mint(f"ex-plat-{name}", f"root/{name}:read,write", platform=True)
    register_principal(store.context.db, f"ex-plat-{name}", platform=False)
    return token


def platform_without_plt(store, name):
    register_principal(store.context.db, f"plat-{name}", platform=True)
    return store.mint(f"plat-{name}", f"root/{name}:read,write")


CASES = [
    ("tenant */* write to root/*", tenant_wildcard, [LOCK_GRANT, LOCK_PLT, LOCK_PLATFORM]),
    ("gate b alone: platform, plt, but * for root", platform_with_wildcard, [LOCK_GRANT]),
    ("tenant with a literal root grant", tenant_literal, [LOCK_PLT, LOCK_PLATFORM]),
    ("gate c alone: tenant token carrying plt", tenant_carrying_plt, [LOCK_PLATFORM]),
    ("gate c alone: platform principal, no plt", platform_without_plt, [LOCK_PLT]),
]


@pytest.mark.parametrize(("case", "make_token", "missing"), CASES, ids=[c[0] for c in CASES])
def test_root_write_refused_naming_exactly_the_open_locks(store, case, make_token, missing):
    name = unique_repo("family")
    token = make_token(store, name)
    answer = publish(store, token, name)
    assert answer.status_code == 403 and code(answer) == "ROOT_RESERVED"
    assert answer.json()["error"]["detail"]["missing"] == missing
    assert audited(store, "ROOT_RESERVED", target=name)
    # Gate a: the preflight gives the same answer before any byte is sent.
    early = preflight(store, token, name)
    assert (early.status_code, code(early), early.json()["error"]["detail"]) == (
        answer.status_code,
        code(answer),
        answer.json()["error"]["detail"],
    )
    assert len(audited(store, "ROOT_RESERVED", target=name)) == 2


def test_all_three_locks_open_the_gate(store):
    name = unique_repo("family")
    token = store.mint("platform-ci", f"root/{name}:read,write", platform=True)
    assert preflight(store, token, name).status_code == 204
    assert publish(store, token, name).status_code == 201
    assert audited(store, "ok", target=f"root/{name}")  # repo.create and the blob link


def test_preflight_refuses_a_token_expiring_within_min_ttl(store):
    name = unique_repo("family")
    token = store.mint("platform-ci", f"root/{name}:read,write", ttl_s=120, platform=True)
    answer = preflight(store, token, name, min_ttl_s=300)
    assert answer.status_code == 403 and code(answer) == "DENIED"
    assert answer.json()["error"]["detail"]["min_ttl_s"] == 300
    assert 100 <= answer.json()["error"]["detail"]["expires_in_s"] <= 120
    assert audited(store, "DENIED", target=name)
    assert preflight(store, token, name, min_ttl_s=60).status_code == 204
    # The default asks for five minutes.
    assert preflight(store, token, name).status_code == 403


def test_preflight_gives_the_401_a_publish_gets(store):
    name = unique_repo("family")
    for token in (None, "not-a-jwt"):
        early, write = preflight(store, token, name), publish(store, token, name)
        assert (early.status_code, code(early)) == (write.status_code, code(write))
        assert early.status_code == 401


def test_preflight_creates_nothing(store):
    name = unique_repo("family")
    token = store.mint("platform-ci", f"root/{name}:read,write", platform=True)
    assert preflight(store, token, name).status_code == 204
    reader = store.mint("reader", "acme/x:read")
    with store.client(reader) as client:
        assert client.get(f"/v1/repos/root/{name}/blobs/{DIGEST}").status_code == 404
    from cgstore.repos.service import find_repo

    with store.context.db.session() as session:
        assert find_repo(session, "root", name) is None


def test_a_root_record_is_yanked_only_by_a_platform_admin(store, pt2_archive):
    """A store admin without the platform is refused like a root publish (audited), and the record stays live."""
    name = unique_repo("family")
    pub = publication(
        pt2_archive,
        archive_report(pt2_archive),
        components={"consts": safetensors_bytes(CONSTANTS_A)},
        envelope=unique_envelope(),
    )
    with store.client(store.mint("platform-ci", f"root/{name}:read,write", platform=True)) as client:
        assert publish_record(client, "root", name, pub).status_code == 201
    yank = {"reason": "a tenant admin cleaning up root"}
    with store.client(store.mint("ops", "*/*:admin")) as client:
        refused = client.post(f"{pub.path('root', name)}:yank", json=yank)
    assert refused.status_code == 403 and code(refused) == "ROOT_RESERVED"
    assert refused.json()["error"]["detail"]["missing"] == [LOCK_GRANT, LOCK_PLT, LOCK_PLATFORM]
    assert audited(store, "ROOT_RESERVED", target=f"root/{name}")
    reader = store.mint("reader", "acme/x:read")
    with store.client(reader) as client:
        assert client.get(pub.path("root", name)).json()["yank"] is None
    platform_admin = store.mint("platform-ops", "*/*:admin", f"root/{name}:read,write", platform=True)
    with store.client(platform_admin) as client:
        yanked = client.post(f"{pub.path('root', name)}:yank", json=yank)
    assert yanked.status_code == 200, yanked.text
    assert (yanked.json()["repo"], yanked.json()["key"]) == (f"root/{name}", pub.key)
    with store.client(reader) as client:
        assert client.get(pub.path("root", name)).status_code == 404
