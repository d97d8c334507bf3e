"""The worker's boot and the mint child's publish, end to end, against the real store in both configurations."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jwt
import pytest

from cgstore.storage.fs import FileStorage
from cgstore_client import Client, CompiledRequired, Conflict, Want
from cgstore_client.archive import inspect
from cgstore_client.keys import Envelope, ck1
from cgstore_client.mint import derived_constants_path
from cgstore_client.worker import outcomes
from cgstore_client.worker.client import DERIVED_COMPONENT
from cgstore_client.worker.outcomes import Eager, Loaded, exact_miss
from tests.client.test_client_blobs import blob_gets, cache_files
from tests.support.live_store import CONFIGURATIONS, unique_repo
from tests.support.services import free_port

pytestmark = pytest.mark.torch

FAMILY = "tiny-family"
ENVELOPE = Envelope(shapes=[(64, 64)], text_len=0, batch_sizes=[1, 2, 5])
TOOLCHAIN = {"torch": "2.13.0"}


@pytest.fixture
def minted(pt2_archive, tmp_path):
    """Archive A as a mint child leaves it: the .pt2 and its derived constants beside it."""
    archive = tmp_path / "mint" / "model.pt2"
    archive.parent.mkdir()
    shutil.copy(pt2_archive, archive)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path(archive))
    return archive


def derived_key(archive: Path) -> str:
    """The worker's side: the key derived from what it would compile (here, the archive's graph)."""
    report = inspect(archive)
    return ck1(report.graph_digest, ENVELOPE, report.sm, TOOLCHAIN)


def publish(client: Client, repo: str, archive: Path, **kwargs):
    return client.publish(
        repo, archive, family=FAMILY, envelope=ENVELOPE, toolchain=TOOLCHAIN, sm=inspect(archive).sm, **kwargs
    )


WORKER_2 = """
import json, sys, torch
from cgstore_client import Client, Want
from cgstore_client.worker.loader import load_compiled
from tests.support.archives import tiny_inputs, tiny_model
url, token, cache, family, key = sys.argv[1:]
with Client(url, token, cache_dir=cache) as client:
    (loaded,) = client.load(family, [Want(key, mandatory=True)], device_total_bytes=16 << 30)
eager = tiny_model(seed=3)  # a checkpoint the archive has never seen
compiled = load_compiled(loaded, eager.state_dict())
same = [torch.equal(compiled(*tiny_inputs(b)), eager(*tiny_inputs(b))) for b in (1, 2, 5)]
print(json.dumps({"same": same, "components": sorted(loaded.component_paths), "lane": loaded.lane,
                  "lane_reason": loaded.lane_reason, "contract": loaded.input_contract["dims"]}))
