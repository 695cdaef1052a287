"""Qwen2.5-VL and Qwen3-VL end to end (issue 43): tiny random-weight Qwen2_5_VLForConditionalGeneration and
Qwen3VLForConditionalGeneration checkpoints loaded as declared families, their images prepared, encoded by the
tower (Qwen3-VL: its DeepStack rows added after the first decoder layers) and placed by M-RoPE's 3-D positions
(Qwen3-VL: interleaved); tokens equal to
transformers' generate with the same images and its processor's inputs, greedy and seeded, through LLM.generate,
LLM.chat and the engine (small prefill chunks that an image must not be split by, text-only requests beside)."""

from __future__ import annotations

import pytest
import torch
from support.qwen_vl import build_qwen2_5_vl, odd_images, reference_processor

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig
from nexttoken.images import read_images

pytestmark = pytest.mark.usefixtures("one_thread")

PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, tmp_path_factory):  # noqa: ANN201
    qwen3 = request.param == "qwen3_vl"
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_qwen2_5_vl(folder, tokenizer=True, seed=1, qwen3=qwen3)
    return nexttoken.load(folder), hf, reference_processor(folder, qwen3), odd_images(seed=3)


def _transformers(vlm, text: str, images: list, new: int = 8, special: bool = True,  # noqa: ANN001
                  **options) -> list[int]:  # noqa: ANN003
    _, hf, processor, _ = vlm
    inputs = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=special)
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=new, min_new_tokens=new, **options)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_declared_family_loads_tower_and_processor(vlm) -> None:
    llm, hf, _, _ = vlm
    qwen3 = type(hf).__name__ == "Qwen3VLForConditionalGeneration"
    assert llm.model.config.architecture == type(hf).__name__
    assert llm.model.config.rope.mrope_section == (2, 3, 3)
    assert llm.model.config.rope.mrope_interleaved == qwen3
    assert type(llm.model.vision).__name__ == ("Qwen3VisionTower" if qwen3 else "QwenVisionTower")
    assert llm.model.vision.image_token_id == hf.config.image_token_id
    assert type(llm.images).__name__ == "QwenVLImages"


@pytest.mark.parametrize("case", ["one wide image", "two images", "tall + grayscale + rgba", "text only"])
def test_generate_greedy_equals_transformers(vlm, case) -> None:
    llm, _, _, pics = vlm
    text, images = {
        "one wide image": (f"look {PICTURE} what is it?", [pics[2]]),
        "two images": (f"a {PICTURE} and b {PICTURE} same?", [pics[0], pics[1]]),
        "tall + grayscale + rgba": (f"{PICTURE}{PICTURE} then {PICTURE}", [pics[3], pics[4], pics[5]]),
        "text only": ("no picture here, words alone", []),
    }[case]
    got = llm.generate(text, images=images or None, max_new_tokens=8, min_new_tokens=8)
    assert got.token_ids == _transformers(vlm, text, images)


def test_generate_seeded_equals_transformers(vlm) -> None:
    llm, _, _, pics = vlm
    text = f"tell {PICTURE} a story"
    options = {"do_sample": True, "top_k": 20, "temperature": 0.9}
    got = llm.generate(text, images=[pics[6]], max_new_tokens=8, min_new_tokens=8, seed=5, **options)
    assert got.token_ids == _transformers(vlm, text, [pics[6]], seed=5, **options)


def test_chat_with_an_image_part_equals_transformers(vlm) -> None:
    llm, _, processor, pics = vlm
    messages = [{"role": "user", "content": [{"type": "image", "image": pics[7]},
                                             {"type": "text", "text": "describe it"}]}]
    got = llm.chat(messages, max_new_tokens=8, min_new_tokens=8)
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert PICTURE in text
    # the rendered template holds its special tokens: tokenized without adding more, as apply_chat_template does
    assert got.token_ids == _transformers(vlm, text, [pics[7]], special=False)


def test_engine_chunks_cache_and_mixed_batch(vlm) -> None:
    """Prefill in chunks of 8 (an image moved whole to its own chunk), text-only requests in the same steps, one
    image in two requests encoded once; decode steps continue from each request's M-RoPE offset."""
    llm, _, _, pics = vlm
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=512, chunk_size=8,
                                                              max_num_batched_tokens=64))
    cases = [(f"one {PICTURE} two", [pics[2]]), ("plain words only, nothing else", []),
             (f"again {PICTURE} with the same picture", [pics[2]]), (f"{PICTURE} x", [pics[0]])]
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
    assert engine.runner.encoder.encoded == 2  # pics[2] twice, pics[0] once


def test_preempted_and_speculated_requests_keep_their_positions(vlm) -> None:
    """A pool too small for every request (the preempted ones recompute, their generated tokens at column +
    rope_delta), and prompt-lookup speculation (its verification rows at column + rope_delta): transformers' tokens."""
    llm, _, _, pics = vlm
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=3, max_model_len=128, chunk_size=8,
                                                              block_size=4, num_kv_blocks=16,
                                                              enable_prefix_caching=False))
    cases = [(f"case {i} {PICTURE} what now?", [pics[i]]) for i in (0, 4, 6)]
    seqs = []
    for text, images in cases:
        inputs = read_images(llm.images, images)
        ids = llm.tokenizer.encode(inputs.expand(text))
        seqs.append(engine.add_request(ids, GenerationConfig(max_new_tokens=8, min_new_tokens=8),
                                       images=inputs.placed(ids, llm.model.vision.image_token_id)))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    for seq, (text, images) in zip(seqs, cases):
        assert seq.output_ids == _transformers(vlm, text, images), text
    text = f"{PICTURE} the the the the the the"
    got = llm.generate(text, images=[pics[2]], max_new_tokens=8, min_new_tokens=8, prompt_lookup_num_tokens=3)
    assert got.token_ids == _transformers(vlm, text, [pics[2]])
