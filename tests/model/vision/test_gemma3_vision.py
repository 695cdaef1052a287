"""Gemma 3's vision tower and projector (nexttoken/model/vision/gemma3.py) and the decoder's image seam
(ForwardBatch.embeds, with_blocks) against transformers' Gemma3ForConditionalGeneration on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from nexttoken.images import processor_for, read_images
from nexttoken.model import ForwardBatch, load_model
from support.vision import gemma3_vlm


@pytest.fixture(scope="module")
def models(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("gemma3")
    hf, processor = gemma3_vlm(folder, seed=1)
    return load_model(folder), hf, processor, folder


def _photos() -> list[Image.Image]:
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((37, 53, 3), (80, 21, 3))]


def test_features_equal_transformers(models) -> None:
    ours, hf, processor, folder = models
    assert ours.config.architecture == "Gemma3ForConditionalGeneration" and ours.vision is not None
    assert "vision" not in dict(ours.named_children())  # beside the decoder, not one of its modules
    pixels = processor.image_processor(_photos(), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = hf.model.get_image_features(pixels).pooler_output  # (2, 4, 32)
    prepared = processor_for("gemma3", folder).prepare(_photos())
    torch.testing.assert_close(ours.vision.encode(prepared), theirs.reshape(8, 32), rtol=0, atol=2e-6)


def test_prefill_with_images_equals_transformers_logits(models) -> None:
    """Every position's logits of a prompt with two images: the encoder's rows replace the placeholders after the
    embedding scale, and each image's tokens attend each other both ways (transformers' token_type_ids)."""
    ours, hf, processor, folder = models
    text = "a <start_of_image> b <start_of_image> c"
    theirs = processor(text=text, images=_photos(), return_tensors="pt")
    with torch.no_grad():
        expected = hf(**theirs).logits[0]
    inputs = read_images(processor_for("gemma3", folder), _photos())
    ids = theirs["input_ids"]
    T = ids.shape[1]
    placed = inputs.placed(ids[0].tolist(), ours.vision.image_token_id)
    cols = torch.arange(T)[None]
    where = ids == ours.vision.image_token_id
    rows = torch.cat([ours.vision.encode(p.prepared) for p in placed])
    groups = torch.full((1, T), -1)
    for i, p in enumerate(placed):
        groups[0, p.start : p.end] = i
    plain = ForwardBatch.build(cols, cols, torch.ones(1, T, dtype=torch.bool), T, ours.config.sliding_window,
                               write_start=0, last_only=False)
    plain.embeds = (where, rows)
    with torch.no_grad():
        got = ours(ids, plain.with_blocks(groups, ours.config.sliding_window), ours.new_cache(1, T))[0]
        causal = ours(ids, plain, ours.new_cache(1, T))[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (causal - expected).abs().max() > 1e-3  # the image blocks' two-way attention matters


def test_text_model_of_a_vision_checkpoint_loads_alone(models) -> None:
    """transformers' text tower of the same checkpoint gives the same logits on text (the renames read it)."""
    ours, hf, processor, folder = models
    ids = torch.tensor([[1, 400, 33, 1200, 7]])
    cols = torch.arange(5)[None]
    batch = ForwardBatch.build(cols, cols, torch.ones(1, 5, dtype=torch.bool), 5, ours.config.sliding_window,
                               write_start=0, last_only=False)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, batch, ours.new_cache(1, 5))[0], hf(input_ids=ids).logits[0],
                                   rtol=0, atol=1e-5)


def test_released_config_reads_as_transformers_fills_it() -> None:
    """gemma-3-4b-it's config.json lists only what differs from the defaults: read as transformers' Gemma3Config
    fills it in."""
    from nexttoken.config import ModelConfig

    released = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
                "mm_tokens_per_image": 256, "text_config": {
                    "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
                "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                  "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                  "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    filled = transformers.Gemma3Config(**{k: v for k, v in released.items() if k != "architectures"}).to_dict()
    filled["architectures"] = released["architectures"]
    ours, theirs = ModelConfig.from_dict(released), ModelConfig.from_dict(filled)
    assert ours == theirs
    assert (ours.num_attention_heads, ours.head_dim, ours.vocab_size) == (8, 256, 262208)
    assert ours.tie_word_embeddings
