"""Tool calls through the server, driven by the real clients: the `openai` client (plain, streamed, and its
stream helper that assembles `delta.tool_calls`), LangChain's `bind_tools(...).invoke`, a full call -> result ->
answer loop, `/tokenize` with tools against transformers, `--tool-call-parser`, and refusals in OpenAI's body.
Models: random weights over the real Llama 3.2 and Qwen2.5 tokenizers and chat templates."""

from __future__ import annotations

import json
import warnings
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import requires_shared
from support.server import CHAT_TEMPLATE, start_server, stop_server
from support.http_errors import expect_error
from support.tools import QUESTION, SCHEMAS, TIME, TOOLS, WEATHER
from support.tiny_models import build_chat_model

pytestmark = requires_shared

MODELS = {"qwen2.5": ("qwen2", "qwen2.5-instruct"), "llama3.2": ("llama", "llama-3.2-instruct")}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, shared_dir, tmp_path_factory):
    arch, name = MODELS[request.param]
    folder = build_chat_model(tmp_path_factory.mktemp(name), shared_dir / "tokenizers" / name, arch)
    proc, url = start_server(folder)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield url, client, client.models.list().data[0].id, folder
    stop_server(proc)


def _ending(folder) -> dict[str, float]:
    """A logit bias towards the end tokens, so a random model stops after a complete call (the grammar allows
    the end there and only there) instead of adding calls until max_tokens."""
    config = json.loads((folder / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    return {str(t): 8.0 for t in (eos if isinstance(eos, list) else [eos])}


def _validate(calls) -> None:  # noqa: ANN001
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_through_the_openai_client(served) -> None:
    url, client, model, folder = served
    for seed in range(3):
        for choice in ("required", NAMED):
            r = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                               max_tokens=120, seed=seed, logit_bias=_ending(folder))
            choice0 = r.choices[0]
            assert choice0.finish_reason == "tool_calls" and choice0.message.content is None, choice0
            _validate(choice0.message.tool_calls)
            if choice == NAMED:
                assert [c.function.name for c in choice0.message.tool_calls] == ["get_time"]


def test_streamed_tool_calls_are_openai_chunks_that_add_up_to_the_answer(served) -> None:
    url, client, model, folder = served
    args = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=120, seed=7, n=2,
                logit_bias=_ending(folder))
    whole = client.chat.completions.create(**args)
    stream = client.chat.completions.create(**args, stream=True)
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finish = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                got = calls[choice.index]
                if delta.id is not None:  # a call's first chunk: index, id, type and name, empty arguments
                    assert delta.index == len(got) and delta.type == "function" and delta.function.name
                    assert delta.function.arguments == ""
                    got[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.function.name is None and delta.index in got
                    got[delta.index]["arguments"] += delta.function.arguments
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    for c in whole.choices:
        assert finish[c.index] == c.finish_reason == "tool_calls"
        expected = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
        assert list(calls[c.index].values()) == expected  # same seed: the same calls, whole or streamed
    # The openai client's own stream helper assembles delta.tool_calls and parses the arguments.
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                        max_tokens=120, seed=7, logit_bias=_ending(folder)) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == whole.choices[0].message.tool_calls[0] \
        .function.arguments
    _validate(final.choices[0].message.tool_calls)


def test_auto_is_free_text_until_a_call_opens(served) -> None:
    url, client, model, folder = served
    tok = httpx.post(url + "/tokenize", json={"prompt": "<tool_call>", "add_special_tokens": False}).json()
    hermes = tok["count"] == 1  # Qwen's template: calls open with the <tool_call> token; Llama 3's with "{"
    opening = tok["tokens"][0] if hermes else httpx.post(url + "/tokenize", json={
        "prompt": "{", "add_special_tokens": False}).json()["tokens"][0]
    free = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=10, seed=1)
    assert free.choices[0].finish_reason == "length" and free.choices[0].message.tool_calls is None
    assert free.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=120, seed=1,
                                            parallel_tool_calls=False, stream=True,
                                            logit_bias={str(opening): 100, **_ending(folder)})
    pieces = [c.choices[0] for c in stream if c.choices]
    name = next(d.function.name for p in pieces for d in p.delta.tool_calls or [] if d.id)
    arguments = "".join(d.function.arguments for p in pieces for d in p.delta.tool_calls or [])
    assert pieces[-1].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_full_loop_through_the_client(served) -> None:
    url, client, model, folder = served
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"result": 21}'}]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    prompt = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert call.function.name in text and "21" in text


