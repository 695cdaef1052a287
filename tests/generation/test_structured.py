"""Structured output against the references that define the formats: every output that finishes with "stop"
validates with `jsonschema` (formats checked), matches with `re.fullmatch`, parses with `lark`, or is one of the
choices; unsupported keywords are refused by name; each supported keyword is shown to matter (without it some output
breaks the schema, with it none does)."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
import torch

import nexttoken
from nexttoken.bench.schemas import PARTIAL, SCHEMAS, UNSUPPORTED
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation.config import GenerationConfig
from nexttoken.generation.processors.structured import GRAMMARS, StructuredOutputError, compile_for

FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield nexttoken.load()  # the packaged model
    torch.set_num_threads(before)


def _outputs(llm, **options):  # noqa: ANN001, ANN003
    """Greedy, then three seeded samples (seeds 7, 8, 9)."""
    greedy = llm.generate(PROMPT, max_new_tokens=100, do_sample=False, **options)
    sampled = llm.generate(PROMPT, max_new_tokens=100, do_sample=True, seed=7, num_return_sequences=3, **options)
    return [greedy, *sampled]


def _valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def test_corpus_outputs_validate(llm) -> None:  # noqa: ANN001
    assert len(SCHEMAS) >= 30
    stopped = total = 0
    for name, schema in SCHEMAS.items():
        for out in _outputs(llm, json_schema=schema):
            total += 1
            assert out.finish_reason in ("stop", "length"), (name, out)
            if out.finish_reason == "stop":
                stopped += 1
                assert _valid(schema, out.text), (name, out.text)
    assert stopped >= 0.75 * total, (stopped, total)  # most outputs finish: the check is not vacuous


def test_schema_as_json_string_and_pydantic_class(llm) -> None:  # noqa: ANN001
    from pydantic import BaseModel, ConfigDict, Field

    class Pet(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=8)
        legs: int = Field(ge=0, le=8)

    greedy = dict(do_sample=False, max_new_tokens=60)
    as_dict = llm.generate(PROMPT, json_schema=Pet.model_json_schema(), **greedy)
    assert llm.generate(PROMPT, json_schema=Pet, **greedy).text == as_dict.text
    assert llm.generate(PROMPT, json_schema=json.dumps(Pet.model_json_schema()), **greedy).text == as_dict.text
    assert as_dict.finish_reason == "stop"
    Pet.model_validate_json(as_dict.text)


# ---- each keyword matters, and is enforced ---------------------------------------------------------------------------

# keyword -> (schema with it, the same schema without it[, a character the model is pushed to write early]). Without
# the keyword some output breaks the full schema (so the keyword is what makes outputs satisfy it); with it, every
# finished output satisfies it. The packaged model fills strings and arrays to their maximum, so for the lower bounds
# a logit bias on the closing character makes it want to stop early, and the mask must hold it back.
_AGE = {"type": "integer", "minimum": 0, "maximum": 99}
KEYWORDS = {
    "minimum": ({"type": "integer", "minimum": 500, "maximum": 999}, {"type": "integer", "maximum": 999}),
    "maximum": ({"type": "integer", "minimum": 0, "maximum": 7}, {"type": "integer", "minimum": 0}),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 40, "maximum": 60}, {"type": "integer", "maximum": 60}),
    "exclusiveMaximum": ({"type": "integer", "minimum": 0, "exclusiveMaximum": 3}, {"type": "integer", "minimum": 0}),
    "multipleOf": ({"type": "integer", "minimum": 1, "maximum": 99, "multipleOf": 7},
                   {"type": "integer", "minimum": 1, "maximum": 99}),
    "minLength": ({"type": "string", "minLength": 6, "maxLength": 24}, {"type": "string", "maxLength": 24}, '"'),
    "maxLength": ({"type": "string", "maxLength": 2}, {"type": "string"}),
    "pattern": ({"type": "string", "pattern": "^[a-c]{3}$"}, {"type": "string", "maxLength": 8}),
    "format": ({"type": "string", "format": "date"}, {"type": "string", "maxLength": 10}),
    "enum": ({"enum": ["alpha", "beta"]}, {"type": "string", "maxLength": 8}),
    "const": ({"const": "zeta"}, {"type": "string", "maxLength": 8}),
    "type": ({"type": "boolean"}, {}),
    "minItems": ({"type": "array", "items": _AGE, "minItems": 3, "maxItems": 6}, {"type": "array", "items": _AGE,
                                                                                  "maxItems": 6}, "]"),
    "maxItems": ({"type": "array", "items": _AGE, "maxItems": 1}, {"type": "array", "items": _AGE}),
    "items": ({"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, {"type": "array", "maxItems": 3}),
    "required": ({"type": "object", "properties": {"a": _AGE, "b": _AGE}, "required": ["a", "b"],
                  "additionalProperties": False},
                 {"type": "object", "properties": {"a": _AGE, "b": _AGE}, "additionalProperties": False}),
    "additionalProperties": ({"type": "object", "properties": {"a": _AGE}, "required": ["a"],
                              "additionalProperties": False},
                             {"type": "object", "properties": {"a": _AGE}, "required": ["a"]}),
    "properties": ({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                    "additionalProperties": False},
                   {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False}),
    "anyOf": ({"anyOf": [{"type": "boolean"}, {"type": "null"}]}, {}),
    "$ref": ({"$defs": {"b": {"type": "boolean"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/b"}},
              "required": ["x"], "additionalProperties": False},
             {"type": "object", "properties": {"x": {}}, "required": ["x"], "additionalProperties": False}),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "boolean"}], "minItems": 1, "maxItems": 1},
                    {"type": "array", "minItems": 1, "maxItems": 1}),
}


@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_each_supported_keyword_is_enforced(llm, keyword) -> None:  # noqa: ANN001
    full, without, *push = KEYWORDS[keyword]
    extra = {}
    if push:
        closing = next(i for i in range(llm.model.config.vocab_size) if llm.tokenizer.decode([i]) == push[0])
        extra = {"logit_bias": {closing: 30.0}}
    # JSON Schema's literal reading (the default closes objects and bounds digits: test_schema_defaults.py)
    loose = [o.text for o in _outputs(llm, json_schema=without, strict_json_schema=False, **extra)]
    assert not all(_valid(full, t) for t in loose), (keyword, loose)  # the keyword is what makes outputs satisfy it
    outs = _outputs(llm, json_schema=full, **extra)
    assert any(o.finish_reason == "stop" for o in outs), (keyword, outs)
    for out in outs:
        if out.finish_reason == "stop":
            assert _valid(full, out.text), (keyword, out.text)


@pytest.mark.parametrize("keyword", sorted(UNSUPPORTED))
def test_each_unsupported_keyword_is_refused_by_name(llm, keyword) -> None:  # noqa: ANN001
    schema = UNSUPPORTED[keyword]
    with pytest.raises(StructuredOutputError, match=re.escape(keyword)) as error:
        llm.generate(PROMPT, json_schema=schema, max_new_tokens=4)
    assert "structured_best_effort" in str(error.value)
    out = llm.generate(PROMPT, json_schema=schema, max_new_tokens=40, structured_best_effort=True)  # opted in
    assert out.token_ids


@pytest.mark.parametrize("keyword", sorted(PARTIAL))
def test_partly_supported_keywords_are_refused_even_with_best_effort(llm, keyword) -> None:  # noqa: ANN001
    for best_effort in (False, True):
        with pytest.raises(StructuredOutputError, match=r"min(/max)?Properties"):
            llm.generate(PROMPT, json_schema=PARTIAL[keyword], max_new_tokens=4, structured_best_effort=best_effort)


# ---- regex, choice, grammars -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [r"[A-Z][a-z]{2,6} is [0-9]{1,2} years old\.", r"(yes|no|maybe)",
                                     r"\d{3}-\d{4}", r"[a-z]{1,8}(, [a-z]{1,8}){2}", r"#[0-9a-f]{6}"])
def test_regex_outputs_fullmatch(llm, pattern) -> None:  # noqa: ANN001
    for out in _outputs(llm, regex=pattern):
        assert out.finish_reason == "stop", out
        assert re.fullmatch(pattern, out.text), (pattern, out.text)


def test_choice_outputs_are_choices(llm) -> None:  # noqa: ANN001
    choices = ["happy", "sad", 'quote " and \\ backslash', "über", "a\nnewline"]
    seen = set()
    for seed in range(6):
        out = llm.generate(PROMPT, choice=choices, do_sample=True, seed=seed, temperature=3.0, max_new_tokens=20)
        assert out.finish_reason == "stop" and out.text in choices, out
        seen.add(out.text)
    assert len(seen) >= 2  # sampling does choose among them


LARK_ARITHMETIC = r"""
start: term OP term | term OP term OP term
term: NUMBER | "(" NUMBER OP NUMBER ")"
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]?/
"""
GBNF_LIST = r"""
root ::= "[" item ("," item)? ("," item)? "]"
item ::= [a-z] [a-z]?
"""


@pytest.mark.parametrize("grammar, reference", [
    (LARK_ARITHMETIC, LARK_ARITHMETIC),
    (GBNF_LIST, 'start: "[" ITEM ("," ITEM)? ("," ITEM)? "]"\nITEM: /[a-z][a-z]?/'),  # GBNF, its Lark equivalent
])
def test_grammar_outputs_parse_with_lark(llm, grammar, reference) -> None:  # noqa: ANN001
    parser = lark.Lark(reference)
    outs = _outputs(llm, grammar=grammar)
    assert sum(o.finish_reason == "stop" for o in outs) >= 3
    for out in outs:
        if out.finish_reason == "stop":
            parser.parse(out.text)


def test_json_object_is_any_object(llm) -> None:  # noqa: ANN001
    for out in _outputs(llm, json_object=True):
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


# ---- the ends: EOS only where the grammar accepts, length mid-object ---------------------------------------------------

def test_eos_only_where_the_grammar_is_complete(llm) -> None:  # noqa: ANN001
    """A bias that makes EOS the model's overwhelming favourite cannot end a half-written object."""
    eos = llm.generation_config.eos_ids[0]
    schema = SCHEMAS["flat-object"]
    out = llm.generate(PROMPT, json_schema=schema, logit_bias={eos: 100.0}, max_new_tokens=100, do_sample=False)
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and _valid(schema, out.text)
    # the other way round: with EOS banned after the grammar is complete, nothing is left to choose: a clear error
    with pytest.raises(nexttoken.errors.GenerationConfigError, match="ruled out by another option"):
        llm.generate(PROMPT, choice=["a"], min_new_tokens=3, max_new_tokens=5)


