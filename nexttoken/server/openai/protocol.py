"""The request bodies the server accepts: OpenAI's fields, vLLM's and llama.cpp's sampling extras, strictly typed.

Strict: a wrong type is an error, never coerced ("0.5" is not a number here), and an unknown field is an error
(a misspelt option must not be silently ignored). The bodies check structure only (types, OpenAI's limits on
counts such as `n` and `stop`); the values of sampling options are checked once, by GenerationConfig, when
`options.py` translates the request into one.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator, model_validator

from ..bodies import NullIsAbsent

MAX_STOP_STRINGS = 4
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _integral(v: Any) -> Any:
    """4.0 is the integer 4 (JSON Schema's "integer" takes any number with no fractional part); 4.5 and "4" stay
    themselves, for strict validation to refuse."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]  # an integer field: ints, and floats with no fractional part


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI pads events against length side channels; no padding is added here


# Options the library offers for one sequence that go over HTTP under the same name (vLLM's and llama.cpp's
# names where they have one: typical_p, dry_multiplier, xtc_probability, mirostat_tau, ...). Their values are
# GenerationConfig's to check; docs/serving.md lists them.
LIBRARY_OPTIONS = (
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "top_n_sigma", "xtc_threshold", "xtc_probability",
    "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
    "mirostat_tau", "mirostat_eta", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "min_length", "exponential_decay_length_penalty", "renormalize_logits",
    "remove_invalid_values", "forced_eos_token_id", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
    "watermarking_config", "sampler_order", "guidance_scale", "max_time", "logprobs_mode",
    "json_schema", "grammar", "structured_best_effort",  # llama.cpp's top-level json_schema and grammar
    "strict_json_schema",  # false: JSON Schema's literal reading (no closed objects, no digit bounds)
    "trace", "trace_top_n",  # nexttoken's: the response's choices carry their trace's explain page URL
)

# The chat fields that other chat-shaped APIs (Responses, Anthropic Messages) accept under the same names (a
# client's `extra_body`), passed on to the chat request: one request means the same on every endpoint.
PASSED_THROUGH = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                  "min_tokens", "ignore_eos", "stop_token_ids", "logit_bias", "skip_special_tokens",
                  "include_stop_str_in_output", "chat_template_kwargs", "thinking_token_budget", *LIBRARY_OPTIONS)


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. `strict` is accepted either way: the schema is always enforced, and
    a keyword the grammar engine cannot enforce is a 400 unless `structured_best_effort` is set."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format gives json_schema exactly when its type is "json_schema"')
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON's layout for this request (the server's --structured-whitespace otherwise): "compact" or "flexible";
    # vLLM's disable_any_whitespace=true is "compact". Either may come alone, beside a response_format.
    whitespace: Literal["compact", "flexible"] | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None  # there is one grammar engine: no fallback to disable

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [n for n in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if n == "json" else n) not in (None, False)]
        if len(given) > 1 or (not given and self.layout() is None):
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object "
                             f"(or only whitespace / disable_any_whitespace, beside a response_format); got "
                             f"{given or 'none'}")
        if self.whitespace == "flexible" and self.disable_any_whitespace:
            raise ValueError('structured_outputs: whitespace "flexible" contradicts disable_any_whitespace=true')
        return self

    def layout(self) -> str | None:
        """The JSON layout this request asks for, or None (the server's)."""
        if self.whitespace is not None:
            return self.whitespace
        if self.disable_any_whitespace is not None:
            return "compact" if self.disable_any_whitespace else "flexible"
        return None


class _OpenAIFields(_Strict, NullIsAbsent):
    model: str | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: Int = Field(1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int | None = None  # -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool = False
    priority: Int = 0  # lower runs first under --scheduling-policy priority (vLLM's field)
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # llama.cpp's mirostat mode: 0 off, 2 mirostat v2 (with mirostat_tau, default 5.0); v1 is not offered
    mirostat: Int | None = None
    # Structured output (options.py turns these into GenerationConfig's constraint): OpenAI's response_format,
    # vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not _TOKEN_ID.fullmatch(key):  # not str.isdigit(): "²" is a digit to it, and int() refuses it
                raise ValueError(f"logit_bias keys must be token ids written in ASCII digits, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {key}")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> "_OpenAIFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed together with stream=true")
        return self


# ... plus every other single-sequence option of the library, typed and checked by GenerationConfig.
SamplingFields = create_model(
    "SamplingFields", __base__=_OpenAIFields, **{name: (Any, None) for name in LIBRARY_OPTIONS}  # type: ignore[call-overload]
)


