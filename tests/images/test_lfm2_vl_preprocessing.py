"""LFM2-VL's preprocessing (nexttoken/images/lfm2_vl.py) against transformers' Lfm2VlImageProcessor and
Lfm2VlProcessor, whose outputs on these images are recorded in tests/data/lfm2_vl_processor.npz (the processor
needs torchvision; tests/support/lfm2_vl.py records them): pixel values, patch masks, spatial shapes and the
placeholder text, on a photo-like picture and odd ones (tiny, one tile, tall, huge, grayscale, RGBA)."""

from __future__ import annotations

import numpy as np
import pytest
from support import lfm2_vl as ref

from nexttoken.errors import ImageError
from nexttoken.images import load_image
from nexttoken.images.lfm2_vl import Lfm2VlProcessor


@pytest.fixture(scope="module")
def recorded():  # noqa: ANN201
    return np.load(ref.DATA)


@pytest.mark.parametrize("name", list(ref.IMAGES))
def test_pixels_and_text_equal_transformers(recorded, name) -> None:
    h, w, mode = ref.IMAGES[name]
    ours = Lfm2VlProcessor.from_settings(ref.SETTINGS, {}, {})
    prepared = ours.prepare([load_image(ref.photo(h, w, mode))])
    np.testing.assert_array_equal(prepared.pixel_values, recorded[f"{name}/pixel_values"])
    np.testing.assert_array_equal(prepared.extra["pixel_attention_mask"], recorded[f"{name}/pixel_attention_mask"])
    np.testing.assert_array_equal(prepared.extra["spatial_shapes"], recorded[f"{name}/spatial_shapes"])
    text = str(recorded[f"{name}/text"])
    assert ours.expand("a <image> b", prepared) == f"a {text} b"
    assert prepared.tokens == [text.count("<image>")]


def test_too_thin_an_image_and_placeholder_counts() -> None:
    ours = Lfm2VlProcessor.from_settings(ref.SETTINGS, {}, {})
    with pytest.raises(ImageError, match="aspect ratio is too extreme"):
        ours.prepare([ref.photo(3, 700)])  # transformers' processor fails on it in torch.stack
    prepared = ours.prepare([ref.photo(20, 20)])
    with pytest.raises(ImageError, match="2 <image> placeholders for 1 images"):
        ours.expand("<image><image>", prepared)
