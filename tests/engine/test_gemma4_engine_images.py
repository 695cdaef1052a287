"""Gemma 4's images through the engine (issue 43): a request with an image and text-only requests in the same
batches, greedy and seeded, give transformers' Gemma4ForConditionalGeneration.generate tokens; the image's
placeholders are prompt tokens and never split across prefill chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig
from nexttoken.images import processor_for, read_images
from nexttoken.model import load_model
from nexttoken.text.tokenizer import Tokenizer
from support.gemma4_vision import gemma4_vlm, hf_inputs


@pytest.fixture(scope="module", params=["causal", "two-way"])
def vlm(request, tmp_path_factory):  # noqa: ANN201
    """The tiny checkpoint, its image tokens attending causally or (use_bidirectional_attention "vision") each other
    both ways on the sliding layers during the prefill."""
    folder = tmp_path_factory.mktemp("gemma4")
    hf, _, _ = gemma4_vlm(folder, seed=2, two_way=request.param == "two-way")
    return load_model(folder), Tokenizer.from_dir(folder), hf, folder


def _photo(seed: int, shape=(30, 44, 3)) -> Image.Image:  # noqa: ANN001
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


def test_tokens_equal_transformers_greedy_and_seeded_mixed_with_text(vlm) -> None:
    model, tok, hf, folder = vlm
    cases = [  # (text, images, options)
        ("hi <|image|> what is it?", [_photo(0)], {}),
        ("just text, no picture at all", [], {}),
        ("compare <|image|> and <|image|> now", [_photo(1), _photo(2, (90, 12, 3))], {}),
        ("seeded <|image|> story", [_photo(3)], {"do_sample": True, "top_k": 20, "temperature": 0.8, "seed": 11}),
    ]
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=8, max_model_len=512, chunk_size=16,
                                                max_num_batched_tokens=96))
    chunks = []  # every prefill chunk the engine runs, observed on the way to the runner
    run = engine.runner.run
    engine.runner.run = lambda plan: (chunks.extend((c.start, c.end, c.seq.images) for c in plan.prefill), run(plan))[1]
    images_of = processor_for("gemma4", folder)
    seqs = []
    for text, images, options in cases:
        inputs = read_images(images_of, images) if images else None
        ids = tok.encode(inputs.expand(text) if images else text)
        placed = inputs.placed(ids, model.vision.image_token_id) if images else ()
        cfg = GenerationConfig(max_new_tokens=8, do_sample=options.get("do_sample", False),
                               top_k=options.get("top_k", 50), temperature=options.get("temperature", 1.0),
                               seed=options.get("seed"))
        seqs.append(engine.add_request(ids, cfg, images=placed))
    while engine.has_unfinished():
        engine.step()
    assert any(im for _, _, im in chunks)
    assert all(end <= im.start or im.end <= start or start <= im.start and im.end <= end
               for start, end, images in chunks for im in images)
    for seq, (text, images, options) in zip(seqs, cases):
        inputs = hf_inputs(folder, text, images)
        if options.get("do_sample"):
            torch.manual_seed(options["seed"])
        hf_options = {k: v for k, v in options.items() if k != "seed"}
        theirs = hf.generate(**inputs, max_new_tokens=8, **hf_options)[0, inputs["input_ids"].shape[1]:].tolist()
        assert seq.output_ids == theirs, text
        assert len(seq.prompt_ids) == inputs["input_ids"].shape[1]  # image tokens are prompt tokens


def test_two_way_blocks_change_the_numbers(vlm) -> None:
    """The check above can fail: with use_bidirectional_attention "vision", transformers' logits depend on the
    image blocks (mm_token_type_ids), and the tower tells the engine to lay them on the sliding layers only."""
    model, _, hf, folder = vlm
    inputs = hf_inputs(folder, "hi <|image|> what is it?", [_photo(0)])
    with torch.no_grad():
        blocks = hf(**inputs).logits
        causal = hf(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"}).logits
    two_way = hf.config.text_config.use_bidirectional_attention == "vision"
    assert model.vision.bidirectional == ("sliding" if two_way else False)
    assert ((blocks - causal).abs().max() > 1e-3) == two_way


def test_decode_rows_after_an_image_take_the_native_step(vlm, monkeypatch) -> None:
    """The images come in during the prefill; the decode rows after them are text-only steps, which the fused native
    step computes (Gemma 4's per-layer inputs included): every row native, the modules' tokens."""
    from nexttoken.model import fused

    model, tok, _, folder = vlm
    inputs = read_images(processor_for("gemma4", folder), [_photo(0)])
    ids = tok.encode(inputs.expand("hi <|image|> what is it?"))

    def run() -> list[int]:
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, max_model_len=512, chunk_size=16))
        seq = engine.add_request(ids, GenerationConfig(max_new_tokens=8), images=inputs.placed(
            ids, model.vision.image_token_id))
        while engine.has_unfinished():
            engine.step()
        return seq.output_ids

    rows: list[bool] = []
    real = fused.decode_rows
    monkeypatch.setattr(fused, "decode_rows", lambda *args: rows.append(real(*args)) or rows[-1])
    native = run()
    assert rows and all(r is not None for r in rows)
    with fused.disabled():
        assert run() == native