class CompletionRequest(SamplingFields):  # type: ignore[misc,valid-type]
    prompt: Union[str, list[str], list[Int], list[list[Int]]]
    echo: bool = False
    logprobs: Int | None = Field(None, ge=0, le=20)  # OpenAI allows 5; vLLM 20
    best_of: Int | None = Field(None, ge=1)  # OpenAI's; only best_of == n (or absent) is offered
    suffix: str | None = None  # OpenAI's insertion: fill in the middle with the tokenizer's FIM tokens (infill.py)

    @model_validator(mode="after")
    def _not_offered(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} (ranking more samples than n={self.n} are returned) is not "
                             "offered: leave it out, or set it to n")
        if self.suffix and not (isinstance(self.prompt, str) or isinstance(self.prompt[0], str)):
            raise ValueError("suffix (fill in the middle) needs the prompt as text: the prefix and the suffix are "
                             "laid out with the model's FIM tokens")
        if self.suffix and self.echo:
            raise ValueError("echo with suffix is not offered: the prompt sent is the model's FIM layout")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list) -> str | list:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v


class ImageURL(_Strict):
    """An image_url part's image: a data:image/...;base64 URL, or an http(s) URL (fetched only where the server
    allows it: --allow-remote-images). `detail` is OpenAI's resolution hint: accepted, the model's own processor
    decides the resolution."""

    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(BaseModel):
    """One part of a message's content: "text" parts, "image_url" parts (for a model that takes images; the
    server loads them, server/images.py), and an assistant's "refusal" parts, kept out of the prompt (as `refusal`
    is); other kinds (input_audio, file) are refused by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _known(self) -> "ContentPart":
        if self.type not in ("text", "refusal", "image_url"):
            raise ValueError(f"content parts of type {self.type!r} are not supported: send \"text\" parts (and "
                             "\"image_url\" parts to a model that takes images)")
        if getattr(self, self.type) is None or self.model_extra or (self.type == "image_url") != (
                self.image_url is not None):
            shape = '{"url": string}' if self.type == "image_url" else "string"
            raise ValueError(f"a {self.type!r} content part is {{\"type\": \"{self.type}\", \"{self.type}\": "
                             f"{shape}}}, nothing else")
        return self


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCall(_Strict):
    """A past assistant turn's call, as OpenAI returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    refusal: str | None = None  # an assistant's refusal, as OpenAI returns it: kept out of the prompt
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant turn's thinking, as this server (and vLLM) returns it: templates that show past thinking
    # (gpt-oss's before a call, Qwen3's in a tool loop) read it
    reasoning_content: str | None = None
    reasoning: str | None = None
    # An assistant turn's legacy function call and audio: refused unless empty, in
    # ChatCompletionRequest._not_offered with the other features that are not offered.
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:  # OpenAI requires it: which call this result answers
            raise ValueError("a tool message needs tool_call_id: the id of the assistant's tool call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content if part.type == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):  # type: ignore[misc,valid-type]
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # Tools: OpenAI's function definitions, passed to the chat template as sent (nexttoken.chat checks them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    # Variables for the chat template (vLLM's), e.g. {"enable_thinking": false}, over the server's defaults.
    chat_template_kwargs: dict[str, Any] | None = None
    # A reasoning model's thinking budget in tokens (vLLM's thinking_token_budget); reasoning_effort sets one too.
    thinking_token_budget: int | None = Field(None, ge=0)
    # OpenAI's other fields. Accepted with no effect on a local model (docs/serving.md says so): metadata, store
    # (nothing is stored), service_tier, prompt_cache_key, safety_identifier, verbosity (a hint for OpenAI's own
    # models), prediction (a latency hint; the output is the same), modalities ["text"]. The rest
    # (the legacy functions / function_call, audio) is refused by value in _not_offered.
    functions: list[dict[str, Any]] | None = None
    function_call: Union[Literal["none", "auto"], dict[str, Any], None] = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _not_offered(self) -> "ChatCompletionRequest":
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise ValueError("functions / function_call (OpenAI's deprecated form) are not offered: send tools "
                             "and tool_choice")
        for i, m in enumerate(self.messages):
            for name in ("function_call", "audio"):
                if getattr(m, name):
                    raise ValueError(f"messages[{i}].{name} is not offered (send tool_calls for past calls): "
                                     "leave it out")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError(f"modalities {self.modalities!r}: this model answers in text only; use [\"text\"]")
        for name in ("audio", "web_search_options"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not offered by this server (a local text model): leave it out")
        return self

    @model_validator(mode="after")
    def _top_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


class EmbeddingRequest(_Strict, NullIsAbsent):
    """OpenAI's embeddings body (and vLLM's `normalize`)."""

    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    normalize: bool = True  # vLLM's: false returns the pooled states as they are


    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list) -> str | list:
        if isinstance(v, list) and (not v or any(isinstance(p, (str, list)) and not p for p in v)):
            raise ValueError("input must not be empty, nor hold an empty string or list")
        if isinstance(v, str) and not v:
            raise ValueError("input must not be empty")
        return v


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered by the chat template
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Int]


class LoadLoraAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter: serve the PEFT adapter at lora_path under the model name lora_name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id: vLLM's own id, accepted and not needed)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