"""


def test_boot_story_miss_mint_publish_then_another_process_loads_and_binds(store, minted, tmp_path):
    repo = f"acme/{unique_repo()}"
    key = derived_key(minted)
    mint_token = store.mint("mint-child", f"{repo}:read,write")
    with Client(store.base_url, mint_token, cache_dir=tmp_path / "worker-1") as worker_1:
        assert worker_1.load(FAMILY, [Want(key)]) == [Eager(key, exact_miss(FAMILY, key))]
        published = publish(worker_1, repo, minted)
        assert (published.key, published.status) == (key, "created")
        assert publish(worker_1, repo, minted).status == "exists"  # safe to call again
    reader = store.mint("worker-2", f"{repo}:read")
    worker_2 = subprocess.run(
        [sys.executable, "-c", WORKER_2, store.base_url, reader, str(tmp_path / "worker-2"), FAMILY, key],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert worker_2.returncode == 0, worker_2.stderr[-3000:]
    outcome = json.loads(worker_2.stdout.strip().splitlines()[-1])
    assert outcome["same"] == [True, True, True]
    assert outcome["components"] == [DERIVED_COMPONENT]
    assert outcome["lane"] == "baseline+dense" and outcome["lane_reason"] == "kernel_lane_verdict_absent"
    assert outcome["contract"] == {"s0": {"min": 1, "max": 64}}
    record = json.loads((tmp_path / "worker-2" / "records" / f"{key}.json").read_text())
    assert record["record"]["key"] == key and record["artifact"]["digest"] == inspect_digest(minted)


def inspect_digest(path: Path) -> str:
    from cgstore_client.worker.cache import hash_file

    return hash_file(path)[0]


@pytest.fixture
def published(store, minted, tmp_path):
    repo = f"acme/{unique_repo()}"
    token = store.mint("mint-child", f"{repo}:read,write")
    with Client(store.base_url, token, cache_dir=tmp_path / "mint-cache") as client:
        publish(client, repo, minted)
    return repo, token, derived_key(minted)


def test_mandatory_miss_raises_optional_miss_is_eager(store, published, tmp_path):
    repo, token, key = published
    unknown = "ck1-" + "e" * 56
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        results = client.load(FAMILY, [Want(key), Want(unknown)])
        assert isinstance(results[0], Loaded) and results[1] == Eager(unknown, exact_miss(FAMILY, unknown))
        with pytest.raises(CompiledRequired) as required:
            client.load(FAMILY, [Want(key, mandatory=True), Want(unknown, mandatory=True)])
    assert required.value.retryable and required.value.reasons == {unknown: exact_miss(FAMILY, unknown)}


def test_an_exact_miss_says_why_in_the_keys_terms_and_the_same_for_a_record_it_cannot_read(store, published, tmp_path):
    """A load's miss names the key, the family and what a ck1 key is, starting with ``miss`` (code matches on
    it); another tenant, for whom the published record is not readable, gets exactly that reason too."""
    repo, _, key = published
    unknown = "ck1-" + "e" * 56
    stranger = store.mint("stranger", f"acme/{unique_repo()}:read")
    with Client(store.base_url, stranger, cache_dir=tmp_path / "s") as client:
        hidden, absent = client.load(FAMILY, [Want(key), Want(unknown)])
    assert absent == Eager(
        unknown,
        f"miss: no live record of {unknown} in family {FAMILY!r} that this token can read "
        "(a ck1 key is exact: another graph, envelope, sm or toolchain is another key)",
    )
    assert absent.reason.startswith(outcomes.MISS + ": ")
    assert hidden == Eager(key, absent.reason.replace(unknown, key))  # nothing tells the hidden one apart


def test_offline_serves_what_was_loaded_and_names_what_it_cannot(store, published, tmp_path):
    repo, token, key = published
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        (online,) = client.load(FAMILY, [key])
    unknown = "ck1-" + "e" * 56
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens: any socket would fail
    with Client(gone, token, cache_dir=tmp_path / "c", offline=True) as offline:
        served, refused = offline.load(FAMILY, [key, unknown])
        assert isinstance(served, Loaded) and served.artifact_path == online.artifact_path
        assert served.record == online.record and served.admits(shape=(64, 64), batch_size=2)
        assert refused.key == unknown and refused.reason.startswith("offline and not cached")
        with pytest.raises(CompiledRequired, match="offline and not cached"):
            offline.load(FAMILY, [Want(unknown, mandatory=True)])


def test_with_the_store_down_a_fresh_client_answers_from_a_warm_cache(store, published, tmp_path):
    """Not offline mode: the store simply does not answer. The cached record and JWKS serve the boot."""
    repo, token, key = published
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        (online,) = client.load(FAMILY, [key])
    unknown = "ck1-" + "e" * 56
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens
    with Client(gone, token, cache_dir=tmp_path / "c") as fresh:
        served, refused = fresh.load(FAMILY, [key, unknown])
    assert isinstance(served, Loaded) and served.artifact_path == online.artifact_path
    assert refused.key == unknown and refused.reason.startswith("store unavailable")
    with Client(gone, token, cache_dir=tmp_path / "cold") as cold:  # nothing cached: the outage is said
        (eager,) = cold.load(FAMILY, [key])
    assert isinstance(eager, Eager) and eager.reason.startswith("store unavailable")


def test_a_loaded_result_prints_on_one_short_line(store, published, tmp_path):
    repo, token, key = published
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        (loaded,) = client.load(FAMILY, [key])
    shown = repr(loaded)
    assert shown.startswith(f"Loaded(key='{key}'") and f"repo='{repo}'" in shown
    assert "\n" not in shown and len(shown) < 600 and loaded.receipt not in shown


def _store_bytes(store, digest: str, data: bytes) -> None:
    """Overwrite the stored bytes of ``digest`` behind the store's back (bit rot, a bad disk)."""
    storage = store.context.storage
    if isinstance(storage, FileStorage):
        storage._blob_path(digest.removeprefix("blake3:")).write_bytes(data)
    else:
        storage.client.put_object(Bucket=storage.bucket, Key=storage.blob_key(digest), Body=data)


