"""Gemma 3's preprocessing (nexttoken/images/gemma3.py) against transformers' slow Gemma3ImageProcessor and
Gemma3Processor on the same images and prompts: pixel values and prompt ids."""

from __future__ import annotations

import io

import numpy as np
import pytest
import transformers
from PIL import Image
from transformers.image_utils import load_image as hf_load_image

from nexttoken.errors import ImageError
from nexttoken.images import ImageLimits, load_image, processor_for, read_images
from nexttoken.text.tokenizer import Tokenizer
from support.vision import gemma3_vlm, odd_images


@pytest.fixture(scope="module")
def folder(tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("gemma3")
    gemma3_vlm(folder, layers=1)
    return folder


@pytest.fixture(scope="module")
def hf_processor(folder):  # noqa: ANN201
    return transformers.AutoProcessor.from_pretrained(folder, backend="pil")


def _theirs(source):  # noqa: ANN001, ANN202
    """The image as transformers' load_image reads the same source (EXIF applied, mode kept)."""
    if isinstance(source, bytes):
        return Image.open(io.BytesIO(source))
    return hf_load_image(source) if isinstance(source, str) else source


def test_pixel_values_equal_transformers_on_odd_images(folder, hf_processor, tmp_path) -> None:
    ours = processor_for("gemma3", folder)
    assert isinstance(hf_processor.image_processor, transformers.Gemma3ImageProcessorPil)  # the slow one
    for name, source in odd_images(tmp_path).items():
        prepared = ours.prepare([load_image(source)])
        theirs = hf_processor.image_processor([_theirs(source)], return_tensors="np")["pixel_values"]
        assert prepared.pixel_values.dtype == np.float32 and prepared.pixel_values.shape == theirs.shape == (
            1, 3, 56, 56), name
        np.testing.assert_allclose(prepared.pixel_values, theirs, rtol=0, atol=1e-6, err_msg=name)
        assert prepared.tokens == [4]


def test_prompt_ids_equal_gemma3_processor(folder, hf_processor, tmp_path) -> None:
    images = odd_images(tmp_path)
    sources = [images["non-square"], images["grayscale"]]
    text = "Compare <start_of_image> with<start_of_image>, please."
    inputs = read_images(processor_for("gemma3", folder), sources)
    ids = Tokenizer.from_dir(folder).encode(inputs.expand(text))
    theirs = hf_processor(text=text, images=[_theirs(s) for s in sources], return_tensors="np")
    assert ids == theirs["input_ids"][0].tolist()
    image_token = hf_processor.tokenizer.image_token_id
    placed = inputs.placed(ids, image_token)
    marked = [i for i, t in enumerate(theirs["token_type_ids"][0]) if t == 1]  # transformers' image positions
    assert [c for p in placed for c in range(p.start, p.end)] == marked
    assert placed[0].hash != placed[1].hash


def test_placeholder_count_and_limits_are_checked(folder) -> None:
    images = processor_for("gemma3", folder)
    photo = Image.new("RGB", (9, 9))
    with pytest.raises(ImageError, match="marks 0 image.*<start_of_image>"):
        read_images(images, [photo]).expand("no placeholder here")
    with pytest.raises(ImageError, match="2 images in one request; at most 1"):
        read_images(images, [photo, photo], ImageLimits(max_images=1))
    with pytest.raises(ImageError, match="reads text only.*vision-language checkpoint"):
        read_images(None, [photo], model="SmolLM2")
