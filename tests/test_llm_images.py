"""LLM.generate / stream / chat with images (issue 43) on a tiny Gemma3ForConditionalGeneration: the same tokens as
transformers' processor + generate (greedy and seeded) from every image source and both chat part shapes; a
text model given an image is an ImageError naming the model and the fix."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

import nexttoken
from nexttoken.errors import ImageError
from support.vision import gemma3_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("gemma3")
    hf, processor = gemma3_vlm(folder, seed=3)
    return nexttoken.load(folder), hf, processor


def _photo(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (33, 47, 3), dtype=np.uint8))


def _hf(hf, inputs, **options) -> list[int]:  # noqa: ANN001, ANN003
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    out = hf.generate(**inputs, max_new_tokens=8, **options)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_generate_and_stream_with_images_equal_transformers(vlm, tmp_path) -> None:
    llm, hf, processor = vlm
    path = tmp_path / "a.png"
    _photo(0).save(path)
    text = "look <start_of_image> and <start_of_image> then"
    inputs = processor(text=text, images=[_photo(0), _photo(1)], return_tensors="pt")
    greedy = llm.generate(text, images=[str(path), np.asarray(_photo(1))], max_new_tokens=8)
    assert greedy.token_ids == _hf(hf, inputs)
    assert greedy.prompt_tokens == inputs["input_ids"].shape[1]  # the image tokens count as prompt tokens
    sampled = llm.generate(text, images=[path.read_bytes(), _photo(1)], max_new_tokens=8, do_sample=True, top_k=20,
                           temperature=0.7, seed=4)
    assert sampled.token_ids == _hf(hf, inputs, do_sample=True, top_k=20, temperature=0.7, seed=4)
    assert "".join(llm.stream(text, images=[_photo(0), _photo(1)], max_new_tokens=8)) == greedy.text
    both = llm.generate([text, "plain text"], images=[[_photo(0), _photo(1)], []], max_new_tokens=8)
    assert both[0].token_ids == greedy.token_ids
    assert both[1].token_ids == _hf(hf, processor(text="plain text", return_tensors="pt"))


def test_chat_with_image_parts_equals_transformers(vlm) -> None:
    llm, hf, processor = vlm
    buf = io.BytesIO()
    _photo(2).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    theirs = [{"role": "user", "content": [{"type": "image", "image": _photo(2)},
                                           {"type": "text", "text": "What is this?"}]}]
    inputs = processor.apply_chat_template(theirs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    expected = _hf(hf, inputs)
    openai = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": "What is this?"}]}]
    assert llm.chat(openai, max_new_tokens=8).token_ids == expected
    assert llm.chat(theirs, max_new_tokens=8).token_ids == expected
    assert "".join(llm.stream_chat(openai, max_new_tokens=8)) == llm.chat(openai, max_new_tokens=8).text
    with pytest.raises(nexttoken.errors.GenerationConfigError, match="images work with greedy"):
        llm.chat(openai, max_new_tokens=4, num_beams=2)


def test_text_model_given_an_image_names_the_model_and_the_fix(model_dir) -> None:
    llm = nexttoken.load(model_dir)
    with pytest.raises(ImageError, match=r"LlamaForCausalLM.*reads text only.*vision-language checkpoint"):
        llm.generate("Tom <image>", images=[_photo(3)], max_new_tokens=2)
    with pytest.raises(ImageError, match="reads text only"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": _photo(3)}]}], max_new_tokens=2)
