"""Agent loops run to the end on a real model: SmolLM2-135M-Instruct behind `nexttoken serve` with its default
flags, driven by the frameworks people use (the openai SDK's manual loop, the OpenAI Agents SDK, LangChain,
pydantic-ai, instructor). SmolLM2's chat template renders no tools, so its requests go through the hermes tools
preamble, the default for such a template (docs/tool_calls.md). What is asserted is the loop's shape, not the
model's wisdom: a call with arguments valid under the tool's schema, the tool's result in the next prompt, and a
final answer. Greedy decoding keeps each run deterministic; where a 135M model's free choice would decide the first
turn, tool_choice forces it.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import openai
import pytest
from conftest import requires_shared
from pydantic import BaseModel
from support.server import start_server, stop_server

pytestmark = requires_shared

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": CITY}}
RESULT = '{"temperature_c": 21}'
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(temperature=0, max_tokens=48)
ONE_CALL = dict(tool_choice="required", parallel_tool_calls=False)
# A conversation that has already been through one call round (as an agent's history is on its next question):
# with it, "auto" is the model's own choice of calling again.
HISTORY = [*QUESTION,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
           {"role": "assistant", "content": "It is 21 °C in Paris."},
           {"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    # A 135M model loads in seconds; the long start-up allowance is for a machine shared with other test runs.
    proc, url = start_server(smollm2_dir, "--max-body-bytes", "200000",
                             startup_s=600)
    os.set_blocking(proc.stdout.fileno(), False)
    startup_log = (proc.stdout.read() or b"").decode()  # what it printed before it answered /health
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield url, client, client.models.list().data[0].id, startup_log
    stop_server(proc)


def _prompt(url: str, messages: list, tools: list | None = None) -> str:
    """The prompt the server renders for `messages` (its /tokenize, then /detokenize)."""
    ids = httpx.post(url + "/tokenize", json={"messages": messages, "tools": tools}, timeout=60).json()
    assert "tokens" in ids, ids
    return httpx.post(url + "/detokenize", json={"tokens": ids["tokens"]}, timeout=60).json()["prompt"]


def _valid_call(name: str, arguments: str | dict) -> dict:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert name == "get_weather"
    jsonschema.validate(args, CITY)
    return args


# ---- the openai SDK: the manual loop; the preamble; "auto" --------------------------------------------------------

def test_the_openai_sdk_manual_tool_loop_runs_to_the_end(served) -> None:
    url, client, model, _ = served
    messages: list = list(QUESTION)
    first = client.chat.completions.with_raw_response.create(model=model, messages=messages, tools=[WEATHER],
                                                             **ONE_CALL, **GREEDY)
    assert first.headers["x-nexttoken-tools-preamble"] == "hermes"  # SmolLM2's template renders no tools
    assert "the chat template renders no tools: requests with tools get the hermes tools preamble" in served[3]
    choice = first.parse().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _valid_call(call.function.name, call.function.arguments)
    # The SDK's loop appends the returned message object itself (content null, tool_calls), then the result.
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], **GREEDY).choices[0]
    assert final.message.tool_calls is None and final.message.content
    prompt = _prompt(url, [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages], [WEATHER])
    assert RESULT in prompt and f'"arguments": {call.function.arguments}' in prompt  # the call and result shown
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the preamble


def test_auto_calls_a_tool_on_a_template_without_tools(served) -> None:
    """tool_choice "auto" (the default): without the preamble the prompt is the same with or without tools, and
    the model cannot know of them; with it, the model calls the tool by itself, and the call is parsed."""
    url, client, model, _ = served
    assert _prompt(url, HISTORY, [WEATHER]) != _prompt(url, HISTORY)
    r = client.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER], **GREEDY).choices[0]
    assert r.finish_reason == "tool_calls", r
    [call] = r.message.tool_calls
    assert _valid_call(call.function.name, call.function.arguments) == {"city": "Rome"}


def test_a_call_cut_by_max_tokens_is_not_emitted_and_comes_back_without_a_400(served) -> None:
    url, client, model, _ = served
    whole = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER], **ONE_CALL, **GREEDY)
    text_len = len(whole.choices[0].message.tool_calls[0].function.arguments)
    for max_tokens in (3, 8, 12):  # inside the marker, inside the name, inside the arguments
        r = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER], **ONE_CALL,
                                           temperature=0, max_tokens=max_tokens).choices[0]
        assert r.finish_reason == "length" and r.message.tool_calls is None, (max_tokens, r)
        assert not r.message.content, (max_tokens, r.message.content)  # no "<tool_call>", "{\"name\":", "</tool"
        streamed = client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER], **ONE_CALL,
                                                  temperature=0, max_tokens=max_tokens, stream=True)
        content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert content == "", (max_tokens, content)
    assert text_len > 0
    # A client that kept a cut call (from a stream) sends it back: its arguments are not JSON, and pass as text.
    for arguments in ("", '{"city": "Par'):
        history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "error: the call was cut off"}]
        r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], temperature=0,
                                           max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


# ---- the OpenAI Agents SDK --------------------------------------------------------------------------------------

def test_the_openai_agents_sdk_runs_a_function_tool_to_a_final_answer(served) -> None:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    url, _, model, _ = served
    set_tracing_disabled(True)  # no export to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return RESULT

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  # forced on the first turn only: the SDK resets tool_choice after a call (reset_tool_choice)
                  model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0,
                                               max_tokens=48))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str) and result.final_output
    items = [type(i).__name__ for i in result.new_items]
    assert items[:2] == ["ToolCallItem", "ToolCallOutputItem"] and items[-1] == "MessageOutputItem", items


# ---- LangChain --------------------------------------------------------------------------------------------------

def test_langchain_bind_tools_and_a_tool_message_turn(served) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    url, _, model, _ = served

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return RESULT

    llm = ChatOpenAI(model=model, base_url=url + "/v1", api_key="unused", temperature=0, max_tokens=48,
                     max_retries=0, timeout=300)
    messages: list = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke(messages)
    [call] = ai.tool_calls
    _valid_call(call["name"], call["args"])
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather]).invoke(messages)
    assert not final.tool_calls and final.content


# ---- pydantic-ai ------------------------------------------------------------------------------------------------

def test_pydantic_ai_with_a_tool_and_message_history(served) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart, UserPromptPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, _, model, _ = served
    calls: list[str] = []
    agent = Agent(OpenAIChatModel(model, provider=OpenAIProvider(base_url=url + "/v1", api_key="unused")),
                  model_settings={"temperature": 0, "max_tokens": 48, "parallel_tool_calls": False})

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return RESULT

    # The history of a first question answered through the tool: pydantic-ai sends it back as OpenAI messages
    # (the assistant's call with null content, the tool's return), and on the next question the model calls again.
    history = [ModelRequest(parts=[UserPromptPart("What is the weather in Paris?")]),
               ModelResponse(parts=[ToolCallPart("get_weather", {"city": "Paris"}, tool_call_id="call_1")]),
               ModelRequest(parts=[ToolReturnPart("get_weather", RESULT, tool_call_id="call_1")]),
               ModelResponse(parts=[TextPart("It is 21 °C in Paris.")])]
    result = agent.run_sync("What is the weather in Rome?", message_history=history)
    assert calls == ["Rome"]
    assert isinstance(result.output, str) and result.output
    sent = result.new_messages()
    assert any(isinstance(p, ToolReturnPart) for m in sent for p in m.parts)


# ---- instructor -------------------------------------------------------------------------------------------------

class Weather(BaseModel):
    city: str
    temperature_c: int


# One worked example before the question (a few-shot prompt, as instructor's docs suggest for small models): without
# it SmolLM2 answers instructor's schema-in-the-prompt with a copy of the schema, which is the model, not the loop.
EXAMPLE = [{"role": "user", "content": "Berlin: 15 degrees Celsius."},
           {"role": "assistant", "content": '{"city": "Berlin", "temperature_c": 15}'},
           {"role": "user", "content": "Paris: 21 degrees Celsius."}]


@pytest.mark.parametrize("mode", ["JSON", "MD_JSON", "TOOLS"])
def test_instructor_extracts_a_model_in_each_mode(served, mode) -> None:
    """JSON: response_format json_object with the schema in the system message; MD_JSON: a ```json block in
    free text; TOOLS: a forced call of the model's schema."""
    import instructor

    url, client, model, _ = served
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    got = patched.chat.completions.create(model=model, response_model=Weather, max_retries=0, temperature=0,
                                          max_tokens=64, messages=EXAMPLE)
    assert got.model_dump() == {"city": "Paris", "temperature_c": 21}


def test_json_mode_lets_the_model_write_the_whitespace_it_prefers(served) -> None:
    """SmolLM2 writes a newline and indentation after "{": the compact layout forbids it (the mask then forces
    a token the model gives log-prob -9, and small models go off the rails); the flexible layout (the server's
    default) allows it, bounded; a request may ask for either."""
    url, client, model, _ = served
    ask = dict(model=model, messages=[{"role": "user", "content": "Give a JSON object with the city Paris."}],
               response_format={"type": "json_object"}, temperature=0, max_tokens=80, logprobs=True)
    flexible = client.chat.completions.create(**ask).choices[0]
    compact = client.chat.completions.create(**ask, extra_body={"structured_outputs": {"whitespace": "compact"}})
    compact = compact.choices[0]
    assert flexible.logprobs.content[0].token == compact.logprobs.content[0].token == "{"
    assert flexible.logprobs.content[1].token.isspace() and flexible.logprobs.content[1].logprob > -1
    assert compact.logprobs.content[1].token == '"' and compact.logprobs.content[1].logprob < -5  # forced
    gaps = re.findall(r"\s+", flexible.message.content)  # bounded: one space, or 1-2 newlines + 20 blanks at most
    assert gaps and all(re.fullmatch(r" |\n{1,2}[ \t]{0,20}", g) for g in gaps), gaps
    vllm = client.chat.completions.create(**ask, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert vllm.choices[0].message.content == compact.message.content


def test_a_template_that_renders_tools_is_left_alone(shared_dir) -> None:
    """Qwen2.5's template renders tools itself: no preamble, the prompt is transformers' own."""
    from transformers import AutoTokenizer

    from nexttoken.text.tokenizer import Tokenizer
    from nexttoken.chat import ToolUse, template_support

    folder = shared_dir / "tokenizers" / "qwen2.5-instruct"
    ours = Tokenizer.from_dir(folder)
    support = template_support(ours)
    assert support.tools and support.calls and support.results
    use = ToolUse.of([WEATHER], "auto", None, "hermes")
    from nexttoken.server.openai.prompts import render_chat
    from nexttoken.server.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    ids, _, preamble = render_chat(req, ours, use, support)
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{**m, "content": m["content"] or ""} if m["role"] == "assistant" else m for m in _with_objects(HISTORY)],
        tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert preamble is None and ours.decode(ids, skip_special_tokens=False) == expected


def _with_objects(messages: list) -> list:
    """Past calls' arguments as objects, as transformers' templates take them."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def test_smollm2s_template_renders_no_tools(smollm2_dir) -> None:
    from nexttoken.text.tokenizer import Tokenizer
    from nexttoken.chat import template_support

    support = template_support(Tokenizer.from_dir(smollm2_dir))
    assert not support.tools and not support.calls and support.results  # ChatML renders any role, "tool" too
