"""Option values that GenerationConfig checks and the processors use, parsed in one place below both: OpenAI's
`logit_bias`, transformers' `sequence_bias` and `WatermarkingConfig`, a JSON Schema or a choice list, which
constraints may go together, and the sampling warpers' names. One definition of validity; no import circle between
the options object and the processors that read it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import GenerationConfigError

CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")
# The sampling warpers (processors.chain.WARPERS), in their default order; `sampler_order` names a permutation.
WARPER_NAMES = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                "top_n_sigma", "xtc")


def parse_logit_bias(bias: Mapping[Any, Any]) -> dict[int, float]:
    """OpenAI `logit_bias`: {token id (int or its decimal string, as JSON keys are): bias in [-100, 100]}."""
    if not isinstance(bias, Mapping):
        raise GenerationConfigError(f"logit_bias must be a mapping of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if isinstance(key, (int, str)) and not isinstance(key, bool) else -1
        except ValueError:
            token = -1
        if token < 0:
            raise GenerationConfigError(f"logit_bias key {key!r} is not a token id (an integer >= 0)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise GenerationConfigError(f"logit_bias[{key!r}] = {value!r}: a bias must be a number in [-100, 100]")
        out[token] = float(value)
    return out


def parse_sequence_bias(sequence_bias: Any) -> dict[tuple[int, ...], float]:
    items: list[tuple[Any, Any]]
    if isinstance(sequence_bias, Mapping):
        items = list(sequence_bias.items())
    elif isinstance(sequence_bias, (list, tuple)):
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in sequence_bias):
            raise GenerationConfigError(
                f"sequence_bias as a list must hold [token ids, bias] pairs, got {sequence_bias!r}"
            )
        items = [(p[0], p[1]) for p in sequence_bias]
    else:
        items = []
    if not items:
        raise GenerationConfigError(
            f"sequence_bias must be a non-empty dict or list of [ids, bias], got {sequence_bias!r}"
        )
    out: dict[tuple[int, ...], float] = {}
    for ids, value in items:
        ok_ids = isinstance(ids, (list, tuple)) and ids and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        )
        if not ok_ids:
            raise GenerationConfigError(f"sequence_bias key {ids!r} must be a non-empty list of token ids")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise GenerationConfigError(f"sequence_bias value for {ids!r} must be a number, got {value!r}")
        out[tuple(ids)] = float(value)
    return out


@dataclass(frozen=True)
class WatermarkingConfig:
    """transformers' WatermarkingConfig fields and defaults."""

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    @classmethod
    def from_any(cls, value: "WatermarkingConfig | Mapping[str, Any]") -> "WatermarkingConfig":
        if isinstance(value, WatermarkingConfig):
            return value
        if not isinstance(value, Mapping):
            raise GenerationConfigError(
                f"watermarking_config must be a dict of WatermarkingConfig fields, got {value!r}"
            )
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known - {"transformers_version"}
        if unknown:
            raise GenerationConfigError(f"unknown watermarking_config keys {sorted(unknown)}; known: {sorted(known)}")
        cfg = cls(**{k: v for k, v in value.items() if k in known})
        if not 0.0 < cfg.greenlist_ratio < 1.0:
            raise GenerationConfigError(f"greenlist_ratio must be in (0, 1), got {cfg.greenlist_ratio!r}")
        if cfg.seeding_scheme not in ("lefthash", "selfhash"):
            raise GenerationConfigError(f"seeding_scheme must be 'lefthash' or 'selfhash', got {cfg.seeding_scheme!r}")
        if not isinstance(cfg.context_width, int) or cfg.context_width < 1:
            raise GenerationConfigError(f"context_width must be an integer >= 1, got {cfg.context_width!r}")
        if not isinstance(cfg.hashing_key, int) or isinstance(cfg.bias, bool) or not isinstance(cfg.bias, (int, float)):
            raise GenerationConfigError(f"hashing_key must be an int and bias a number, got {value!r}")
        return cfg


