"""One image from wherever a caller has it, as an RGB PIL image: a path, raw bytes, a `data:` URL, a PIL image or
a numpy array. The bytes are decoded fully here (a truncated file fails now, not in the encoder), the EXIF
orientation is applied (as transformers' `load_image` does, and as a browser shows the photo), and the limits are
checked from the header before any pixel is decoded."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from dataclasses import dataclass
from typing import Any

from ..errors import ImageError


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry: images per request, pixels per image (width x height) and encoded bytes per
    image. The server's flags set them; every source is checked against them before decoding its pixels."""

    max_images: int = 8
    max_pixels: int = 4096 * 4096
    max_bytes: int = 20 * 1024 * 1024

    def check_count(self, n: int) -> None:
        if n > self.max_images:
            raise ImageError(f"{n} images in one request; at most {self.max_images} are allowed "
                             "(send fewer, or raise the limit: --max-images-per-request)")


DEFAULT_LIMITS = ImageLimits()


def load_image(source: Any, limits: ImageLimits = DEFAULT_LIMITS) -> Any:
    """source -> an RGB `PIL.Image.Image`, fully decoded.

    source: a path (str or os.PathLike), bytes, a `data:image/...;base64,...` URL, a PIL image, or a numpy array
    (H, W) / (H, W, 1|3|4) of uint8. Raises ImageError naming the problem. Orientation: the EXIF tag is applied
    (`ImageOps.exif_transpose`), so an upright photo is upright for the model too."""
    from PIL import Image, ImageOps

    if isinstance(source, Image.Image):
        image = source
    else:
        data = _bytes_of(source, limits)
        if data is None:
            image = _from_array(source)
        else:
            image = _decode(data, limits)
    _check_pixels(image, limits)
    image = ImageOps.exif_transpose(image) if image.getexif() else image
    return image if image.mode == "RGB" else _to_rgb(image)


def content_hash(image: Any) -> str:
    """A stable key of an image's pixels (mode, size and bytes): two requests with the same picture, from any
    source, share it (the encoder cache and the prefix cache key images by it)."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def _bytes_of(source: Any, limits: ImageLimits) -> bytes | None:
    """The encoded bytes of a path, bytes or data: URL source; None for an array."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        data = _data_url(source)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if "://" in path:
            raise ImageError(f"image source {path[:80]!r} is a URL; pass the image's bytes, a data: URL or a path "
                             "(a server fetches http(s) URLs only with --allow-remote-images)")
        try:
            size = os.path.getsize(path)
            if size > limits.max_bytes:
                raise ImageError(f"image file {path} is {size} bytes; at most {limits.max_bytes} are allowed")
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ImageError(f"cannot read image file {path}: {e.strerror or e}") from None
    elif hasattr(source, "__array_interface__"):
        return None
    else:
        raise ImageError(f"an image must be a path, bytes, a data: URL, a PIL image or a numpy array, not "
                         f"{type(source).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes; at most {limits.max_bytes} are allowed")
    return data


def _data_url(url: str) -> bytes:
    """`data:[<mime>][;base64],<payload>` -> bytes (RFC 2397); only base64 payloads of image/* types."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("malformed data: URL: no ',' between the header and the payload "
                         "(expected data:image/png;base64,...)")
    mime = head[5:].split(";")[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"data: URL has type {mime!r}; an image's type starts with image/")
    if ";base64" not in head.lower():
        raise ImageError("data: URL is not base64-encoded; send data:image/...;base64,<payload>")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("data: URL payload is not valid base64") from None


def _decode(data: bytes, limits: ImageLimits) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError(f"image is too large to decode safely ({e})") from None
    except Exception:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError... for bad bytes
        raise ImageError(f"cannot decode the image ({len(data)} bytes): not a PNG, JPEG, GIF, WebP, BMP or other "
                         "format Pillow reads") from None
    _check_pixels(image, limits)  # from the header, before the pixels are decoded
    try:
        image.load()
    except Exception as e:
        raise ImageError(f"the image's data is broken or truncated ({type(e).__name__}: {e})") from None
    return image


def _from_array(array: Any) -> Any:
    import numpy as np
    from PIL import Image

    a = np.asarray(array)
    if a.dtype != np.uint8:
        raise ImageError(f"an image array must be uint8 (0-255), not {a.dtype}; convert it with "
                         "(x * 255).clip(0, 255).astype(np.uint8) if it holds floats in [0, 1]")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[2] in (3, 4))):
        raise ImageError(f"an image array must be (H, W), (H, W, 1), (H, W, 3) or (H, W, 4), not {a.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ImageError(f"an image array must not be empty, got shape {a.shape}")
    return Image.fromarray(a)


def _check_pixels(image: Any, limits: ImageLimits) -> None:
    w, h = image.size
    if w <= 0 or h <= 0:
        raise ImageError(f"image has no pixels ({w}x{h})")
    if w * h > limits.max_pixels:
        raise ImageError(f"image is {w}x{h} = {w * h} pixels; at most {limits.max_pixels} are allowed "
                         "(resize it, or raise the limit: --max-image-pixels)")


def _to_rgb(image: Any) -> Any:
    """RGB as transformers' `image_transforms.convert_to_rgb` makes it: an image with alpha (or a transparent
    palette colour) composited onto white, any other mode converted."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255))  # transparent pixels become white
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")