def test_tokenize_with_tools_is_transformers_rendering(served, shared_dir) -> None:
    url, client, model, folder = served
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls},
                          {"role": "tool", "tool_call_id": "call_1", "content": "14:05"}]
    reference = QUESTION + [{"role": "assistant", "tool_calls": [
        {**calls[0], "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]}, history[-1]]
    ours = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = hf.apply_chat_template(reference, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    if "Today Date: " in text:  # Llama 3's template prints today's date: compare with the server's day
        day = httpx.post(url + "/detokenize", json={"tokens": ours}).json()["prompt"].split("Today Date: ")[1][:11]
        text = hf.apply_chat_template(reference, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                      date_string=day)
    assert ours == hf.encode(text, add_special_tokens=False)


def test_langchain_bind_tools_invoke_returns_tool_calls(served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    url, client, model, folder = served

    @tool
    def get_weather(city: Literal["Paris", "Zürich"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        return "21"

    chat = ChatOpenAI(base_url=url + "/v1", api_key="unused", model=model, max_tokens=120, seed=3, max_retries=0,
                      logit_bias=_ending(folder))
    message = chat.bind_tools([get_weather], tool_choice="any", strict=True).invoke("Weather in Zürich?")
    assert message.tool_calls and not message.invalid_tool_calls, message
    assert message.tool_calls[0]["name"] == "get_weather"
    assert message.tool_calls[0]["args"]["city"] in ("Paris", "Zürich")
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_tool_requests_that_cannot_work_are_400s(served) -> None:
    url, client, model, folder = served

    def post(**body) -> httpx.Response:  # noqa: ANN003
        return httpx.post(url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 5, **body})

    expect_error(post(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "tool_choice")
    expect_error(post(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]), 400,
           "tools")
    expect_error(post(tools=[WEATHER, WEATHER]), 400, "tools")
    error = expect_error(post(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), 400,
                   "tool_choice")
    assert "json_object" in error["message"]
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}}}  # a look-behind
    expect_error(post(tools=[bad], tool_choice="required"), 400, "tools")
    # the server still serves
    r = post(tools=[TIME], tool_choice="required", max_tokens=40, temperature=0, logit_bias=_ending(folder))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


def test_tool_call_parser_setting_gives_a_model_a_format(model_dir, tmp_path) -> None:  # noqa: F811
    """stories260k's template shows no tool format; --tool-call-parser hermes gives it one (its tokenizer has
    no <tool_call> token, so the markers are plain text and "auto" uses the grammar engine's lazy trigger).
    Its template here renders the tools (as JSON, no call format): the hermes preamble a template without tools
    gets would not fit stories260k's 512 positions (tests/server/test_agent_loops.py covers the preamble)."""
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(model_dir / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    proc, url = start_server(tmp_path, "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me the time"}],
                                           tools=[TIME], tool_choice=NAMED, max_tokens=150, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        _validate(r.choices[0].message.tool_calls)
        # "auto": the text is free until "<tool_call>" is written, so a greedy answer without one is the
        # unconstrained answer, token for token (tool_choice "none": the same prompt, neither constrained nor
        # parsed).
        story = [{"role": "user", "content": "Tell me a story"}]
        auto = client.chat.completions.with_raw_response.create(model=model, messages=story, tools=[TIME],
                                                                max_tokens=40, temperature=0, logprobs=True)
        assert "x-nexttoken-tools-preamble" not in auto.headers  # the template renders the tools itself
        auto = auto.parse()
        plain = client.chat.completions.create(model=model, messages=story, tools=[TIME], tool_choice="none",
                                               max_tokens=40, temperature=0, logprobs=True)
        assert auto.choices[0].message.content == plain.choices[0].message.content
        assert [t.token for t in auto.choices[0].logprobs.content] == [t.token for t in plain.choices[0].logprobs.content]
        assert auto.choices[0].message.tool_calls is None
    finally:
        stop_server(proc)


def test_a_template_that_renders_tools_gets_no_preamble(served) -> None:
    """Qwen2.5's and Llama 3.2's templates render tools themselves: left alone, and no preamble header."""
    url, client, model, folder = served
    r = client.chat.completions.with_raw_response.create(model=model, messages=QUESTION, tools=TOOLS,
                                                         tool_choice=NAMED, max_tokens=60, seed=0,
                                                         logit_bias=_ending(folder))
    assert "x-nexttoken-tools-preamble" not in r.headers
    assert r.parse().choices[0].message.tool_calls
