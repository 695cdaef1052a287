"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the real clients against a
real server on loopback: the `anthropic` SDK (create, stream, tools, a tool-result turn, count_tokens, its typed
errors), LangChain's `ChatAnthropic` and litellm's `anthropic/` route. The reference is the Chat Completions
endpoint: the same request path, so the same request gives the same tokens.

Model: random weights over the real Qwen2.5 tokenizer and chat template (hermes tool calls)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import requires_shared
from support.server import start_server, stop_server
from support.chat import INSTRUCTIONS, MESSAGES, QUESTION, ending
from support.tools import SCHEMAS, TOOLS
from support.tiny_models import build_chat_model

pytestmark = requires_shared

KEY = "sk-local"
NEW = 12
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]

# (Chat Completions fields, the same request's Messages fields)
GRID = [
    pytest.param(dict(temperature=0), dict(extra_body=dict(temperature=0)), id="greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.9, seed=3), dict(extra_body=dict(temperature=0.8, top_p=0.9, seed=3)),
                 id="sampled"),
    pytest.param(dict(temperature=1.0, seed=5, extra_body=dict(top_k=5, repetition_penalty=1.3)),
                 dict(extra_body=dict(temperature=1.0, seed=5, top_k=5, repetition_penalty=1.3)), id="top-k-penalty"),
]


@pytest.fixture(scope="module")
def served(shared_dir, tmp_path_factory):
    folder = build_chat_model(tmp_path_factory.mktemp("qwen"), shared_dir / "tokenizers" / "qwen2.5-instruct", "qwen2")
    proc, url = start_server(folder, "--api-key", KEY)
    chat = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)  # sends x-api-key
    yield url, client, chat, chat.models.list().data[0].id, folder
    stop_server(proc)


@pytest.mark.parametrize("chat_fields, fields", GRID)
def test_messages_give_the_chat_tokens(served, chat_fields, fields) -> None:
    url, client, chat, model, folder = served
    ref = chat.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW, **chat_fields)
    m = client.messages.create(model=model, system=INSTRUCTIONS, max_tokens=NEW,
                               messages=[{"role": "user", "content": QUESTION}], **fields)
    choice = ref.choices[0]
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == choice.message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)

    with client.messages.stream(model=model, system=[{"type": "text", "text": INSTRUCTIONS}], max_tokens=NEW,
                                messages=[{"role": "user", "content": QUESTION}], **fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.content[0].text == text
    assert (final.stop_reason, final.usage.output_tokens) == (m.stop_reason, m.usage.output_tokens)


def test_stream_events_in_anthropic_order(served) -> None:
    url, client, chat, model, folder = served
    body = {"model": model, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    kinds = [json.loads(line.removeprefix("data: "))["type"] for line in lines[1::2]]
    assert names == kinds  # each event named by its type, as Anthropic sends them
    assert kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * kinds.count(
        "content_block_delta"), "content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences_name_the_one_that_matched(served) -> None:
    url, client, chat, model, folder = served
    said = client.messages.create(model=model, max_tokens=NEW, messages=[{"role": "user", "content": QUESTION}],
                                  extra_body=dict(temperature=0)).content[0].text
    stop = said[3:6]
    m = client.messages.create(model=model, max_tokens=NEW, stop_sequences=[stop, "never said"],
                               messages=[{"role": "user", "content": QUESTION}], extra_body=dict(temperature=0))
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert m.content[0].text == said[:said.index(stop)]


def test_tools_tool_result_turn_and_count_tokens(served) -> None:
    url, client, chat, model, folder = served
    args = dict(model=model, max_tokens=120, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": QUESTION}],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                extra_body=dict(seed=7, logit_bias=ending(folder)))
    m = client.messages.create(**args)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMAS[call.name])
    ref = chat.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=7,
                                       logit_bias=ending(folder))
    ref_call = ref.choices[0].message.tool_calls[0].function
    assert (call.name, call.input) == (ref_call.name, json.loads(ref_call.arguments))

    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == call.input and final.stop_reason == "tool_use"

    turn = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name,
                                               "input": call.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]}]
    answer = client.messages.create(model=model, max_tokens=NEW, tools=ANTHROPIC_TOOLS, messages=turn,
                                    tool_choice={"type": "none"}, extra_body=dict(temperature=0))
    ref = chat.chat.completions.create(model=model, max_tokens=NEW, tools=TOOLS, tool_choice="none", temperature=0,
                                       messages=[{"role": "user", "content": QUESTION},
                                                 {"role": "assistant", "content": None, "tool_calls": [{
                                                     "id": call.id, "type": "function", "function": {
                                                         "name": call.name, "arguments": json.dumps(call.input)}}]},
                                                 {"role": "tool", "tool_call_id": call.id, "content": "12:00"}])
    assert answer.content[0].text == ref.choices[0].message.content
    count = client.messages.count_tokens(model=model, tools=ANTHROPIC_TOOLS, messages=turn)
    assert count.input_tokens == answer.usage.input_tokens == ref.usage.prompt_tokens


BAD = [
    ({"model": "M", "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens is required"),
    ({"model": "M", "max_tokens": 5, "messages": []}, 400, "messages"),
    ({"model": "M", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "type 'image'"),
    ({"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     400, "input_schema"),
    ({"model": "M", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400,
     "temperature"),
    ({"model": "M", "max_tokens": 10 ** 6, "messages": [{"role": "user", "content": "x"}]}, 400, "context length"),
    ({"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
]


@pytest.mark.parametrize("body, status, says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_anthropic_error_then_server_serves(served, body, status, says) -> None:
    url, client, chat, model, folder = served
    body = {**body, "model": model if body["model"] == "M" else body["model"]}
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert says in error["error"]["message"]
    assert client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}]).content


def test_anthropic_client_sees_typed_errors(served) -> None:
    url, client, chat, model, folder = served
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "document"}]}])
    assert e.value.body["type"] == "error"


def test_langchain_and_litellm_anthropic(served, monkeypatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its price list off the net otherwise
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    litellm = pytest.importorskip("litellm")
    url, client, chat, model, folder = served
    reference = client.messages.create(model=model, max_tokens=NEW, messages=[{"role": "user", "content": QUESTION}],
                                       extra_body=dict(temperature=0)).content[0].text
    llm = langchain_anthropic.ChatAnthropic(model=model, base_url=url, api_key=KEY, temperature=0, max_tokens=NEW,
                                            max_retries=0)
    assert llm.invoke(QUESTION).text == reference
    bound = llm.model_copy(update={"max_tokens": 120}).bind_tools(ANTHROPIC_TOOLS[1:], tool_choice="get_time")
    call = bound.invoke(QUESTION, extra_body={"logit_bias": ending(folder)}).tool_calls[0]
    assert call["name"] == "get_time"
    jsonschema.validate(call["args"], SCHEMAS["get_time"])
    r = litellm.completion(model=f"anthropic/{model}", api_base=url, api_key=KEY, max_tokens=NEW, temperature=0,
                           messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].message.content == reference
