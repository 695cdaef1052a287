"""Images through the engine (issue 43): each request's images encoded before the prefill chunk that holds them,
through the encoder cache (one image encoded once), chunks never splitting an image, prefix-cache keys naming the
images, image tokens counted as prompt tokens; tokens equal to transformers' generate with the same images, greedy
and seeded, with text-only requests in the same batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.engine.encoder import EncoderCache
from nexttoken.errors import ImageError
from nexttoken.generation.config import GenerationConfig
from nexttoken.images import processor_for, read_images
from nexttoken.model import load_model
from nexttoken.text.tokenizer import Tokenizer
from support.vision import gemma3_vlm

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("gemma3")
    hf, processor = gemma3_vlm(folder, seed=2)
    return load_model(folder), Tokenizer.from_dir(folder), hf, processor, processor_for("gemma3", folder)


def _photo(seed: int, shape=(30, 44, 3)) -> Image.Image:  # noqa: ANN001
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


def _engine(model, tok, prefix_caching: bool = False) -> LLMEngine:  # noqa: ANN001
    config = EngineConfig(max_num_seqs=8, max_model_len=256, chunk_size=8, max_num_batched_tokens=64,
                          enable_prefix_caching=prefix_caching)
    return LLMEngine(model, tok, config)


def _request(vlm, text: str, images: list):  # noqa: ANN001, ANN202
    model, tok, _, _, images_of = vlm
    inputs = read_images(images_of, images)
    ids = tok.encode(inputs.expand(text))
    return ids, inputs.placed(ids, model.vision.image_token_id)


def _transformers(vlm, text: str, images: list, **options) -> list[int]:  # noqa: ANN001, ANN003
    _, _, hf, processor, _ = vlm
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    out = hf.generate(**inputs, max_new_tokens=8, **options)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_tokens_equal_transformers_greedy_and_seeded_mixed_with_text(vlm) -> None:
    model, tok, *_ = vlm
    cases = [  # (text, images, options): an image across a chunk boundary, two images, text alone, a seeded draw
        ("hi <start_of_image> what is it?", [_photo(0)], {}),
        ("compare <start_of_image> and <start_of_image> now", [_photo(1), _photo(2, (90, 12, 3))], {}),
        ("just text, no picture at all", [], {}),
        ("seeded <start_of_image> story", [_photo(3)], {"do_sample": True, "top_k": 20, "temperature": 0.8,
                                                        "seed": 11}),
    ]
    engine = _engine(model, tok)
    chunks = []  # every prefill chunk the engine runs, observed on the way to the runner
    run = engine.runner.run
    engine.runner.run = lambda plan: (chunks.extend((c.start, c.end, c.seq.images) for c in plan.prefill), run(plan))[1]
    seqs = []
    for text, images, options in cases:
        ids, placed = _request(vlm, text, images)
        cfg = GenerationConfig(max_new_tokens=8, do_sample=options.get("do_sample", False),
                               top_k=options.get("top_k", 50), temperature=options.get("temperature", 1.0),
                               seed=options.get("seed"))
        seqs.append(engine.add_request(ids, cfg, images=placed))
    first = seqs[0].images[0]
    assert first.start // 8 != (first.end - 1) // 8  # its placeholders straddle a chunk boundary: moved, not split
    while engine.has_unfinished():
        engine.step()
    assert all(end <= im.start or im.end <= start or start <= im.start and im.end <= end
               for start, end, images in chunks for im in images)
    for seq, (text, images, options) in zip(seqs, cases):
        assert seq.output_ids == _transformers(vlm, text, images, **options), text
        assert len(seq.prompt_ids) == len(_request(vlm, text, images)[0])  # image tokens are prompt tokens


def test_two_requests_with_one_image_encode_it_once(vlm) -> None:
    model, tok, *_ = vlm
    engine = _engine(model, tok)
    photo = _photo(5)
    texts = ["first <start_of_image> question", "second, longer <start_of_image> question here"]
    seqs = [engine.add_request(*_request(vlm, t, [photo])[:1], GenerationConfig(max_new_tokens=8),
                               images=_request(vlm, t, [photo])[1]) for t in texts]
    while engine.has_unfinished():
        engine.step()
    cache = engine.runner.encoder
    assert (cache.encoded, cache.hits, len(cache)) == (1, 1, 1)
    for seq, text in zip(seqs, texts):
        assert seq.output_ids == _transformers(vlm, text, [photo])


def test_prefix_cache_keys_name_the_images(vlm) -> None:
    """The same prompt text with another picture shares only the blocks before the picture; with the same
    picture, more; and both answer as transformers does for their own picture."""
    model, tok, *_ = vlm
    engine = _engine(model, tok, prefix_caching=True)
    words = LONG.split()
    for n in range(len(words)):  # a prefix that puts the picture inside one chunk, so later chunks stay whole
        text = " ".join(words[n:]) + " <start_of_image> " + LONG + " what is it?"
        image = _request(vlm, text, [_photo(6)])[1][0]
        if image.start // 8 == (image.end - 1) // 8 and image.start >= 16:
            break
    hits = []
    for photo in (_photo(6), _photo(7), _photo(6)):
        ids, placed = _request(vlm, text, [photo])
        seq = engine.add_request(ids, GenerationConfig(max_new_tokens=8), images=placed)
        while engine.has_unfinished():
            engine.step()
        assert seq.output_ids == _transformers(vlm, text, [photo])
        hits.append(seq.prefix_hit_tokens)
    assert hits[0] == 0 and 0 < hits[1] <= image.start and hits[2] >= image.end


def test_images_need_a_vision_model_and_matching_placeholders(vlm, tmp_path) -> None:
    model, tok, *_ = vlm
    ids, placed = _request(vlm, "look <start_of_image> here", [_photo(8)])
    with pytest.raises(ImageError, match="take 4"):
        _engine(model, tok).add_request(ids[:-8] + ids[-4:], GenerationConfig(max_new_tokens=2), images=placed)
    text_model = load_model(_text_folder(tmp_path))
    with pytest.raises(ImageError, match="LlamaForCausalLM.*reads text only.*vision-language"):
        LLMEngine(text_model, None, EngineConfig(max_num_seqs=2, max_model_len=64)).add_request(
            [1, 2, 3], GenerationConfig(max_new_tokens=2), images=placed)


def _text_folder(tmp_path):  # noqa: ANN001, ANN202
    from support.tiny_models import build_hf_model

    build_hf_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_encoder_cache_is_bounded_in_bytes(vlm) -> None:
    model, tok, *_ = vlm
    rows = 4 * 32 * 4  # one image's features: 4 tokens x 32 float32
    cache = EncoderCache(model.vision, max_bytes=2 * rows)
    images = [_request(vlm, "<start_of_image>", [_photo(20 + i)])[1][0] for i in range(3)]
    for image in images + images[-1:]:
        cache.features(image)
    assert (len(cache), cache.bytes, cache.encoded, cache.hits) == (2, 2 * rows, 3, 1)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, max_model_len=64, encoder_cache_memory=rows))
    assert engine.runner.encoder.max_bytes == rows


def test_async_engine_streams_requests_with_images(vlm) -> None:
    """The server's engine thread (AsyncEngine) carries a request's images to the engine: the same tokens."""
    import asyncio

    from nexttoken.engine.async_engine import AsyncEngine

    model, tok, *_ = vlm
    text = "async <start_of_image> please"
    ids, placed = _request(vlm, text, [_photo(30)])
    engine = AsyncEngine(_engine(model, tok))
    engine.start()

    async def tokens() -> list[int]:
        return [t async for e in engine.stream("r", ids, GenerationConfig(max_new_tokens=8), images=placed)
                for t in e.token_ids]

    try:
        assert asyncio.run(tokens()) == _transformers(vlm, text, [_photo(30)])
    finally:
        engine.shutdown()


def test_preempted_requests_with_images_recompute_the_same_tokens(vlm) -> None:
    """A pool too small for every request: the preempted ones prefill their images again (from the encoder
    cache) and answer as transformers does."""
    model, tok, *_ = vlm
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=3, max_model_len=128, chunk_size=8, block_size=4,
                                                num_kv_blocks=16, enable_prefix_caching=False))
    cases = [(f"case {i} <start_of_image> what now?", [_photo(40 + i)]) for i in range(3)]
    seqs = [engine.add_request(*_request(vlm, t, im)[:1], GenerationConfig(max_new_tokens=8),
                               images=_request(vlm, t, im)[1]) for t, im in cases]
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.encoder.encoded == 3 and engine.runner.encoder.hits > 0
    for seq, (text, images) in zip(seqs, cases):
        assert seq.output_ids == _transformers(vlm, text, images)
