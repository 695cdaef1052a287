"""llama.cpp's /infill request (what llama.vim and llama.vscode send), its /completion request (a text prompt, or a
multimodal one: llama-server's `{"prompt_string", "multimodal_data"}` prompt, or the older `image_data` placed with
`[img-<id>]`), and their answer's body.

The sampling fields have llama.cpp's names; `completion_body` writes them as the Completions request the one
request path runs (`n_predict` -> max_tokens, `repeat_penalty` -> repetition_penalty; the rest the same name)."""

from __future__ import annotations

import re
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..bodies import NullIsAbsent
from ..http.errors import bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ExtraChunk(_Strict):
    filename: str = "tmp"
    text: str


class _Sampling(NullIsAbsent):
    """The sampling fields llama.cpp's own endpoints share, under its names."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n_predict: int = Field(-1, ge=-1)  # -1: until the end of the text or the context
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    ignore_eos: bool = False
    # Sent by llama.cpp's clients; no effect here (one sampler chain, no slots, no time limits).
    n_indent: int | None = None
    cache_prompt: bool | None = None
    samplers: list[str] | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    response_fields: list[str] | None = None
    id_slot: int | None = None


class InfillRequest(_Sampling):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # the start of the middle, written after the middle marker


class MediaPrompt(_Strict):
    """llama-server's multimodal prompt: the text with one MEDIA_MARKER where each of `multimodal_data`'s
    base64 images goes, in order."""

    prompt_string: str
    multimodal_data: list[str] = Field(default_factory=list)


class ImageData(_Strict):
    """llama.cpp's older multimodal field: an image (base64) the prompt places with `[img-<id>]`."""

    data: str
    id: int


class LlamaCompletionRequest(_Sampling):
    """POST /completion (llama-server's native completion): a text prompt (or token ids), or a multimodal one."""

    prompt: Union[str, list[int], MediaPrompt]
    image_data: list[ImageData] | None = None
    n_keep: int | None = None  # no context shifting here: a prompt too long is a 400

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


MEDIA_MARKER = "<__media__>"  # mtmd_default_marker(): where llama-server's multimodal_data go in the prompt
_IMAGE_REF = re.compile(r"\[img-(-?[0-9]+)\]")


def media_prompt(req: LlamaCompletionRequest) -> tuple[str, list[str]] | None:
    """A text prompt with images as (the text with MEDIA_MARKER where each image goes, their data: URLs in
    order); None for a prompt without images. `multimodal_data` go where the markers are; `image_data` where the
    prompt says `[img-<id>]`."""
    if isinstance(req.prompt, MediaPrompt):
        if req.image_data:
            raise bad_request("image_data: send the images once, in prompt.multimodal_data", "image_data")
        found = req.prompt.prompt_string.count(MEDIA_MARKER)
        if found != len(req.prompt.multimodal_data):
            raise bad_request(f"prompt.prompt_string has {found} {MEDIA_MARKER} marker(s) for "
                              f"{len(req.prompt.multimodal_data)} multimodal_data item(s): put one marker where each "
                              "image goes", "prompt.multimodal_data")
        return req.prompt.prompt_string, [_data_url(d) for d in req.prompt.multimodal_data]
    if not req.image_data:
        return None
    if not isinstance(req.prompt, str):
        raise bad_request("image_data needs the prompt as text, with [img-<id>] where each image goes", "prompt")
    given = {image.id: image.data for image in req.image_data}
    urls = []
    for ref in _IMAGE_REF.finditer(req.prompt):
        if int(ref.group(1)) not in given:
            raise bad_request(f"the prompt refers to {ref.group(0)} but image_data has no image with id "
                              f"{ref.group(1)} (ids: {sorted(given)})", "image_data")
        urls.append(_data_url(given[int(ref.group(1))]))
    if not urls:
        raise bad_request("image_data is given but the prompt places no image: write [img-<id>] where each goes",
                          "prompt")
    return _IMAGE_REF.sub(MEDIA_MARKER, req.prompt), urls


def _data_url(data: str) -> str:
    return data if data.startswith("data:") else f"data:;base64,{data}"


def completion_body(req: _Sampling, prompt_ids: list[int]) -> dict[str, Any]:
    """The Completions request that samples the same way over the FIM prompt."""
    body: dict[str, Any] = {"prompt": prompt_ids, "stream": req.stream}
    if req.n_predict > 0:
        body["max_tokens"] = req.n_predict
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.repeat_penalty is not None:
        body["repetition_penalty"] = req.repeat_penalty
    if req.ignore_eos:
        body["ignore_eos"] = True
    return body


def stop_type(finish_reason: str | None, stop_reason: int | str | None) -> str:
    """llama.cpp's stop_type: "word" (a stop string), "eos", "limit" (n_predict or the context)."""
    if finish_reason == "length":
        return "limit"
    return "word" if isinstance(stop_reason, str) else "eos"
