"""Binding by name with real archives: derived constants, ties, dead parameters, every gap named first."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cgstore_client.archive import inspect  # noqa: E402
from cgstore_client.archive.graph import graph_digest_from_document, graph_digest_from_program  # noqa: E402
from cgstore_client.components import save_tensors  # noqa: E402
from cgstore_client.mint import derived_constants_path  # noqa: E402
from cgstore_client.worker.client import DERIVED_COMPONENT  # noqa: E402
from cgstore_client.worker.loader import BindingError, load_compiled  # noqa: E402
from cgstore_client.worker.outcomes import Loaded  # noqa: E402
from tests.support.archives import tied_inputs, tied_model, tied_program, tiny_inputs, tiny_model  # noqa: E402

pytestmark = pytest.mark.torch


def loaded(archive: Path, *, derived: bool = True) -> Loaded:
    components = {DERIVED_COMPONENT: Path(derived_constants_path(archive))} if derived else {}
    return Loaded(key="ck1-" + "0" * 56, artifact_path=archive, component_paths=components)


def test_another_checkpoint_binds_by_name_and_matches_eager(pt2_archive, tmp_path):
    eager = tiny_model(seed=3)
    checkpoint = tmp_path / "weights.safetensors"
    save_tensors(eager.state_dict(), checkpoint)  # a state_dict checkpoint: no non-persistent buffers
    compiled = load_compiled(loaded(pt2_archive), checkpoint)
    for batch in (1, 5, 64):
        inputs, offset = tiny_inputs(batch)
        assert torch.equal(compiled(inputs, offset), eager(inputs, offset))


def test_a_cached_blob_loads_without_a_torch_warning(pt2_archive, tmp_path, capfd, caplog):
    """The cache names a blob by its digest, without ``.pt2``: torch must still take it as a package, quietly."""
    blob = tmp_path / "blobs" / "blake3" / "0f1e2d"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(pt2_archive.read_bytes())
    (tmp_path / "consts.safetensors").write_bytes(Path(derived_constants_path(pt2_archive)).read_bytes())
    eager = tiny_model(seed=4)
    target = Loaded(
        key="ck1-" + "0" * 56, artifact_path=blob, component_paths={DERIVED_COMPONENT: tmp_path / "consts.safetensors"}
    )
    with caplog.at_level("WARNING"):
        compiled = load_compiled(target, eager.state_dict())
    inputs, offset = tiny_inputs(3)
    assert torch.equal(compiled(inputs, offset), eager(inputs, offset))
    printed = capfd.readouterr()
    said = printed.out + printed.err + caplog.text
    assert "Unable to load package" not in said and "outdated" not in said, said
    assert [p.name for p in blob.parent.iterdir()] == ["0f1e2d"]  # nothing left beside the blob


def test_every_gap_is_named_before_any_call(pt2_archive):
    state = tiny_model(seed=3).state_dict()
    state["lin.weight"] = state["lin.weight"].double()
    del state["scale"]
    with pytest.raises(BindingError) as refused:
        load_compiled(loaded(pt2_archive, derived=False), state)
    gaps = " | ".join(refused.value.gaps)
    assert "lin.weight: declared float32[4, 8], 'lin.weight' is float64[4, 8]" in gaps
    assert "scale: not in the checkpoint" in gaps
    # Without the mint's derived constants, what no checkpoint holds is missing too.
    assert "table: not in the checkpoint" in gaps and "lifted_tensor_0: not in the checkpoint" in gaps


def test_ties_are_recorded_and_part_of_the_graph_identity(pt2_archive_tied):
    report = inspect(pt2_archive_tied)
    assert report.metadata.ties == (("lm_head.weight", "wte.weight"),)
    program = tied_program()
    assert report.graph_digest == graph_digest_from_program(program)
    import json

    from cgstore_client.archive.graph import program_document_from_program

    untied = graph_digest_from_document(json.loads(program_document_from_program(program)))
    assert report.graph_digest != untied  # the same program text without its ties is another identity


def test_a_tie_deduplicated_checkpoint_binds_and_a_dead_parameter_is_not_required(pt2_archive_tied):
    eager = tied_model(seed=5)
    state = eager.state_dict()
    # save_pretrained keeps one name of a tie; the unused pooler need not be there either.
    for name in ("lm_head.weight", "pooler.weight", "pooler.bias"):
        del state[name]
    compiled = load_compiled(loaded(pt2_archive_tied), state)
    for length in (4,):
        (ids,) = tied_inputs(length)
        assert torch.equal(compiled(ids), eager(ids))


def test_an_untied_fine_tune_is_refused_by_name(pt2_archive_tied):
    state = tied_model(seed=5).state_dict()
    state["lm_head.weight"] = state["lm_head.weight"].clone() + 1
    with pytest.raises(BindingError, match=r"tied names \['lm_head.weight', 'wte.weight'\] hold different values"):
        load_compiled(loaded(pt2_archive_tied), state)
