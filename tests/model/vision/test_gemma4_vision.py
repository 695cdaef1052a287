"""Gemma 4's vision tower and embedder (nexttoken/model/vision/gemma4.py) and the image seam in Gemma 4's decoder
(model/gemma4.py: ForwardBatch.embeds, the placeholders' per-layer inputs read as the pad token's) against
transformers' Gemma4ForConditionalGeneration on the same weights; the declared checkpoint through LLM.generate /
LLM.chat, greedy and seeded, equal to transformers' generate."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import nexttoken
from nexttoken.images import processor_for, read_images
from nexttoken.images.gemma4 import Gemma4Images
from nexttoken.model import ForwardBatch, load_model
from nexttoken.model.vision.gemma4 import Gemma4Vision
from support.gemma4_vision import gemma4_vlm, hf_inputs


@pytest.fixture(scope="module")
def models(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("gemma4")
    hf, _, _ = gemma4_vlm(folder, seed=1)
    return load_model(folder), hf, folder


def _photos() -> list[Image.Image]:
    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for shape in ((37, 53, 3), (80, 21, 3))]


def _hf_generate(hf, inputs: dict, **options) -> list[int]:  # noqa: ANN001, ANN003
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    return hf.generate(**inputs, max_new_tokens=8, **options)[0, inputs["input_ids"].shape[1]:].tolist()


def test_features_equal_transformers(models) -> None:
    ours, hf, folder = models
    assert ours.config.architecture == "Gemma4ForConditionalGeneration" and ours.vision is not None
    pixels = transformers.Gemma4ImageProcessorPil.from_pretrained(folder)(_photos(), return_tensors="pt")
    with torch.no_grad():
        theirs = torch.cat(hf.model.get_image_features(pixels["pixel_values"],
                                                       pixels["image_position_ids"]).pooler_output)
    prepared = processor_for("gemma4", folder).prepare(_photos())
    got = ours.vision.encode(prepared)
    assert got.shape == (sum(prepared.tokens), 32) == theirs.shape
    torch.testing.assert_close(got, theirs, rtol=0, atol=1e-5)
    assert theirs.std() > 0.1


def test_clipped_linears_and_standardize_equal_transformers() -> None:
    """The options the tiny checkpoint leaves off: each linear clamping its input and output to stored bounds,
    and the pooled rows standardised by std_bias / std_scale, on a 3 x 3 pooling with padding."""
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, patch_size=2, pooling_kernel_size=3, position_embedding_size=200, use_clipped_linears=True,
        standardize=True)
    text = transformers.Gemma4TextConfig(vocab_size=64, hidden_size=24, num_hidden_layers=1, num_attention_heads=1,
                                         num_key_value_heads=1, head_dim=8, global_head_dim=8)
    config = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, t in hf.model.named_buffers():
            if name.endswith(("_min", "_max")):
                t.fill_(0.3 * (1 if name.endswith("_max") else -1))
            elif name.endswith(("std_bias", "std_scale")):
                t.normal_(0.0, 1.0)
        for name, p in hf.named_parameters():
            if "norm" in name or "position_embedding_table" in name:
                p.normal_(0.0, 0.5)
    tensors = {n: t for n, t in hf.state_dict().items() if n.startswith(Gemma4Vision.prefixes)}
    ours = Gemma4Vision.from_checkpoint(config.to_dict(), tensors)
    images = transformers.Gemma4ImageProcessorPil(patch_size=2, pooling_kernel_size=3, max_soft_tokens=70)
    pixels = images(_photos(), return_tensors="pt")
    with torch.no_grad():
        theirs = torch.cat(hf.model.get_image_features(pixels["pixel_values"],
                                                       pixels["image_position_ids"]).pooler_output)
    got = ours.encode(Gemma4Images(images.to_dict()).prepare(_photos()))
    torch.testing.assert_close(got, theirs, rtol=0, atol=1e-5)


def test_prefill_with_images_equals_transformers_logits(models) -> None:
    """Every position's logits of a prompt with two images: the encoder's rows replace the placeholders after the
    embedding scale, the placeholders' per-layer inputs are the pad token's, and they attend causally."""
    ours, hf, folder = models
    text = "a <|image|> b <|image|> c"
    theirs = hf_inputs(folder, text, _photos())
    with torch.no_grad():
        expected = hf(**theirs).logits[0]
        other = hf(**{**theirs, "pixel_values": theirs["pixel_values"].flip(0)}).logits[0]  # images swapped
    ids = theirs["input_ids"]
    T = ids.shape[1]
    inputs = read_images(processor_for("gemma4", folder), _photos())
    placed = inputs.placed(ids[0].tolist(), ours.vision.image_token_id)
    assert [p.end - p.start for p in placed] == [60, 64]
    cols = torch.arange(T)[None]
    batch = ForwardBatch.build(cols, cols, torch.ones(1, T, dtype=torch.bool), T, ours.config.sliding_window,
                               write_start=0, last_only=False)
    batch.embeds = (ids == ours.vision.image_token_id, torch.cat([ours.vision.encode(p.prepared) for p in placed]))
    with torch.no_grad():
        got = ours(ids, batch, ours.new_cache(1, T))[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (other - expected).abs().max() > 1e-2  # the images' rows matter


def test_generate_and_chat_equal_transformers_greedy_and_seeded(models) -> None:
    _, hf, folder = models
    llm = nexttoken.load(folder)
    photo = _photos()[0]
    text = "hi <|image|> what is it?"
    inputs = hf_inputs(folder, text, [photo])
    assert llm.generate(text, images=[photo], max_new_tokens=8).token_ids == _hf_generate(hf, inputs)
    sampled = llm.generate(text, images=[photo], max_new_tokens=8, do_sample=True, top_k=20, temperature=0.7, seed=4)
    assert sampled.token_ids == _hf_generate(hf, inputs, do_sample=True, top_k=20, temperature=0.7, seed=4)
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]
    prompt = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert "<|image|>" in prompt
    expected = _hf_generate(hf, hf_inputs(folder, prompt, [photo]))
    assert llm.chat(messages, max_new_tokens=8).token_ids == expected


def test_bidirectional_text_is_refused_by_name(models) -> None:
    """use_bidirectional_attention "all" (every token both ways) is not a decoder nexttoken runs: refused by name;
    "vision" loads (its image blocks: tests/engine/test_gemma4_images.py)."""
    import json

    from nexttoken.config import ModelConfig
    from nexttoken.errors import ModelLoadError

    _, _, folder = models
    raw = json.loads((folder / "config.json").read_text())
    assert ModelConfig.from_dict(raw).architecture == "Gemma4ForConditionalGeneration"
    raw["text_config"]["use_bidirectional_attention"] = "vision"
    assert ModelConfig.from_dict(raw).architecture == "Gemma4ForConditionalGeneration"
    raw["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention='all' is not supported"):
        ModelConfig.from_dict(raw)
