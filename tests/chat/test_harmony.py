"""Harmony, gpt-oss's chat format (chat/harmony.py): the real gpt-oss chat template rendered byte-identical to
transformers' rendering for conversations with reasoning, tool calls and tool results; the request's reasoning
effort as the system message's level; the parser on every prefix of realistic harmony answers (no markup ever
leaks into the reasoning, the content or a call, and each field of a prefix is a prefix of the whole's); the
calls' grammar accepting gpt-oss's answers and refusing arguments outside the schema (llguidance, the engine the
constraint runs on).

Tokenizer: the real Qwen2.5 one with harmony's special tokens and gpt-oss's template (support/harmony.py)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from conftest import requires_shared
from support.harmony import (ANSWERS, CALL, CONVERSATIONS, EXPECTED, MARKUP, QUESTION, SPECIALS, TOOLS, WEATHER,
                             harmony_tokenizer, special_ids)

from nexttoken.chat import ToolUse
from nexttoken.chat.answer import Thinking
from nexttoken.chat.harmony import HarmonyParser, effort, structured
from nexttoken.chat.messages import template_messages
from nexttoken.chat.render import ChatRenderer
from nexttoken.chat.tools.parser import ToolCallDelta
from nexttoken.generation.config import GenerationConfig
from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared


@pytest.fixture(scope="module")
def folder(shared_dir, tmp_path_factory):
    return harmony_tokenizer(tmp_path_factory.mktemp("harmony"), shared_dir)


@pytest.fixture(scope="module")
def renderer(folder):
    return ChatRenderer(Tokenizer.from_dir(folder))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _stripped(text: str) -> str:
    """The answer as the server's text has it: the stop token that ended it left out."""
    for stop in ("<|call|>", "<|return|>"):
        text = text.removesuffix(stop)
    return text


def _fields(pieces: list, parser: HarmonyParser) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning = "".join(p.text for p in pieces if isinstance(p, Thinking))
    content = "".join(p for p in pieces if isinstance(p, str))
    return reasoning, content, [(c.name, c.arguments) for c in parser.calls]


def _no_markup(*texts: str) -> None:
    for text in texts:
        leaked = [m for m in MARKUP if m in text]
        assert not leaked, (leaked, text)


# ---- rendering ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_gpt_oss_template_renders_as_transformers_renders_it(hf, renderer, name) -> None:
    conversation = CONVERSATIONS[name]
    for tools in (None, TOOLS):
        for level in (None, "low", "high"):
            variables = {} if level is None else {"reasoning_effort": level}
            prompt = renderer.render(conversation, renderer.tool_use(tools), variables)
            reference = hf.apply_chat_template(template_messages(conversation), tools=tools, tokenize=False,
                                               add_generation_prompt=True, **variables)
            assert prompt.text == reference
            assert prompt.ids == hf.encode(reference, add_special_tokens=False)
            assert prompt.harmony and prompt.text.endswith("<|start|>assistant")
            assert f"Reasoning: {level or 'medium'}\n" in prompt.text
    if name == "call_pending":  # the call's reasoning comes back as its analysis (no final answer after it)
        assert "<|channel|>analysis<|message|>I should call get_weather.<|end|><|start|>assistant to=" in prompt.text
    if name == "call_answered":  # ... and is dropped once a final answer followed
        assert "I should call" not in prompt.text and '"21 C, sunny"' in prompt.text


def test_reasoning_and_content_of_a_call_turn_keep_the_reasoning(renderer) -> None:
    """gpt-oss's template refuses an assistant turn with a call, content and reasoning together; the reasoning is
    kept as the call's analysis (llama.cpp's choice)."""
    turn = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call the tool.",
            "tool_calls": CONVERSATIONS["call_pending"][1]["tool_calls"]}
    text = renderer.render([*QUESTION, turn, CONVERSATIONS["call_pending"][2]], renderer.tool_use(TOOLS)).text
    assert "<|channel|>analysis<|message|>Call the tool.<|end|>" in text and "Let me check." not in text