def test_max_tokens_mid_object_is_length(llm) -> None:  # noqa: ANN001
    out = llm.generate(PROMPT, json_schema=SCHEMAS["extraction-invoice"], max_new_tokens=8)
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


# ---- every path: stream, the low-level generate, the engine's batch --------------------------------------------------------

def test_stream_joins_to_generate(llm) -> None:  # noqa: ANN001
    schema = SCHEMAS["agent-action"]
    full = llm.generate(PROMPT, json_schema=schema, max_new_tokens=80, do_sample=True, seed=3)
    assert full.finish_reason == "stop"
    assert "".join(llm.stream(PROMPT, json_schema=schema, max_new_tokens=80, do_sample=True, seed=3)) == full.text


def test_low_level_generate_with_batch_rows(llm) -> None:  # noqa: ANN001
    """nexttoken.generate(model, input_ids, tokenizer=...): left-padded rows, each its own grammar state, the same
    tokens as the engine gives each prompt alone."""
    schema = SCHEMAS["flat-object"]
    prompts = [PROMPT, "The dog ran"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    width = max(map(len, ids))
    pad = llm.generation_config.pad_token_id or 0
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    out = nexttoken.generate(llm.model, input_ids, mask, tokenizer=llm.tokenizer, json_schema=schema,
                             max_new_tokens=60, do_sample=False)
    eos = set(llm.generation_config.eos_ids)
    for row, prompt in zip(out, prompts):
        new = row[width:].tolist()
        new = new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]
        assert new == llm.generate(prompt, json_schema=schema, max_new_tokens=60, do_sample=False).token_ids
    with pytest.raises(StructuredOutputError, match="tokenizer"):
        nexttoken.generate(llm.model, input_ids, mask, json_schema=schema, max_new_tokens=4)


