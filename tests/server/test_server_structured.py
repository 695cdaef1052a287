"""Structured output through the server, driven by the real clients: the `openai` client's response_format and
`beta.chat.completions.parse`, LangChain's `with_structured_output`, vLLM's structured_outputs and guided_* fields,
streaming; outputs checked with `jsonschema` and `re`, refusals in OpenAI's error body."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from support.server import model_id
from support.http_errors import expect_error

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Tell me about a girl"}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)


def test_response_format_json_schema_and_json_object(server, client) -> None:  # noqa: F811
    for seed in range(3):
        r = client.chat.completions.create(
            model=model_id(client), messages=MESSAGES, max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=4, seed=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{") and r.choices[0].finish_reason == "length"


def test_openai_parse_with_a_pydantic_model(server, client) -> None:  # noqa: F811
    r = client.beta.chat.completions.parse(model=model_id(client), messages=MESSAGES, response_format=Person,
                                           max_tokens=60, seed=1)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and r.choices[0].finish_reason == "stop"


def test_streamed_chunks_join_to_valid_json(server, client) -> None:  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    stream = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=60, seed=4,
                                            response_format=fmt, stream=True)
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    whole = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=60, seed=4,
                                           response_format=fmt)
    assert whole.choices[0].message.content == text


def test_langchain_with_structured_output(server, client, model_dir) -> None:  # noqa: F811
    from langchain_openai import ChatOpenAI

    from nexttoken.text.tokenizer import Tokenizer

    chat = ChatOpenAI(base_url=server + "/v1", api_key="unused", model=model_id(client), max_tokens=60, seed=2,
                      max_retries=0)
    person = chat.with_structured_output(Person, method="json_schema").invoke("Tell me about a girl")
    assert isinstance(person, Person)
    # json_mode: any JSON object. The tiny model's keys run on past any budget, so a logit bias towards '"' and '}'
    # makes it close them (the grammar still decides where they may go).
    tokenizer = Tokenizer.from_dir(model_dir)
    closing = {str(i): 10 for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) in ('"', "}")}
    chat = ChatOpenAI(base_url=server + "/v1", api_key="unused", model=model_id(client), max_tokens=60, seed=2,
                      max_retries=0, logit_bias=closing)
    parsed = chat.with_structured_output(None, method="json_mode").invoke("Tell me about a girl")
    assert isinstance(parsed, dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),  # llama.cpp's
    ({"grammar": 'root ::= "a" [0-9]'}, lambda t: re.fullmatch("a[0-9]", t)),  # llama.cpp's GBNF
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_completions_endpoint_takes_every_spelling(server, extra, check) -> None:  # noqa: F811
    for stream in (False, True):
        body = {"prompt": "Once upon a time", "max_tokens": 60, "seed": 3, "stream": stream, **extra}
        r = httpx.post(server + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
        else:
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert finish == "stop" and check(text), (extra, text)


@pytest.mark.parametrize("extra, param, said", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs", "look-around"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "nothing_here"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": SCHEMA}, "guided_regex": "a"}, "guided_regex", "given twice"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None, "ignore_eos"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
])
def test_constraints_that_cannot_be_enforced_are_400s(server, extra, param, said) -> None:  # noqa: F811
    r = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra})
    error = expect_error(r, 400, param)
    assert said in error["message"], error
    ok = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200  # and the server goes on serving


def test_best_effort_opt_in_and_compile_metrics(server) -> None:  # noqa: F811
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3,
              "uniqueItems": True}
    body = {"prompt": "Once", "max_tokens": 30, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema}}, "structured_best_effort": True}
    r = httpx.post(server + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["text"]), list)
    httpx.post(server + "/v1/completions", json=body)  # the same schema again: a cache hit
    metrics = httpx.get(server + "/metrics").text
    assert re.search(r"^nexttoken_grammar_compile_seconds_count [1-9]", metrics, re.M), metrics
    assert re.search(r'^nexttoken_grammar_requests_total\{cache="hit"\} [1-9]', metrics, re.M)