def test_parallel_calls_sent_back_render_one_call_per_turn(hf, renderer) -> None:
    """gpt-oss's template renders one call per assistant turn and names each result after the last call: a turn
    with two calls renders as transformers renders the same conversation one call per turn."""
    calls = [dict(CALL, id="call_a"), dict(CALL, id="call_b", function={"name": "get_time", "arguments": "{}"})]
    sent = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
            {"role": "tool", "tool_call_id": "call_a", "content": "21 C"}]
    one_by_one = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [calls[0]]},
                  {"role": "tool", "tool_call_id": "call_a", "content": "21 C"},
                  {"role": "assistant", "content": "", "tool_calls": [calls[1]]},
                  {"role": "tool", "tool_call_id": "call_b", "content": "12:00"}]
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                                       "parameters": {"type": "object", "properties": {}}}}]
    text = renderer.render(sent, renderer.tool_use(tools)).text
    assert text == hf.apply_chat_template(template_messages(one_by_one), tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    assert '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"' in text


def test_the_format_is_read_off_the_template(renderer) -> None:
    assert renderer.harmony and renderer.reasoning.name == "openai_gptoss" and renderer.markers is None
    assert renderer.tool_use(TOOLS).format.name == "openai"


def test_a_requests_effort_is_the_system_messages_level(renderer) -> None:
    assert [effort(e) for e in ("none", "minimal", "low", "medium", "high", "xhigh")] == \
        ["low", "low", "low", "medium", "high", "high"]
    assert [effort(budget=b) for b in (1, 1024, 1025, 4096, 20000)] == ["low", "low", "medium", "medium", "high"]
    assert effort(enable_thinking=False) == "low" and effort() is None
    assert renderer.with_effort({}, "xhigh") == {"reasoning_effort": "high"}
    assert renderer.with_effort({"reasoning_effort": "low"}, "high") == {"reasoning_effort": "low"}  # the client's
    assert renderer.with_effort({"enable_thinking": True}, budget=2000)["reasoning_effort"] == "medium"
    text = renderer.render(QUESTION, None, renderer.with_effort({}, "high")).text
    assert "\nReasoning: high\n" in text


# ---- parsing -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ANSWERS))
def test_every_prefix_parses_without_markup(name) -> None:
    whole = ANSWERS[name]
    reasoning, content, calls = EXPECTED[name]
    for text in (whole, _stripped(whole)):  # with the stop token as a client may keep it, and without
        parser = HarmonyParser(calls=True)
        assert _fields(parser.parse(text), parser) == (reasoning, content, calls)
    for n in range(len(whole) + 1):
        for cut in (False, True):
            parser = HarmonyParser(calls=True)
            pieces = parser.parse(whole[:n], cut=cut)
            got_reasoning, got_content, got_calls = _fields(pieces, parser)
            streamed_args = "".join(p.arguments for p in pieces if isinstance(p, ToolCallDelta))
            _no_markup(got_reasoning, got_content, streamed_args, *(c[0] for c in got_calls))
            if cut or not whole[:n].endswith("<"):  # (a lone "<" at a real end is text)
                assert reasoning.startswith(got_reasoning) and content.startswith(got_content), (n, cut)
            for got in got_calls:  # a finished call is whole (or has no arguments: "{}"); a cut one is left out
                assert got in calls or (got[1] == "{}" and whole[:n].endswith("<|message|>")), (n, cut, got)
                json.loads(got[1])
            if cut and n < len(_stripped(whole)):
                assert not got_calls


@pytest.mark.parametrize("name", list(ANSWERS))
def test_a_stream_in_any_chunks_gives_the_whole_answers_pieces(name) -> None:
    text = _stripped(ANSWERS[name])
    whole = HarmonyParser(calls=True)
    expected = _fields(whole.parse(text), whole)
    rng = random.Random(0)
    for _ in range(20):
        parser, pieces, at = HarmonyParser(calls=True), [], 0
        while at < len(text):
            step = rng.randint(1, 12)
            pieces += parser.feed(text[at:at + step])
            at += step
        pieces += parser.finish()
        assert _fields(pieces, parser) == expected
        deltas = [p for p in pieces if isinstance(p, ToolCallDelta)]
        if deltas:  # the first delta names the call, the rest add up to its arguments
            assert deltas[0].id == parser.calls[0].id and deltas[0].name == "get_weather"
            assert "".join(d.arguments for d in deltas) == parser.calls[0].arguments


def test_calls_without_tools_are_the_models_own_work_and_plain_text_is_content(renderer) -> None:
    prompt = renderer.render(QUESTION)  # no tools: the call's text is not a call
    answer = prompt.split(_stripped(ANSWERS["call"]))
    assert answer.tool_calls == [] and answer.content == ""
    assert answer.reasoning.startswith("Need weather; call the tool.")
    with_tools = renderer.render(QUESTION, renderer.tool_use(TOOLS)).split(_stripped(ANSWERS["call"]))
    assert [(c.name, c.arguments) for c in with_tools.tool_calls] == EXPECTED["call"][2]
    assert with_tools.reasoning == EXPECTED["call"][0] and with_tools.content == ""
    for text in ("Hello, no channels here.", " Hi there"):  # a model not trained on harmony
        assert (prompt.split(text).content, prompt.split(text).reasoning) == (text, None)
    after = prompt.split("<|channel|>final<|message|>Hi.<|end|>And more")  # text after a message, not harmony
    assert (after.content, after.reasoning) == ("Hi.And more", None)
    builtin = renderer.render(QUESTION, renderer.tool_use(TOOLS)).split(
        '<|channel|>analysis to=browser.search code<|message|>{"query":"Paris"}')  # a built-in tool: not a call
    assert (builtin.tool_calls, builtin.content, builtin.reasoning) == ([], "", '{"query":"Paris"}')


def test_a_call_whose_arguments_are_not_an_object_is_left_out() -> None:
    head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    for body, kept in (('{"city":"Paris"}', True), ('{"city":', False), ("not json", False), ("", True)):
        parser = HarmonyParser(calls=True)
        parser.parse(head + body)
        assert bool(parser.calls) == kept, body
    parser = HarmonyParser(calls=True)
    parser.parse(head + '{"city":"Paris"}', cut=True)  # cut at max_tokens: the call may be unfinished
    assert parser.calls == []


# ---- the calls' grammar ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def matcher(folder):
    import llguidance

    tokenizer = Tokenizer.from_dir(folder)
    stops = [special_ids(folder)[s] for s in ("<|return|>", "<|call|>")]
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=len(tokenizer), eos_token=stops)

    def accepts(choice, text: str) -> bool:
        """Whether the calls' grammar under `choice` takes `text`; with a config as `choice`, its structured
        output's grammar (chat/harmony.py `structured`)."""
        if isinstance(choice, GenerationConfig):
            grammar = structured(choice, tokenizer).grammar
        else:
            grammar = ToolUse.of(TOOLS, choice, format="openai").grammar(tokenizer)
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
        assert not m.is_error(), m.get_error()
        ok = m.consume_tokens(tokenizer.encode(_stripped(text), add_special_tokens=False))
        return bool(ok) and not m.is_error() and m.is_accepting()

    return accepts


