"""Workers behind a mirror that miss mint at the upstream, once, and serve the record through their mirror.

Issue 27 §1: a mirror refuses writes, so a worker minting on a miss claims and publishes at the
upstream (``CGSTORE_WRITE_URL`` / ``CGSTORE_WRITE_TOKEN``: one compile per declaration across regions)
and picks the record up through its mirror within seconds of the publish. The workers are real
processes (``tests/fleet/worker.py``), their mint child too; its compile comes from the fleet tests'
memo (``tests/fleet/memo.py``): what is tested here is where each request goes, not AOTInductor.
One configuration, production (PostgreSQL + RGW) on both sides: the mirror's two configurations are
covered by the other tests of this directory, and each fleet costs a minute of this machine.
"""

from __future__ import annotations

import pytest

from tests.fleet import memo
from tests.fleet.test_fleet import EVENTS_WAIT_S, FLEET_SLACK_S, MINT_BOUND_S, Fleet, compiled, logged_at, reason

pytestmark = pytest.mark.torch


def test_workers_behind_a_mirror_mint_once_at_the_upstream_and_serve_through_the_mirror(
    upstream, make_mirror, pt2_archive, tmp_path
):
    mirror = make_mirror("production", mirror_follow_wait_s=EVENTS_WAIT_S)
    compile_memo = tmp_path / "compile-memo"
    memo.seed(compile_memo, pt2_archive)
    (tmp_path / "fleet").mkdir()
    fleet = Fleet(mirror.live, tmp_path / "fleet", compile_memo=compile_memo)
    # Reads (and the events feed) at the mirror with a mirror token; writes at the upstream with its own.
    fleet.env["CGSTORE_TOKEN"] = mirror.live.mint("fleet-workers", f"{fleet.repo}:read")
    fleet.env["CGSTORE_WRITE_URL"] = upstream.base_url
    fleet.env["CGSTORE_WRITE_TOKEN"] = upstream.live.mint("fleet-mint", f"{fleet.repo}:read,write")
    try:
        workers = fleet.start(2)
        served = [worker.first(compiled, MINT_BOUND_S) for worker in workers]
        assert all(served), [w.lines for w in workers]
        (log,) = fleet.mint_logs()  # one claim granted (at the upstream), one compile
        published_at = logged_at(log, "published ")
        assert published_at is not None, log
        assert max(line["t"] for line in served) <= published_at + FLEET_SLACK_S, [
            line["t"] - published_at for line in served
        ]
        assert all(line["equal"] for line in served)
        assert any(w.first(lambda line: reason(line).startswith("minting here (claim ")) for w in workers)
        # The record was admitted by the upstream and pulled by the mirror, with the upstream's receipt.
        with upstream.live.client(upstream.publisher) as client:
            at_upstream = client.get(f"/v1/repos/{fleet.repo}/compiled-graphs", params={"family": fleet.family})
        assert at_upstream.status_code == 200, at_upstream.text
        (record,) = at_upstream.json()["records"]
        assert {line["key"] for line in served} == {record["key"]}
        (mirrored,) = fleet.records()
        assert mirrored["receipt"] == record["receipt"]
        # The claim and the publish were the upstream's, under the write token's principal.
        assert _audited(upstream.live, upstream.admin, fleet.repo, "compiled_graph.claim.grant") == ["fleet-mint"]
        assert record["publisher"]["principal"] == "fleet-mint"
    finally:
        fleet.close()


def _audited(store, admin: str, repo: str, action: str) -> list[str]:
    """The actors of ``repo``'s ``action`` audit entries in ``store``."""
    with store.client(admin) as client:
        answer = client.get("/v1/audit", params={"repo": repo, "action": action})
    assert answer.status_code == 200, answer.text
    return [entry["actor"] for entry in answer.json()["entries"]]
