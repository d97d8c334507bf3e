"""Discovery derivations (``cgstore_client.binding``): vectors, and a live module agreeing with its archive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cgstore_client.binding import (
    code_fingerprint,
    discovery_digest,
    fingerprint_from_digests,
    signature_from_module,
    signature_from_table,
)
from cgstore_client.keys import Envelope, Toolchain

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "binding.json").read_text())


def _ids(vectors: list[dict]) -> list[str]:
    return [vector["name"] for vector in vectors]


@pytest.mark.parametrize("vector", VECTORS["binding_signatures"], ids=_ids(VECTORS["binding_signatures"]))
def test_binding_signature_vector(vector):
    assert signature_from_table(vector["binding_table"], vector["ties"]) == vector["signature"]


@pytest.mark.parametrize("vector", VECTORS["discovery_digests"], ids=_ids(VECTORS["discovery_digests"]))
def test_discovery_digest_vector(vector):
    given = vector["input"]
    envelope, toolchain = Envelope.from_dict(given["envelope"]), Toolchain(given["components"])
    assert (envelope.digest, toolchain.digest, dict(toolchain.recorded)) == (
        vector["envelope_digest"],
        vector["toolchain_digest"],
        vector["recorded"],
    )
    assert (
        discovery_digest(given["family"], envelope.digest, given["sm"], toolchain.digest, toolchain.recorded)
        == vector["digest"]
    )


@pytest.mark.parametrize("vector", VECTORS["code_fingerprints"], ids=_ids(VECTORS["code_fingerprints"]))
def test_code_fingerprint_vector(vector):
    assert fingerprint_from_digests(vector["file_digests"]) == vector["fingerprint"]


def test_vectors_are_distinct_where_their_inputs_are():
    signatures = [vector["signature"] for vector in VECTORS["binding_signatures"]]
    digests = [vector["digest"] for vector in VECTORS["discovery_digests"]]
    assert len(set(signatures)) == len(signatures) and len(set(digests)) == len(digests)


def test_the_model_libraries_move_the_discovery_digest_and_keyed_order_does_not():
    envelope = Envelope.from_dict({"shapes": [[64, 64]], "text_len": 0})
    base = {"torch": "2.13.0", "transformers": "4.57.1"}
    digests = {
        discovery_digest("f", envelope.digest, "sm_90", Toolchain(c).digest, Toolchain(c).recorded)
        for c in (base, {**base, "transformers": "4.57.2"}, {"transformers": "4.57.1", "torch": "2.13.0"})
    }
    assert len(digests) == 2
    # Names other than the model libraries are not the recorded part of a declaration.
    assert discovery_digest("f", envelope.digest, "sm_90", "t", {"other": "1"}) == discovery_digest(
        "f", envelope.digest, "sm_90", "t", {}
    )


def test_the_module_imports_no_torch():
    code = "import sys, cgstore_client.binding; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- a live module against the archive minted from it ------------------------------------------


@pytest.mark.torch
def test_a_module_and_its_archive_agree(pt2_archive, pt2_archive_tied):
    pytest.importorskip("torch")
    from cgstore_client.archive import inspect
    from tests.support.archives import tied_model, tiny_model

    for archive, model in ((pt2_archive, tiny_model()), (pt2_archive_tied, tied_model())):
        report = inspect(archive)
        assert signature_from_module(model) == signature_from_table(report.binding_table, report.metadata.ties)


@pytest.mark.torch
def test_the_module_signature_folds_ties_and_needs_no_weights(pt2_archive_tied):
    torch = pytest.importorskip("torch")
    from cgstore_client.archive import inspect
    from tests.support.archives import tied_model

    report = inspect(pt2_archive_tied)
    expected = signature_from_table(report.binding_table, report.metadata.ties)
    with torch.device("meta"):  # built without weights, as a worker may before loading them
        assert signature_from_module(tied_model()) == expected
    untied = tied_model()
    untied.lm_head.weight = torch.nn.Parameter(untied.wte.weight.detach().clone())
    assert signature_from_module(untied) != expected  # two tensors now: the artifact binds one
    assert signature_from_module(tied_model(seed=5)) == expected  # weight values are not the signature
    assert signature_from_module(tied_model().to(torch.bfloat16)) != expected


@pytest.mark.torch
def test_code_fingerprint_follows_source_files_not_weights():
    torch = pytest.importorskip("torch")

    from tests.support.archives import tied_model, tiny_model

    assert code_fingerprint(tiny_model(seed=0)) == code_fingerprint(tiny_model(seed=1))
    assert code_fingerprint(tiny_model()).startswith("cf1:")
    # TinyModel and TiedLM share their source file; Embedding adds torch's sparse.py.
    assert code_fingerprint(tiny_model()) != code_fingerprint(tied_model())
    assert code_fingerprint(torch.nn.Linear(2, 2)) != code_fingerprint(tiny_model())
