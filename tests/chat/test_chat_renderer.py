"""One chat renderer (chat/render.py) for the library and the server: a thinking model's answer through `LLM.chat`
splits into the same reasoning, content and tool calls as the server's Chat Completions (whole and streamed),
Responses and Messages answers, on the real Qwen3 and DeepSeek-R1 chat templates.

Models: chain models (tests/support/chain_model.py) whose greedy output is a chosen text, here one that thinks first; the
tokenizer is the real Qwen2.5 one with Qwen3's thinking tokens (support/reasoning.py's thinking_tokenizer)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from support.chain_model import build_chain_model, chain_ids
from conftest import requires_shared
from support.reasoning import ANSWER, QUESTION, thinking_tokenizer
from support.server import start_server, stop_server

import nexttoken
from nexttoken.text.tokenizer import Tokenizer
from nexttoken.chat.render import ChatRenderer

pytestmark = requires_shared

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def both(request, shared_dir, tmp_path_factory):
    """(format name, the library's LLM, the server's url and OpenAI client) over one chain-model folder."""
    template = {"qwen3": "qwen3_chat_template.jinja", "deepseek_r1": "deepseek_r1_distill_chat_template.jinja"}
    tokenizer = thinking_tokenizer(tmp_path_factory.mktemp("tok"), shared_dir, template[request.param])
    text = ANSWER if request.param == "qwen3" else ANSWER.removeprefix("<think>")  # R1's prompt opens the block
    eos = Tokenizer.from_dir(tokenizer).encode("<|endoftext|>", add_special_tokens=False)[0]
    folder = build_chain_model(tmp_path_factory.mktemp(request.param), tokenizer, chain_ids(tokenizer, text) + [eos],
                               eos)
    proc, url = start_server(folder, "--served-model-name", "m")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield request.param, nexttoken.load(folder), url, client
    stop_server(proc)


def _server_split(client: openai.OpenAI, **fields) -> dict:
    choice = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, **fields).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return {"reasoning": choice.message.reasoning_content, "content": choice.message.content or "", "calls": calls,
            "finish_reason": choice.finish_reason}


def _library_split(llm, **options) -> dict:
    c = llm.chat(QUESTION, do_sample=False, **options)
    assert c.reasoning == c.reasoning_content
    return {"reasoning": c.reasoning_content, "content": c.text,
            "calls": [(call.name, call.arguments) for call in c.tool_calls or []], "finish_reason": c.finish_reason}


def test_the_library_splits_as_the_server_does(both) -> None:
    name, llm, url, client = both
    want = {"reasoning": "Let me see", "content": "Hello there", "calls": [], "finish_reason": "stop"}
    assert _library_split(llm, max_new_tokens=20) == _server_split(client, max_tokens=20) == want
    chunks = [c.choices[0].delta for c in client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=20, temperature=0, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == want["reasoning"]
    assert "".join(d.content or "" for d in chunks) == want["content"]
    r = client.responses.create(model="m", input="Hi", max_output_tokens=20, temperature=0)
    assert (r.output[0].content[0].text, r.output_text) == (want["reasoning"], want["content"])
    m = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
        model="m", max_tokens=20, messages=QUESTION, extra_body={"temperature": 0})
    assert [getattr(b, "thinking", None) or getattr(b, "text", None) for b in m.content] == [want["reasoning"],
                                                                                            want["content"]]


def test_a_cut_answer_splits_alike(both) -> None:
    name, llm, url, client = both
    assert _library_split(llm, max_new_tokens=2) == _server_split(client, max_tokens=2)


def test_tool_calls_after_thinking_alike(both) -> None:
    name, llm, url, client = both  # DeepSeek-R1's distill template renders no tools: it gets Hermes' preamble
    fields = dict(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    ours = _library_split(llm, max_new_tokens=60, **fields)
    assert ours == _server_split(client, max_tokens=60, **fields)
    assert ours["reasoning"] == "Let me see" and ours["finish_reason"] == "tool_calls"
    (call, arguments), = ours["calls"]
    assert call == "get_time" and json.loads(arguments)["tz"] in ("CET", "UTC")
    # the thinking never reaches the call parser: the streamed calls are the same call
    chunks = [c.choices[0].delta for c in client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=60, temperature=0, stream=True, **fields) if c.choices]
    streamed = "".join(t.function.arguments or "" for d in chunks for t in d.tool_calls or [])
    assert streamed == arguments


def test_template_variables_reach_both(both) -> None:
    name, llm, url, client = both
    if name != "qwen3":
        pytest.skip("DeepSeek-R1's template has no enable_thinking switch")
    off = {"enable_thinking": False}  # the template closes a block in the prompt; the chain opens one anyway
    ours = llm.chat_renderer.render(QUESTION, variables=off)
    tokens = httpx.post(url + "/tokenize", json={"messages": QUESTION, "chat_template_kwargs": off}).json()["tokens"]
    assert ours.ids == tokens and not ours.opened
    assert _library_split(llm, max_new_tokens=20, chat_template_kwargs=off) == _server_split(
        client, max_tokens=20, extra_body={"chat_template_kwargs": off})


def test_the_renderer_reads_the_format_off_the_template(both) -> None:
    name, llm, url, client = both
    renderer = ChatRenderer(llm.tokenizer)
    assert renderer.reasoning.name == name and renderer.markers == (151667, 151668)
    prompt = renderer.render(QUESTION)
    assert prompt.opened == (name == "deepseek_r1")  # R1's generation prompt opens the block
    assert prompt.ids == llm.tokenizer.encode(prompt.text, add_special_tokens=False)
