"""Publishing compiled graphs (docs/protocol.md "Compiled graphs"): admission, write-once keys, audit, metrics.

Every test runs on both configurations with real archives compiled by torch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from cgstore.audit.models import AuditEvent
from cgstore.compiled_graphs.models import CompiledGraph
from cgstore.repos.models import Repo
from cgstore_client.receipts import verify_receipt
from cgstore_client.wire.records import PublishAnswer, Record
from tests.compiled_graphs.support import (
    error_code,
    publication,
    publish,
)
from tests.hostile.corpus import rewrite
from tests.support.archives import archive_report
from tests.support.live_store import unique_repo


@pytest.fixture
def tenant(store):
    name = unique_repo()
    return name, store.mint("minter", f"acme/{name}:read,write")


def live_rows(store, repo: str, key: str) -> int:
    """Live records of ``key`` in ``acme/<repo>``, counted in the database."""
    with store.context.db.session() as session:
        return session.scalar(
            select(func.count())
            .select_from(CompiledGraph)
            .join(Repo, Repo.id == CompiledGraph.repo_id)
            .where(Repo.owner == "acme", Repo.name == repo, CompiledGraph.key == key, CompiledGraph.yanked_at.is_(None))
        )


def test_publish_creates_the_record_and_get_returns_manifest_and_derived_facts(
    store, tenant, pt2_archive, report_a, constants_a
):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    with store.client(token) as client:
        created = publish(client, "acme", name, pub)
        assert created.status_code == 201, created.text
        answer = PublishAnswer.model_validate_json(created.content)
        assert (answer.status, answer.key, answer.repo) == ("created", pub.key, f"acme/{name}")
        assert answer.receipt and answer.receipt.count(".") == 2  # a compact JWS (tests/security/test_receipts.py)
        got = client.get(pub.path("acme", name))
    assert got.status_code == 200, got.text
    record = Record.model_validate_json(got.content)
    assert record.manifest.artifact.digest == pub.artifact.digest
    assert record.manifest.axes.graph == report_a.graph_digest
    assert record.manifest.axes.toolchain.recorded == {"diffusers": "0.35.1"}
    assert record.input_contract == report_a.input_contract
    assert record.publisher.principal == "minter" and record.publisher.jti
    assert record.manifest.evidence.mint_phases == {"compile_s": "19.4"}
    assert record.manifest.layout.display == "tiny.diffusers@1+cozy.fp8-rowwise@1"
    sources = {row.fqn: row.source for row in record.binding_table}
    assert sources == {
        "lin.weight": "checkpoint",
        "lin.bias": "checkpoint",
        "scale": "checkpoint",
        "table": "component:consts",
        "lifted_tensor_0": "component:consts",
    }
    assert [c.name for c in record.manifest.components] == ["consts"]


def test_republishing_the_same_bytes_is_200_and_a_second_mint_is_byte_identical(
    store, tenant, pt2_archive, pt2_archive_second_mint, report_a, constants_a
):
    name, token = tenant
    first = publication(pt2_archive, report_a, components={"consts": constants_a})
    again = publication(
        pt2_archive_second_mint, archive_report(pt2_archive_second_mint), components={"consts": constants_a}
    )
    assert again.key == first.key and again.artifact.digest == first.artifact.digest
    with store.client(token) as client:
        assert publish(client, "acme", name, first).status_code == 201
        repeat = publish(client, "acme", name, again)
    assert repeat.status_code == 200, repeat.text
    assert repeat.json()["status"] == "exists"
    assert live_rows(store, name, first.key) == 1


def test_different_bytes_under_a_live_key_is_409_naming_both_digests_and_audited(
    store, tenant, pt2_archive, report_a, constants_a
):
    name, token = tenant
    first = publication(pt2_archive, report_a, components={"consts": constants_a})
    # Same key, other bytes: the same program repackaged (an entry added under extra/).
    other_path = rewrite(pt2_archive, Path(store.settings.home) / "other.pt2", add=[("archive/extra/note.txt", b"x")])
    other = publication(other_path, archive_report(other_path), components={"consts": constants_a})
    assert other.key == first.key and other.artifact.digest != first.artifact.digest
    with store.client(token) as client:
        assert publish(client, "acme", name, first).status_code == 201
        conflict = publish(client, "acme", name, other)
    assert conflict.status_code == 409
    body = conflict.json()["error"]
    assert body["code"] == "KEY_CONFLICT"
    assert body["detail"]["live"]["artifact"] == first.artifact.digest
    assert body["detail"]["offered"]["artifact"] == other.artifact.digest
    assert live_rows(store, name, first.key) == 1
    with store.context.db.session() as session:
        outcomes = session.scalars(
            select(AuditEvent.outcome).where(AuditEvent.target == f"acme/{name}:{first.key}").order_by(AuditEvent.id)
        ).all()
    assert outcomes == ["ok", "KEY_CONFLICT"]


def test_same_artifact_with_another_component_set_is_a_conflict(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    first = publication(pt2_archive, report_a, components={"consts": constants_a})
    renamed = publication(pt2_archive, report_a, components={"consts-v2": constants_a})
    with store.client(token) as client:
        assert publish(client, "acme", name, first).status_code == 201
        conflict = publish(client, "acme", name, renamed)
    assert conflict.status_code == 409 and error_code(conflict) == "KEY_CONFLICT"


def test_one_component_shared_by_many_records_is_stored_once(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    first = publication(pt2_archive, report_a, components={"consts": constants_a})
    second = publication(
        pt2_archive, report_a, components={"consts": constants_a}, envelope={"shapes": [[512, 512]], "text_len": 0}
    )
    assert first.key != second.key
    with store.client(token) as client:
        assert publish(client, "acme", name, first).status_code == 201
        assert publish(client, "acme", name, second).status_code == 201
        first_record = client.get(first.path("acme", name)).json()
        second_record = client.get(second.path("acme", name)).json()
    assert first_record["manifest"]["components"] == second_record["manifest"]["components"]
    assert store.context.storage.size(first.components["consts"].digest) == len(constants_a)


def test_publish_outcomes_are_counted(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    with store.client(token) as client:
        publish(client, "acme", name, pub)
        publish(client, "acme", name, pub)
        publish(client, "acme", name, publication(pt2_archive, report_a, kind="torch-inductor-cache"))
        metrics = client.get("/metrics", headers=store.metrics_headers()).text
    assert 'cgstore_publish_total{code="",outcome="created"}' in metrics
    assert 'cgstore_publish_total{code="",outcome="exists"}' in metrics
    assert 'cgstore_publish_total{code="KIND_RETIRED",outcome="refused"}' in metrics


def test_a_re_publish_signs_a_receipt_for_a_record_published_before_receipts(
    store, tenant, pt2_archive, report_a, constants_a
):
    """Revision 0007 leaves older records without one; their next idempotent publish vouches for them."""
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    with store.client(token) as client:
        first = publish(client, "acme", name, pub)
        assert first.status_code == 201, first.text
        with store.context.db.session() as session:
            session.execute(
                update(CompiledGraph)
                .where(
                    CompiledGraph.key == pub.key,
                    CompiledGraph.repo_id.in_(select(Repo.id).where(Repo.owner == "acme", Repo.name == name)),
                )
                .values(receipt=None)
            )
        assert client.get(pub.path("acme", name)).json()["receipt"] is None
        again = client.put(pub.path("acme", name), json=pub.manifest)
        assert again.status_code == 200, again.text
        receipt = again.json()["receipt"]
        jwks = client.get("/v1/keys").json()
        claims = verify_receipt(
            receipt,
            jwks,
            expect_key=pub.key,
            expect_artifact=pub.artifact.digest,
            expect_components={"consts": pub.components["consts"].digest},
            expect_repo=f"acme/{name}",
        )
        assert claims["publisher"] == "minter"
        assert client.get(pub.path("acme", name)).json()["receipt"] == receipt  # kept