@pytest.fixture
def flipped(store, minted):
    """Archive A's stored bytes with one bit flipped, restored afterwards (blobs are shared store-wide)."""
    digest = inspect_digest(minted)
    data = bytearray(minted.read_bytes())
    data[len(data) // 2] ^= 0x01
    _store_bytes(store, digest, bytes(data))
    yield digest
    _store_bytes(store, digest, minted.read_bytes())


def test_a_flipped_stored_byte_is_refused_and_leaves_nothing(store, published, flipped, tmp_path):
    repo, token, key = published
    digest = flipped
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        (eager,) = client.load(FAMILY, [key])
        assert isinstance(eager, Eager) and eager.reason.startswith("artifact failed verification")
        with pytest.raises(CompiledRequired, match="artifact failed verification"):
            client.load(FAMILY, [Want(key, mandatory=True)])
    assert not (tmp_path / "c" / "blobs" / "blake3" / digest[7:]).exists()
    assert not (tmp_path / "c" / "records" / f"{key}.json").exists()
    assert list((tmp_path / "c" / "tmp").iterdir()) == []


def _load_in_child(url: str, token: str, cache_dir: str, key: str) -> None:
    with Client(url, token, cache_dir=cache_dir) as client:
        (loaded,) = client.load(FAMILY, [Want(key, mandatory=True)])
        assert loaded.artifact_path.exists()


def test_eight_processes_booting_together_download_each_blob_once(store, published, tmp_path):
    repo, token, key = published
    gets = blob_gets(store)
    spawn = multiprocessing.get_context("spawn")
    children = [
        spawn.Process(target=_load_in_child, args=(store.base_url, token, str(tmp_path), key)) for _ in range(8)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [c.exitcode for c in children] == [0] * 8
    assert blob_gets(store) == gets + 2  # the artifact and its one component, once each
    assert list((tmp_path / "tmp").iterdir()) == []
    assert len([f for f in cache_files(tmp_path) if f.startswith("blobs/")]) == 2


def test_a_load_fetches_big_blobs_as_ranged_parts(store, published, minted, tmp_path):
    repo, token, key = published
    part = 64 * 1024  # the archive is many parts; its tiny constants one stream
    sizes = [minted.stat().st_size, Path(derived_constants_path(minted)).stat().st_size]
    assert sizes[0] > 8 * part
    gets = blob_gets(store)
    with Client(
        store.base_url, token, cache_dir=tmp_path / "c", download_connections=3, download_part_bytes=part
    ) as client:
        (loaded,) = client.load(FAMILY, [Want(key, mandatory=True)])
    assert loaded.artifact_path.read_bytes() == minted.read_bytes()
    assert loaded.component_paths[DERIVED_COMPONENT].read_bytes() == Path(derived_constants_path(minted)).read_bytes()
    # Embedded: the store serves every part; S3: the store answers one 307 per blob, the parts go to S3.
    assert blob_gets(store) == gets + (2 if store.is_s3 else sum(max(1, -(-size // part)) for size in sizes))
    assert list((tmp_path / "c" / "tmp").iterdir()) == []


def test_a_key_holding_other_bytes_is_a_conflict_naming_both(store, published, minted, tmp_path):
    repo, token, key = published
    other = tmp_path / "other.constants.safetensors"
    import torch
    from safetensors import safe_open

    from cgstore_client.components import save_tensors

    with safe_open(derived_constants_path(minted), framework="pt") as f:
        save_tensors({name: f.get_tensor(name) + 1 for name in f.keys()}, other)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client, pytest.raises(Conflict) as conflict:
        publish(client, repo, minted, components={DERIVED_COMPONENT: other})
    assert conflict.value.code == "KEY_CONFLICT" and torch.__version__
    assert {"live", "offered"} <= set(conflict.value.detail)


def test_a_tampered_cached_record_is_refused_by_its_receipt(store, published, tmp_path):
    """The cached entry carries the store's receipt over its key and digests; editing a digest breaks it, offline too."""
    repo, token, key = published
    cache = tmp_path / "c"
    with Client(store.base_url, token, cache_dir=cache) as client:
        (online,) = client.load(FAMILY, [key])  # verified against GET /v1/keys, cached as keys.json
    assert isinstance(online, Loaded) and online.receipt
    entry_path = cache / "records" / f"{key}.json"
    entry = json.loads(entry_path.read_text())
    assert entry["receipt"] == online.receipt and (cache / "keys.json").exists()
    gone = f"http://127.0.0.1:{free_port()}"
    with Client(gone, token, cache_dir=cache, offline=True) as offline:
        (served,) = offline.load(FAMILY, [key])
        assert isinstance(served, Loaded) and served.receipt == entry["receipt"]
        entry["artifact"]["digest"] = "blake3:" + "0" * 64  # point the record at other bytes
        entry_path.write_text(json.dumps(entry))
        (refused,) = offline.load(FAMILY, [key])
        assert isinstance(refused, Eager) and refused.reason.startswith("receipt invalid")
        with pytest.raises(CompiledRequired, match="receipt invalid"):
            offline.load(FAMILY, [Want(key, mandatory=True)])


def test_a_receipt_signed_by_a_key_rotated_in_since_the_jwks_was_fetched_verifies(make_store, minted, tmp_path):
    """A long-running client fetched the JWKS before an operator rotated: it fetches it again, once."""
    live = make_store("embedded")
    repo = f"acme/{unique_repo()}"
    token = live.mint("mint-child", f"{repo}:read,write")
    with Client(live.base_url, token, cache_dir=tmp_path / "c") as client:
        before = {jwk["kid"] for jwk in client.jwks()["keys"]}
        with live.context.db.session() as session:
            rotated = live.context.tokens.ring.rotate(session)  # what `cgstore keys rotate` does
        publish(client, repo, minted)  # the receipt is signed with the new key
        (loaded,) = client.load(FAMILY, [derived_key(minted)])
    assert rotated not in before
    assert isinstance(loaded, Loaded), loaded
    assert jwt.get_unverified_header(loaded.receipt)["kid"] == rotated


def jwks_gets(live) -> int:
    """``GET /v1/keys`` the store has answered since it started."""
    pattern = r'cgstore_requests_total\{method="GET",route="/v1/keys",status="200"\} (\S+)'
    return int(sum(float(n) for n in re.findall(pattern, live.scrape_metrics())))


def unseen_bytes(archive: Path, directory: Path) -> Path:
    """The same graph under bytes no test stored yet (a zip comment, other constant values).

    A production extra store shares the session's database but not its bucket:
    bytes the database already knows would be linked, not written to it.
    """
    import torch
    from safetensors import safe_open

    from cgstore_client.components import save_tensors

    directory.mkdir()
    copy = directory / "model.pt2"
    shutil.copy(archive, copy)
    with zipfile.ZipFile(copy, "a") as zf:
        zf.comment = os.urandom(16).hex().encode()
    with safe_open(derived_constants_path(archive), framework="pt") as f:
        save_tensors({name: f.get_tensor(name) + torch.rand(()) for name in f.keys()}, derived_constants_path(copy))
    return copy


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_a_receipt_whose_key_is_still_unknown_after_one_refetch_is_not_served(
    make_store, configuration, minted, tmp_path
):
    """The record's receipt was signed by a key since retired: the JWKS never lists it again.

    The client fetches the JWKS, refetches it once, then serves eager (and
    refuses a mandatory want), whatever the record says.
    """
    live = make_store(configuration)
    repo = f"acme/{unique_repo()}"
    key = derived_key(minted)
    with Client(live.base_url, live.mint("mint-child", f"{repo}:read,write"), cache_dir=tmp_path / "mint") as client:
        publish(client, repo, unseen_bytes(minted, tmp_path / "unseen"))
        (loaded,) = client.load(FAMILY, [key])
    signer = jwt.get_unverified_header(loaded.receipt)["kid"]
    with live.context.db.session() as session:
        live.context.tokens.ring.rotate(session)  # what `cgstore keys rotate` then `retire` do
    with live.context.db.session() as session:
        assert live.context.tokens.ring.retire(session, signer)
    reader = live.mint("worker", f"{repo}:read")  # signed by the new key
    with Client(live.base_url, reader, cache_dir=tmp_path / "worker") as worker:
        before = jwks_gets(live)
        (served,) = worker.load(FAMILY, [key])
        assert isinstance(served, Eager), served
        assert served.reason.startswith("receipt invalid") and "unknown key" in served.reason
        assert jwks_gets(live) == before + 2  # the fetch, and exactly one refetch
        with pytest.raises(CompiledRequired, match="receipt invalid.*unknown key"):
            worker.load(FAMILY, [Want(key, mandatory=True)])
        assert jwks_gets(live) == before + 3  # one refetch again, no more
