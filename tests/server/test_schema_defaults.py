"""JSON Schemas as clients write them: by default an object with `properties` and no `additionalProperties` takes no
other keys and numbers have bounded digits (llama.cpp's json-schema-to-grammar and XGrammar's strict reading);
`strict_json_schema=False` (a library option, a request field, `--no-strict-json-schema`) reads the schema
literally. The grammar is checked with llguidance on a real tokenizer; the real clients (LangChain's
`with_structured_output` both ways, ChatAnthropic's, the openai SDK's `parse` with a float field, Responses'
`text.format`) drive the real SmolLM2 GGUF with ordinary prompts: each answer finishes and validates."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from conftest import requires_shared
from pydantic import BaseModel

from nexttoken.generation.processors.structured import Constraint
from nexttoken.generation.values import bounded_schema

pytestmark = requires_shared


class Country(BaseModel):
    name: str
    capital: str
    population_millions: float


class Person(BaseModel):
    name: str
    age: int


SCHEMA = Country.model_json_schema()  # no additionalProperties, as pydantic writes it


@pytest.fixture(scope="module")
def tokenizers(shared_dir):
    """A real tokenizer, and llguidance's view of it."""
    import llguidance.hf
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(shared_dir / "tokenizers" / "qwen2.5-instruct")
    return tok, llguidance.hf.from_tokenizer(tok)


def _accepts(tokenizers, constraint: Constraint, text: str) -> bool:
    import llguidance

    tok, lltok = tokenizers
    matcher = llguidance.LLMatcher(lltok, constraint.grammar())
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


def test_the_default_closes_objects_and_bounds_digits(tokenizers) -> None:
    strict = Constraint("json_schema", SCHEMA, whitespace="compact")
    literal = Constraint("json_schema", SCHEMA, whitespace="compact", strict=False)
    good = '{"name": "France", "capital": "Paris", "population_millions": 68.2}'
    extra = '{"name": "France", "capital": "Paris", "population_millions": 68.2, "official_name": "R"}'
    long_int = '{"name": "F", "capital": "P", "population_millions": 12122222222222222222}'
    long_fraction = '{"name": "F", "capital": "P", "population_millions": 1.12222222222222222}'
    for text in (good, extra, long_int, long_fraction):
        jsonschema.validate(json.loads(text), SCHEMA)  # all valid under the literal reading
        assert _accepts(tokenizers, literal, text)
    assert [_accepts(tokenizers, strict, t) for t in (good, extra, long_int, long_fraction)] == [True, False, False,
                                                                                               False]
    assert SCHEMA == Country.model_json_schema()  # the client's schema is left as it was


def test_bounded_schema_leaves_what_the_client_said() -> None:
    open_object = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}},
                   "additionalProperties": {"type": "string"}}
    out = bounded_schema(open_object)
    assert out["additionalProperties"] == {"type": "string"} and out["properties"]["a"]["minimum"] == 0
    # allOf members add keys to each other: none is closed
    merged = bounded_schema({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in merged["allOf"]) and "additionalProperties" not in merged
    nested = bounded_schema({"$defs": {"P": Person.model_json_schema()}, "type": "array",
                             "items": {"$ref": "#/$defs/P"}})
    assert nested["$defs"]["P"]["additionalProperties"] is False
    assert nested["$defs"]["P"]["properties"]["age"]["maximum"] == 10**16 - 1


@pytest.fixture(scope="module")
def served(smollm2_server):
    # SmolLM2's template renders no tools: the default flags give the function-calling clients hermes' preamble
    url = smollm2_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return url, client.models.list().data[0].id


ASK = "Tell me about France: its name, its capital and its population in millions."
# The clients' default temperature (the server's 1.0: sampled, as a user gets it), with a seed so that CI sees
# one sample, not a new draw per run (a 135M model's sampled strings run past any token limit once in a while).
SEED = 0


def test_openai_parse_with_a_float_field_finishes(served) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": ASK}],
                                      response_format=Country, max_tokens=300, seed=SEED)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Country)
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_responses_text_format_finishes(served) -> None:
    url, model = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.responses.create(model=model, input=ASK, max_output_tokens=300, text={"format": {
        "type": "json_schema", "name": "country", "schema": SCHEMA}}, extra_body={"seed": SEED})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output_finishes(served, method) -> None:
    from langchain_openai import ChatOpenAI

    url, model = served
    llm = ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300, max_tokens=300,
                     seed=SEED)
    out = llm.with_structured_output(Country, method=method, include_raw=True).invoke(ASK)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Country)
    raw = out["raw"].response_metadata
    assert raw["finish_reason"] in ("stop", "tool_calls")


def test_chat_anthropic_structured_output_finishes(served) -> None:
    from langchain_anthropic import ChatAnthropic

    url, model = served
    llm = ChatAnthropic(model=model, base_url=url, api_key="unused", max_retries=0, timeout=300, max_tokens=300,
                        model_kwargs={"extra_body": {"seed": SEED}})
    out = llm.with_structured_output(Country, include_raw=True).invoke(ASK)
    assert out["parsing_error"] is None and isinstance(out["parsed"], Country)
    assert out["raw"].response_metadata["stop_reason"] == "tool_use"


def test_literal_reading_is_an_opt_in_per_request(served) -> None:
    url, model = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
    m = client.messages.create(model=model, max_tokens=40, messages=[{"role": "user", "content": ASK}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
                                           "strict_json_schema": False, "temperature": 0})
    assert m.content[0].type == "text"  # accepted; the literal schema may run to max_tokens on a small model
    with pytest.raises(anthropic.BadRequestError, match="strict_json_schema"):
        client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": ASK}],
                               extra_body={"strict_json_schema": "sometimes"})
