"""Boot by declaration (issue 16): discover, the structural gate, confirmation, offline and store-down boots.

Real archives (``tests/support/archives.py``: the tiny model, minted once per
session) against the real store in both configurations. The worker's model is
another instance (other weights, same tensors' names, dtypes and shapes): what
is served compiled is bound to the live model's own state.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading

import jwt
import pytest
import torch

from cgstore_client import Booted, Client, CompiledRequired
from cgstore_client.archive import inspect
from cgstore_client.binding import code_fingerprint
from cgstore_client.environment import environment_sm, environment_toolchain
from cgstore_client.keys import Envelope, Toolchain
from cgstore_client.mint import derived_constants_path
from tests.support.archives import REPO, tiny_inputs, tiny_model
from tests.support.docs import example
from tests.support.hf_archives import HF_NAMES
from tests.support.live_store import CONFIGURATIONS, unique_repo
from tests.support.services import free_port

pytestmark = pytest.mark.torch

FAMILY = "tiny-discover"
ENVELOPE = Envelope(shapes=[(64, 64)], text_len=0, batch_sizes=[1, 2, 5])
RELEASE = "endpoint-7"
CONFIRM_TIMEOUT_S = 300  # an export on a loaded 2-core machine


def publish_archive_a(store, pt2_archive, tmp_path, code: str):
    """Archive A published (with its release and ``code``) under this environment's toolchain and sm, in a new repo."""
    archive = tmp_path / "mint" / "model.pt2"
    archive.parent.mkdir()
    shutil.copy(pt2_archive, archive)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path(archive))
    repo = f"acme/{unique_repo()}"
    token = store.mint("mint-child", f"{repo}:read,write")
    with Client(store.base_url, token, cache_dir=tmp_path / "mint-cache") as client:
        published = client.publish(
            repo,
            archive,
            family=FAMILY,
            envelope=ENVELOPE,
            toolchain=environment_toolchain(),
            sm=environment_sm("cpu"),
            release=RELEASE,
            code=code,
        )
    return repo, token, published.key, inspect(archive).graph_digest


@pytest.fixture
def declared(store, pt2_archive, tmp_path):
    """Archive A published with the code fingerprint of :func:`tiny_model`'s source."""
    return publish_archive_a(store, pt2_archive, tmp_path, code_fingerprint(tiny_model(0)))


def boot(client: Client, model, **options) -> Booted:
    return client.boot(FAMILY, model, envelope=ENVELOPE, release=RELEASE, **options)


def same_outputs(booted: Booted, model) -> bool:
    with torch.no_grad():
        return all(torch.equal(booted(*tiny_inputs(b)), model(*tiny_inputs(b))) for b in (1, 2, 5))


def test_discover_answers_the_declaration_and_only_it(store, declared, tmp_path):
    repo, token, key, graph = declared
    toolchain, sm = environment_toolchain(), environment_sm("cpu")
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        (candidate,) = client.discover(FAMILY, envelope=ENVELOPE, sm=sm, toolchain=toolchain, release=RELEASE)
        other_release = client.discover(FAMILY, envelope=ENVELOPE, sm=sm, toolchain=toolchain, release="other")
    assert (candidate.key, candidate.repo, candidate.record.graph) == (key, repo, graph)
    assert candidate.binding_signature.startswith("bs1:") and other_release == []


def test_another_instance_boots_compiled_from_a_fresh_cache_and_is_confirmed(store, declared, tmp_path):
    repo, token, key, _ = declared
    live = tiny_model(seed=3)  # weights the archive has never seen
    with Client(store.base_url, token, cache_dir=tmp_path / "fresh") as client:
        before = boot(client, live, confirm="before", example_inputs=tiny_inputs())
        background = boot(client, live, example_inputs=tiny_inputs())
        assert background.wait_confirmed(CONFIRM_TIMEOUT_S) == "confirmed"
    for booted in (before, background):
        assert booted.compiled and booted.reason is None and booted.confirmation == "confirmed"
        assert (booted.loaded.key, booted.loaded.repo) == (key, repo)
        assert same_outputs(booted, live)


def patched(model):
    """Same tensors, another computation: the forward of the sigmoid variant, over this model's weights."""
    other = tiny_model(activation="sigmoid")
    other.load_state_dict(model.state_dict())
    return other


