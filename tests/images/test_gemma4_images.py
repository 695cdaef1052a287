"""Gemma 4's preprocessing (nexttoken/images/gemma4.py) against transformers' Gemma4ImageProcessorPil (the slow,
Pillow one) and Gemma4Processor's placeholder expansion on the same images and prompts: patches, positions, soft
token counts and prompt ids."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

from nexttoken.errors import ImageError, ModelLoadError
from nexttoken.images import ImageLimits, load_image, processor_for, read_images
from nexttoken.images.gemma4 import Gemma4Images, target_size
from nexttoken.text.tokenizer import Tokenizer
from support.gemma4_vision import gemma4_vlm, hf_inputs
from support.vision import odd_images


@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("gemma4")
    gemma4_vlm(folder)
    return folder


def test_pixels_and_positions_equal_transformers_on_odd_images(folder, tmp_path) -> None:
    hf = transformers.Gemma4ImageProcessorPil.from_pretrained(folder)
    ours = processor_for("gemma4", folder)
    limits = ImageLimits(max_pixels=4_000_000)
    for name, source in odd_images(tmp_path).items():  # loaded once (images/source.py: tested against transformers')
        image = load_image(source, limits)
        theirs = hf([image], return_tensors="np")
        got = ours.prepare([image])
        assert got.pixel_values.dtype == np.float32 and got.pixel_values.shape == theirs["pixel_values"].shape, name
        np.testing.assert_array_equal(got.pixel_values, theirs["pixel_values"], err_msg=name)
        np.testing.assert_array_equal(got.extra["image_position_ids"], theirs["image_position_ids"], err_msg=name)
        assert got.tokens == list(theirs["num_soft_tokens_per_image"]), name
        assert 0 < got.tokens[0] <= 70


def test_several_images_at_once_equal_transformers(folder) -> None:
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, s, dtype=np.uint8)) for s in ((37, 53, 3), (80, 21, 3), (8, 8, 3))]
    theirs = transformers.Gemma4ImageProcessorPil.from_pretrained(folder)(images, return_tensors="np")
    got = processor_for("gemma4", folder).prepare(images)
    np.testing.assert_array_equal(got.pixel_values, theirs["pixel_values"])
    np.testing.assert_array_equal(got.extra["image_position_ids"], theirs["image_position_ids"])
    assert got.tokens == list(theirs["num_soft_tokens_per_image"]) and len(set(got.tokens)) > 1


def test_target_sizes_equal_transformers() -> None:
    for h, w in ((1, 1), (1, 2000), (2000, 3), (37, 53), (480, 640), (4000, 3000), (17, 17), (9, 1000)):
        for patch, tokens, kernel in ((16, 280, 3), (4, 70, 2), (14, 1120, 3)):
            assert target_size(h, w, patch, tokens * kernel**2, kernel) == get_aspect_ratio_preserving_size(
                h, w, patch, tokens * kernel**2, kernel), (h, w, patch)


def test_prompt_ids_equal_transformers(folder) -> None:
    rng = np.random.default_rng(2)
    images = [Image.fromarray(rng.integers(0, 256, s, dtype=np.uint8)) for s in ((30, 44, 3), (90, 12, 3))]
    text = "compare <|image|> and <|image|> now"
    inputs = read_images(processor_for("gemma4", folder), images)
    assert Tokenizer.from_dir(folder).encode(inputs.expand(text)) == hf_inputs(folder, text, images)[
        "input_ids"][0].tolist()
    with pytest.raises(ImageError, match="marks 1 image"):
        inputs.expand("only one <|image|> here")


def test_a_budget_transformers_refuses_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="max_soft_tokens must be one of"):
        Gemma4Images({"max_soft_tokens": 100})
