"""Idefics3's and SmolVLM's preprocessing (nexttoken/images/idefics3.py) against transformers' own processor on a
tiny checkpoint's settings: the same pixel values and pixel mask, and the same token ids once each `<image>` is
expanded, on a photo-like picture and odd ones (tiny, huge, thin, grayscale, RGBA, EXIF-rotated)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from support import idefics3 as tiny

from nexttoken.errors import ImageError
from nexttoken.images import load_image
from nexttoken.images.idefics3 import Idefics3Processor


def _photo(h: int, w: int, seed: int = 0) -> Image.Image:
    """A photo-like picture: smooth gradients, a disc, JPEG noise (what LANCZOS meets in real photos)."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 100 * np.sin((x + y) / 7)], axis=-1)
    rgb[(y - h / 2) ** 2 + (x - w / 3) ** 2 < (min(h, w) / 4) ** 2] = (250, 30, 60)
    buf = io.BytesIO()
    Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=80)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


NAMES = ["photo", "tiny", "huge", "thin", "tall", "square-tile", "grayscale", "rgba"]


@pytest.fixture(scope="module")
def odd_images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (45, 29, 4), dtype=np.uint8)
    return {
        "photo": _photo(240, 320),
        "tiny": Image.fromarray(rng.integers(0, 256, (1, 1, 3), dtype=np.uint8)),
        "huge": _photo(2100, 2900),
        "thin": Image.fromarray(rng.integers(0, 256, (3, 700, 3), dtype=np.uint8)),
        "tall": _photo(333, 40),
        "square-tile": _photo(32, 32),
        "grayscale": Image.fromarray(rng.integers(0, 256, (50, 61), dtype=np.uint8)),
        "rgba": Image.fromarray(rgba),
    }


@pytest.fixture(scope="module", params=[True, False], ids=["splitting", "no-splitting"])
def processors(request, shared_dir, tmp_path_factory):
    """(transformers' processor, ours) from one folder's files."""
    import transformers

    out = tmp_path_factory.mktemp("smolvlm")
    image_processor = transformers.SmolVLMImageProcessorPil(
        max_image_size={"longest_edge": 32}, size={"longest_edge": 128}, do_image_splitting=request.param)
    tiny.write_processor(out, shared_dir / "models" / "stories260k", image_processor)
    return tiny.hf_processor(out), Idefics3Processor.from_dir(out)


@pytest.mark.parametrize("name", NAMES)
def test_pixels_and_tokens_equal_transformers(processors, odd_images, name) -> None:
    image = odd_images[name]
    hf, ours = processors
    prompt = "User:<image>What is this?<end_of_utterance>\nAssistant:"
    theirs = hf(text=[prompt], images=[[image]], return_tensors="np")
    prepared = ours.prepare([load_image(image)])
    np.testing.assert_allclose(prepared.pixel_values, theirs["pixel_values"][0], rtol=0, atol=1e-6)
    assert prepared.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(prepared.extra["pixel_attention_mask"], theirs["pixel_attention_mask"][0])
    ids = hf.tokenizer(ours.expand(prompt, prepared))["input_ids"]
    assert ids == theirs["input_ids"][0].tolist()
    assert prepared.tokens == [int((theirs["input_ids"] == tiny.IMAGE_TOKEN_ID).sum())]


def test_several_images_in_one_prompt_and_exif(processors, tmp_path) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    path = tmp_path / "rotated.jpg"
    _photo(50, 90).save(path, format="JPEG", exif=exif)
    images = [_photo(100, 60, 1), load_image(path), _photo(20, 20)]
    assert images[1].size == (50, 90)  # upright, as transformers' load_image shows it
    hf, ours = processors
    prompt = "<image>one<image>two and <image>"
    theirs = hf(text=[prompt], images=[images], return_tensors="np")
    prepared = ours.prepare(images)
    np.testing.assert_allclose(prepared.pixel_values, theirs["pixel_values"][0], rtol=0, atol=1e-6)
    assert hf.tokenizer(ours.expand(prompt, prepared))["input_ids"] == theirs["input_ids"][0].tolist()
    assert len(prepared.tokens) == 3 and sum(prepared.tokens) == int((theirs["input_ids"] == tiny.IMAGE_TOKEN_ID).sum())


def test_placeholder_count_must_match(processors) -> None:
    ours = processors[1]
    prepared = ours.prepare([_photo(40, 40)])
    with pytest.raises(ImageError, match="2 <image> placeholders for 1 images"):
        ours.expand("<image><image>", prepared)
    with pytest.raises(ImageError, match="0 <image> placeholders"):
        ours.expand("no image here", prepared)
