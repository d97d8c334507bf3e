"""The envelope against the input contract (admission, issue 25 §4): which dim each axis speaks for, no store."""

from __future__ import annotations

import pytest

from cgstore.compiled_graphs.admission import check_envelope_fits
from cgstore.core.errors import EnvelopeInvalid
from cgstore_client.keys import Envelope

GPT2 = {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": [1, 8]}], "dims": {}}
TEXT_ENCODER = {
    "inputs": [
        {"name": "input_ids", "dtype": "int64", "shape": ["s0", "s1"]},
        {"name": "attention_mask", "dtype": "int64", "shape": ["s0", "s1"]},
    ],
    "dims": {"s0": {"min": 1, "max": 8}, "s1": {"min": 2, "max": 512}},
}
UNET = {
    "inputs": [
        {"name": "sample", "dtype": "bfloat16", "shape": ["s0", 4, "s1", "s1"]},
        {"name": "timestep", "dtype": "float32", "shape": [1]},
        {"name": "text", "dtype": "bfloat16", "shape": ["s0", 77, 768]},
    ],
    "dims": {"s0": {"min": 1, "max": 4}, "s1": {"min": 64, "max": 128}},
}


def envelope(**fields) -> Envelope:
    return Envelope.from_dict({"shapes": [[1, 1]], "text_len": 0, **fields})


def refused_axis(contract, env: Envelope) -> str | None:
    try:
        check_envelope_fits(env, contract)
    except EnvelopeInvalid as err:
        return err.detail["axis"]
    return None


@pytest.mark.parametrize(
    ("contract", "fields", "axis"),
    [
        (GPT2, {"text_len": 8}, None),
        (GPT2, {"text_len": 8, "batch_sizes": [1, 2]}, "batch_sizes"),  # the GPT-2: batch 1 is fixed
        (GPT2, {"text_len": 16}, "text_len"),
        (GPT2, {}, None),  # text_len 0: no promise on the sequence
        (TEXT_ENCODER, {"text_len": 512, "batch_sizes": [1, 8]}, None),
        (TEXT_ENCODER, {"text_len": 513}, "text_len"),
        (TEXT_ENCODER, {"text_len": 77, "batch_sizes": [16]}, "batch_sizes"),
        (UNET, {"shapes": [[512, 512], [1024, 1024]], "text_len": 77, "batch_sizes": [1, 4]}, None),  # latents /8
        (UNET, {"shapes": [[768, 768]], "text_len": 77}, None),  # 96 latent
        (UNET, {"shapes": [[2048, 2048]], "text_len": 77}, "shapes"),  # 256 latent > 128
        (UNET, {"shapes": [[516, 516]], "text_len": 77}, "shapes"),  # 64.5 latent rows: not a multiple of 8
        (UNET, {"shapes": [[512, 512]], "text_len": 77, "batch_sizes": [5]}, "batch_sizes"),
    ],
)
def test_each_axis_is_held_against_its_dims(contract, fields, axis):
    assert refused_axis(contract, envelope(**fields)) == axis
