"""Reasoning models: the thinking split off the content (tools/reasoning.py), streamed and whole, on the real
Qwen3 and DeepSeek-R1 chat templates (tests/data/chat_templates.md); `enable_thinking: false` rendered as
transformers renders it; the thinking budget that closes the block; tool calls and structured output after the
thinking; and the same thinking in every API (Chat Completions' reasoning_content / reasoning, Responses'
reasoning items, Messages' thinking blocks).

Models: chain models (tests/support/chain_model.py) whose greedy output is a chosen text, here one that thinks first."""

from __future__ import annotations

import json
import random
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from support.chain_model import build_chain_model, chain_ids
from conftest import requires_shared
from support.reasoning import ANSWER, QUESTION, QWEN3_TOKENS, thinking_tokenizer
from support.server import start_server, stop_server

from nexttoken.generation.processors.thinking import ThinkingBudget
from nexttoken.generation.values import Thinking
from nexttoken.text.tokenizer import Tokenizer
from nexttoken.chat.reasoning import FORMATS, ReasoningParser, detect_format

pytestmark = requires_shared

DATA = Path(__file__).resolve().parents[1] / "data"




def _split(fmt: str, text: str, opened: bool | None = None, cuts: list[int] | None = None) -> tuple[str, str]:
    parser = ReasoningParser(FORMATS[fmt], opened)
    pieces = []
    last = 0
    for cut in (cuts or []) + [len(text)]:
        pieces += parser.feed(text[last:cut])
        last = cut
    pieces += parser.finish()
    return "".join(t for th, t in pieces if th), "".join(t for th, t in pieces if not th)


@pytest.mark.parametrize("fmt, text, opened, want", [
    ("qwen3", "<think>\nplan\n</think>\n\nanswer", None, ("\nplan\n", "\n\nanswer")),
    ("qwen3", "no thinking here", None, ("", "no thinking here")),
    ("qwen3", "<think>cut short", None, ("cut short", "")),
    ("qwen3", "<thin", None, ("", "<thin")),  # an unfinished marker at the end is text
    ("deepseek_r1", "plan</think>answer", None, ("plan", "answer")),
    ("deepseek_r1", "<think>plan</think>answer", None, ("plan", "answer")),
    ("deepseek_r1", "all thinking", None, ("all thinking", "")),
    ("deepseek_r1", "after a tool: an answer", False, ("", "after a tool: an answer")),  # the prompt opened none
    ("mistral", "[THINK]plan[/THINK]answer", None, ("plan", "answer")),
])
def test_split_whole_and_streamed(fmt, text, opened, want) -> None:
    assert _split(fmt, text, opened) == want
    rng = random.Random(0)
    for _ in range(20):  # any chunking, markers cut anywhere, gives the same split
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        assert _split(fmt, text, opened, cuts) == want


def test_formats_read_off_the_templates(shared_dir) -> None:
    assert detect_format((DATA / "qwen3_chat_template.jinja").read_text()).name == "qwen3"
    assert detect_format((DATA / "deepseek_r1_distill_chat_template.jinja").read_text()).name == "deepseek_r1"
    plain = json.loads((shared_dir / "tokenizers" / "qwen2.5-instruct" / "tokenizer_config.json").read_text())
    assert detect_format(plain["chat_template"]) is None


