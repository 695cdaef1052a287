"""OpenAI's Responses API (`/v1/responses`), driven by the real clients against a real server on loopback: the
`openai` client (plain, streamed, tools, a tool-result turn, `text.format`, stored responses), the OpenAI Agents
SDK (`Runner.run_sync` with a function tool over its Responses and Chat Completions models), LangChain's
`ChatOpenAI(use_responses_api=True)` and litellm's `responses`. The reference is the Chat Completions endpoint:
the Responses API is the same request path, so the same request gives the same tokens.

Model: random weights over the real Qwen2.5 tokenizer and chat template (hermes tool calls)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from conftest import requires_shared
from support.chat import INSTRUCTIONS, MESSAGES, QUESTION, ending
from support.server import start_server, stop_server
from support.tools import SCHEMAS, TOOLS
from support.tiny_models import build_chat_model

pytestmark = requires_shared

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat function tools
NEW = 12

# (Chat Completions fields, the same request's Responses fields): each a point of the grid.
GRID = [
    pytest.param(dict(temperature=0), dict(temperature=0), id="greedy"),
    pytest.param(dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=0.8, top_p=0.9, extra_body=dict(seed=3)),
                 id="sampled"),
    pytest.param(dict(temperature=0, presence_penalty=0.5, extra_body=dict(repetition_penalty=1.3)),
                 dict(temperature=0, extra_body=dict(presence_penalty=0.5, repetition_penalty=1.3)), id="penalties"),
    pytest.param(dict(temperature=1.0, seed=5, extra_body=dict(top_k=5, min_p=0.05)),
                 dict(temperature=1.0, extra_body=dict(seed=5, top_k=5, min_p=0.05)), id="top-k-min-p"),
]


@pytest.fixture(scope="module")
def served(shared_dir, tmp_path_factory):
    folder = build_chat_model(tmp_path_factory.mktemp("qwen"), shared_dir / "tokenizers" / "qwen2.5-instruct", "qwen2")
    proc, url = start_server(folder)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield url, client, client.models.list().data[0].id, folder
    stop_server(proc)


def _without_ids(items: list) -> list[dict]:
    """Output items without the ids each response mints afresh (and the SDK helpers' own additions)."""
    keep = ("type", "status", "name", "arguments", "role", "content")
    return [{k: v for k, v in item.model_dump().items() if k in keep} for item in items]


@pytest.mark.parametrize("chat_fields, fields", GRID)
def test_responses_give_the_chat_tokens(served, chat_fields, fields) -> None:
    url, client, model, folder = served
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW, logprobs=True,
                                          top_logprobs=2, **chat_fields)
    r = client.responses.create(model=model, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=NEW,
                                top_logprobs=2, **fields)
    choice = chat.choices[0]
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == choice.message.content
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    logprobs = r.output[0].content[0].logprobs
    assert [t.token for t in logprobs] == [t.token for t in choice.logprobs.content]  # the same tokens
    assert [t.logprob for t in logprobs] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-4)

    events = list(client.responses.create(model=model, instructions=INSTRUCTIONS, input=QUESTION,
                                          max_output_tokens=NEW, stream=True, **fields))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{r.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens


def test_input_items_equal_the_chat_messages(served) -> None:
    url, client, model, folder = served
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!",
                                                                    "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text",
                                                                                   "text": "again?"}]}]
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And again?"}]
    r = client.responses.create(model=model, input=items, max_output_tokens=NEW, temperature=0)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_function_calls_plain_and_streamed(served) -> None:
    url, client, model, folder = served
    args = dict(model=model, input=QUESTION, instructions=INSTRUCTIONS, tools=FLAT_TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=120, extra_body=dict(seed=7, logit_bias=ending(folder)))
    r = client.responses.create(**args)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].status == "completed"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    chat = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=120, seed=7,
                                          logit_bias=ending(folder))
    call = chat.choices[0].message.tool_calls[0].function
    assert (calls[0].name, calls[0].arguments) == (call.name, call.arguments)  # the one path: the same call

    events = list(client.responses.create(**args, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [i.type for i in r.output]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == calls[0].arguments
    assert _without_ids(events[-1].response.output) == _without_ids(r.output)
    # The client's stream helper assembles the same items.
    with client.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert _without_ids(final.output) == _without_ids(r.output)


def test_a_tool_result_turn_and_text_format(served) -> None:
    url, client, model, folder = served
    first = client.responses.create(model=model, input=QUESTION, tools=FLAT_TOOLS, tool_choice={
        "type": "function", "name": "get_time"}, max_output_tokens=120,
        extra_body=dict(seed=2, logit_bias=ending(folder)))
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_time"
    turn = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}]
    second = client.responses.create(model=model, input=turn, tools=FLAT_TOOLS, tool_choice="none",
                                     max_output_tokens=NEW, temperature=0)
    chat = client.chat.completions.create(model=model, tools=TOOLS, tool_choice="none", max_tokens=NEW,
                                          temperature=0, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    shaped = client.responses.create(model=model, input=QUESTION, max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}},
        extra_body=dict(seed=1, logit_bias=ending(folder)))
    jsonschema.validate(json.loads(shaped.output_text), schema)
    assert shaped.text.format.type == "json_schema"


