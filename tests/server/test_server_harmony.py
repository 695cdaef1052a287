"""gpt-oss's harmony format through the server, driven by the real clients: the `openai` SDK (Chat Completions and
Responses, streamed and not), the OpenAI Agents SDK with a function tool, and the `anthropic` SDK. The model's
text is harmony (analysis, a call on the commentary channel, the final answer); the reasoning arrives as
reasoning_content / reasoning items / thinking blocks, the call as tool_calls / function_call items / tool_use
blocks, the answer as content, and no field, whole or streamed, holds harmony's markup.

Model: random weights over the real Qwen2.5 tokenizer with harmony's special tokens and the real gpt-oss chat
template (support/harmony.py). Its answers without tools are the harmony text a grammar sent with the request
spells out (`ANSWER`: the random model writes it, special tokens and all); with tools, the request's own calls
grammar (harmony's, tools/formats.py) shapes the answer, and a logit bias towards harmony's `<|end|>` and stop
tokens keeps it short (the arguments' schema is enums, so the random model's call is short too). The parser's
cases (analysis before a call, a preamble, a cut call, every prefix) are tests/chat/test_harmony.py's."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from conftest import requires_shared
from support.harmony import MARKUP, harmony_tokenizer, special_ids
from support.server import start_server, stop_server
from support.tiny_models import build_chat_model

from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared

REASONING, CONTENT = "The user greets me; answer.", "Hello there."
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": CITY}}
QUESTION = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served(shared_dir, tmp_path_factory):
    tokenizer = harmony_tokenizer(tmp_path_factory.mktemp("tok"), shared_dir)
    folder = build_chat_model(tmp_path_factory.mktemp("gpt-oss-shaped"), tokenizer, "llama")
    ids = special_ids(folder)
    proc, url = start_server(folder, "--served-model-name", "m")
    yield url, ids, {str(ids["<|end|>"]): 2.0, str(ids["<|call|>"]): 8.0, str(ids["<|return|>"]): 8.0}, folder
    stop_server(proc)


def _answer_grammar(ids: dict[str, int]) -> str:
    """A grammar whose only sentence is a harmony answer: analysis REASONING, then the final CONTENT."""
    s = {name: f"<[{i}]>" for name, i in ids.items()}
    return (f'%llguidance {{}}\nstart: {s["<|channel|>"]} "analysis" {s["<|message|>"]} {json.dumps(REASONING)} '
            f'{s["<|end|>"]} {s["<|start|>"]} "assistant" {s["<|channel|>"]} "final" {s["<|message|>"]} '
            f'{json.dumps(CONTENT)}\n')


def _clean(*texts: str | None) -> None:
    for text in texts:
        leaked = [m for m in MARKUP if m in (text or "")]
        assert not leaked, (leaked, text)


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- the answer and its reasoning -------------------------------------------------------------------------------

def test_chat_completions_reasoning_and_answer_whole_and_streamed(served) -> None:
    url, ids, _, _ = served
    client = _openai(url)
    args = dict(model="m", messages=QUESTION, max_tokens=60, reasoning_effort="high",
                extra_body={"grammar": _answer_grammar(ids)})
    message = client.chat.completions.create(**args).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, CONTENT)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            _clean(delta.content, getattr(delta, "reasoning_content", None))
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == (REASONING, CONTENT)


def test_the_requests_effort_is_the_prompts_reasoning_level(served) -> None:
    """reasoning_effort, and a thinking budget in tokens, reach gpt-oss's system message (the request's trace holds
    the prompt it ran): no 400 for a budget, which harmony has none of."""
    url, ids, _, _ = served
    for fields, level in (({"reasoning_effort": "xhigh"}, "high"), ({"thinking_token_budget": 500}, "low"),
                          ({}, "medium")):
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": QUESTION, "max_tokens": 40, "grammar": _answer_grammar(ids), "trace": True,
            **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (REASONING, CONTENT)
        prompt = httpx.get(url + choice["trace"]["json_url"], timeout=60).json()["prompt_text"]
        assert f"\nReasoning: {level}\n" in prompt and prompt.endswith("<|start|>assistant"), (fields, prompt)


def test_responses_reasoning_item_and_message_whole_and_streamed(served) -> None:
    url, ids, _, _ = served
    client = _openai(url)
    args = dict(model="m", input="Hi", max_output_tokens=60, reasoning={"effort": "low"},
                extra_body={"grammar": _answer_grammar(ids)})
    response = client.responses.create(**args)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], kinds
    assert response.output[0].content[0].text == REASONING and response.output_text == CONTENT
    deltas: dict[str, str] = {}
    for event in client.responses.create(**args, stream=True):
        if event.type in ("response.reasoning_text.delta", "response.output_text.delta"):
            _clean(event.delta)
            deltas[event.type] = deltas.get(event.type, "") + event.delta
        if event.type == "response.completed":
            assert event.response.output_text == CONTENT
    assert deltas == {"response.reasoning_text.delta": REASONING, "response.output_text.delta": CONTENT}


def test_anthropic_thinking_and_text_blocks_whole_and_streamed(served) -> None:
    url, ids, _, _ = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    args = dict(model="m", max_tokens=60, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 2048},
                extra_body={"grammar": _answer_grammar(ids)})
    message = client.messages.create(**args)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
        [("thinking", REASONING), ("text", CONTENT)]
    with client.messages.stream(**args) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                _clean(getattr(event.delta, "thinking", None), getattr(event.delta, "text", None))
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == CONTENT


def test_the_library_splits_the_same_answer(served) -> None:
    """`LLM.chat` renders and reads harmony as the server does (chat/render.py): the markers kept in its text."""
    import nexttoken

    _, ids, _, folder = served
    llm = nexttoken.load(folder)
    completion = llm.chat(QUESTION, grammar=_answer_grammar(ids), max_new_tokens=60,
                          chat_template_kwargs={"reasoning_effort": "low"})
    assert (completion.reasoning_content, completion.text) == (REASONING, CONTENT)
    final = Tokenizer.from_dir(folder).encode("final", add_special_tokens=False)[0]
    structured = llm.chat(QUESTION, json_schema=CITY, max_new_tokens=60, logit_bias={
        final: 20.0, ids["<|return|>"]: 20.0, ids["<|call|>"]: 20.0})  # as the server's (below)
    jsonschema.validate(json.loads(structured.text), CITY)
    assert llm.tokenizer.decode(structured.token_ids[:3], skip_special_tokens=False) == "<|channel|>final<|message|>"


def test_structured_output_is_the_final_messages_after_the_analysis(served) -> None:
    """response_format constrains the final channel's body, not the whole text: the answer is harmony (analysis or
    preamble messages, then the final message), its content JSON under the schema."""
    url, ids, _, folder = served
    client = _openai(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    final = Tokenizer.from_dir(folder).encode("final", add_special_tokens=False)
    assert len(final) == 1
    # the random model (its logits near 0 over 151k tokens) goes to the final channel, and ends after the JSON
    short = {str(final[0]): 20.0, str(ids["<|return|>"]): 20.0, str(ids["<|call|>"]): 20.0}
    choice = client.chat.completions.create(model="m", messages=QUESTION, response_format=fmt, seed=0,
                                            max_tokens=60, logit_bias=short, logprobs=True).choices[0]
    _clean(choice.message.content, choice.message.reasoning_content)
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), CITY)
    tokens = [t.token for t in choice.logprobs.content]  # the text the model wrote: harmony, the JSON last
    assert tokens[:3] == ["<|channel|>", "final", "<|message|>"] and "".join(tokens[3:]) == choice.message.content


# ---- tool calls -------------------------------------------------------------------------------------------------

def _valid(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), CITY)


def test_chat_completions_tool_calls_whole_and_streamed(served) -> None:
    url, _, bias, _ = served
    client = _openai(url)
    for seed in range(3):
        args = dict(model="m", messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=100,
                    seed=seed, logit_bias=bias)
        choice = client.chat.completions.create(**args).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _clean(choice.message.content, choice.message.reasoning_content)
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments)
        streamed: dict = {}
        for chunk in client.chat.completions.create(**args, stream=True):
            for c in chunk.choices:
                _clean(c.delta.content, getattr(c.delta, "reasoning_content", None))
                for delta in c.delta.tool_calls or []:
                    entry = streamed.setdefault(delta.index, {"name": delta.function.name, "arguments": ""})
                    entry["arguments"] += delta.function.arguments or ""
                    _clean(delta.function.arguments)
                if c.finish_reason is not None:
                    assert c.finish_reason == "tool_calls"
        assert [(e["name"], e["arguments"]) for e in streamed.values()] == \
            [(call.function.name, call.function.arguments)]


def test_responses_function_call_item_and_the_next_turn(served) -> None:
    url, _, bias, _ = served
    client = _openai(url)
    args = dict(model="m", input="Weather in Paris?", tools=[
        {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
         "parameters": CITY}], tool_choice="required", max_output_tokens=100, extra_body={"logit_bias": bias,
                                                                                          "seed": 1})
    response = client.responses.create(**args)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    _valid(calls[0].name, calls[0].arguments)
    arguments = ""
    for event in client.responses.create(**args, stream=True):  # streamed: the same call, its arguments in deltas
        if event.type == "response.function_call_arguments.delta":
            _clean(event.delta)
            arguments += event.delta
        if event.type == "response.completed":
            assert [(i.name, i.arguments) for i in event.response.output if i.type == "function_call"] == \
                [(calls[0].name, calls[0].arguments)]
    assert arguments == calls[0].arguments
    for item in response.output:
        if item.type == "reasoning":
            _clean(item.content[0].text)
    # the call, its reasoning and its result go back: gpt-oss's template shows the reasoning before the call
    history = [{"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": "Call the weather tool."}]},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}]
    followed = client.responses.create(model="m", input=[{"role": "user", "content": "Weather in Paris?"},
                                                         *history], max_output_tokens=4)
    assert followed.status in ("completed", "incomplete")


def test_a_past_calls_reasoning_comes_back_in_the_prompt(served) -> None:
    """An assistant turn's reasoning_content (as this server returns it) is rendered as the call's analysis."""
    url, _, _, _ = served
    messages = [*QUESTION, {"role": "assistant", "content": None, "reasoning_content": "Call the weather tool.",
                            "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    ids = httpx.post(url + "/tokenize", json={"model": "m", "messages": messages, "tools": [WEATHER]}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert ("<|channel|>analysis<|message|>Call the weather tool.<|end|><|start|>assistant to=functions.get_weather"
            "<|channel|>commentary json<|message|>") in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"21 C"<|end|>' in text


def test_anthropic_tool_use_block(served) -> None:
    url, _, bias, _ = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    args = dict(model="m", max_tokens=100, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[{"name": "get_weather", "description": "Current weather in a city.", "input_schema": CITY}],
                tool_choice={"type": "any"}, extra_body={"logit_bias": bias, "seed": 2})
    message = client.messages.create(**args)
    assert message.stop_reason == "tool_use", message
    uses = [b for b in message.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, CITY)
    for block in message.content:
        _clean(getattr(block, "thinking", None), getattr(block, "text", None))
    with client.messages.stream(**args) as stream:  # streamed: the same blocks, input_json_delta adding up
        for event in stream:
            if event.type == "content_block_delta":
                _clean(getattr(event.delta, "thinking", None), getattr(event.delta, "text", None),
                       getattr(event.delta, "partial_json", None))
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == \
        [uses[0].input]


def test_the_openai_agents_sdk_calls_a_function_tool(served) -> None:
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    url, _, bias, _ = served
    set_tracing_disabled(True)  # no export to OpenAI's servers
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], unit: Literal["c", "f"]) -> str:
        """Current weather in a city."""
        calls.append((city, unit))
        return "21 C"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="m", openai_client=client),
                  # one model turn: the call, then the tool's result is the final output
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=100,
                                               extra_body={"logit_bias": bias, "seed": 0}))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and all(calls[0]) and result.final_output == "21 C"
    assert [type(i).__name__ for i in result.new_items if type(i).__name__.startswith("ToolCall")] == \
        ["ToolCallItem", "ToolCallOutputItem"]
