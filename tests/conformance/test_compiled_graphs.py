"""Conformance: publish admission, write-once keys, resolve and its misses, the root gates.

Real ``.pt2`` archives (``tests/support/archives.py``, built once and cached)
are published over HTTP only; every refusal is checked by its protocol code.
"""

from __future__ import annotations

import pytest

from tests.compiled_graphs.support import CONSTANTS_A, FAMILY, publication, publish, safetensors_bytes, upload_all
from tests.conformance.conftest import unique
from tests.hostile.corpus import rewrite
from tests.support.archives import archive_report

pytestmark = pytest.mark.torch


@pytest.fixture
def tenant(deployment):
    owner = unique("conf")
    token = deployment.mint(f"{owner}-mint", f"{owner}/*:read,write")
    with deployment.client(token) as client:
        yield owner, client


@pytest.fixture(scope="session")
def pub(pt2_archive):
    return publication(pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)})


def _code(answer, status: int) -> str:
    assert answer.status_code == status, answer.text
    return answer.json()["error"]["code"]


def test_publish_is_write_once(tenant, pub, pt2_archive, tmp_path):
    owner, client = tenant
    assert publish(client, owner, "graphs", pub).status_code == 201
    again = client.put(pub.path(owner, "graphs"), json=pub.manifest)
    assert again.status_code == 200, again.text  # the same artifact and components: idempotent
    # Another artifact of the same program (same key), repackaged: a non-reproducible mint.
    variant = rewrite(pt2_archive, tmp_path / "variant.pt2", add=[("archive/extra/other-mint.txt", b"x")])
    other = publication(variant, archive_report(variant), components={"consts": safetensors_bytes(CONSTANTS_A)})
    assert other.key == pub.key and other.artifact.digest != pub.artifact.digest
    conflict = publish(client, owner, "graphs", other)
    assert _code(conflict, 409) == "KEY_CONFLICT"
    assert client.get(pub.path(owner, "graphs")).json()["manifest"]["artifact"]["digest"] == pub.artifact.digest


@pytest.mark.parametrize(
    ("change", "status", "code"),
    [
        ({"kind": "torch-inductor-cache"}, 422, "KIND_RETIRED"),
        ({"kind": "onnx"}, 422, "KIND_UNSUPPORTED"),
        ({"envelope": {"shapes": [[1024, 1024]], "guidance": [3.5]}}, 422, "ENVELOPE_INVALID"),
        ({"graph": "blake3:" + "0" * 64}, 422, "GRAPH_MISMATCH"),
    ],
)
def test_admission_refusals(tenant, pt2_archive, change, status, code):
    owner, client = tenant
    refused = publication(
        pt2_archive, archive_report(pt2_archive), components={"consts": safetensors_bytes(CONSTANTS_A)}, **change
    )
    answer = publish(client, owner, "admission", refused)
    assert _code(answer, status) == code


def test_a_key_not_derived_from_the_axes(tenant, pub):
    owner, client = tenant
    upload_all(client, owner, "keys", pub)
    other_key = "ck1-" + "1" * 56
    answer = client.put(f"/v1/repos/{owner}/keys/compiled-graphs/{other_key}", json=pub.manifest)
    assert _code(answer, 400) in ("KEY_MISMATCH", "KEY_INVALID")


def test_resolve_answers_in_order_and_misses_look_alike(deployment, tenant, pub):
    owner, client = tenant
    assert publish(client, owner, "resolve", pub).status_code == 201
    absent = "ck1-" + "2" * 56
    answer = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key, absent, pub.key]})
    assert answer.status_code == 200, answer.text
    statuses = [entry["status"] for entry in answer.json()["answers"]]
    assert statuses == ["hit", "miss", "hit"]
    # A tenant who cannot read that repo gets the same miss as for a key nobody published.
    stranger = unique("conf")
    with deployment.client(deployment.mint(f"{stranger}-r", f"{stranger}/*:read")) as other:
        hidden = other.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [pub.key]})
        nothing = other.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [absent]})
    assert hidden.json()["answers"][0] == {**nothing.json()["answers"][0], "key": pub.key}
    too_many = client.post("/v1/compiled-graphs:resolve", json={"family": FAMILY, "keys": [absent] * 257})
    assert too_many.status_code == 400


def test_the_root_gates_answer_before_a_mint_compiles(deployment):
    repo = unique("r")
    tenant = deployment.mint(unique("conf-tenant"), "*/*:read,write")
    literal = deployment.mint(unique("conf-tenant"), "root/*:read,write")
    platform = deployment.mint(unique("conf-platform"), "root/*:read,write", platform=True)
    for token in (tenant, literal):
        with deployment.client(token) as client:
            assert _code(client.post(f"/v1/repos/root/{repo}/preflight"), 403) == "ROOT_RESERVED"
    with deployment.client(platform) as client:
        assert client.post(f"/v1/repos/root/{repo}/preflight").status_code == 204
        soon = client.post(f"/v1/repos/root/{repo}/preflight", params={"min_ttl_s": 7200})
        assert _code(soon, 403) == "DENIED"  # the token expires before a long mint would finish
