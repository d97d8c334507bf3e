"""GPT-2 and BERT in tiny configs (transformers), minted once and cached across runs, like ``archives.py``.

GPT-2 ties its LM head to the token embedding; BERT has non-persistent
buffers (``position_ids``, ``token_type_ids``): the two shapes of real models
a worker's checkpoint (``save_pretrained``) does not spell the way the
compiled graph binds them. Each mint costs ~50 s, so the archives live in
``<repo>/.test-cache/hf/<key>/`` keyed by the torch and transformers versions
and the sources that decide their bytes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
from filelock import FileLock

from tests.support import archives

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

CACHE_ROOT = archives.REPO / ".test-cache" / "hf"
#: The architectures ``hf_archive`` mints.
HF_NAMES = ("gpt2", "bert")
#: The one input both are exported on (static: batch 1, 8 tokens).
IDS_SHAPE = (1, 8)
VOCAB = 128


def tiny_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """``gpt2`` (``GPT2LMHeadModel``) or ``bert`` (``BertModel``) in a tiny config, in eval mode."""
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    if name == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=2,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config).eval()
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return BertModel(config).eval()


def hf_inputs() -> tuple[torch.Tensor]:
    import torch

    return (torch.randint(0, VOCAB, IDS_SHAPE, generator=torch.Generator().manual_seed(11)),)


def _key() -> str:
    import torch
    import transformers

    hasher = blake3.blake3(f"torch={torch.__version__}\ntransformers={transformers.__version__}\n".encode())
    for source in (Path(__file__).resolve(), *archives._KEY_SOURCES):
        hasher.update(source.read_bytes())
    return hasher.hexdigest()[:24]


@functools.cache
def hf_archive(name: str) -> Path:
    """The minted archive of ``tiny_hf_model(name, seed=0)`` (its derived constants beside it)."""
    import torch

    from cgstore_client.mint import derived_constants_path, package_compiled_graph

    directory = CACHE_ROOT / _key()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.pt2"
    with FileLock(str(directory) + f".{name}.lock"):
        if not path.exists():
            scratch = directory / f".{name}.partial.pt2"
            package_compiled_graph(torch.export.export(tiny_hf_model(name), hf_inputs()), scratch)
            derived = Path(derived_constants_path(scratch))
            if derived.exists():
                derived.rename(derived_constants_path(path))
            scratch.rename(path)  # last: a present archive is a complete one
    return path
