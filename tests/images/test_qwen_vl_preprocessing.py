"""Qwen2-VL / Qwen2.5-VL preprocessing against transformers' slow image processor (the PIL backend that
`use_fast=False` picks without torchvision) and its processor's placeholder expansion, on awkward images."""

import json

import numpy as np
import pytest
from support.qwen_vl import PREPROCESSOR, odd_images, reference_processor

from nexttoken.errors import ImageError
from nexttoken.images.qwen_vl import QwenVLImages, smart_resize


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import AutoImageProcessor

    folder = tmp_path_factory.mktemp("qwen_vl_pre")
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    processor = AutoImageProcessor.from_pretrained(folder, use_fast=False)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    return processor, QwenVLImages.from_dir(folder)


@pytest.fixture(scope="module")
def images():
    return odd_images()


@pytest.mark.parametrize("index", range(8))
def test_pixel_values_equal_transformers(reference, images, index):
    processor, ours = reference
    image = images[index]
    want = processor(images=[image], return_tensors="np")
    got = ours.prepare([image])
    assert got.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(got.extra["image_grid_thw"], want["image_grid_thw"])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], rtol=0, atol=1e-6)
    t, h, w = want["image_grid_thw"][0]
    assert got.tokens == [t * h * w // 4]


def test_several_images_concatenate_in_order(reference, images):
    processor, ours = reference
    images = images[:4]
    want = processor(images=images, return_tensors="np")
    got = ours.prepare(images)
    np.testing.assert_array_equal(got.extra["image_grid_thw"], want["image_grid_thw"])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], rtol=0, atol=1e-6)


def test_defaults_and_size_keys_read_as_transformers_does(images):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = images[1]
    default = Qwen2VLImageProcessorPil()(images=[image], return_tensors="np")
    ours = QwenVLImages.from_config({})
    np.testing.assert_array_equal(ours.prepare([image]).extra["image_grid_thw"], default["image_grid_thw"])
    sized = {"size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 9}}
    want = Qwen2VLImageProcessorPil(**sized)(images=[image], return_tensors="np")
    np.testing.assert_array_equal(QwenVLImages.from_config(sized).prepare([image]).extra["image_grid_thw"],
                                  want["image_grid_thw"])


def test_expand_matches_the_processor(reference, images, shared_dir):
    from nexttoken.text.tokenizer import Tokenizer

    tokenizer_dir = shared_dir / "tokenizers" / "qwen2.5-instruct"
    _, ours = reference
    processor = reference_processor(tokenizer_dir)
    images = images[2:4]
    text = "a <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>?"
    want = processor(text=[text], images=images, return_tensors="np")
    prepared = ours.prepare(images)
    expanded = ours.expand(text, prepared)
    ids = Tokenizer.from_dir(tokenizer_dir).encode(expanded)
    assert ids == want["input_ids"][0].tolist()
    image_id = Tokenizer.from_dir(tokenizer_dir).token_to_id("<|image_pad|>")
    assert ids.count(image_id) == sum(prepared.tokens) == int((want["mm_token_type_ids"][0] == 1).sum())


def test_placeholders_must_match_images(reference, images):
    _, ours = reference
    prepared = ours.prepare(images[:2])
    with pytest.raises(ImageError, match="2 images"):
        ours.expand("only <|image_pad|> one", prepared)


def test_extreme_aspect_ratio_is_an_image_error():
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 56 * 56, 28 * 28 * 1280)