def test_the_grammar_takes_gpt_oss_answers_and_keeps_calls_in_their_schema(matcher) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for name in ANSWERS:
        is_call = bool(EXPECTED[name][2])
        assert matcher("auto", ANSWERS[name]), name
        assert matcher("required", ANSWERS[name]) == is_call, name
        assert matcher(named, ANSWERS[name]) == is_call, name
        for _, arguments in EXPECTED[name][2]:
            jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    bad = ANSWERS["call"].replace('"unit":"c"', '"unit":"kelvin"')
    assert not matcher("auto", bad) and not matcher("required", bad)
    assert not matcher("required", ANSWERS["call"].replace("get_weather", "get_time"))


def test_structured_output_constrains_the_final_message_after_the_analysis(matcher) -> None:
    schema = WEATHER["function"]["parameters"]
    cfg = GenerationConfig(json_schema=schema, structured_whitespace="compact")
    analysis = "<|channel|>analysis<|message|>Return JSON.<|end|><|start|>assistant"
    for head in ("", analysis, analysis + "<|channel|>commentary<|message|>Here it is.<|end|><|start|>assistant"):
        assert matcher(cfg, head + '<|channel|>final<|message|>{"city": "Paris", "unit": "c"}')
        assert matcher(cfg, head + '<|channel|>final <|constrain|>json<|message|>{"city": "Rome"}')
        assert not matcher(cfg, head + '<|channel|>final<|message|>{"city": 3}')  # outside the schema
        assert not matcher(cfg, head + "<|channel|>final<|message|>Paris")
    assert not matcher(cfg, '{"city": "Paris"}')  # JSON with no channel: not harmony
    assert matcher(GenerationConfig(json_object=True), '<|channel|>final<|message|>{"any": [1]}')
    assert structured(GenerationConfig(regex="a+"), None).regex == "a+"  # other constraints as given


def test_the_markers_are_special_tokens_kept_in_the_text(renderer) -> None:
    use = renderer.tool_use(TOOLS)
    tokenizer = renderer.tokenizer
    assert use.keeps_special_tokens(tokenizer)
    assert all(len(tokenizer.encode(s, add_special_tokens=False)) == 1 for s in SPECIALS)
