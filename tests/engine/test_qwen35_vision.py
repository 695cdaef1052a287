"""Qwen3.5's vision tower end to end (issue 43): a tiny random-weight Qwen3_5ForConditionalGeneration (and
Qwen3_5MoeForConditionalGeneration: the same tower, the MoE text model) (a hybrid
text model: gated-DeltaNet layers before a gated attention layer, half of each head rotated by interleaved M-RoPE;
Qwen3-VL's tower without DeepStack) loaded as the declared Qwen3.5 family with its tower; features equal to
transformers' Qwen3_5VisionModel, tokens equal to transformers' generate with the same images and its processor's
inputs (Qwen3VLProcessor, as the released checkpoints ship), greedy and seeded, through LLM.generate, LLM.chat and
the engine (an image request beside text-only ones, small prefill chunks, one image encoded once)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.qwen_vl import build_qwen3_5, odd_images, reference_processor
from transformers import PreTrainedTokenizerFast

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig
from nexttoken.errors import ImageError
from nexttoken.images import read_images

pytestmark = pytest.mark.usefixtures("one_thread")

PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def vlm(request, tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_qwen3_5(folder, seed=1, moe=request.param == "qwen3_5_moe")
    processor = reference_processor(folder, qwen3=True)
    # transformers' AutoTokenizer gives model_type qwen3_5 its own Qwen3_5Tokenizer (Qwen's pre-tokenizer, not the
    # folder's tokenizer.json); the folder's tokenizer_config.json names the fast tokenizer its tokenizer.json is
    processor.tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    return nexttoken.load(folder), hf, processor, odd_images(seed=3)


def _transformers(vlm, text: str, images: list, new: int = 8, special: bool = True,  # noqa: ANN001
                  **options) -> list[int]:  # noqa: ANN003
    _, hf, processor, _ = vlm
    inputs = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=special)
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=new, min_new_tokens=new, **options)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_the_family_loads_its_hybrid_text_model_tower_and_processor(vlm) -> None:
    llm, hf, _, _ = vlm
    cfg = llm.model.config
    moe = type(hf).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert cfg.architecture == ("Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM")
    assert cfg.recurrent is not None and cfg.rotary_dim == 16 and (cfg.moe is not None) == moe
    assert (cfg.rope.mrope_section, cfg.rope.mrope_interleaved) == ((2, 3, 3), True)
    assert type(llm.model.vision).__name__ == "Qwen35VisionTower"
    assert llm.model.vision.config.deepstack_visual_indexes == ()
    assert llm.model.vision.image_token_id == hf.config.image_token_id
    assert type(llm.images).__name__ == "QwenVLImages"


def test_tower_features_equal_transformers(vlm) -> None:
    llm, hf, processor, pics = vlm
    images = [pics[0], pics[2], pics[5]]
    prepared = llm.images.prepare(images)
    want = processor.image_processor(images=images, return_tensors="pt")
    assert torch.equal(torch.as_tensor(prepared.extra["image_grid_thw"]), want["image_grid_thw"])
    got = llm.model.vision.encode(prepared)
    with torch.no_grad():
        ref = hf.model.visual(want["pixel_values"], grid_thw=want["image_grid_thw"]).pooler_output
    assert got.shape == ref.shape == (sum(prepared.tokens), hf.config.text_config.hidden_size)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("case", ["one wide image", "two images", "text only"])
def test_generate_greedy_equals_transformers(vlm, case) -> None:
    llm, _, _, pics = vlm
    text, images = {
        "one wide image": (f"look {PICTURE} what is it?", [pics[2]]),
        "two images": (f"a {PICTURE} and b {PICTURE} same?", [pics[3], pics[4]]),
        "text only": ("no picture here, words alone", []),
    }[case]
    got = llm.generate(text, images=images or None, max_new_tokens=8, min_new_tokens=8)
    assert got.token_ids == _transformers(vlm, text, images)


def test_generate_seeded_and_chat_equal_transformers(vlm) -> None:
    llm, _, processor, pics = vlm
    text = f"tell {PICTURE} a story"
    options = {"do_sample": True, "top_k": 20, "temperature": 0.9}
    got = llm.generate(text, images=[pics[6]], max_new_tokens=8, min_new_tokens=8, seed=5, **options)
    assert got.token_ids == _transformers(vlm, text, [pics[6]], seed=5, **options)
    messages = [{"role": "user", "content": [{"type": "image", "image": pics[7]},
                                             {"type": "text", "text": "describe it"}]}]
    got = llm.chat(messages, max_new_tokens=8, min_new_tokens=8)
    rendered = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert PICTURE in rendered
    assert got.token_ids == _transformers(vlm, rendered, [pics[7]], special=False)


def test_engine_mixes_image_and_text_requests(vlm) -> None:
    """Prefill in chunks of 8 (an image kept whole in its chunk), a text-only request in the same steps, one image
    in two requests encoded once; each request's recurrent state and M-RoPE offset its own."""
    llm, _, _, pics = vlm
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=512, chunk_size=8,
                                                              max_num_batched_tokens=64))
    cases = [(f"one {PICTURE} two", [pics[2]]), ("plain words only, nothing else", []),
             (f"again {PICTURE} with the same picture", [pics[2]])]
    seqs = []
    for text, images in cases:
        inputs = read_images(llm.images, images) if images else None
        ids = llm.tokenizer.encode(inputs.expand(text) if inputs else text)
        placed = inputs.placed(ids, llm.model.vision.image_token_id) if inputs else ()
        seqs.append(engine.add_request(ids, GenerationConfig(max_new_tokens=6, min_new_tokens=6), images=placed))
    assert seqs[0].rope_delta < 0 and seqs[1].rope_delta == 0
    while engine.has_unfinished():
        engine.step()
    for (text, images), seq in zip(cases, seqs):
        assert seq.output_ids == _transformers(vlm, text, images, new=6), text
    assert engine.runner.encoder.encoded == 1  # pics[2] in two requests


def test_a_checkpoint_without_tower_tensors_is_a_text_model(vlm, tmp_path) -> None:
    """A text-only export that kept the vision config (no `model.visual.*` tensors) loads its text model, as before
    the tower: its tokens are the full checkpoint's on text, and an image is an ImageError naming the fix."""
    llm, _, _, pics = vlm
    for f in llm.path.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(f).items() if ".visual." not in k}, tmp_path / f.name,
                      metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, tmp_path / f.name)
    text = nexttoken.load(tmp_path)
    assert getattr(text.model, "vision", None) is None and text.images is None
    prompt = "no picture here, words alone"
    assert text.generate(prompt, max_new_tokens=6).token_ids == llm.generate(prompt, max_new_tokens=6).token_ids
    with pytest.raises(ImageError):
        text.generate(f"look {PICTURE}", images=[pics[0]], max_new_tokens=2)
