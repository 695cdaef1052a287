"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/show`) and their
translation into the Chat Completions request the one request path runs: the same request means the same here.

The field table: `options.num_predict` -> max_tokens (-1 and -2: until the end or the context), `repeat_penalty`
-> repetition_penalty, `temperature`, `top_p`, `top_k`, `min_p`, `seed` (negative: random), `stop`,
`presence_penalty`, `frequency_penalty`, `typical_p`, `mirostat`, `mirostat_tau`, `mirostat_eta` under their own
names; `format` "json" -> response_format json_object, a schema -> json_schema; `think` true / false -> the
template's enable_thinking, "low" / "medium" / "high" -> reasoning_effort; a message's `tool_calls` (arguments as
an object) -> OpenAI's calls (arguments as JSON text), a `tool` message answers the call its `tool_name` names.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..bodies import NullIsAbsent
from ..http.errors import APIError, bad_request
from ..openai.protocol import Int

# Options that tune how Ollama's runner loads and batches (GPU layers, threads, mmap, ...) or trims a long prompt:
# accepted, with no effect on this server (its engine is set up by `nexttoken serve`'s flags).
NO_EFFECT = ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
             "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "penalize_newline")
# option -> the Chat Completions field that carries it (the rest need a rule: num_predict, seed, repeat_last_n)
SAME_MEANING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty", "typical_p": "typical_p", "mirostat": "mirostat",
                "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
# A Chat Completions field (an error's `param`) -> the Ollama field that carried it.
OLLAMA_FIELDS = {**{field: f"options.{option}" for option, field in SAME_MEANING.items()},
                 "max_tokens": "options.num_predict", "seed": "options.seed", "response_format": "format",
                 "reasoning_effort": "think", "chat_template_kwargs": "think"}
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: a model stays loaded 5 minutes after its last request
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class OllamaOptions(_Strict, NullIsAbsent):
    """Ollama's `options` (its Modelfile parameters). An unknown key is a 400, as every option is here."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None  # negative: a random seed (Ollama's -1)
    num_predict: Int | None = Field(None, ge=-2)  # -1: until the end; -2: until the context is full
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    repeat_last_n: Int | None = Field(None, ge=-1)  # -1: the whole sequence (the only window offered), 0: off
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    typical_p: float | None = None
    mirostat: Int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    num_ctx: Int | None = Field(None, ge=1)  # checked against the served context (the handler knows it)
    # NO_EFFECT
    numa: bool | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: Int | None = None
    num_keep: Int | None = None
    penalize_newline: bool | None = None


class OllamaFunction(_Strict):
    name: str
    arguments: dict[str, Any]
    index: int | None = None  # Ollama numbers a turn's calls; the order says the same


class OllamaToolCall(_Strict):
    function: OllamaFunction
    id: str | None = None


class OllamaMessage(_Strict, NullIsAbsent):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # a past turn's thinking: chat templates leave it out of later turns
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool message: the tool whose result it is
    tool_call_id: str | None = None


Format = Union[Literal["", "json"], dict[str, Any]]
Think = Union[bool, Literal["low", "medium", "high"]]
KeepAlive = Union[float, int, str]


class _KeptAlive(_Strict, NullIsAbsent):
    keep_alive: KeepAlive | None = None  # how long the model stays loaded after this request (idle unload)

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, v: KeepAlive | None) -> KeepAlive | None:
        if v is not None:
            keep_alive_s(v)  # a bad duration is a 400 now, naming the field
        return v

    @property
    def keep_alive_s(self) -> float:
        """How long the model stays loaded after this request, in seconds (inf: for good, 0: unload now)."""
        return DEFAULT_KEEP_ALIVE_S if self.keep_alive is None else keep_alive_s(self.keep_alive)


class _Generating(_KeptAlive):
    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: Format | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    think: Think | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaChatRequest(_Generating):
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: load the model, generate nothing
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Generating):
    prompt: str = ""  # empty: load the model, generate nothing
    suffix: str | None = None  # fill in the middle: the text after the answer
    system: str | None = None
    template: str | None = None  # a Go template over the model's: refused (see `generate_messages`)
    context: list[Int] | None = None  # a previous answer's `context`: the conversation so far, as token ids
    raw: bool = False  # the prompt as it is, no chat template
    images: list[str] | None = None


class OllamaEmbedRequest(_KeptAlive):
    model: str = Field(min_length=1)
    input: Union[str, list[str]]
    truncate: bool = True  # cut an input longer than the context (false: a 400)
    dimensions: Int | None = Field(None, ge=1)
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaEmbeddingsRequest(_KeptAlive):
    """The legacy /api/embeddings: one prompt, its embedding as the model gives it (not normalized)."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    options: OllamaOptions = Field(default_factory=OllamaOptions)


class OllamaShowRequest(_Strict, NullIsAbsent):
    model: str | None = None
    name: str | None = None  # the older name of `model`
    verbose: bool = False


def keep_alive_s(value: KeepAlive) -> float:
    """Ollama's keep_alive in seconds: a number of seconds or a Go duration ("5m", "1h30m", "300ms"); negative:
    for good (inf)."""
    if isinstance(value, bool):
        raise bad_request(f"keep_alive: {value!r} is not a duration: send seconds or a duration like \"5m\"",
                          "keep_alive")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)  # a number as text: seconds
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise bad_request(f"keep_alive: {value!r} is not a duration: send seconds or a duration like "
                                  "\"5m\", \"1h30m\", \"-1\" (for good)", "keep_alive") from None
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
        value = sign * seconds
    return math.inf if value < 0 else float(value)