def test_enable_thinking_renders_as_transformers_does(shared_dir, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = thinking_tokenizer(tmp_path, shared_dir, "qwen3_chat_template.jinja")
    ours = Tokenizer.from_dir(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION,
                {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"}, {"role": "user", "content": "Go"}]
    for thinking in (True, False, None):
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == want
        assert want.endswith("<think>\n\n</think>\n\n") == (thinking is False)
    assert ours.encode("<think></think>", add_special_tokens=False) == [151667, 151668]


def test_budget_processor_forces_the_end_marker() -> None:
    t = Thinking(start_id=7, end_id=8, budget=2)
    budget = ThinkingBudget(t, prompt_length=2)
    scores = torch.zeros(3, 10)
    ids = torch.tensor([[1, 2, 7, 4, 5],  # opened by the answer, 2 thinking tokens: forced to close
                        [1, 7, 4, 5, 6],  # opened by the prompt, 3 tokens: forced
                        [1, 2, 7, 4, 8]])  # closed already: free
    out = budget(ids, scores)
    assert out[0].argmax() == 8 and torch.isinf(out[0]).sum() == 9
    assert out[1].argmax() == 8 and torch.isinf(out[1]).sum() == 9
    assert torch.equal(out[2], scores[2]) and torch.equal(scores, torch.zeros(3, 10))  # the input is untouched
    assert t.span(False, [7, 4]) == (0, None) and t.span(False, [4]) == (None, 0) and t.span(True, [4, 8, 3]) == (-1, 2)


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1"])
def served(request, shared_dir, tmp_path_factory):
    template = {"qwen3": "qwen3_chat_template.jinja", "deepseek_r1": "deepseek_r1_distill_chat_template.jinja"}
    tokenizer = thinking_tokenizer(tmp_path_factory.mktemp("tok"), shared_dir, template[request.param])
    # DeepSeek-R1's template opens the block in the prompt: its answer starts inside the thinking.
    text = ANSWER if request.param == "qwen3" else ANSWER.removeprefix("<think>")
    eos = Tokenizer.from_dir(tokenizer).encode("<|endoftext|>", add_special_tokens=False)[0]
    folder = build_chain_model(tmp_path_factory.mktemp(request.param), tokenizer, chain_ids(tokenizer, text) + [eos],
                               eos)
    # Qwen3 with thinking off by default: the template closes a block in the prompt, and the model (the chain)
    # opens one anyway, as the answer's first token; every split below must still hold.
    extra = ("--default-chat-template-kwargs", '{"enable_thinking": false}') if request.param == "qwen3" else ()
    proc, url = start_server(folder, *extra)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield request.param, url, client, client.models.list().data[0].id
    stop_server(proc)


def test_thinking_in_every_api_whole_and_streamed(served) -> None:
    name, url, client, model = served
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0)
    message = chat.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == ("Let me see", "Let me see",
                                                                               "Hello there")
    assert chat.choices[0].finish_reason == "stop"
    chunks = [c.choices[0].delta for c in client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=20, temperature=0, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == "Let me see"
    assert "".join(getattr(d, "reasoning", None) or "" for d in chunks) == "Let me see"
    assert "".join(d.content or "" for d in chunks) == "Hello there"

    r = client.responses.create(model=model, input="Hi", max_output_tokens=20, temperature=0)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me see" and r.output_text == "Hello there"
    assert r.usage.output_tokens_details.reasoning_tokens == 3
    events = list(client.responses.create(model=model, input="Hi", max_output_tokens=20, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Let me see"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there"

    m = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
        model=model, max_tokens=20, messages=QUESTION, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "Let me see"), ("text", "Hello there")]
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.stream(
            model=model, max_tokens=20, messages=QUESTION, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == "Let me see"


@pytest.mark.parametrize("fields", [dict(extra_body={"thinking_token_budget": 1}), dict(reasoning_effort="none")],
                         ids=["budget", "effort"])
def test_the_budget_closes_the_block(served, fields) -> None:
    name, url, client, model = served
    budget = fields.get("extra_body", {}).get("thinking_token_budget", 0)
    message = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0,
                                             **fields).choices[0].message
    assert message.reasoning_content == (["Let"][:budget][0] if budget else None)
    assert message.content == "Hello there"  # the chain goes on from the forced end marker
    r = client.responses.create(model=model, input="Hi", max_output_tokens=20, temperature=0,
                                reasoning={"effort": "none"})
    assert r.output_text == "Hello there"


def test_a_tool_call_and_a_schema_after_thinking(served) -> None:
    name, url, client, model = served
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"],
        "additionalProperties": False}}}
    if name == "qwen3":  # hermes calls: the chain thinks first, then the grammar writes the call
        choice = client.chat.completions.create(model=model, messages=QUESTION, tools=[tool], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=60, temperature=0).choices[0]
        assert choice.message.reasoning_content == "Let me see"
        call = choice.message.tool_calls[0].function
        assert call.name == "get_time" and json.loads(call.arguments)["tz"] in ("CET", "UTC")
        assert choice.finish_reason == "tool_calls"
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    shaped = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=40, temperature=0,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "s", "schema": schema}}).choices[0].message
    assert shaped.reasoning_content == "Let me see"
    assert json.loads(shaped.content)["a"] in ("x", "y")


def test_chat_template_kwargs_reach_the_template(served) -> None:
    name, url, client, model = served
    if name != "qwen3":
        pytest.skip("DeepSeek-R1's template has no enable_thinking switch")
    default = httpx.post(url + "/tokenize", json={"messages": QUESTION}).json()["tokens"]  # the server's: off
    on = httpx.post(url + "/tokenize", json={"messages": QUESTION,
                                             "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
    assert default[:len(on)] == on and default[len(on):][0] == QWEN3_TOKENS["<think>"]
    bad = httpx.post(url + "/v1/chat/completions", json={"messages": QUESTION, "chat_template_kwargs": {
        "tools": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    traced = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=20, temperature=0,
                                            extra_body={"trace": True})
    kept = httpx.get(url + traced.choices[0].model_extra["trace"]["json_url"]).json()
    assert (kept["reasoning"], kept["content"]) == ("Let me see", "Hello there")  # the trace keeps the split
