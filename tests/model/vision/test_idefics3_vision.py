"""Idefics3's / SmolVLM's tower and connector (nexttoken/model/vision/idefics3.py) against transformers'
get_image_features on the same pixel values, for both architectures, and the tower alone on padded tiles (the
patch mask and the bucketed positions of a partly real tile)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import idefics3 as tiny

from nexttoken.errors import ModelLoadError
from nexttoken.images.idefics3 import Idefics3Processor
from nexttoken.model.vision.idefics3 import Idefics3Vision


@pytest.fixture(scope="module", params=["SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"])
def checkpoint(request, shared_dir, tmp_path_factory):
    """(folder, transformers' model, our tower loaded from the folder's files)."""
    folder = tmp_path_factory.mktemp("vlm")
    model = tiny.build(folder, shared_dir / "models" / "stories260k", architecture=request.param)
    ours = Idefics3Vision(json.loads((folder / "config.json").read_text()))
    return folder, model, ours.load(load_file(folder / "model.safetensors"))


def test_features_equal_transformers(checkpoint) -> None:
    from PIL import Image

    folder, model, ours = checkpoint
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))]
    prepared = Idefics3Processor.from_dir(folder).prepare(images)
    with torch.no_grad():
        theirs = model.model.get_image_features(torch.from_numpy(prepared.pixel_values)[None],
                                                torch.from_numpy(prepared.extra["pixel_attention_mask"])[None])
    theirs = torch.cat(list(theirs.pooler_output))
    got = ours.encode(prepared)
    assert got.shape == (sum(prepared.tokens), 64) == theirs.shape
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.std() > 0.5  # the random weights move the numbers


def test_padded_tiles_equal_transformers(checkpoint) -> None:
    """Tiles only partly real (the rest padding): the patch mask, the positions bucketed over the real patches
    and the keys the padding hides, as Idefics3VisionTransformer computes them."""
    _, model, ours = checkpoint
    torch.manual_seed(0)
    pixels = torch.randn(3, 3, 32, 32)
    mask = torch.ones(3, 32, 32, dtype=torch.bool)
    mask[0, 20:, :] = False
    mask[1, :, 13:] = False  # 13 columns: a partly real patch counts as real
    for i in (0, 1):
        pixels[i][:, ~mask[i]] = 0
    patches = mask.reshape(3, 8, 4, 8, 4).any(dim=4).any(dim=2)
    with torch.no_grad():
        theirs = model.model.vision_model(pixels, patch_attention_mask=patches).last_hidden_state
        got = ours.vision_model(pixels, mask)
    real = patches.reshape(3, -1)
    torch.testing.assert_close(got[real], theirs[real], rtol=1e-5, atol=1e-5)


def test_the_declared_checkpoint_generates_as_transformers(checkpoint) -> None:
    """The family declaration end to end (both architectures): nexttoken.load reads the text model from
    text_config and hangs the tower beside it; greedy tokens equal transformers' generate."""
    import nexttoken
    from PIL import Image

    folder, model, _ = checkpoint
    photo = Image.fromarray(np.random.default_rng(2).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    prompt = "User:<image>Once upon a time<end_of_utterance>\nAssistant:"
    inputs = tiny.hf_processor(folder)(text=[prompt], images=[[photo]], return_tensors="pt")
    theirs = model.generate(**inputs, max_new_tokens=6)[0, inputs["input_ids"].shape[1]:].tolist()
    assert nexttoken.load(folder).generate(prompt, images=[photo], max_new_tokens=6).token_ids == theirs


def test_tensors_must_match_the_config(checkpoint) -> None:
    folder, _, _ = checkpoint
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = 3
    with pytest.raises(ModelLoadError, match="missing"):
        Idefics3Vision(config).load(load_file(folder / "model.safetensors"))
