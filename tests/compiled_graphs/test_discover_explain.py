"""A miss explains itself (issues 25 §2, 26 §4): five causes, five answers, from readable records only.

On both configurations: discover with ``explain`` answers, when nothing
matches, how many live records the family has in the repos searched and which
axes of the nearest differ, with both values; never counting, naming or
suggesting what the caller may not read.
"""

from __future__ import annotations

import uuid

import pytest

from cgstore_client.wire.discovery import DiscoverAnswer
from tests.compiled_graphs.support import RECORDED, TOOLCHAIN, publication, publish, unique_envelope
from tests.compiled_graphs.test_discover import CODE, candidates, declaration, discover
from tests.support.live_store import unique_repo


def explained(client, body: dict) -> DiscoverAnswer:
    response = discover(client, {**body, "explain": True})
    assert response.status_code == 200, response.text
    answer = DiscoverAnswer.model_validate_json(response.content)
    assert answer.candidates == [] and answer.miss is not None
    return answer


@pytest.fixture
def family_record(store, pt2_archive, report_a, constants_a):
    """One record of a family no other test uses, with a release and a code fingerprint."""
    name, family = unique_repo(), f"gpt2-{uuid.uuid4().hex[:8]}"
    token = store.mint("minter", f"acme/{name}:read,write")
    pub = publication(
        pt2_archive,
        report_a,
        components={"consts": constants_a},
        envelope=unique_envelope(),
        family=family,
        release="endpoint-7",
        code=CODE,
    )
    with store.client(token) as client:
        assert publish(client, "acme", name, pub).status_code == 201
    return name, token, pub


def test_five_causes_of_a_miss_give_five_reasons(store, family_record):
    name, token, pub = family_record
    family, envelope = pub.manifest["family"], pub.manifest["axes"]["envelope"]
    causes = {
        "family typo": {"family": family.replace("gpt2", "gtp2")},
        "batch_sizes": {"envelope": {**envelope, "batch_sizes": [1, 2]}},
        "release": {"release": "endpoint-8"},
        "torch": {"toolchain": {"components": {**TOOLCHAIN, "torch": "2.12.0"}, "recorded": RECORDED}},
        "spelling": {"toolchain": {"components": {"torch": TOOLCHAIN["torch"]}, "recorded": RECORDED}},
    }
    with store.client(token) as client:
        assert [c.key for c in candidates(discover(client, {**declaration(pub), "explain": True}))] == [pub.key]
        answers = {cause: explained(client, declaration(pub, **changed)).miss for cause, changed in causes.items()}
    where = f"1 record of {family} in acme/{name}; nearest differs in"
    assert answers["family typo"].records == 0 and answers["family typo"].similar_families == [family]
    assert answers["family typo"].detail == (
        f"no record of family {family.replace('gpt2', 'gtp2')!r} this token may read (did you mean {family}?)"
    )
    assert answers["batch_sizes"].detail == f"{where} envelope batch_sizes: [1, 2] here, [1] recorded"
    assert answers["release"].detail == f"{where} release: endpoint-8 here, endpoint-7 recorded"
    assert answers["torch"].detail == f"{where} toolchain torch: 2.12.0 here, 2.13.0 recorded"
    assert answers["spelling"].detail == f"{where} toolchain triton: none here, 3.6.0 recorded"
    assert len({miss.detail for miss in answers.values()}) == 5
    nearest = answers["torch"].nearest
    assert (nearest.key, nearest.repo) == (pub.key, f"acme/{name}")
    assert [(d.axis, d.name, d.here, d.recorded) for d in nearest.differences] == [
        ("toolchain", "torch", "2.12.0", "2.13.0")
    ]