@dataclass(frozen=True)
class Thinking:
    """A reasoning model's thinking block, by its marker tokens: where it opens and closes in a sequence, and the
    budget that closes it (GenerationConfig's `thinking`).

    Read off the tokens alone: thinking is open where the last marker so far is `start` (a template that opens
    the block in the prompt, DeepSeek-R1's, leaves it open; Qwen3's with thinking off closes it there). A block
    the prompt leaves closed may still be opened by the answer's first token, and only there."""

    start_id: int
    end_id: int
    budget: int | None = None  # thinking tokens at most; then the end marker is forced (None: no limit)

    def __post_init__(self) -> None:
        for name in ("start_id", "end_id"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise GenerationConfigError(f"thinking.{name} must be a token id, got {v!r}")
        if self.budget is not None and (isinstance(self.budget, bool) or not isinstance(self.budget, int)
                                        or self.budget < 0):
            raise GenerationConfigError(f"thinking.budget must be an integer >= 0 (or None), got {self.budget!r}")

    def open_after(self, ids: Sequence[int]) -> bool:
        """Whether the block is open after `ids` (a prompt): its last marker is the start."""
        for token in reversed(ids):
            if token in (self.start_id, self.end_id):
                return token == self.start_id
        return False

    def span(self, prompt_open: bool, generated: Sequence[int]) -> tuple[int | None, int | None]:
        """(where the thinking began in `generated`, where the answer after it begins): (None, 0) when there is no
        thinking; (k, None) while it is open; the start is -1 when the prompt opened it."""
        begun = -1 if prompt_open else (0 if generated and generated[0] == self.start_id else None)
        if begun is None:
            return None, 0
        for i in range(begun + 1, len(generated)):
            if generated[i] == self.end_id:
                return begun, i + 1
        return begun, None


class StructuredOutputError(GenerationConfigError):
    """A constraint that cannot be enforced as given: a bad schema, regex or grammar, or a feature the grammar
    engine does not implement (named in the message)."""



def json_schema_value(value: Any) -> dict[str, Any]:
    """A JSON Schema given as a dict, a JSON string or a pydantic model class -> the schema as a dict."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic BaseModel class
        return value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"json_schema is not valid JSON ({e}): pass a dict, a JSON string or a "
                                        "pydantic model class") from e
    if isinstance(value, bool):  # JSON Schema's `true` (anything) and `false` (nothing)
        raise StructuredOutputError("json_schema must be an object schema ({...}), not a boolean schema: use "
                                    "json_object=True for any JSON object")
    if not isinstance(value, dict):
        raise StructuredOutputError(f"json_schema must be a dict, a JSON string or a pydantic model class, got "
                                    f"{type(value).__name__}")
    return value


# What a client's JSON Schema means by default (strict_json_schema=True), as llama.cpp's json-schema-to-grammar and
# XGrammar's strict mode read it: an object schema with `properties` and no `additionalProperties` takes no other
# keys (else a model may invent keys until max_tokens), and numbers have bounded digits (else "1212222..." runs on):
# at most INTEGER_DIGITS before the point (llama.cpp's `[1-9] [0-9]{0,15}`) and FRACTION_DIGITS after it (the
# finest `multipleOf` llguidance compiles is 1e-10). strict_json_schema=False reads the schema literally.
INTEGER_DIGITS = 16
FRACTION_DIGITS = 10
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "not", "if", "then",
              "else", "contains", "propertyNames", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_schema(schema: Any, closable: bool = True) -> Any:
    """`schema` as the grammar reads it by default (the bounds above), a new object: the client's is unchanged.
    `closable`: False for an allOf member, whose keys its siblings' properties may add."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = bounded_schema(out[key])
    if isinstance(out.get("items"), list):  # draft-4 tuple items
        out["items"] = [bounded_schema(s) for s in out["items"]]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(s) for s in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [bounded_schema(s, closable=False) for s in out["allOf"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_schema(s) for name, s in out[key].items()}
    if closable and "properties" in out and "allOf" not in out and "additionalProperties" not in out \
            and "unevaluatedProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    types = out.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if ("number" in types or "integer" in types) and "enum" not in out and "const" not in out:
        largest = 10**INTEGER_DIGITS - 1
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = largest
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -largest
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")
    return out


def check_choice(value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
        raise StructuredOutputError(f"choice must be a non-empty list of non-empty strings, got {value!r}")


def check_combination(cfg: Any) -> None:
    """Options that cannot go with a constraint, refused by name (GenerationConfig calls this)."""
    given = [n for n in CONSTRAINTS if (getattr(cfg, n) not in (None, False))]
    if len(given) > 1:
        raise StructuredOutputError(f"give one constraint, not {' and '.join(given)}")
    if not given:
        return
    if cfg.num_beams > 1 or (cfg.penalty_alpha or 0) > 0:
        raise StructuredOutputError(
            f"{given[0]} works with greedy decoding and sampling, not beam or contrastive search (their rows are "
            "reordered and re-ranked, and a ranked-out prefix may not complete the grammar): use num_beams=1"
        )
    if cfg.ignore_eos:
        raise StructuredOutputError(f"{given[0]} ends the output where its grammar ends; ignore_eos would run past "
                                    "it: leave ignore_eos off")
