"""Images from every source a caller has (nexttoken/images/source.py), decoded as transformers' `load_image` and
`convert_to_rgb` decode them, and every broken or oversized one refused by name."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import load_image as hf_load_image

from nexttoken.errors import ImageError
from nexttoken.images import ImageLimits, content_hash, load_image


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))


def _rotated_jpeg(tmp_path, photo: Image.Image) -> str:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to show
    path = tmp_path / "rotated.jpg"
    photo.save(path, format="JPEG", exif=exif)
    return str(path)


def test_every_source_gives_the_same_pixels(tmp_path, photo) -> None:
    path = tmp_path / "p.png"
    photo.save(path)
    data = _png(photo)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [str(path), path, data, url, photo, np.asarray(photo)]
    hashes = {content_hash(load_image(s)) for s in sources}
    assert hashes == {content_hash(photo)}


def test_exif_rotation_and_rgb_as_transformers(tmp_path, photo) -> None:
    path = _rotated_jpeg(tmp_path, photo)
    ours = load_image(path)
    theirs = hf_load_image(path)
    assert ours.size == theirs.size == (37, 53)  # rotated: width and height swapped
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs.convert("RGB")))
    rgba = Image.fromarray(np.random.default_rng(1).integers(0, 256, (9, 7, 4), dtype=np.uint8))
    np.testing.assert_array_equal(np.asarray(load_image(_png(rgba))), convert_to_rgb(rgba, return_numpy=True))
    gray = Image.fromarray(np.arange(63, dtype=np.uint8).reshape(9, 7))
    assert load_image(_png(gray)).mode == "RGB"
    np.testing.assert_array_equal(np.asarray(load_image(np.asarray(gray)))[:, :, 1], np.asarray(gray))


@pytest.mark.parametrize("source, message", [
    (b"not an image at all", "cannot decode"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "image/"),
    ("data:image/png,rawbytes", "not base64"),
    ("https://example.com/cat.png", "--allow-remote-images"),
    ("/no/such/file.png", "cannot read image file"),
    (np.zeros((4, 4), dtype=np.float32), "uint8"),
    (np.zeros((4, 4, 2), dtype=np.uint8), "(H, W)"),
    (3.5, "not float"),
])
def test_bad_sources_are_refused_by_name(source, message) -> None:
    with pytest.raises(ImageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_image(source)


def test_truncated_and_oversized(photo) -> None:
    data = _png(photo.resize((200, 200)))
    with pytest.raises(ImageError, match="broken or truncated"):
        load_image(data[: len(data) // 2])
    with pytest.raises(ImageError, match="200x200 = 40000 pixels"):
        load_image(data, ImageLimits(max_pixels=10_000))
    with pytest.raises(ImageError, match="bytes; at most 100"):
        load_image(data, ImageLimits(max_bytes=100))
    with pytest.raises(ImageError, match="3 images in one request"):
        ImageLimits(max_images=2).check_count(3)
