"""LFM2-VL's SigLIP2 NaFlex tower and projector (nexttoken/model/vision/lfm2_vl.py) against transformers'
Lfm2VlModel.get_image_features on the same patchified inputs: tiles of different patch grids in one batch (the
position grid resized to each, the padding patches masked), then the pixel unshuffle and the MLP."""

from __future__ import annotations

import pytest
import torch

from nexttoken.errors import ModelLoadError
from nexttoken.model.vision.lfm2_vl import Lfm2VlVision


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    import transformers

    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, patch_size=4, num_patches=64, vision_use_head=False)
    text = dict(model_type="lfm2", vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
    config = transformers.Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=5,
                                       projector_hidden_size=40, downsample_factor=2)
    torch.manual_seed(0)
    hf = transformers.Lfm2VlForConditionalGeneration(config).eval()
    with torch.no_grad():  # LayerNorms and biases start at ones and zeros: make each one matter
        for name, p in hf.named_parameters():
            if ("vision_tower" in name or "projector" in name) and ("norm" in name or name.endswith("bias")):
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
            elif "vision_tower" in name or "projector" in name:
                p.normal_(0.0, 0.2)
    return hf


def test_features_equal_transformers(model) -> None:
    shapes = torch.tensor([[6, 8], [4, 4], [10, 2]])  # patch rows x columns of three tiles, padded to 48
    length = 48
    torch.manual_seed(1)
    pixels = torch.randn(3, length, 3 * 4 * 4)
    mask = torch.arange(length)[None] < shapes.prod(-1)[:, None]  # (3, 48)
    pixels[~mask] = 0
    with torch.no_grad():
        theirs = torch.cat(list(model.model.get_image_features(pixels, shapes, mask).pooler_output))
    ours = Lfm2VlVision(model.config.to_dict()).load(model.state_dict())
    got = ours.features(ours.vision_tower(pixels, mask, shapes), shapes)
    assert got.shape == theirs.shape == (12 + 4 + 5, 64)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
    assert theirs.std() > 0.1


def test_tensors_must_match_the_config(model) -> None:
    config = model.config.to_dict()
    config["projector_hidden_size"] = 41
    with pytest.raises(ModelLoadError, match="do not match"):
        Lfm2VlVision(config).load(model.state_dict())