def test_sm_library_signature_and_code_are_named_too(store, family_record):
    _, token, pub = family_record
    sm = "sm_90" if pub.manifest["axes"]["sm"] != "sm_90" else "sm_80"
    with store.client(token) as client:
        by_sm = explained(client, declaration(pub, sm=sm)).miss
        by_library = explained(
            client, declaration(pub, toolchain={"components": TOOLCHAIN, "recorded": {"diffusers": "0.36.0"}})
        ).miss
        by_tensors = explained(client, declaration(pub, binding_signature="bs1:" + "0" * 64)).miss
        by_code = explained(client, declaration(pub, code="cf1:" + "0" * 64)).miss
    assert by_sm.detail.endswith(f"nearest differs in sm: {sm} here, {pub.manifest['axes']['sm']} recorded")
    assert by_library.detail.endswith("nearest differs in library diffusers: 0.36.0 here, 0.35.1 recorded")
    assert "nearest differs in binding signature: bs1:0000" in by_tensors.detail
    assert by_code.detail.endswith(f"nearest differs in code: cf1:{'0' * 64} here, {CODE} recorded")


def test_the_nearest_is_the_record_with_fewest_differences(store, pt2_archive, report_a, constants_a):
    name, family = unique_repo(), f"near-{uuid.uuid4().hex[:8]}"
    token = store.mint("minter", f"acme/{name}:read,write")
    envelope = unique_envelope()
    close = publication(
        pt2_archive,
        report_a,
        components={"consts": constants_a},
        envelope=envelope,
        family=family,
        toolchain={**TOOLCHAIN, "triton": "3.4.0"},
    )
    far = publication(
        pt2_archive,
        report_a,
        components={"consts": constants_a},
        envelope=unique_envelope(),
        family=family,
        toolchain={**TOOLCHAIN, "torch": "2.12.0"},
    )
    with store.client(token) as client:
        for pub in (close, far):  # the far one newest: nearness, not age, picks
            assert publish(client, "acme", name, pub).status_code == 201
        miss = explained(
            client, declaration(close, toolchain={"components": {**TOOLCHAIN, "triton": "3.5.0"}, "recorded": RECORDED})
        ).miss
    assert miss.records == 2 and miss.nearest.key == close.key
    assert miss.detail == (
        f"2 records of {family} in acme/{name}; nearest differs in toolchain triton: 3.5.0 here, 3.4.0 recorded"
    )


def test_an_explanation_counts_only_what_the_caller_may_read(store, pt2_archive, report_a, constants_a):
    """Another principal's records in a private cache and another tenant's repo: no count, no nearest, no family."""
    name, family = unique_repo(), f"secret-{uuid.uuid4().hex[:8]}"
    manager = store.mint("ops", f"acme/{name}:admin")
    writer = store.mint("release-a", f"acme/{name}:read,write")
    reader = store.mint("release-b", f"acme/{name}:read")
    outsider = store.mint("mallory", "evil/*:read,write")
    with store.client(manager) as client:
        assert client.put(f"/v1/repos/acme/{name}", json={"visibility": "principal"}).status_code == 201
    pub = publication(
        pt2_archive, report_a, components={"consts": constants_a}, envelope=unique_envelope(), family=family
    )
    with store.client(writer) as client:
        assert publish(client, "acme", name, pub).status_code == 201
        own = explained(client, declaration(pub, release="other")).miss
    assert own.records == 1 and own.nearest.key == pub.key
    for token in (reader, outsider):
        with store.client(token) as client:
            typo = explained(client, declaration(pub, family=family + "x")).miss
            hidden = explained(client, declaration(pub, release="other")).miss
            absent = explained(client, declaration(pub, family=f"absent-{uuid.uuid4().hex[:8]}")).miss
            plain = discover(client, declaration(pub, release="other"))
        assert (hidden.records, hidden.nearest, hidden.repos) == (0, None, [])
        assert typo.similar_families == [] and "did you mean" not in typo.detail
        assert hidden.detail == f"no record of family {family!r} this token may read"
        assert absent.model_dump(exclude={"detail"}) == hidden.model_dump(exclude={"detail"})
        assert plain.content == b'{"candidates":[]}'  # not asked: the answer clients before the field parse
