"""llama.cpp's /infill request (what llama.vim and llama.vscode send) and its answer's body.

The sampling fields have llama.cpp's names; `completion_body` writes them as the Completions request the one
request path runs (`n_predict` -> max_tokens, `repeat_penalty` -> repetition_penalty; the rest the same name)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..bodies import NullIsAbsent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ExtraChunk(_Strict):
    filename: str = "tmp"
    text: str


class InfillRequest(NullIsAbsent):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = Field(default_factory=list)
    prompt: str = ""  # the start of the middle, written after the middle marker
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
    # Sent by llama.cpp's editor plugins; no effect here (one sampler chain, no slots, no time limits).
    n_indent: int | None = None
    cache_prompt: bool | None = None
    samplers: list[str] | None = None
    t_max_prompt_ms: int | None = None
    t_max_predict_ms: int | None = None
    response_fields: list[str] | None = None
    id_slot: int | None = None


def completion_body(req: InfillRequest, prompt_ids: list[int]) -> dict[str, Any]:
    """The Completions request that samples the same way over the FIM prompt."""
    body: dict[str, Any] = {"prompt": prompt_ids, "stream": req.stream}
    if req.n_predict > 0:
        body["max_tokens"] = req.n_predict
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.repeat_penalty is not None:
        body["repetition_penalty"] = req.repeat_penalty
    return body


def stop_type(finish_reason: str | None, stop_reason: int | str | None) -> str:
    """llama.cpp's stop_type: "word" (a stop string), "eos", "limit" (n_predict or the context)."""
    if finish_reason == "length":
        return "limit"
    return "word" if isinstance(stop_reason, str) else "eos"
