"""The whole admission table of docs/protocol.md, each code triggered by a real bad input, on both configurations.

Every bad archive is archive A (compiled by torch) with one thing wrong; after
every refusal the key has no record.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from cgstore_client.keys import Envelope, Toolchain, ck1
from tests.compiled_graphs.support import (
    RECORDED,
    TOOLCHAIN,
    error_code,
    publication,
    publish,
    safetensors_bytes,
    upload,
)
from tests.hostile.corpus import rewrite
from tests.support.live_store import unique_repo

METADATA = "archive/extra/metadata.json"


@pytest.fixture
def tenant(store):
    name = unique_repo()
    return name, store.mint("minter", f"acme/{name}:read,write")


@pytest.fixture
def scratch(store, tmp_path) -> Path:
    return tmp_path


def refused(store, token: str, name: str, pub, *, status: int, code: str, send_blobs: bool = True) -> dict:
    """Publish ``pub``, expect the refusal, check nothing became visible, return the error body."""
    with store.client(token) as client:
        response = publish(client, "acme", name, pub, send_blobs=send_blobs)
        assert (response.status_code, error_code(response)) == (status, code), response.text
        if pub.key.startswith("ck1-"):
            assert client.get(pub.path("acme", name)).status_code == 404
    return response.json()["error"]


def test_write_permission_comes_first(store, tenant, pt2_archive, report_a, constants_a):
    name, _ = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, kind="torch-inductor-cache")
    reader = store.mint("reader", f"acme/{name}:read")
    with store.client(reader) as client:
        denied = client.put(pub.path("acme", name), json=pub.manifest)
    assert denied.status_code == 403 and error_code(denied) == "DENIED"
    tenant_on_root = store.mint("tenant", "root/family:read,write")
    with store.client(tenant_on_root) as client:
        root = client.put(pub.path("root", "family"), json=pub.manifest)
    assert root.status_code == 403 and error_code(root) == "ROOT_RESERVED"
    with store.client() as client:
        anonymous = client.put(pub.path("acme", name), json=pub.manifest)
    assert anonymous.status_code == 401 and error_code(anonymous) == "UNAUTHORIZED"


def test_key_grammar(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    pub.key = "Not_A_Key"
    refused(store, token, name, pub, status=400, code="KEY_INVALID")


def test_a_key_not_derived_from_the_axes(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    derived = pub.key
    pub.key = ck1(report_a.graph_digest, Envelope(shapes=[(1, 1)], text_len=1), report_a.sm, Toolchain(TOOLCHAIN))
    error = refused(store, token, name, pub, status=400, code="KEY_MISMATCH")
    assert error["detail"]["derived"] == derived


def test_a_keyed_component_smuggled_as_recorded_is_still_keyed(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    # The mint child derives its key with triton keyed; moving triton to "recorded" cannot unkey it.
    pub.manifest["axes"]["toolchain"] = {"components": {"torch": "2.13.0"}, "recorded": {"triton": "3.6.0", **RECORDED}}
    with store.client(tenant[1]) as client:
        assert publish(client, "acme", name, pub).status_code == 201


def test_the_retired_kind_is_refused_by_name(store, tenant, pt2_archive, report_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, kind="torch-inductor-cache")
    error = refused(store, token, name, pub, status=422, code="KIND_RETIRED", send_blobs=False)
    assert "torch-inductor-cache" in error["message"]


@pytest.mark.parametrize("field,value", [("kind", "onnx"), ("format", "zip")])
def test_other_kinds_and_formats_are_unsupported(store, tenant, pt2_archive, report_a, field, value):
    name, token = tenant
    pub = publication(pt2_archive, report_a, **{field: value})
    refused(store, token, name, pub, status=422, code="KIND_UNSUPPORTED", send_blobs=False)


def test_an_envelope_without_text_len(store, tenant, pt2_archive, report_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, envelope={"shapes": [[1024, 1024]], "guidance": [3.5]})
    error = refused(store, token, name, pub, status=422, code="ENVELOPE_INVALID", send_blobs=False)
    assert "text_len" in error["message"]


def test_blobs_not_in_the_repo(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    error = refused(store, token, name, pub, status=400, code="BLOB_UNKNOWN", send_blobs=False)
    assert set(error["detail"]["missing"]) == {pub.artifact.digest, pub.components["consts"].digest}
    # Bytes in another repo grant nothing here.
    other = unique_repo()
    other_token = store.mint("minter", f"acme/{other}:read,write", f"acme/{name}:read,write")
    with store.client(other_token) as client:
        upload(client, "acme", other, pub.artifact)
        upload(client, "acme", other, pub.components["consts"])
    refused(store, token, name, pub, status=400, code="BLOB_UNKNOWN", send_blobs=False)


def test_a_size_that_is_not_the_blobs(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a})
    pub.manifest["artifact"]["size"] += 1
    refused(store, token, name, pub, status=400, code="SIZE_INVALID")


def spooled(store) -> list[Path]:
    """Admission's temp copies of archives still on disk (in this store's private spool)."""
    return sorted(store.settings.spool_dir.glob("cgstore-admit-*"))


def test_an_archive_carrying_weights_is_refused_naming_the_entry(store, tenant, pt2_archive, report_a, scratch):
    name, token = tenant
    heavy = rewrite(pt2_archive, scratch / "weights.pt2", add=[("archive/data/weights/lin.weight", b"\0" * 128)])
    pub = publication(heavy, report_a)
    before = spooled(store)
    error = refused(store, token, name, pub, status=422, code="ARTIFACT_INVALID")
    assert "data/weights/lin.weight" in error["message"]
    assert store.settings.spool_dir.is_dir()  # admission spooled here
    assert spooled(store) == before  # the spooled copy is removed whatever the outcome


def test_an_archive_carrying_pickled_sample_inputs_is_refused(store, tenant, pt2_archive, report_a, scratch):
    name, token = tenant
    pickled = rewrite(
        pt2_archive, scratch / "pickled.pt2", add=[("archive/data/sample_inputs/model.pt", b"\x80\x04N.")]
    )
    error = refused(store, token, name, publication(pickled, report_a), status=422, code="ARTIFACT_INVALID")
    assert "sample_inputs" in error["message"]


def test_bytes_that_are_not_an_archive(store, tenant, pt2_archive, report_a, scratch):
    name, token = tenant
    junk = scratch / "junk.pt2"
    junk.write_bytes(b"definitely not a zip" * 100)
    refused(store, token, name, publication(junk, report_a), status=422, code="KIND_UNSUPPORTED")


def test_a_claimed_graph_digest_that_is_not_the_archives(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    claimed = "blake3:" + "ab" * 32
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, graph=claimed)
    error = refused(store, token, name, pub, status=422, code="GRAPH_MISMATCH")
    assert error["detail"] == {"claimed": claimed, "measured": report_a.graph_digest}


def test_a_declared_input_contract_that_differs(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    declared = json.loads(json.dumps(report_a.input_contract))
    declared["dims"]["s0"]["max"] = 128
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, input_contract=declared)
    error = refused(store, token, name, pub, status=422, code="CONTRACT_MISMATCH")
    assert error["detail"]["derived"] == report_a.input_contract
    # The derived contract itself, declared, is admitted.
    pub.manifest["input_contract"] = report_a.input_contract
    with store.client(token) as client:
        assert client.put(pub.path("acme", name), json=pub.manifest).status_code == 201


def test_device_facts_against_sm(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, sm="sm_90")
    error = refused(store, token, name, pub, status=422, code="SM_MISMATCH")
    assert error["detail"] == {"measured": report_a.sm, "claimed": "sm_90"}


def test_metadata_with_a_wall_clock(store, tenant, pt2_archive, report_a, constants_a, scratch):
    name, token = tenant
    with zipfile.ZipFile(pt2_archive) as archive:
        metadata = json.loads(archive.read(METADATA))
    metadata["minted_at"] = "2026-12-03T06:00:00Z"
    clocked = rewrite(pt2_archive, scratch / "clock.pt2", replace={METADATA: json.dumps(metadata).encode()})
    pub = publication(clocked, report_a, components={"consts": constants_a})
    error = refused(store, token, name, pub, status=422, code="METADATA_INVALID")
    assert "minted_at" in error["message"]


def test_a_malformed_lane(store, tenant, pt2_archive, report_a, constants_a):
    name, token = tenant
    pub = publication(pt2_archive, report_a, components={"consts": constants_a}, lane="fastest")
    refused(store, token, name, pub, status=422, code="METADATA_INVALID")


def test_constants_in_neither_checkpoint_nor_component_are_refused_by_name(store, tenant, pt2_archive, report_a):
    name, token = tenant
    # Archive A has a lifted tensor literal and a non-persistent buffer: neither is in the state_dict.
    error = refused(store, token, name, publication(pt2_archive, report_a), status=422, code="ARTIFACT_INVALID")
    assert error["detail"]["constants"] == ["table", "lifted_tensor_0"]
    half = safetensors_bytes({"table": ("F32", [3])})
    error = refused(
        store,
        token,
        name,
        publication(pt2_archive, report_a, components={"half": half}),
        status=422,
        code="ARTIFACT_INVALID",
    )
    assert error["detail"]["constants"] == ["lifted_tensor_0"]


def test_a_component_whose_tensor_has_the_wrong_shape(store, tenant, pt2_archive, report_a):
    name, token = tenant
    wrong = safetensors_bytes({"table": ("F32", [4]), "lifted_tensor_0": ("F32", [4])})
    error = refused(
        store,
        token,
        name,
        publication(pt2_archive, report_a, components={"consts": wrong}),
        status=422,
        code="CONTRACT_MISMATCH",
    )
    assert error["detail"]["tensor"] == "table" and error["detail"]["declared"] == {"dtype": "float32", "shape": [3]}


def test_a_component_tensor_that_is_no_constant_or_has_another_dtype(store, tenant, pt2_archive, report_a):
    name, token = tenant
    stranger = safetensors_bytes({"table": ("F32", [3]), "lifted_tensor_0": ("F32", [4]), "pos_table": ("F32", [2])})
    error = refused(
        store,
        token,
        name,
        publication(pt2_archive, report_a, components={"consts": stranger}),
        status=422,
        code="CONTRACT_MISMATCH",
    )
    assert error["detail"]["tensor"] == "pos_table"
    halved = safetensors_bytes({"table": ("F16", [3]), "lifted_tensor_0": ("F32", [4])})
    error = refused(
        store,
        token,
        name,
        publication(pt2_archive, report_a, components={"consts": halved}),
        status=422,
        code="CONTRACT_MISMATCH",
    )
    assert error["detail"]["tensor"] == "table"


@pytest.mark.parametrize(
    "component",
    [
        b"\xff" * 8 + b"{}",  # header length past the blob
        (12).to_bytes(8, "little") + b'{"a": [1, 2]}'[:12],  # header not a tensor table
        (2).to_bytes(8, "little") + b"{}" + b"trailing bytes",  # data no tensor covers
        b"\x80\x04\x95" + b"pickle!" * 4,  # a pickle, never unpickled
    ],
    ids=["length-past-end", "not-a-table", "uncovered-bytes", "pickle"],
)
def test_a_component_that_is_not_safetensors(store, tenant, pt2_archive, report_a, component):
    name, token = tenant
    error = refused(
        store,
        token,
        name,
        publication(pt2_archive, report_a, components={"consts": component}),
        status=422,
        code="ARTIFACT_INVALID",
    )
    assert error["detail"]["component"] == "consts"


def test_admission_order_kind_before_blobs(store, tenant, pt2_archive, report_a):
    name, token = tenant
    # Both a retired kind and absent blobs: the kind answers first.
    pub = publication(pt2_archive, report_a, kind="torch-inductor-cache")
    refused(store, token, name, pub, status=422, code="KIND_RETIRED", send_blobs=False)


def test_a_malformed_manifest_is_400_never_500(store, tenant):
    name, token = tenant
    with store.client(token) as client:
        for body in ({}, {"kind": 1}, [], "x"):
            response = client.put(f"/v1/repos/acme/{name}/compiled-graphs/ck1-{'0' * 56}", json=body)
            assert response.status_code == 400 and error_code(response) == "BAD_REQUEST"
        broken = client.put(f"/v1/repos/acme/{name}/compiled-graphs/ck1-{'0' * 56}", content=b"{not json")
        assert broken.status_code == 400


# -- a promise the graph cannot keep (issue 25 §4) ------------------------------------------


@pytest.mark.parametrize(
    ("envelope", "axis", "said"),
    [
        (
            {"shapes": [[64, 64]], "text_len": 0, "batch_sizes": [1, 65]},
            "batch_sizes",
            "envelope batch_sizes declares 65, which the graph cannot take: input inputs_x dim 0 is s0 in [1, 64]",
        ),
    ],
)
def test_an_envelope_beyond_the_contract_is_refused_naming_the_axis(
    store, tenant, pt2_archive, constants_a, envelope, axis, said
):
    from tests.support.archives import archive_report

    name, token = tenant
    pub = publication(pt2_archive, archive_report(pt2_archive), components={"consts": constants_a}, envelope=envelope)
    with store.client(token) as client:
        refused = publish(client, "acme", name, pub)
        assert client.get(pub.path("acme", name)).status_code == 404
    body = refused.json()["error"]
    assert (refused.status_code, body["code"], body["detail"]["axis"]) == (422, "ENVELOPE_INVALID", axis)
    assert body["message"] == said


def test_token_ids_fix_batch_and_text_len(store, tenant, pt2_archive_tied):
    """The tied LM takes ids of batch 2 and 4 tokens (static): batch 1 or 5 tokens is refused, 2 and 4 admitted."""
    from cgstore_client.mint import derived_constants_path
    from tests.support.archives import archive_report

    name, token = tenant
    report = archive_report(pt2_archive_tied)
    consts = {"consts": Path(derived_constants_path(pt2_archive_tied)).read_bytes()}
    base = {"shapes": [[1, 1]], "text_len": 4, "batch_sizes": [2]}
    cases = [({**base, "batch_sizes": [1, 2]}, "batch_sizes"), ({**base, "text_len": 5}, "text_len"), (base, None)]
    with store.client(token) as client:
        for envelope, axis in cases:
            answer = publish(
                client, "acme", name, publication(pt2_archive_tied, report, components=consts, envelope=envelope)
            )
            if axis is None:
                assert answer.status_code == 201, answer.text
            else:
                assert (answer.status_code, error_code(answer)) == (422, "ENVELOPE_INVALID"), envelope
                assert answer.json()["error"]["detail"]["axis"] == axis and "input ids dim" in answer.text
