"""Helpers of the claims tests: declarations nobody else claims, calls of the three routes, answers checked
against the wire types."""

from __future__ import annotations

import httpx
from pydantic import TypeAdapter

from cgstore_client.wire.fleet import ClaimAnswer, ClaimHeartbeat, ClaimReleased
from tests.compiled_graphs.support import FAMILY, RECORDED, TOOLCHAIN, unique_envelope
from tests.compiled_graphs.test_discover import declaration

ANSWER = TypeAdapter(ClaimAnswer)
SM = "sm_90"


def fresh_declaration(**overrides) -> dict:
    """A declaration (an envelope) no other test uses: its claims are this test's alone."""
    body = {
        "family": FAMILY,
        "envelope": unique_envelope(),
        "sm": SM,
        "toolchain": {"components": TOOLCHAIN, "recorded": RECORDED},
    }
    body.update(overrides)
    return body


#: The declaration a worker booting a publication's model states: discover's test helper, one definition.
of_publication = declaration


def post_claim(client: httpx.Client, owner: str, repo: str, declaration: dict) -> httpx.Response:
    return client.post(f"/v1/repos/{owner}/{repo}/compiled-graphs:claim", json=declaration)


def claim(client: httpx.Client, owner: str, repo: str, declaration: dict):
    """The claim's answer, validated: exactly the wire type's bytes, 201 for granted and 200 otherwise."""
    response = post_claim(client, owner, repo, declaration)
    assert response.status_code in (200, 201), response.text
    answer = ANSWER.validate_json(response.content)
    assert response.content == ANSWER.dump_json(answer)
    assert response.status_code == (201 if answer.state == "granted" else 200)
    return answer


def beat(client: httpx.Client, owner: str, repo: str, claim_id: str) -> httpx.Response:
    response = client.post(f"/v1/repos/{owner}/{repo}/compiled-graphs/claims/{claim_id}:heartbeat")
    if response.status_code == 200:
        ClaimHeartbeat.model_validate_json(response.content)
    return response


def release(client: httpx.Client, owner: str, repo: str, claim_id: str, body: dict) -> httpx.Response:
    response = client.post(f"/v1/repos/{owner}/{repo}/compiled-graphs/claims/{claim_id}:release", json=body)
    if response.status_code == 200:
        assert ClaimReleased.model_validate_json(response.content).outcome == body["outcome"]
    return response