def test_a_patched_forward_is_served_then_switched_to_eager_when_background_confirmation_finds_drift(
    store, declared, tmp_path, caplog
):
    repo, token, key, graph = declared
    live = patched(tiny_model(seed=3))
    compiled_twin = tiny_model(seed=3)  # what the record computes with these weights
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        booted = boot(client, live, code=False, example_inputs=tiny_inputs())
        # Served: the structural gate cannot tell (same names, dtypes, shapes). Whether it is still compiled
        # depends on how far the background confirmation got already (with warm caches it can be done).
        assert booted.loaded is not None and booted.loaded.key == key
        # Each call runs the compiled graph or, once confirmation found the drift (it may already
        # have: it runs in the background), the live model: never anything else.
        with torch.no_grad():
            for batch in (1, 2, 5):
                answer = booted(*tiny_inputs(batch))
                assert torch.equal(answer, compiled_twin(*tiny_inputs(batch))) or torch.equal(
                    answer, live(*tiny_inputs(batch))
                )
        assert booted.wait_confirmed(CONFIRM_TIMEOUT_S) == "drift"
        record = client.transport.request("GET", f"/v1/repos/{repo}/compiled-graphs/{key}").json()
    assert record["drift_reports"] == 1  # the store was told
    assert not booted.compiled and booted.reason.startswith("drift") and graph in booted.reason
    assert booted.loaded.key == key and same_outputs(booted, live)
    assert any("serves eager from now on" in r.getMessage() for r in caplog.records)


def test_confirm_before_refuses_a_patched_forward_up_front_and_mandatory_raises(store, declared, tmp_path):
    _, token, _, _ = declared
    live = patched(tiny_model(seed=3))
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        booted = boot(client, live, code=False, confirm="before", example_inputs=tiny_inputs())
        assert not booted.compiled and booted.confirmation == "drift" and booted.reason.startswith("drift")
        assert same_outputs(booted, live)
        with pytest.raises(CompiledRequired, match="drift") as required:
            boot(client, live, code=False, mandatory=True, example_inputs=tiny_inputs())
    assert required.value.retryable


def test_confirm_before_reports_a_drifting_candidate_and_serves_the_next_one_holding_the_live_graph(
    store, pt2_archive, pt2_archive_sigmoid, tmp_path
):
    """Two records of one declaration and the same tensors, graphs differing (what a config flag makes): the
    newest drifts from the live model, is reported, and the next one, confirmed, is served."""
    repo = f"acme/{unique_repo()}"
    token = store.mint("mint-child", f"{repo}:read,write")
    keys = {}
    with Client(store.base_url, token, cache_dir=tmp_path / "mint-cache") as client:
        for name, source in (("sigmoid", pt2_archive_sigmoid), ("relu", pt2_archive)):  # relu is the newest
            archive = tmp_path / name / "model.pt2"
            archive.parent.mkdir()
            shutil.copy(source, archive)
            shutil.copy(derived_constants_path(source), derived_constants_path(archive))
            keys[name] = client.publish(
                repo,
                archive,
                family=FAMILY,
                envelope=ENVELOPE,
                release=RELEASE,
                toolchain=environment_toolchain(),
                sm=environment_sm("cpu"),
            ).key
    live = patched(tiny_model(seed=3))
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        found = client.discover(
            FAMILY, envelope=ENVELOPE, sm=environment_sm("cpu"), toolchain=environment_toolchain(), release=RELEASE
        )
        assert [c.key for c in found] == [keys["relu"], keys["sigmoid"]]  # the drifting one is tried first
        booted = boot(client, live, code=False, confirm="before", example_inputs=tiny_inputs())
        assert booted.compiled and booted.confirmation == "confirmed" and booted.loaded.key == keys["sigmoid"]
        with torch.no_grad():  # inductor's fused sigmoid may differ from eager's in the last bits
            assert all(
                torch.allclose(booted(*tiny_inputs(b)), live(*tiny_inputs(b)), rtol=1e-5, atol=1e-6) for b in (1, 2, 5)
            )
        assert boot(client, live, code=False, mandatory=True, example_inputs=tiny_inputs()).compiled
        reports = {
            name: client.transport.request("GET", f"/v1/repos/{repo}/compiled-graphs/{key}").json()["drift_reports"]
            for name, key in keys.items()
        }
    assert reports == {"relu": 2, "sigmoid": 0}  # each confirming boot told the store about the drifting one


