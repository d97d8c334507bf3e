"""A publish receipt presented as a bearer token: 401 ``TOKEN_INVALID`` and audited (both configurations).

The receipt is signed by the store's own key ring with a valid ``kid``, so
only its ``typ`` keeps it from authenticating; the refusal must say so.
"""

from __future__ import annotations

from tests.compiled_graphs.support import CONSTANTS_A, publication, publish, safetensors_bytes
from tests.security.conftest import code
from tests.support.archives import archive_report
from tests.support.audit import audited, flush_denials
from tests.support.live_store import unique_repo


def test_a_receipt_presented_as_a_token_is_refused_and_audited(store, pt2_archive):
    name = unique_repo("rcpt-bearer")
    token = store.mint("minter", f"acme/{name}:read,write")
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})
    with store.client(token) as client:
        receipt = publish(client, "acme", name, pub).json()["receipt"]
    flush_denials(store)
    with store.client(receipt) as client:
        answer = client.get(pub.path("acme", name))
    assert answer.status_code == 401, answer.text
    assert code(answer) == "TOKEN_INVALID"
    assert "receipt is not a cap-token" in answer.json()["error"]["message"]
    assert answer.headers["www-authenticate"].startswith("Bearer")
    assert audited(store, "TOKEN_INVALID", target=name), "the refusal was not audited"
