"""Qwen2.5-VL's (and Qwen3-VL's) vision tower and M-RoPE decoder against transformers' models on the same tiny
random weights: the tower's features on the same pixel values, the 3-D positions of get_rope_index, and
the text model's logits with those positions given."""

import json

import pytest
import torch
from support.qwen_vl import SMALL_IDS, build_qwen2_5_vl, odd_images

from nexttoken.config import ModelConfig
from nexttoken.images.qwen_vl import QwenVLImages
from nexttoken.model.batch import ForwardBatch
from nexttoken.model.rope import mrope_index
from nexttoken.model.vision.qwen_vl import QwenVisionTower
from nexttoken.model.weights.loader import build_model, read_tensors, safetensors_files

IMAGE = SMALL_IDS["image_token_id"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = build_qwen2_5_vl(folder)
    tensors = read_tensors(safetensors_files(folder))
    raw = json.loads((folder / "config.json").read_text())
    return folder, hf, raw, tensors


@pytest.fixture(scope="module")
def prepared(checkpoint):
    images = odd_images()
    return QwenVLImages.from_dir(checkpoint[0]).prepare([images[0], images[2], images[5], images[1]])


def test_tower_features_equal_transformers(checkpoint, prepared):
    _, hf, raw, tensors = checkpoint
    tower = QwenVisionTower.from_tensors(raw["vision_config"], tensors)
    pixels, grid = torch.from_numpy(prepared.pixel_values), torch.from_numpy(prepared.extra["image_grid_thw"])
    with torch.no_grad():
        want = torch.cat(hf.model.get_image_features(pixels, grid).pooler_output)
    got = tower.encode(prepared.pixel_values, prepared.extra["image_grid_thw"])
    assert got.shape == (sum(prepared.tokens), 64)
    # several windows per image (56-pixel windows over up to 8 x 8 tokens) and one full-attention block
    assert max(int(h) for _, h, _ in prepared.extra["image_grid_thw"]) // 2 > 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _prompt(prepared) -> list[int]:
    ids = [5, 6, SMALL_IDS["vision_start_token_id"]]
    for count in prepared.tokens:
        ids += [IMAGE] * count + [SMALL_IDS["vision_end_token_id"], 7, 8, SMALL_IDS["vision_start_token_id"]]
    return ids[:-1] + [9, 10]


def test_positions_equal_get_rope_index(checkpoint, prepared):
    _, hf, _, _ = checkpoint
    ids = _prompt(prepared)
    grid = torch.from_numpy(prepared.extra["image_grid_thw"])
    tensor = torch.tensor([ids])
    want, delta = hf.model.get_rope_index(tensor, mm_token_type_ids=(tensor == IMAGE).int(), image_grid_thw=grid)
    got, got_delta = mrope_index(ids, IMAGE, [tuple(g) for g in grid.tolist()], 2)
    assert torch.equal(got, want[:, 0]) and got_delta == int(delta)
    assert got_delta < 0  # images take fewer positions than tokens: later tokens continue from the max


def test_decoder_logits_with_mrope_positions(checkpoint, prepared):
    """The text model alone (image tokens embedded as their id), rotated by the 3-D positions."""
    _, hf, raw, tensors = checkpoint
    cfg = ModelConfig.from_dict({**raw["text_config"], "architectures": ["Qwen2ForCausalLM"],
                                 "tie_word_embeddings": False})
    assert cfg.rope.mrope_section == (2, 3, 3)
    text = {k: v for k, v in tensors.items() if not k.startswith("visual.")}
    model = build_model(cfg, text, checkpoint[0], torch.device("cpu"), torch.float32)
    ids = _prompt(prepared)
    positions, _ = mrope_index(ids, IMAGE, [tuple(g) for g in prepared.extra["image_grid_thw"].tolist()], 2)
    tensor = torch.tensor([ids])
    with torch.no_grad():
        want = hf(input_ids=tensor, position_ids=positions[:, None]).logits[0]
    n = len(ids)
    cache = model.new_cache(1, n)
    batch = ForwardBatch.build(positions[0][None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool), n,
                               write_start=0, last_only=False)
    batch.mrope_positions = positions[:, None]
    with torch.no_grad():
        got = model(tensor, batch, cache)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = ForwardBatch.build(positions[0][None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool), n,
                               write_start=0, last_only=False)
    with torch.no_grad():
        assert not torch.allclose(model(tensor, plain, model.new_cache(1, n))[0], want, atol=1e-3)


def test_text_only_mrope_is_plain_rope():
    from nexttoken.model.rope import inverse_frequencies, mrope_cos_sin, rope_cos_sin

    cfg = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 64,
                                 "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}})
    inv = inverse_frequencies(cfg.rope, 16)
    positions = torch.arange(11)[None]
    for interleaved in (False, True):
        got = mrope_cos_sin(inv, positions.expand(3, 1, -1), torch.float32, cfg.rope.mrope_section, interleaved)
        for a, b in zip(got, rope_cos_sin(inv, positions, torch.float32)):
            assert torch.equal(a, b)


def test_mrope_section_must_split_the_head():
    from nexttoken.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="mrope_section"):
        ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 64,
                               "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
                               "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 4]}})


def test_image_tokens_must_match_the_grids(prepared):
    from nexttoken.errors import ImageError

    grids = [tuple(g) for g in prepared.extra["image_grid_thw"].tolist()]
    with pytest.raises(ImageError):
        mrope_index([1, IMAGE, IMAGE, 2], IMAGE, grids, 2)


def test_qwen3_tower_features_and_deepstack_equal_transformers(tmp_path):
    from nexttoken.model.vision.qwen3_vl import Qwen3VisionTower

    hf = build_qwen2_5_vl(tmp_path, qwen3=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    tower = Qwen3VisionTower.from_checkpoint(raw, read_tensors(safetensors_files(tmp_path)))
    images = odd_images()
    prepared = QwenVLImages.from_dir(tmp_path).prepare([images[0], images[3], images[1]])
    pixels, grid = torch.from_numpy(prepared.pixel_values), torch.from_numpy(prepared.extra["image_grid_thw"])
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, grid)
    want = torch.cat([torch.cat(out.pooler_output), *(torch.cat(d) for d in out.deepstack_features)], dim=-1)
    got = tower.encode(prepared)
    assert got.shape == (sum(prepared.tokens), 64 * 3)  # the final merger's rows, then two DeepStack mergers'
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