class Renamed(torch.nn.Module):
    """The tiny model one level down: every tensor's name gains ``inner.``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_model(seed=3)

    def forward(self, inputs, offset):
        return self.inner(inputs, offset)


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (lambda: tiny_model(seed=3, hidden=5), "lin.weight is ('float32', [5, 8]), recorded ('float32', [4, 8])"),
        (Renamed, "inner.lin.weight is not recorded"),
    ],
    ids=["reshaped", "renamed"],
)
def test_a_reshaped_or_renamed_tensor_finds_no_candidate_and_says_which(store, declared, tmp_path, model, named):
    _, token, key, _ = declared
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        booted = boot(client, model(), code=False)
    assert not booted.compiled and booted.loaded is None
    assert booted.reason.startswith(f"miss: 1 record of {FAMILY} in ") and key in booted.reason
    assert "nearest differs in binding signature: bs1:" in booted.reason and named in booted.reason


def test_example_inputs_outside_the_contract_are_served_eager_with_the_contracts_words(store, declared, tmp_path):
    _, token, key, _ = declared
    live = tiny_model(seed=3)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        booted = boot(client, live, example_inputs=tiny_inputs(65))
    assert not booted.compiled and f"{key}: the input contract refuses" in booted.reason
    assert "declared [1, 64]" in booted.reason


def test_offline_boot_answers_from_the_cache_and_says_what_it_lacks(store, declared, tmp_path):
    _, token, key, _ = declared
    live = tiny_model(seed=3)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        assert boot(client, live).compiled
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens: any socket would fail
    with Client(gone, token, cache_dir=tmp_path / "c", offline=True) as offline:
        served = boot(offline, live)
        other_release = offline.boot(FAMILY, live, envelope=ENVELOPE, release="never-discovered")
    assert served.compiled and served.loaded.key == key and same_outputs(served, live)
    assert served.served_from == "cache" and served.reason.startswith("served from the local cache (offline: ")
    assert not other_release.compiled and other_release.reason.startswith("offline and not cached")


def test_with_the_store_down_boot_answers_from_a_warm_cache(store, declared, tmp_path):
    _, token, key, _ = declared
    live = tiny_model(seed=3)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        assert boot(client, live).compiled
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens
    with Client(gone, token, cache_dir=tmp_path / "c") as fresh:
        served = boot(fresh, live, example_inputs=tiny_inputs())
        assert served.wait_confirmed(CONFIRM_TIMEOUT_S) == "confirmed"  # the report path is never taken
    assert served.compiled and served.loaded.key == key and same_outputs(served, live)
    assert served.served_from == "cache" and served.reason.startswith("served from the local cache (unavailable: ")
    with Client(gone, token, cache_dir=tmp_path / "cold") as cold:
        eager = boot(cold, live)
    assert not eager.compiled and eager.reason.startswith("store unavailable")


@contextlib.contextmanager
def store_before_discovery():
    """A store from before ``:discover``: every route it lacks answers the protocol's 404."""
    body = json.dumps({"error": {"code": "NOT_FOUND", "message": "Not Found", "detail": {}}}).encode()

    class Old(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the stdlib's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_store_without_the_discover_route_boots_from_the_cache_or_eager(store, declared, tmp_path):
    """An older store answers ``:discover`` 404: a worker serves what it cached, else eager, never raises."""
    _, token, key, _ = declared
    live = tiny_model(seed=3)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        assert boot(client, live).compiled
    with store_before_discovery() as old:
        with Client(old, token, cache_dir=tmp_path / "c") as warm:
            served = boot(warm, live)
        with Client(old, token, cache_dir=tmp_path / "cold") as cold:
            eager = boot(cold, live)
            with pytest.raises(CompiledRequired, match="does not serve discovery"):
                boot(cold, live, mandatory=True)
    assert served.compiled and served.loaded.key == key and same_outputs(served, live)
    assert not eager.compiled and eager.reason.startswith("store unavailable: this store does not serve discovery")


def test_five_causes_of_a_miss_say_five_different_things(store, declared, tmp_path):
    """A family typo, a missing batch_sizes, a release the record lacks, another torch, another toolchain spelling."""
    _, token, key, _ = declared
    live, toolchain = tiny_model(seed=3), environment_toolchain()
    torch_version = toolchain.components["torch"]
    document = {k: v for k, v in ENVELOPE.document.items() if k not in ("v", "batch_sizes")}
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        booted = {
            "family": client.boot("tiny-discvoer", live, envelope=ENVELOPE, release=RELEASE),
            "batch_sizes": client.boot(FAMILY, live, envelope=document, release=RELEASE),
            "release": client.boot(FAMILY, live, envelope=ENVELOPE, release="endpoint-8"),
            "torch": boot(
                client, live, toolchain=Toolchain({**toolchain.components, **toolchain.recorded, "torch": "2.12.0"})
            ),
            "spelling": boot(client, live, toolchain={"torch": torch_version}),
        }
    reasons = {cause: handle.reason for cause, handle in booted.items()}
    assert not any(handle.compiled for handle in booted.values())
    assert reasons["family"] == (
        f"miss: no record of family 'tiny-discvoer' this token may read (did you mean {FAMILY}?)"
    )
    assert reasons["batch_sizes"].endswith("nearest differs in envelope batch_sizes: [1] here, [1, 2, 5] recorded")
    assert reasons["release"].endswith(f"nearest differs in release: endpoint-8 here, {RELEASE} recorded")
    assert reasons["torch"].endswith(f"nearest differs in toolchain torch: 2.12.0 here, {torch_version} recorded")
    assert "nearest differs in toolchain " in reasons["spelling"]  # the walk-through's {"torch": …} lacks the rest
    assert f"toolchain settings: none here, {toolchain.components['settings']} recorded" in reasons["spelling"]
    assert len(set(reasons.values())) == 5


def test_the_docs_boot_by_declaration_runs_as_written(make_store, pt2_archive, tmp_path, monkeypatch):
    live = make_store("embedded")
    monkeypatch.setenv("CGSTORE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    shutil.copy(pt2_archive, "model.pt2")  # minted from tiny_model (another seed: the weights are the worker's)
    shutil.copy(derived_constants_path(pt2_archive), derived_constants_path("model.pt2"))
    code = example("boot-by-declaration").replace("http://127.0.0.1:8080", live.base_url)
    scope = {
        "TOKEN": live.mint("w", "acme/*:read,write"),
        "model": tiny_model(seed=3),
        "example_inputs": tiny_inputs(),
        "__name__": "docs",
    }
    exec(compile(code, "docs/client.md", "exec"), scope)  # noqa: S102 - the docs' own code
    booted = scope["booted"]
    assert booted.compiled and booted.confirmation == "confirmed"
    assert torch.equal(scope["y"], tiny_model(3)(*tiny_inputs()))


HF_WORKER = """
import json, sys, torch
from cgstore_client import Client
from tests.support.hf_archives import hf_inputs, tiny_hf_model
url, token, cache, name, checkpoint, family = sys.argv[1:]
live = tiny_hf_model(name, seed=5)  # its own weights are not served: the checkpoint's are
with Client(url, token, cache_dir=cache) as client:
    booted = client.boot(family, live, envelope={"shapes": [[64, 64]], "text_len": 0, "batch_sizes": [1]},
                         mandatory=True, example_inputs=hf_inputs(), checkpoint=checkpoint)
with torch.no_grad():
    out = booted(*hf_inputs())[0]
print(json.dumps({"compiled": booted.compiled, "confirmation": booted.confirmation, "out": out.tolist()}))
"""


@pytest.mark.parametrize("name", HF_NAMES)
def test_a_transformers_model_boots_in_another_process_on_a_save_pretrained_checkpoint(store, tmp_path, name):
    """GPT-2 (tied LM head) and BERT (non-persistent buffers), checkpoint of another seed, fresh cache, subprocess."""
    from tests.support.hf_archives import hf_archive, hf_inputs, tiny_hf_model

    archive = hf_archive(name)
    family, repo = f"hf-{name}", f"acme/{unique_repo()}"
    token = store.mint("mint-child", f"{repo}:read,write")
    envelope = {"shapes": [[64, 64]], "text_len": 0, "batch_sizes": [1]}
    with Client(store.base_url, token, cache_dir=tmp_path / "mint-cache") as client:
        client.publish(
            repo,
            archive,
            family=family,
            envelope=envelope,
            toolchain=environment_toolchain(),
            sm=environment_sm("cpu"),
            code=code_fingerprint(tiny_hf_model(name)),
        )
    trained = tiny_hf_model(name, seed=1)
    trained.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    worker = subprocess.run(
        [
            sys.executable,
            "-c",
            HF_WORKER,
            store.base_url,
            token,
            str(tmp_path / "worker-cache"),
            name,
            str(tmp_path / "ckpt" / "model.safetensors"),
            family,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    answer = json.loads(worker.stdout.strip().splitlines()[-1])
    assert answer["compiled"] and answer["confirmation"] == "confirmed"
    with torch.no_grad():
        expected = trained(*hf_inputs())[0]
    # AOTI's fused kernels round differently from eager: equal to float32 precision, not bit for bit.
    torch.testing.assert_close(torch.tensor(answer["out"]), expected, rtol=1e-5, atol=1e-5)


def unexportable(model):
    """A forward that branches on a tensor's value: it runs eagerly, ``torch.export`` refuses it."""
    forward = model.forward

    def branching(inputs, offset):
        return forward(inputs, offset) if float(offset.sum()) < 1e9 else forward(inputs, -offset)

    model.forward = branching
    return model


def test_a_model_that_cannot_be_exported_is_unconfirmed_served_eager_before_and_compiled_in_the_background(
    store, declared, tmp_path
):
    _, token, _, _ = declared
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        before = boot(
            client, unexportable(tiny_model(seed=3)), code=False, confirm="before", example_inputs=tiny_inputs()
        )
        background = boot(client, unexportable(tiny_model(seed=3)), code=False, example_inputs=tiny_inputs())
        assert background.wait_confirmed(CONFIRM_TIMEOUT_S) == "skipped"
    assert not before.compiled and before.reason.startswith("unconfirmed") and before.confirmation == "skipped"
    assert background.compiled and background.reason is None


# The tiny model's class (``tiny_model()``'s defaults) in a file of its own, so that its source can be edited.
TINY_MODEL_FILE = """
import torch


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.rand(4))
        self.register_buffer("table", torch.arange(3, dtype=torch.float32), persistent=False)

    def forward(self, inputs, offset):
        h = torch.relu(self.lin(inputs["x"]) * self.scale + inputs["y"])
        steps = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=h.dtype)
        return h + self.table.sum() * 0.5 + offset + steps
"""
EDITED_LINE = ("offset + steps\n", "offset + steps * 1.0\n")  # a real change to forward: one more op


def model_from_file(path, source: str, seed: int = 3) -> torch.nn.Module:
    """``TinyModel`` from ``source`` written to ``path`` and imported from there (a module of its own)."""
    path.write_text(source)
    name = f"tiny_model_file_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect finds a class's source file through its module
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return module.TinyModel()


def test_an_edit_to_the_model_class_file_finds_no_candidate_by_code_fingerprint(store, pt2_archive, tmp_path):
    original = model_from_file(tmp_path / "original.py", TINY_MODEL_FILE)
    edited = model_from_file(tmp_path / "edited.py", TINY_MODEL_FILE.replace(*EDITED_LINE))
    assert code_fingerprint(edited) != code_fingerprint(original)
    _, token, key, _ = publish_archive_a(store, pt2_archive, tmp_path, code_fingerprint(original))
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        served = boot(client, original)
        by_code = boot(client, edited)
        # Without the fingerprint the structural gate passes (same tensors): only an export says the graph differs.
        by_structure = boot(client, edited, code=False, confirm="before", example_inputs=tiny_inputs())
    assert served.compiled and served.loaded.key == key and same_outputs(served, original)
    assert not by_code.compiled and by_code.loaded is None
    assert by_code.reason.startswith(f"miss: 1 record of {FAMILY} in ")
    assert by_code.reason.endswith(
        f"nearest differs in code: {code_fingerprint(edited)} here, {code_fingerprint(original)} recorded"
    )
    assert by_structure.loaded.key == key and by_structure.confirmation == "drift"
    assert not by_structure.compiled and by_structure.reason.startswith("drift")


def test_a_recorded_library_version_other_than_the_records_finds_no_candidate(store, declared, tmp_path):
    _, token, key, _ = declared
    toolchain = environment_toolchain()  # what the record was published with
    other = Toolchain({**toolchain.components, **toolchain.recorded, "transformers": "0.0.1"})  # keyed: the same
    live = tiny_model(seed=3)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        same = boot(client, live, toolchain=toolchain)
        newer = boot(client, live, toolchain=other)
    assert same.compiled and same.loaded.key == key
    assert not newer.compiled and newer.loaded is None
    assert newer.reason.endswith(
        f"nearest differs in library transformers: 0.0.1 here, {toolchain.recorded.get('transformers')} recorded"
    )


# -- the structural gate's receipt check (issue 30, section 6) -------------------------------------------------------


@pytest.fixture
def fetched(monkeypatch) -> list[str]:
    """The digests ``Client.fetch_blob`` is asked for (from the cache or the store), in order."""
    calls: list[str] = []
    original = Client.fetch_blob

    def spy(self, repo, digest, *args, **kwargs):
        calls.append(digest)
        return original(self, repo, digest, *args, **kwargs)

    monkeypatch.setattr(Client, "fetch_blob", spy)
    return calls


def rewritten_claims(receipt: str) -> str:
    """The receipt vouching for another publisher, its signature kept (what anyone can write into a cache file)."""
    header, payload, signature = receipt.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["publisher"] = "someone-else"
    encoded = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{encoded}.{signature}"


def rewrite_cached_receipts(cache_dir, change) -> int:
    """Every candidate's receipt in the cached discover answers replaced by ``change(receipt)``; how many."""
    changed = 0
    for path in (cache_dir / "discover").glob("*.json"):
        answer = json.loads(path.read_text())
        for candidate in answer["candidates"]:
            candidate["receipt"] = change(candidate["receipt"])
            changed += 1
        path.write_text(json.dumps(answer))
    return changed


def assert_refused_for_its_receipt(booted: Booted, key: str, fetched: list[str]) -> None:
    assert not booted.compiled and booted.loaded is None
    assert booted.reason.startswith(f"miss: no candidate could be served ({key}: receipt invalid: "), booted.reason
    assert fetched == []  # refused before any blob was asked for


@pytest.mark.parametrize("tamper", ["altered", "swapped"])
def test_an_offline_boot_refuses_a_cached_candidate_whose_receipt_is_altered_or_another_records(
    store, declared, pt2_archive, tmp_path, fetched, tamper
):
    """The cache is only a file: an offline boot verifies the cached candidate's receipt as an online one does."""
    _, token, key, _ = declared
    live = tiny_model(seed=3)
    with Client(store.base_url, token, cache_dir=tmp_path / "c") as client:
        assert boot(client, live).compiled  # warm: the answer, the record, the blobs and the JWKS cached
    if tamper == "swapped":  # the same archive in another repo: the same key, another record with its own receipt
        (tmp_path / "other").mkdir()
        _, other_token, other_key, _ = publish_archive_a(
            store, pt2_archive, tmp_path / "other", code_fingerprint(tiny_model(0))
        )
        assert other_key == key
        with Client(store.base_url, other_token, cache_dir=tmp_path / "other" / "c") as other:
            (hit,) = other.resolve(FAMILY, [key])
        change = lambda receipt: hit["receipt"]  # noqa: E731
    else:
        change = rewritten_claims
    assert rewrite_cached_receipts(tmp_path / "c", change) == 1
    fetched.clear()
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens
    with Client(gone, token, cache_dir=tmp_path / "c", offline=True) as offline:
        refused = boot(offline, live)
        with pytest.raises(CompiledRequired, match="receipt invalid"):
            boot(offline, live, mandatory=True)
    assert_refused_for_its_receipt(refused, key, fetched)


@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_an_online_boot_refuses_a_candidate_whose_receipt_a_retired_key_signed(
    make_store, pt2_archive, tmp_path, fetched, configuration
):
    live_store = make_store(configuration)  # its own key ring: retiring its key touches no other test
    repo, _, key, _ = publish_archive_a(live_store, pt2_archive, tmp_path, code_fingerprint(tiny_model(0)))
    ring = live_store.context.tokens.ring
    with live_store.context.db.session() as session:
        signer, _ = ring.signing_key(session)
    with live_store.context.db.session() as session:
        ring.rotate(session)
    # Retired without re-signing its receipts (``cgstore keys retire`` re-signs them): the store goes on
    # answering a receipt only the retired key verifies, as a store that lost the re-signing would.
    with live_store.context.db.session() as session:
        assert ring.retire(session, signer)
    token = live_store.mint("worker", f"{repo}:read")  # signed by the new key
    live = tiny_model(seed=3)
    with Client(live_store.base_url, token, cache_dir=tmp_path / "c") as client:
        (candidate,) = client.discover(
            FAMILY, envelope=ENVELOPE, sm=environment_sm("cpu"), toolchain=environment_toolchain(), release=RELEASE
        )
        assert jwt.get_unverified_header(candidate.receipt)["kid"] == signer
        assert signer not in [k["kid"] for k in client.jwks(refresh=True)["keys"]]
        refused = boot(client, live)
        with pytest.raises(CompiledRequired, match="receipt invalid"):
            boot(client, live, mandatory=True)
    assert_refused_for_its_receipt(refused, key, fetched)
