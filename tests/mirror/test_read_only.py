"""A mirror takes no writes (typed refusal naming its upstream), and its upstream token appears in no answer,
log line, metric, audit entry, state row or console page (issue 27 §1, §2)."""

from __future__ import annotations

import json
import logging

import httpx
from sqlalchemy import select

from cgstore.audit.models import AuditEvent
from cgstore.mirror.models import MirrorState
from tests.compiled_graphs.support import digest_of
from tests.mirror.support import MIRROR_FAMILY, OWNER, resolve
from tests.support.live_store import unique_repo


def test_mirror_tokens_cannot_write(upstream, mirror):
    repo = unique_repo("ro")
    pub = upstream.publish(repo)
    writer = mirror.live.mint("writer", f"{OWNER}/*:read,write,admin")
    base = f"/v1/repos/{OWNER}/{repo}"
    declaration = {"family": MIRROR_FAMILY, **{k: pub.manifest["axes"][k] for k in ("envelope", "sm", "toolchain")}}
    writes = [
        ("PUT", f"{base}/blobs/{pub.artifact.digest}", {"content": pub.artifact.data}),
        ("POST", f"{base}/uploads", {}),
        ("POST", f"{base}/blobs:missing", {"json": {"digests": [pub.artifact.digest]}}),
        ("PUT", pub.path(OWNER, repo), {"json": pub.manifest}),
        ("POST", f"{pub.path(OWNER, repo)}:yank", {"json": {"reason": "no"}}),
        ("POST", f"{base}/compiled-graphs:claim", {"json": declaration}),
        ("PUT", base, {"json": {"visibility": "principal"}}),
        ("POST", f"{base}/preflight", {}),
        ("POST", "/v1/owners", {"json": {"slug": "someone"}}),
    ]
    with mirror.live.client(writer) as client:
        for method, path, body in writes:
            answer = client.request(method, path, **body)
            assert answer.status_code == 403, (method, path, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "MIRROR_READ_ONLY", (method, path, error)
            assert error["detail"] == {"upstream": mirror.live.settings.upstream_url}
        # Reads still work, and nothing of the refused writes was kept.
        assert resolve(client, pub.key)["status"] == "hit"
        assert client.get(f"{base}/compiled-graphs").status_code == 200
    with mirror.live.context.db.session() as session:
        assert not session.scalars(select(AuditEvent).where(AuditEvent.action.like("blob.%"))).all()


def test_the_upstream_token_appears_in_no_answer_log_metric_audit_or_page(upstream, mirror, caplog):
    caplog.set_level(logging.DEBUG)
    token = mirror.upstream_token
    secrets = (token, token.rsplit(".", 1)[-1])
    seen: list[str] = []

    def keep(answer: httpx.Response) -> httpx.Response:
        seen.append(json.dumps(dict(answer.headers)) + answer.text)
        return answer

    repo = unique_repo("secret")
    pub = upstream.publish(repo)
    data = b"secret blob " * 100
    with upstream.live.client(upstream.publisher) as client:
        assert client.put(f"/v1/repos/{OWNER}/{repo}/blobs/{digest_of(data)}", content=data).status_code == 201
    admin = mirror.live.mint("mirror-admin", "*/*:admin")
    with mirror.live.client(mirror.worker) as client:
        keep(client.post("/v1/compiled-graphs:resolve", json={"family": MIRROR_FAMILY, "keys": [pub.key]}))
        keep(client.get(pub.path(OWNER, repo)))
        keep(client.get(f"/v1/repos/{OWNER}/{repo}/blobs/{digest_of(data)}"))
        keep(client.put(f"/v1/repos/{OWNER}/{repo}/blobs/{digest_of(data)}", content=data))
        mirror.proxy.cut()
        try:
            keep(
                client.post("/v1/compiled-graphs:resolve", json={"family": MIRROR_FAMILY, "keys": ["ck1-" + "5" * 56]})
            )
            keep(client.get(f"/v1/repos/{OWNER}/{repo}/compiled-graphs/ck1-{'6' * 56}"))
        finally:
            mirror.proxy.restore()
        keep(client.get("/v1/keys"))
    keep(httpx.get(f"{mirror.base_url}/healthz"))
    keep(httpx.get(f"{mirror.base_url}/v1/capabilities"))
    seen.append(mirror.live.scrape_metrics())
    with mirror.live.client(admin) as client:
        keep(client.get("/v1/audit", params={"limit": 500}))
    with httpx.Client(base_url=mirror.base_url, timeout=60) as console:
        assert console.post("/console/login", data={"token": admin}).status_code == 303
        for page in ("/console", "/console/storage", "/console/audit", "/console/records", "/console/tokens"):
            answer = keep(console.get(page))
            assert answer.status_code == 200, (page, answer.status_code)
    with mirror.live.context.db.session() as session:
        seen += [json.dumps(row.detail) + row.target for row in session.scalars(select(AuditEvent))]
        seen += [json.dumps(row.value) for row in session.scalars(select(MirrorState))]
    seen.append(repr(mirror.live.context.mirror.upstream) + repr(mirror.live.settings))
    seen.append(caplog.text)
    assert any("unavailable" in text for text in seen)  # the outage was seen and answered
    for secret in secrets:
        assert not [text[:200] for text in seen if secret in text]
