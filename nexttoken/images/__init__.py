"""Images in (issue 43): where an image comes from (`source.py`: paths, bytes, data: URLs, PIL images, arrays, read
with Pillow and checked against the limits), and each vision family's preprocessing, equal to transformers'
image processors, with Pillow and numpy only. The towers that encode them are model/vision/."""

from .source import ImageLimits, content_hash, load_image

__all__ = ["ImageLimits", "content_hash", "load_image"]
