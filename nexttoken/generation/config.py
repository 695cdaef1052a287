"""GenerationConfig: transformers' field names and defaults, validated once, at the edge.

Options arrive from three places, merged in this order: the model's `generation_config.json`, a
`GenerationConfig` passed by the caller, then keyword options. An unknown name or a bad value raises a
GenerationConfigError that names it and says what is allowed; nothing is silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import GenerationConfigError
from .values import (WARPER_NAMES, Thinking, WatermarkingConfig, check_choice, check_combination, json_schema_value,
                     parse_logit_bias, parse_sequence_bias)

# Keys transformers writes into generation_config.json that describe the file, not the generation.
_FILE_METADATA = {"transformers_version", "_from_model_config", "use_cache", "trust_remote_code"}
# transformers fields that a generation_config.json may carry at values that change nothing here. Any other
# value of them is an option nexttoken does not implement, and reading the file raises rather than ignore it.
_FILE_NO_OP_VALUES: dict[str, object] = {
    "output_attentions": False,
    "output_hidden_states": False,
    "return_legacy_cache": True,
    "cache_implementation": None,
    "decoder_start_token_id": None,
}


GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: below it, sampling is greedy decoding
PENALTY_RANGE = (0.01, 100.0)  # multiplicative penalties outside it overflow float32 scores (1e-300: inf, NaN)
# Additive biases (sequence_bias values, the watermark's bias) in OpenAI's logit_bias range: +-100 already makes a
# token certain or impossible, and much larger values overflow float32 scores. sequence_bias also takes -inf (a ban).
BIAS_LIMIT = 100.0
GUIDANCE_LIMIT = 100.0  # classifier-free guidance scales past it only overflow (the guided distribution is one-hot)
# DRY's penalty is dry_multiplier * dry_base ** (n - allowed_length): a multiplier past 100 logits only bans harder,
# and text-generation-webui's slider stops the base at 4 (10 leaves room); larger values overflow float32 scores.
DRY_MULTIPLIER_LIMIT = 100.0
DRY_BASE_LIMIT = 10.0


@dataclass(frozen=True)
class GenerationConfig:
    # Length. When neither is set, 20 new tokens (transformers' default `max_length=20` counts new tokens then).
    max_new_tokens: int | None = None
    max_length: int | None = None
    # Strategy.
    do_sample: bool = False
    seed: int | None = None
    # Processors: the chain and its order are built in processors.build_processors (see docs/decoding.md).
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    top_h: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    encoder_repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    sequence_bias: Any = None  # {tuple(ids): bias} or [[ids, bias], ...]
    min_length: int = 0
    min_new_tokens: int | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | list[int] | None = None
    remove_invalid_values: bool = False
    exponential_decay_length_penalty: tuple[int, float] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    guidance_scale: float | None = None
    watermarking_config: Any = None  # a watermark.WatermarkingConfig or a dict of its fields
    renormalize_logits: bool = False
    # Beyond transformers: OpenAI penalties and llama.cpp samplers (see docs/decoding.md).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 0
    dry_sequence_breakers: list[int] | None = None
    xtc_threshold: float = 0.1
    xtc_probability: float = 0.0
    top_n_sigma: float | None = None
    mirostat_tau: float | None = None  # mirostat v2 when set; it replaces the truncation warpers
    mirostat_eta: float = 0.1
    sampler_order: list[str] | None = None  # explicit order of the sampling warpers (names in processors.WARPERS)
    # Many sequences and beams.
    num_return_sequences: int = 1
    num_beams: int = 1
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    penalty_alpha: float | None = None  # contrastive search with top_k candidates when > 0 and not sampling
    # Stopping.
    eos_token_id: int | list[int] | None = None
    stop_strings: str | list[str] | None = None
    max_time: float | None = None
    stop_token_ids: list[int] | None = None  # ids that end a sequence like EOS, reported as its stop_reason
    ignore_eos: bool = False  # keep going past EOS (stop_token_ids, stop strings and length still stop)
    # Text and what is reported with it (the output pipeline, generation/output_pipeline.py).
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    echo: bool = False  # the prompt's text, ids and log-probs lead the completion's
    # Special tokens.
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # Outputs of the low-level generate().
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    top_logprobs: int = 0  # per generated token: log-probabilities of the N most likely alternatives
    prompt_logprobs: bool = False  # log-probability of every prompt token given the ones before it
    logprobs_mode: str = "raw"  # "raw": the model's distribution; "processed": the one sampled from
    # Structured output (generation/processors/structured.py, docs/structured_output.md): at most one constraint.
    json_schema: Any = None  # a JSON Schema: dict, JSON string or pydantic model class (kept as a dict)
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect), or GBNF (llama.cpp's) when it has '::='
    structured_best_effort: bool = False  # enforce what the grammar engine can and let unimplemented keywords pass
    # JSON's whitespace (json_schema, json_object): "flexible" lets the model write the blanks it writes by habit
    # (a newline and indentation after "{", a space after ":"), bounded per gap as llama.cpp bounds it, so it
    # cannot loop on blanks; "compact" allows exactly json.dumps' layout ('{"a": 1, "b": 2}').
    structured_whitespace: str = "flexible"
    # JSON Schema as clients write it (json_schema and tool arguments): an object with `properties` and no
    # `additionalProperties` takes no other keys, numbers have bounded digits (values.bounded_schema), as llama.cpp
    # and XGrammar read schemas; False: JSON Schema's literal reading (other keys and any digits allowed).
    strict_json_schema: bool = True
    # Traces (generation/trace/recorder.py, docs/tracing.md): per step, the top trace_top_n candidates before and after
    # each processor, the draw, the stop decisions and timings. Recorded by the engine (greedy and sampling).
    trace: bool = False
    trace_top_n: int = 10
    # A reasoning model's thinking block (values.Thinking: its markers, its budget): the budget closes it, and
    # structured output and tool calls constrain the answer after it, not the thinking.
    thinking: Any = None
    # speculative decoding (generation/speculative.py): prompt lookup, or a draft model passed as assistant_model
    prompt_lookup_num_tokens: int | None = None  # draft this many tokens by prompt lookup
    max_matching_ngram_size: int | None = None  # prompt lookup's longest n-gram (default 2)
    num_assistant_tokens: int = 20  # tokens an assistant (draft) model drafts per step
    num_assistant_tokens_schedule: str = "constant"  # "constant", or "heuristic": +2 after all kept, -1 otherwise

    @classmethod
    def from_file(cls, path: str | Path, base: "GenerationConfig | None" = None) -> "GenerationConfig":
        """Read a generation_config.json over `base`; metadata keys are skipped, unknown options raise."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GenerationConfigError(f"{path} is not valid JSON: {e}") from e
        options = {
            k: v
            for k, v in raw.items()
            if k not in _FILE_METADATA and not (k in _FILE_NO_OP_VALUES and _FILE_NO_OP_VALUES[k] == v)
        }
        return (base or cls()).updated(_source=str(path), **options)

    def updated(self, _source: str = "option", **options: Any) -> "GenerationConfig":
        """A copy with `options` applied, every value checked."""
        names = {f.name for f in dataclasses.fields(self)}
        for name, value in options.items():
            if name not in names:
                raise GenerationConfigError(
                    f"unknown generation option {name!r} ({_source}); known options: {', '.join(sorted(names))}"
                )
            _CHECKS[name](name, value)
            if name in _CANONICAL:
                options[name] = _CANONICAL[name](value)
        updated = dataclasses.replace(self, **options)
        check_combination(updated)
        return updated

    @property
    def greedy(self) -> bool:
        # Temperatures below GREEDY_TEMPERATURE (0 included) mean greedy, as in vLLM: dividing logits by 1e-300
        # would overflow to inf and NaN probabilities, and a temperature that small picks the argmax anyway.
        return not self.do_sample or self.temperature < GREEDY_TEMPERATURE

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """echo reports the prompt's log-probs with its text, so it needs them computed too."""
        return self.prompt_logprobs or self.echo

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends a sequence: EOS (unless ignore_eos) and stop_token_ids."""
        return frozenset(([] if self.ignore_eos else self.eos_ids) + list(self.stop_token_ids or ()))

    @property
    def stop_string_list(self) -> list[str]:
        if self.stop_strings is None:
            return []
        return [self.stop_strings] if isinstance(self.stop_strings, str) else list(self.stop_strings)

    def ids_outside(self, vocab_size: int) -> dict[str, list[int]]:
        """The token ids options name that lie outside [0, vocab_size), per option ({} when all fit).

        The field checks cannot know the vocabulary; whoever holds the model (the engine, the server) calls this
        before running, so an id past the vocabulary is a bad option, not a failure inside a processor."""
        def flat(v: Any) -> list[int]:
            return [v] if isinstance(v, int) else [t for x in v for t in flat(x)] if v is not None else []

        named = {
            "bad_words_ids": flat(self.bad_words_ids),
            "sequence_bias": flat([list(k) for k in parse_sequence_bias(self.sequence_bias)])
            if self.sequence_bias is not None else [],
            "suppress_tokens": flat(self.suppress_tokens),
            "begin_suppress_tokens": flat(self.begin_suppress_tokens),
            "forced_bos_token_id": flat(self.forced_bos_token_id),
            "forced_eos_token_id": flat(self.forced_eos_token_id),
            "dry_sequence_breakers": flat(self.dry_sequence_breakers),
            "stop_token_ids": flat(self.stop_token_ids),
            "logit_bias": list(parse_logit_bias(self.logit_bias)) if self.logit_bias is not None else [],
        }
        outside = {name: sorted({t for t in ids if not 0 <= t < vocab_size}) for name, ids in named.items()}
        return {name: ids for name, ids in outside.items() if ids}

    def bans_every_token(self, vocab_size: int) -> tuple[str, str] | None:
        """(option, reason) when the bans these options set leave no id in [0, vocab_size) to choose at some step
        (the sampler would draw from an empty distribution, greedy from a row of -inf); None when one is left.

        Bans that hold at every step come first (suppress_tokens, single-token bad_words_ids, -inf single-token
        sequence_bias), then the first step's (begin_suppress_tokens), then min_new_tokens' ban on the stop ids.
        The option named is the one whose ids complete the ban."""
        vocab = set(range(vocab_size))
        biased = parse_sequence_bias(self.sequence_bias) if self.sequence_bias is not None else {}
        stages = [
            ("suppress_tokens", self.suppress_tokens or (), "at every step"),
            ("bad_words_ids", [w[0] for w in self.bad_words_ids or () if len(w) == 1 and w[0] not in self.eos_ids],
             "at every step"),  # a bad word that is one EOS id is dropped (processors.penalties.NoBadWords)
            ("sequence_bias", [ids[0] for ids, b in biased.items() if len(ids) == 1 and b == -math.inf],
             "at every step"),
            ("begin_suppress_tokens", self.begin_suppress_tokens or (), "at the first step"),
            ("min_new_tokens", [*self.eos_ids, *(self.stop_token_ids or ())] if self.min_new_tokens else (),
             f"until min_new_tokens={self.min_new_tokens} (it bans the stop ids: EOS and stop_token_ids)"),
        ]
        banned: set[int] = set()
        for name, ids, when in stages:
            added = vocab & set(ids)
            if added and banned | added >= vocab:
                return name, when
            banned |= added
        return None

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise GenerationConfigError naming the first option with a token id outside [0, vocab_size), or the
        option that leaves no token to choose."""
        for name, ids in self.ids_outside(vocab_size).items():
            raise GenerationConfigError(
                f"{name} names token ids {ids[:5]} outside the vocabulary [0, {vocab_size}): use ids below "
                f"{vocab_size}"
            )
        banned = self.bans_every_token(vocab_size)
        if banned is not None:
            raise GenerationConfigError(no_token_left(*banned, vocab_size))


