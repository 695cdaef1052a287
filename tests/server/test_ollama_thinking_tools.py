"""Ollama's `think` and tools on /api/chat and /api/generate, driven by the real `ollama` client: the thinking in
`message.thinking` (`thinking` on /api/generate), the calls in `message.tool_calls` with their arguments as
objects, whole and streamed, and a past turn's calls (objects) and tool results rendered as the OpenAI API renders
the same conversation. The reference is the OpenAI API on the same server.

Model: a chain model (support/chain_model.py) over the Qwen2.5 tokenizer with Qwen3's thinking tokens and
template, whose greedy answer is a thinking block and then a hermes tool call."""

from __future__ import annotations

import json

import ollama
import openai
import pytest
from conftest import requires_shared
from support.chain_model import build_chain_model, chain_ids
from support.reasoning import thinking_tokenizer
from support.server import start_server, stop_server

from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared

ANSWER = '<think>Let me see</think><tool_call>{"name":"now","arguments":{"tz": "CET"}}</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "now", "description": "The time in a time zone.",
    # (in the order the ollama client sends a tool's keys: the template renders them as JSON)
    "parameters": {"type": "object", "required": ["tz"], "properties": {"tz": {"type": "string"}}}}}]
QUESTION = [{"role": "user", "content": "What time is it in CET?"}]
GREEDY = dict(temperature=0, num_predict=40)


@pytest.fixture(scope="module")
def apis(shared_dir, tmp_path_factory):
    tokenizer = thinking_tokenizer(tmp_path_factory.mktemp("tok"), shared_dir, "qwen3_chat_template.jinja")
    eos = Tokenizer.from_dir(tokenizer).encode("<|im_end|>", add_special_tokens=False)[0]
    folder = build_chain_model(tmp_path_factory.mktemp("chain"), tokenizer, chain_ids(tokenizer, ANSWER) + [eos], eos)
    proc, url = start_server(folder)
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield ollama.Client(host=url, timeout=120), chat, chat.models.list().data[0].id
    stop_server(proc)


def test_thinking_and_calls_whole_and_streamed(apis) -> None:
    client, chat, model = apis
    ref = chat.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=40)
    call = ref.choices[0].message.tool_calls[0]
    r = client.chat(model=model, messages=QUESTION, tools=TOOLS, think=True, options=GREEDY)
    assert r.message.thinking == ref.choices[0].message.reasoning_content == "Let me see"
    assert r.message.content == "" and r.done_reason == "stop"
    assert [(c.function.name, c.function.arguments) for c in r.message.tool_calls] == [
        (call.function.name, json.loads(call.function.arguments))] == [("now", {"tz": "CET"})]
    assert r.eval_count == ref.usage.completion_tokens
    low = client.chat(model=model, messages=QUESTION, tools=TOOLS, think="low", options=GREEDY)  # an effort
    assert (low.message.thinking, low.message.tool_calls) == (r.message.thinking, r.message.tool_calls)

    parts = list(client.chat(model=model, messages=QUESTION, tools=TOOLS, think=True, options=GREEDY, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Let me see"
    assert "".join(p.message.content for p in parts) == ""
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("now", {"tz": "CET"})]
    assert parts[-1].done and parts[-1].eval_count == r.eval_count


def test_generate_splits_the_thinking(apis) -> None:
    client, chat, model = apis
    ref = chat.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    g = client.generate(model=model, prompt=QUESTION[0]["content"], think=True, options=GREEDY)
    assert g.thinking == ref.choices[0].message.reasoning_content == "Let me see"
    assert g.response == ref.choices[0].message.content and g.response.startswith("<tool_call>")
    parts = list(client.generate(model=model, prompt=QUESTION[0]["content"], think=True, options=GREEDY, stream=True))
    assert "".join(p.thinking or "" for p in parts) == "Let me see" and "".join(p.response for p in parts) == g.response


def test_think_off_and_a_past_call_render_as_the_openai_request(apis) -> None:
    client, chat, model = apis
    ollama_history = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "now", "arguments": {"tz": "CET"}}}]}, {"role": "tool", "tool_name": "now",
                                                                       "content": "12:00"}]
    openai_history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "now", "arguments": json.dumps({"tz": "CET"})}}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "12:00"}]
    r = client.chat(model=model, messages=ollama_history, tools=TOOLS, think=False, options=dict(num_predict=1))
    ref = chat.chat.completions.create(model=model, messages=openai_history, tools=TOOLS, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    on = client.chat(model=model, messages=ollama_history, tools=TOOLS, options=dict(num_predict=1))
    assert on.prompt_eval_count != r.prompt_eval_count  # think=False closes the thinking block in the prompt


def test_show_names_the_capabilities(apis) -> None:
    client, chat, model = apis
    shown = client.show(model)
    assert shown.capabilities == ["completion", "tools", "thinking"] and "<think>" in shown.template