def test_stored_responses_continue_and_can_be_read_and_deleted(served) -> None:
    url, client, model, folder = served
    first = client.responses.create(model=model, input="Hi", max_output_tokens=6, temperature=0, store=True)
    assert first.store is True
    again = client.responses.retrieve(first.id)
    assert again.output_text == first.output_text and again.id == first.id
    second = client.responses.create(model=model, input="More", previous_response_id=first.id,
                                     max_output_tokens=NEW, temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"}])
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    plain = client.responses.create(model=model, input="Hi", max_output_tokens=2)  # stateless by default
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(plain.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert "store" in e.value.body["message"]


BAD = [
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, "max_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_gets_openai_error_then_server_serves(served, body, param) -> None:
    url, client, model, folder = served
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error",) and error["param"] == param, error
    assert client.responses.create(model=model, input="Hi", max_output_tokens=2).status == "incomplete"


def test_openai_agents_sdk_runs_a_function_tool(served) -> None:
    agents = pytest.importorskip("agents")
    url, client, model, folder = served
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_time(tz: str) -> str:
        """The time in a time zone."""
        called.append(tz)
        return "12:00"

    aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                    extra_body={"seed": 4, "logit_bias": ending(folder)})
    for kind in (agents.OpenAIResponsesModel, agents.OpenAIChatCompletionsModel):
        called.clear()
        agent = agents.Agent(name="clock", instructions=INSTRUCTIONS, tools=[get_time], model_settings=settings,
                             model=kind(model=model, openai_client=aclient))
        result = agents.Runner.run_sync(agent, "What time is it in CET?", max_turns=4)
        assert called, kind  # the SDK parsed the call, ran the tool and sent its result back
        assert isinstance(result.final_output, str)
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    asyncio.run(aclient.close())


def test_langchain_and_litellm_responses(served, monkeypatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its price list off the net otherwise
    langchain_openai = pytest.importorskip("langchain_openai")
    litellm = pytest.importorskip("litellm")
    url, client, model, folder = served
    reference = client.responses.create(model=model, input=QUESTION, max_output_tokens=NEW, temperature=0)
    llm = langchain_openai.ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", use_responses_api=True,
                                      temperature=0, max_tokens=NEW, max_retries=0)
    said = llm.invoke(QUESTION)
    assert said.text == reference.output_text
    bound = llm.model_copy(update={"max_tokens": 80}).bind_tools([TOOLS[1]], tool_choice="get_time")
    call = bound.invoke(QUESTION, extra_body={"logit_bias": ending(folder)}).tool_calls[0]
    assert call["name"] == "get_time"
    jsonschema.validate(call["args"], SCHEMAS["get_time"])
    reference = client.responses.create(model=model, input=QUESTION, max_output_tokens=16, temperature=0)
    r = litellm.responses(model=f"openai/{model}", input=QUESTION, api_base=url + "/v1", api_key="unused",
                          max_output_tokens=16, temperature=0)  # litellm raises it to OpenAI's minimum, 16
    assert r.output[0].content[0].text == reference.output_text