def test_engine_batch_rows_keep_their_own_state(llm) -> None:  # noqa: ANN001
    """Constrained and free requests share the engine's steps; each constrained one equals its run alone, and the
    free one is untouched by its neighbours' masks."""
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=4, max_model_len=256))
    base = llm.generation_config
    configs = [base.updated(max_new_tokens=60, do_sample=False, json_schema=SCHEMAS["flat-object"]),
               base.updated(max_new_tokens=60, do_sample=False, regex=r"[0-9]{2}-[a-z]{3}"),
               base.updated(max_new_tokens=30, do_sample=False),
               base.updated(max_new_tokens=60, do_sample=True, seed=5, choice=["one", "two", "three"])]
    prompt = llm.tokenizer.encode(PROMPT)
    together = [engine.add_request(prompt, c) for c in configs]
    while engine.has_unfinished():
        engine.step()
    for seq, cfg in zip(together, configs):
        alone = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=1, max_model_len=256))
        assert alone.generate([prompt], cfg)[0].output_ids == seq.output_ids
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", together[1].out.text)
    assert together[3].out.text in ("one", "two", "three")


def test_compiled_grammars_are_cached(llm) -> None:  # noqa: ANN001
    schema = {"type": "object", "properties": {"cache_probe": {"type": "boolean"}}, "required": ["cache_probe"]}
    compiles, hits = GRAMMARS.stats.compiles, GRAMMARS.stats.hits
    llm.generate(PROMPT, json_schema=schema, max_new_tokens=10)
    assert GRAMMARS.stats.compiles == compiles + 1
    llm.generate(PROMPT, json_schema=json.dumps(schema), max_new_tokens=10)  # the same schema, another spelling
    assert GRAMMARS.stats.compiles == compiles + 1 and GRAMMARS.stats.hits > hits


@pytest.mark.parametrize("options, message", [
    (dict(regex="a", choice=["a"]), "give one constraint"),
    (dict(regex="a", num_beams=2), "beam or contrastive"),
    (dict(regex="a", ignore_eos=True), "ignore_eos"),
    (dict(json_schema="{not json"), "not valid JSON"),
    (dict(json_schema=True), "boolean schema"),
    (dict(choice=[]), "non-empty list"),
    (dict(regex="(?<=a)b"), "look-around"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_bad_constraints_are_clear_errors(llm, options, message) -> None:  # noqa: ANN001
    with pytest.raises(nexttoken.errors.GenerationConfigError, match=re.escape(message)):
        cfg = GenerationConfig(eos_token_id=2).updated(**options)
        compile_for(cfg, llm.tokenizer, llm.model.config.vocab_size)
