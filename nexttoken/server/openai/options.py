"""From an OpenAI request's fields to the one options object, GenerationConfig: one table, translated once.

Each request field either has the same name in GenerationConfig (temperature, top_p, seed, typical_p,
dry_multiplier, ...: vLLM's and llama.cpp's names are the library's) or a row in `RENAMED`. Every value is checked
by GenerationConfig, and a bad one is a 400 naming the field the client sent. `temperature: 0` needs no rule here:
GenerationConfig reads temperatures below 1e-5 (0 included) as greedy, wherever they come from.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ...errors import GenerationConfigError
from ...generation.config import GenerationConfig
from ..http.errors import bad_request
from .protocol import LIBRARY_OPTIONS, SamplingFields

MIROSTAT_TAU = 5.0  # llama.cpp's default target surprise when `mirostat: 2` comes without mirostat_tau

# request field -> (GenerationConfig field, the value translated); fields not here keep their name.
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "stop": ("stop_strings", lambda v: [v] if isinstance(v, str) else list(v)),
    "min_tokens": ("min_new_tokens", lambda v: v),
    "top_k": ("top_k", lambda v: None if v in (-1, 0) else v),  # vLLM: -1 is off
    "logit_bias": ("logit_bias", lambda v: {int(k): b for k, b in v.items()}),
    "n": ("num_return_sequences", lambda v: v),
}
SAME_NAME = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty",
    "ignore_eos", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output", *LIBRARY_OPTIONS,
)


# The sampling fields of a model's generation_config.json that a request inherits when it leaves them out, and
# max_new_tokens as its default max_tokens: vLLM's `--generation-config auto` (its default) reads the same ones.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# What a request gets for a field neither it nor the model's file sets (OpenAI's and vLLM's defaults): sampling at
# temperature 1 with no top-k / top-p / min-p cut, max_tokens all the context has room for.
APPLIED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def model_defaults(gen: GenerationConfig) -> dict[str, Any]:
    """The MODEL_DEFAULT_FIELDS the model's generation_config.json sets (those that differ from GenerationConfig's
    own defaults, as vLLM reads the file); {} when it has none (a GGUF file carries none)."""
    plain = GenerationConfig()
    out = {name: getattr(gen, name) for name in MODEL_DEFAULT_FIELDS if getattr(gen, name) != getattr(plain, name)}
    if out.get("top_k") == 0:  # transformers' "no top-k"
        out["top_k"] = None
    return out


def server_defaults(model_defaults: GenerationConfig, structured_whitespace: str = "flexible",
                    strict_json_schema: bool = True, sampling: dict[str, Any] | None = None) -> GenerationConfig:
    """The model's special tokens with OpenAI's sampling defaults: sampling at temperature 1, no top-k (the
    library's defaults are transformers': greedy, top_k=50), under the model file's own `sampling` defaults
    (model_defaults; max_new_tokens is applied per request); JSON's layout as --structured-whitespace sets it."""
    base = GenerationConfig(
        bos_token_id=model_defaults.bos_token_id,
        eos_token_id=model_defaults.eos_token_id,
        pad_token_id=model_defaults.pad_token_id,
        do_sample=True,
        top_k=None,
        structured_whitespace=structured_whitespace,
        strict_json_schema=strict_json_schema,
    )
    return base.updated(**{k: v for k, v in (sampling or {}).items() if k != "max_new_tokens"})


def applied(cfg: GenerationConfig) -> dict[str, Any]:
    """The sampling options a request runs with (what the request log reports)."""
    return {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "min_p": cfg.min_p,
            "repetition_penalty": cfg.repetition_penalty, "max_tokens": cfg.max_new_tokens}


def _constraints(req: SamplingFields) -> dict[str, tuple[str, Any]]:
    """Structured output, from whichever of OpenAI's, vLLM's or llama.cpp's fields carries it (one at most), and
    the request's JSON layout (structured_outputs.whitespace)."""
    found: list[tuple[str, str, Any]] = []  # (request field, GenerationConfig field, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_object", True))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_  # type: ignore[union-attr]
        found.append(("response_format", "json_schema", schema) if schema is not None
                     else ("response_format", "json_object", True))
    so = req.structured_outputs
    if so is not None:
        for field, name in (("json_", "json_schema"), ("regex", "regex"), ("choice", "choice"),
                            ("grammar", "grammar"), ("json_object", "json_object")):
            if getattr(so, field) not in (None, False):
                found.append(("structured_outputs", name, getattr(so, field)))
    for field, name in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar"), ("json_schema", "json_schema"), ("grammar", "grammar")):
        if getattr(req, field, None) is not None:
            found.append((field, name, getattr(req, field)))
    if len(found) > 1:
        raise bad_request(f"structured output is given twice ({', '.join(f for f, _, _ in found)}): send one",
                          found[1][0])
    out = {name: (field, value) for field, name, value in found}
    if so is not None and so.layout() is not None:  # JSON's layout for this request, over --structured-whitespace
        out["structured_whitespace"] = ("structured_outputs", so.layout())
    return out


def request_options(req: SamplingFields, base: GenerationConfig, **extra: Any) -> GenerationConfig:
    """The request's GenerationConfig over `base`; `extra` are GenerationConfig values the endpoint worked out
    itself (max_new_tokens, top_logprobs, prompt_logprobs)."""
    options: dict[str, tuple[str, Any]] = {}  # GenerationConfig field -> (request field, value)
    for field in (*RENAMED, *SAME_NAME):
        value = getattr(req, field, None)
        if value is None or field not in req.model_fields_set or field in ("json_schema", "grammar"):
            continue
        name, translate = RENAMED.get(field, (field, lambda v: v))
        options[name] = (field, translate(value))
    options.update(_constraints(req))
    if req.mirostat is not None:
        if req.mirostat not in (0, 2):
            raise bad_request(f"mirostat: {req.mirostat} is not offered: use 0 (off) or 2 (mirostat v2)", "mirostat")
        if req.mirostat == 2 and "mirostat_tau" not in options:
            options["mirostat_tau"] = ("mirostat", MIROSTAT_TAU)
        if req.mirostat == 0:
            options.pop("mirostat_tau", None)
    cfg = base
    for name, (field, value) in options.items():
        try:
            cfg = cfg.updated(**{name: value})
        except GenerationConfigError as e:
            raise bad_request(f"{field}: {e}", field) from e
    cfg = dataclasses.replace(cfg, **extra)  # worked out here from checked fields
    if (cfg.min_new_tokens or 0) > (cfg.max_new_tokens or 0):
        raise bad_request(
            f"min_tokens ({cfg.min_new_tokens}) must not exceed max_tokens ({cfg.max_new_tokens})", "min_tokens"
        )
    return cfg


def request_field(name: str) -> str:
    """The request field that carries GenerationConfig's `name` (min_new_tokens: min_tokens)."""
    return next((field for field, (renamed, _) in RENAMED.items() if renamed == name), name)


def constraint_field(req: SamplingFields) -> str:
    """The request field that carried the structured-output constraint (for a 400's `param`)."""
    return next((field for field, _ in _constraints(req).values()), "structured_outputs")
