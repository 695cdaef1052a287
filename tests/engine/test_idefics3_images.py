"""SmolVLM and Idefics3 end to end (issue 43): images through the library (LLM.generate with images=, LLM.chat with
image parts) and the engine (several requests at once, a small prefill chunk that images must not straddle, a
text-only request beside them), greedy and seeded tokens equal to transformers' generate on the same tiny
checkpoint, and one image encoded once for two requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from support import idefics3 as tiny

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig

PROMPT = "User:<image>Once upon a time<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def vlm(shared_dir, tmp_path_factory):  # noqa: ANN201
    """(transformers' model, its processor, our LLM) on one tiny SmolVLM folder (Idefics3's declaration, the same
    network, is run in tests/model/vision/test_idefics3_vision.py)."""
    folder = tmp_path_factory.mktemp("vlm")
    hf = tiny.build(folder, shared_dir / "models" / "stories260k", seed=3)
    return hf, tiny.hf_processor(folder), nexttoken.load(str(folder))


def _photo(seed: int, shape=(37, 53, 3)) -> Image.Image:  # noqa: ANN001
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


def _transformers(vlm, text: str, images: list, **options) -> list[int]:  # noqa: ANN001, ANN003
    hf, processor, _ = vlm
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    out = hf.generate(**inputs, max_new_tokens=8, **options)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_generate_and_chat_equal_transformers(vlm) -> None:
    _, processor, llm = vlm
    photo = _photo(0)
    assert llm.generate(PROMPT, images=[photo], max_new_tokens=8).token_ids == _transformers(vlm, PROMPT, [photo])
    seeded = dict(do_sample=True, top_k=20, temperature=0.9, seed=5)
    assert (llm.generate(PROMPT, images=[photo], max_new_tokens=8, **seeded).token_ids
            == _transformers(vlm, PROMPT, [photo], **seeded))
    messages = [{"role": "user", "content": [{"type": "image", "image": photo},
                                             {"type": "text", "text": "Tell me a story."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert llm.chat(messages, max_new_tokens=8).token_ids == _transformers(vlm, text, [photo])


def test_engine_batches_images_and_text_and_encodes_an_image_once(vlm) -> None:
    _, _, llm = vlm
    photo, tall = _photo(1), _photo(2, (90, 12, 3))
    cases = [  # (text, images, options): one image (5 tiles: 80 placeholders over 8-column chunks), two, none
        (PROMPT, [photo], {}),
        ("<image>and<image>: which?", [tall, photo], {}),
        ("Once upon a time there was", [], {}),
        ("A story about <image>", [tall], {"do_sample": True, "top_k": 20, "temperature": 0.8, "seed": 11}),
    ]
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=8, max_model_len=2048, chunk_size=8,
                                                              max_num_batched_tokens=512))
    seqs = []
    for text, images, options in cases:
        inputs = llm._read_images(images) if images else None
        ids = llm.encode(inputs.expand(text) if inputs else text)
        placed = inputs.placed(ids, llm.model.vision.image_token_id) if inputs else ()
        cfg = GenerationConfig(max_new_tokens=8, do_sample=options.get("do_sample", False),
                               top_k=options.get("top_k", 50), temperature=options.get("temperature", 1.0),
                               seed=options.get("seed"))
        seqs.append(engine.add_request(ids, cfg, images=placed))
    while engine.has_unfinished():
        engine.step()
    for seq, (text, images, options) in zip(seqs, cases):
        assert seq.output_ids == _transformers(vlm, text, images, **options), text
    cache = engine.runner.encoder
    assert (cache.encoded, cache.hits) == (2, 2)  # photo and tall encoded once each, each found again once