def sampling_fields(options: OllamaOptions) -> dict[str, Any]:
    """The Chat Completions fields that sample as `options` say."""
    body = {SAME_MEANING[name]: getattr(options, name) for name in SAME_MEANING
            if name in options.model_fields_set}
    if options.num_predict is not None:
        if options.num_predict == 0:
            raise bad_request("options.num_predict: 0 generates nothing: send a count >= 1, or -1 (until the end)",
                              "options.num_predict")
        if options.num_predict > 0:
            body["max_tokens"] = options.num_predict
    if options.seed is not None and options.seed >= 0:
        body["seed"] = options.seed
    if options.repeat_last_n == 0:  # Ollama's "no window": the penalty is off
        body.pop("repetition_penalty", None)
    elif options.repeat_last_n not in (None, -1) and body.get("repetition_penalty", 1.0) != 1.0:
        raise bad_request(f"options.repeat_last_n: {options.repeat_last_n} is not offered: repeat_penalty covers "
                          "the whole sequence here; send -1 (the whole sequence) or 0 (off)",
                          "options.repeat_last_n")
    return body


def format_fields(fmt: Format | None) -> dict[str, Any]:
    """`format` as the Chat Completions response_format: "json" any JSON object, a schema its JSON."""
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt}}}


def think_fields(think: Think | None) -> dict[str, Any]:
    """`think`: true / false turn the template's thinking on or off; a level is a reasoning effort."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    return {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": think}


def chat_messages(messages: list[OllamaMessage], images: bool = False) -> list[dict[str, Any]]:
    """Ollama's messages as Chat Completions messages: a call gets an id (`call_<turn>_<k>`), and a tool message
    answers the call its tool_name names (else the next unanswered one); a message's `images` (to a model that
    takes images) come before its text, as Ollama lays them out, as `image_url` parts."""
    out: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (call id, tool name) of the last assistant turn, not yet answered
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": _with_images(m.content, m.images, images,
                                                                            f"messages.{i}.images")}
        if m.role == "assistant" and m.tool_calls:
            calls = [(c.id or f"call_{i}_{k}", c.function) for k, c in enumerate(m.tool_calls)]
            message["content"] = m.content or None
            message["tool_calls"] = [{"id": cid, "type": "function",
                                      "function": {"name": f.name, "arguments": json.dumps(f.arguments)}}
                                     for cid, f in calls]
            pending = [(cid, f.name) for cid, f in calls]
        elif m.role == "tool":
            message["tool_call_id"] = m.tool_call_id or _answered(pending, m.tool_name)
        out.append(message)
    return out


def _answered(pending: list[tuple[str, str]], name: str | None) -> str:
    """The id of the call a tool result answers (taken off `pending`); a made-up one with no call before it."""
    k = next((k for k, (_, n) in enumerate(pending) if n == name), 0 if pending else None)
    return pending.pop(k)[0] if k is not None else f"call_{name or 'tool'}"


def generating_fields(req: _Generating, model: str) -> dict[str, Any]:
    """What a chat and a generate request share, as Chat Completions fields."""
    if req.logprobs or req.top_logprobs:
        raise bad_request("logprobs are not offered on Ollama's API here: use /v1/chat/completions with "
                          "logprobs", "logprobs")
    return {"model": model, "stream": req.stream, **sampling_fields(req.options), **format_fields(req.format),
            **think_fields(req.think)}


def chat_body(req: OllamaChatRequest, model: str, images: bool = False) -> dict[str, Any]:
    """The Chat Completions body that asks for the same thing (`images`: the model takes images)."""
    body = {**generating_fields(req, model), "messages": chat_messages(req.messages, images)}
    if req.tools:
        body["tools"] = req.tools
    return body


def generate_messages(req: OllamaGenerateRequest, images: bool = False) -> list[dict[str, Any]]:
    """A templated generate request's conversation: the system prompt, then the prompt (after its `images`, to a
    model that takes images) as the user's turn."""
    if req.template:
        raise bad_request("template: Go templates are not offered; the model's chat template applies (or send "
                          "raw=true with the prompt laid out as the model expects)", "template")
    system = [{"role": "system", "content": req.system}] if req.system else []
    return [*system, {"role": "user", "content": _with_images(req.prompt, req.images, images, "images")}]


def _with_images(text: str, given: list[str] | None, images: bool, param: str) -> str | list[dict[str, Any]]:
    """A message's text, or (with images) its images as `image_url` parts (Ollama sends each as plain base64, or
    a data: URL) before its text."""
    if not given:
        return text
    if not images:
        raise bad_request(f"{param}: this model takes no images (it has no vision encoder); send the message "
                          "without images", param)
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {
        "url": image if image.startswith("data:") else f"data:;base64,{image}"}} for image in given]
    return parts + ([{"type": "text", "text": text}] if text else [])


def in_ollama_terms(error: APIError) -> APIError:
    """An error the chat request path raised, naming the Ollama field the client sent (`format`, not
    response_format; `options.num_predict`, not max_tokens)."""
    field = OLLAMA_FIELDS.get((error.param or "").split(".")[0])
    if field is None:
        return error
    message = error.message.removeprefix(f"{error.param}: ")
    return APIError(error.status, f"{field}: {message}", field, error.type, error.code, error.headers)


def ollama_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Finished calls (chat/tools' ToolCall) as Ollama returns them: the arguments as an object, the calls
    numbered."""
    out = []
    for k, call in enumerate(calls):
        try:
            arguments = json.loads(call.arguments) if call.arguments else {}
        except json.JSONDecodeError:
            continue  # a call cut off mid-arguments (num_predict): left out, done_reason "length" says why
        out.append({"id": call.id, "function": {"index": k, "name": call.name, "arguments": arguments}})
    return out
