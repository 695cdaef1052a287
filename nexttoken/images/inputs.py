"""One request's images, from the caller's sources to what the engine carries: each loaded (source.py, checked
against the limits), prepared alone by the model's preprocessing (images/<family>.py) and hashed; the prompt's
placeholders expanded (`expand`); then, once the prompt is token ids, each image's placeholder span found
(`placed`). The library (llm.py) and the server call this one path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ImageError
from .prepared import Prepared, PromptImage, joined
from .source import DEFAULT_LIMITS, ImageLimits, content_hash, load_image


@dataclass(frozen=True)
class ImageInputs:
    parts: tuple[Prepared, ...]  # each image prepared alone, in prompt order
    hashes: tuple[str, ...]  # each image's content hash
    processor: Any  # the model's preprocessing (images/<family>.py)

    def __len__(self) -> int:
        return len(self.parts)

    def expand(self, text: str) -> str:
        """The prompt text with each image's placeholder expanded, as the family's transformers processor does."""
        return self.processor.expand(text, joined(list(self.parts)))

    def placed(self, ids: Sequence[int], image_token_id: int) -> tuple[PromptImage, ...]:
        """Each image with the prompt columns its placeholders span: image i takes the next parts[i].tokens
        placeholder ids (image_token_id) of the prompt."""
        where = [i for i, t in enumerate(ids) if t == image_token_id]
        need = sum(p.tokens[0] for p in self.parts)
        if len(where) != need:
            raise ImageError(f"the prompt holds {len(where)} image placeholder tokens but its {len(self)} image(s) "
                             f"take {need}: mark each image's place once, and do not type image tokens into the text")
        out, at = [], 0
        for prepared, digest in zip(self.parts, self.hashes):
            cols = where[at : at + prepared.tokens[0]]
            out.append(PromptImage(prepared, digest, cols[0], cols[-1] + 1))
            at += prepared.tokens[0]
        return tuple(out)


def read_images(processor: Any, sources: Sequence[Any], limits: ImageLimits = DEFAULT_LIMITS,
                model: str = "this model") -> ImageInputs:
    """The caller's image sources (paths, bytes, data: URLs, PIL images, arrays) loaded, prepared and hashed.
    `processor` None (a text model) raises ImageError naming `model` and the fix."""
    if processor is None:
        raise ImageError(f"{model} reads text only and cannot take images: load a vision-language checkpoint "
                         "(docs/models.md, 'Images': Gemma3ForConditionalGeneration, ...) or send text alone")
    limits.check_count(len(sources))
    images = [load_image(source, limits) for source in sources]
    parts = tuple(processor.prepare([image]) for image in images)
    return ImageInputs(parts, tuple(content_hash(image) for image in images), processor)
