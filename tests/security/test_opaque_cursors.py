"""Listing cursors are opaque: they tell a tenant nothing of other tenants' records, and open only where handed out.

Record ids are global, so a listing's ``next_cursor`` used to be the last id of
the page: a tenant paging through its own records saw gaps where others had
published in between. Now it is the position sealed to the repo's listing
(``core.cursors``): not a number, different each time it is handed out, and a
cursor from another repo's listing, altered, cut or made up is 400
``BAD_REQUEST``. Both configurations (``store``).
"""

from __future__ import annotations

import pytest

from tests.compiled_graphs.support import CONSTANTS_A, publication, publish, safetensors_bytes
from tests.security.conftest import code
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo


@pytest.fixture
def repos(store, pt2_archive):
    """Two repos bob reads: ``paged`` with two of his records (so a first page of one has a cursor), and ``other``."""
    paged, other = unique_repo("paged"), unique_repo("other")
    bob = store.mint("bob", f"acme/{paged}:read,write", f"acme/{other}:read,write")
    report, consts = archive_report(pt2_archive), safetensors_bytes(CONSTANTS_A)
    with store.client(bob) as client:
        for width in (8, 16):
            pub = publication(
                pt2_archive, report, components={"consts": consts}, envelope={"shapes": [[width, 8]], "text_len": 0}
            )
            assert publish(client, "acme", paged, pub).status_code == 201
        assert publish(client, "acme", other, pub).status_code == 201
    return {"bob": bob, "paged": paged, "other": other}


def listing(client, name: str, **params):
    return client.get(f"/v1/repos/acme/{name}/compiled-graphs", params={"limit": 1, **params})


def test_a_cursor_is_no_record_id_and_differs_each_time(store, repos):
    with store.client(repos["bob"]) as client:
        first, again = listing(client, repos["paged"]).json(), listing(client, repos["paged"]).json()
        cursor = first["next_cursor"]
        assert cursor and not cursor.isdigit() and cursor != again["next_cursor"]
        # Either cursor opens the second page, which is the last.
        for handed_out in (cursor, again["next_cursor"]):
            second = listing(client, repos["paged"], cursor=handed_out)
            assert second.status_code == 200 and len(second.json()["records"]) == 1
            assert second.json()["next_cursor"] is None
            assert second.json()["records"] != first["records"]


def test_a_cursor_from_another_repo_or_altered_is_refused(store, repos):
    with store.client(repos["bob"]) as client:
        cursor = listing(client, repos["paged"]).json()["next_cursor"]
        flipped = cursor[:10] + ("A" if cursor[10] != "A" else "B") + cursor[11:]
        for name, bad in (
            (repos["other"], cursor),
            (repos["paged"], flipped),
            (repos["paged"], cursor[:-1]),
            (repos["paged"], cursor + "A"),
            (repos["paged"], "1"),
            (repos["paged"], "é" * 48),
        ):
            answer = listing(client, name, cursor=bad)
            assert answer.status_code == 400 and code(answer) == "BAD_REQUEST", (name, bad, answer.text)
