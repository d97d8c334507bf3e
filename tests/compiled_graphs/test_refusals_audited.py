"""Refused publishes (400/422 for what they sent) are audited: actor, jti, key and code; repeats are bounded."""

from __future__ import annotations

import pytest

from cgstore.audit.models import AuditEvent
from cgstore_client.keys import Envelope, Toolchain, ck1
from tests.audit.conftest import rows
from tests.compiled_graphs.support import TOOLCHAIN, error_code, publication, publish
from tests.support.live_store import CONFIGURATIONS, unique_repo


def _mismatched(pt2_archive, report_a, constants_a):
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    pub.key = ck1(report_a.graph_digest, Envelope(shapes=[(1, 1)], text_len=1), report_a.sm, Toolchain(TOOLCHAIN))
    return pub


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_refused_publishes_are_audited_and_repeats_counted(
    make_store, configuration, pt2_archive, report_a, constants_a
):
    # One audit interval for the whole test: a periodic flush in between would start a new
    # interval, and the next repeat would rightly get a row of its own again.
    store = make_store(configuration, audit_interval_s=3600)
    name, actor = unique_repo(), unique_repo("refuser")
    token = store.mint(actor, f"acme/{name}:read,write")
    mismatched = _mismatched(pt2_archive, report_a, constants_a)
    bad_lane = publication(pt2_archive, report_a, components={"consts": constants_a}, lane="fastest")
    with store.client(token) as client:
        for _ in range(5):
            answer = publish(client, "acme", name, mismatched)
            assert (answer.status_code, error_code(answer)) == (400, "KEY_MISMATCH")
        answer = publish(client, "acme", name, bad_lane)
        assert (answer.status_code, error_code(answer)) == (422, "METADATA_INVALID")

    own = rows(store, AuditEvent.actor == actor, AuditEvent.action == "compiled_graph.publish")
    assert sorted(row.outcome for row in own) == ["KEY_MISMATCH", "METADATA_INVALID"]
    first = next(row for row in own if row.outcome == "KEY_MISMATCH")
    assert first.jti and first.repo == f"acme/{name}" and mismatched.key in first.target

    store.context.denials.flush()
    everything = rows(store, AuditEvent.actor == actor, AuditEvent.outcome != "ok")  # its uploads were ok
    # Five identical refusals: one row of their own, the four repeats in one counted row.
    assert len([row for row in everything if row.outcome == "KEY_MISMATCH"]) == 2
    assert len(everything) == 3