def no_token_left(name: str, when: str, vocab_size: int) -> str:
    """The message for an option that, with the bans before it, leaves no token to choose."""
    return (f"{name} leaves no token to choose from: alone or with the bans before it, it bans all {vocab_size} "
            f"ids of the vocabulary {when}; leave at least one id allowed")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise GenerationConfigError(f"invalid value {value!r} for {name}: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int_at_least(lo: int, optional: bool = True) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v is None and optional:
            return
        if not _is_int(v) or v < lo:
            _fail(name, v, f"must be an integer >= {lo}" + (" or None" if optional else ""))

    return check


def _number(lo: float, hi: float, lo_open: bool = False, optional: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v is None and optional:
            return
        ok = _is_number(v) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            left = "(" if lo_open else "["
            _fail(name, v, f"must be a number in {left}{lo}, {hi}]" + (" or None" if optional else ""))

    return check


def _boolean(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        _fail(name, v, "must be true or false")


def _token_ids(name: str, v: Any) -> None:
    if v is None or (_is_int(v) and v >= 0):
        return
    if isinstance(v, (list, tuple)) and v and all(_is_int(t) and t >= 0 for t in v):
        return
    _fail(name, v, "must be a token id (integer >= 0), a non-empty list of them, or None")


def _token_id(name: str, v: Any) -> None:
    if v is not None and not (_is_int(v) and v >= 0):
        _fail(name, v, "must be a token id (integer >= 0) or None")


def _stop_strings(name: str, v: Any) -> None:
    if v is None or (isinstance(v, str) and v):
        return
    if isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v):
        return
    _fail(name, v, "must be a non-empty string or a list of non-empty strings")


def _seed(name: str, v: Any) -> None:
    if v is not None and not (_is_int(v) and 0 <= v < 2**63):
        _fail(name, v, "must be an integer in [0, 2**63) or None")


def _id_list(name: str, v: Any) -> None:
    if v is None or (isinstance(v, (list, tuple)) and all(_is_int(t) and t >= 0 for t in v)):
        return
    _fail(name, v, "must be a list of token ids (integers >= 0) or None")


def _id_lists(name: str, v: Any) -> None:
    if v is None or (isinstance(v, (list, tuple)) and v and all(
        isinstance(w, (list, tuple)) and w and all(_is_int(t) and t >= 0 for t in w) for w in v
    )):
        return
    _fail(name, v, "must be a non-empty list of non-empty lists of token ids, or None")


def _parsed_by(parse: Callable[[Any], Any], errors: tuple[type[Exception], ...] = (GenerationConfigError,)) -> Callable[[str, Any], None]:
    """A check that runs the processors' own parser (values.py): one definition of validity."""

    def check(name: str, v: Any) -> None:
        if v is None:
            return
        try:
            parse(v)
        except errors as e:
            _fail(name, v, str(e))

    return check


_sequence_bias_parsed = _parsed_by(parse_sequence_bias)
_logit_bias = _parsed_by(parse_logit_bias)
_watermarking_parsed = _parsed_by(WatermarkingConfig.from_any, (GenerationConfigError, TypeError))


def _sequence_bias(name: str, v: Any) -> None:
    _sequence_bias_parsed(name, v)
    if v is None:
        return
    for ids, bias in parse_sequence_bias(v).items():
        if not (-BIAS_LIMIT <= bias <= BIAS_LIMIT or bias == -math.inf):
            _fail(name, v, f"the bias for {list(ids)} must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}] (or -inf, a ban), "
                           f"got {bias!r}")


def _watermarking(name: str, v: Any) -> None:
    _watermarking_parsed(name, v)
    if v is None:
        return
    bias = WatermarkingConfig.from_any(v).bias
    if not (math.isfinite(bias) and abs(bias) <= BIAS_LIMIT):
        _fail(name, v, f"bias must be a number in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bias!r}")


def _thinking(name: str, v: Any) -> None:
    if v is not None and not isinstance(v, Thinking):
        _fail(name, v, "must be a nexttoken.generation.values.Thinking (the block's marker ids and budget)")


def _decay(name: str, v: Any) -> None:
    if v is None or (
        isinstance(v, (list, tuple)) and len(v) == 2 and _is_int(v[0]) and v[0] >= 0 and _is_number(v[1]) and v[1] > 0
    ):
        return
    _fail(name, v, "must be (start_index: int >= 0, decay_factor: number > 0) or None")


def _early_stopping(name: str, v: Any) -> None:
    if not (isinstance(v, bool) or v == "never"):
        _fail(name, v, 'must be true, false or "never"')


def _json_schema(name: str, v: Any) -> None:
    if v is not None:
        json_schema_value(v)


def _choice(name: str, v: Any) -> None:
    if v is not None:
        check_choice(v)


def _text(name: str, v: Any) -> None:
    if v is not None and not (isinstance(v, str) and v):
        _fail(name, v, "must be a non-empty string or None")


def _one_of(*allowed: str) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if v not in allowed:
            _fail(name, v, "must be one of " + ", ".join(repr(a) for a in allowed))

    return check


def _sampler_order(name: str, v: Any) -> None:
    if v is None:
        return
    if not isinstance(v, (list, tuple)) or len(set(v)) != len(v) or not all(x in WARPER_NAMES for x in v):
        _fail(name, v, f"must be a list of distinct names from {sorted(WARPER_NAMES)}")


TRACE_TOP_N_LIMIT = 1000  # candidates kept per stage and step: the trace's memory bound


def _trace_top_n(name: str, v: Any) -> None:
    if not (_is_int(v) and 1 <= v <= TRACE_TOP_N_LIMIT):
        _fail(name, v, f"must be an integer in [1, {TRACE_TOP_N_LIMIT}]")


_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "max_new_tokens": _int_at_least(0),
    "max_length": _int_at_least(1),
    "do_sample": _boolean,
    "seed": _seed,
    "temperature": _number(0.0, math.inf),
    "top_k": _int_at_least(0),
    "top_p": _number(0.0, 1.0, lo_open=True),
    "min_p": _number(0.0, 1.0, optional=True),
    "repetition_penalty": _number(*PENALTY_RANGE),
    "eos_token_id": _token_ids,
    "stop_strings": _stop_strings,
    "bos_token_id": _token_id,
    "pad_token_id": _token_id,
    "return_dict_in_generate": _boolean,
    "output_scores": _boolean,
    "output_logits": _boolean,
    "top_logprobs": _int_at_least(0, optional=False),
    "prompt_logprobs": _boolean,
    "top_h": _number(0.0, 1.0, lo_open=True, optional=True),
    "typical_p": _number(0.0, 1.0, lo_open=True),
    "epsilon_cutoff": _number(0.0, 1.0),
    "eta_cutoff": _number(0.0, 1.0),
    "encoder_repetition_penalty": _number(*PENALTY_RANGE),
    "no_repeat_ngram_size": _int_at_least(0, optional=False),
    "encoder_no_repeat_ngram_size": _int_at_least(0, optional=False),
    "bad_words_ids": _id_lists,
    "sequence_bias": _sequence_bias,
    "min_length": _int_at_least(0, optional=False),
    "min_new_tokens": _int_at_least(0),
    "forced_bos_token_id": _token_id,
    "forced_eos_token_id": _token_ids,
    "remove_invalid_values": _boolean,
    "exponential_decay_length_penalty": _decay,
    "suppress_tokens": _id_list,
    "begin_suppress_tokens": _id_list,
    "guidance_scale": _number(0.0, GUIDANCE_LIMIT, optional=True),
    "watermarking_config": _watermarking,
    "renormalize_logits": _boolean,
    "presence_penalty": _number(-2.0, 2.0),
    "frequency_penalty": _number(-2.0, 2.0),
    "logit_bias": _logit_bias,
    "dry_multiplier": _number(0.0, DRY_MULTIPLIER_LIMIT),
    "dry_base": _number(1.0, DRY_BASE_LIMIT, lo_open=True),
    "dry_allowed_length": _int_at_least(1, optional=False),
    "dry_penalty_last_n": _int_at_least(0, optional=False),
    "dry_sequence_breakers": _id_list,
    "xtc_threshold": _number(0.0, 1.0),
    "xtc_probability": _number(0.0, 1.0),
    "top_n_sigma": _number(0.0, math.inf, optional=True),
    "mirostat_tau": _number(0.0, math.inf, lo_open=True, optional=True),
    "mirostat_eta": _number(0.0, math.inf, lo_open=True),
    "sampler_order": _sampler_order,
    "num_return_sequences": _int_at_least(1, optional=False),
    "num_beams": _int_at_least(1, optional=False),
    "num_beam_groups": _int_at_least(1, optional=False),
    "diversity_penalty": _number(0.0, math.inf),
    "length_penalty": _number(-math.inf, math.inf),
    "early_stopping": _early_stopping,
    "penalty_alpha": _number(0.0, 1.0, optional=True),
    "max_time": _number(0.0, math.inf, lo_open=True, optional=True),
    "stop_token_ids": _id_list,
    "ignore_eos": _boolean,
    "skip_special_tokens": _boolean,
    "include_stop_str_in_output": _boolean,
    "echo": _boolean,
    "logprobs_mode": _one_of("raw", "processed"),
    "json_schema": _json_schema,
    "json_object": _boolean,
    "regex": _text,
    "choice": _choice,
    "grammar": _text,
    "structured_best_effort": _boolean,
    "structured_whitespace": _one_of("compact", "flexible"),
    "strict_json_schema": _boolean,
    "trace": _boolean,
    "trace_top_n": _trace_top_n,
    "thinking": _thinking,
    "prompt_lookup_num_tokens": _int_at_least(1),
    "max_matching_ngram_size": _int_at_least(1),
    "num_assistant_tokens": _int_at_least(1, optional=False),
    "num_assistant_tokens_schedule": _one_of("constant", "heuristic"),
}
# Values kept in one form once checked: a schema as a dict (from a JSON string or a pydantic class), choices a list.
_CANONICAL: dict[str, Callable[[Any], Any]] = {
    "json_schema": lambda v: None if v is None else json_schema_value(v),
    "choice": lambda v: None if v is None else list(v),
}
assert set(_CHECKS) == {f.name for f in dataclasses.fields(GenerationConfig)}
