"""OpenAI messages as chat templates read them (nexttoken.chat.template_messages), and the tools preamble for
templates that render no tools (nexttoken.chat.with_preamble), with real chat templates: SmolLM2's ChatML (no
tools section), Qwen2.5's and Llama 3.2's (tools rendered by the template), against transformers' rendering."""

from __future__ import annotations

import json

import pytest
from conftest import requires_shared
from transformers import AutoTokenizer

from nexttoken.text.tokenizer import Tokenizer
from nexttoken.chat import FORMATS, ToolUse, template_messages, template_support, with_preamble

pytestmark = requires_shared

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# The second turn every agent framework sends: the assistant's call with content null (or no content at all),
# the tool's result (here as content parts), then the next question in parts.
SECOND_TURN = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": '{"temp": 21}'}]},
               {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "Rome?"}]}]


def test_the_normalisation_rules() -> None:
    out = template_messages([{"role": "assistant", "tool_calls": [CALL]},
                             {"role": "assistant", "content": None, "tool_calls": []},
                             {"role": "tool", "tool_call_id": "c", "content": {"temp": 21}},
                             {"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "refusal", "refusal": "no"},
                                                          {"type": "text", "text": "b"}]},
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Par'}},
                                 {**CALL, "function": {"name": "get_weather", "arguments": ""}}]}])
    assert out[0] == {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert out[1] == {"role": "assistant", "content": ""}
    assert out[2]["content"] == '{"temp": 21}'
    assert out[3]["content"] == "ab"
    assert [c["function"]["arguments"] for c in out[4]["tool_calls"]] == ['{"city": "Par', ""]  # passed as text
    assert CALL["function"]["arguments"] == '{"city": "Paris"}'  # the input is not modified


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "llama-3.2-instruct"])
def test_the_second_turn_renders_as_transformers_renders_it(shared_dir, name) -> None:
    folder = shared_dir / "tokenizers" / name
    ours = Tokenizer.from_dir(folder).apply_chat_template(template_messages(SECOND_TURN), tools=[WEATHER],
                                                          add_generation_prompt=True)
    reference = [{"role": "user", "content": "What is the weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                 {"role": "user", "content": "And Rome?"}]
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(reference, tools=[WEATHER],
                                                                       add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert template_support(Tokenizer.from_dir(folder)).tools  # rendered by the template: no preamble


def test_smollm2_renders_the_second_turn_and_gets_the_preamble(smollm2_dir) -> None:
    """SmolLM2's template concatenates message['content']: content null broke it (a 400 "'dict object' has no
    attribute 'content'"). It renders no tools, so the hermes preamble and the past call are written as text."""
    tok = Tokenizer.from_dir(smollm2_dir)
    plain = tok.apply_chat_template(template_messages(SECOND_TURN), tools=[WEATHER], add_generation_prompt=True)
    assert plain == tok.apply_chat_template(template_messages(SECOND_TURN), add_generation_prompt=True)  # tools ignored
    support = template_support(tok)
    assert not support.tools and not support.calls and support.results
    use = ToolUse.of([WEATHER], "auto", None, "hermes")
    messages = with_preamble(template_messages(SECOND_TURN), use.tools, use.format, support)
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    hermes = FORMATS["hermes"]
    expected = AutoTokenizer.from_pretrained(smollm2_dir).apply_chat_template(
        [{"role": "system", "content": hermes.preamble([WEATHER])},
         {"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                          '</tool_call>'},
         {"role": "tool", "content": '{"temp": 21}'},
         {"role": "user", "content": "And Rome?"}], add_generation_prompt=True, tokenize=False)
    assert text == expected
    assert json.dumps(WEATHER) in text and "<tool_call>" in text


def test_a_system_message_keeps_its_text_before_the_preamble(smollm2_dir) -> None:
    tok = Tokenizer.from_dir(smollm2_dir)
    use = ToolUse.of([WEATHER], "auto", None, "llama3_json")
    messages = with_preamble(template_messages([{"role": "system", "content": "Be brief."}, *SECOND_TURN[:1]]),
                             use.tools, use.format, template_support(tok))
    assert messages[0]["content"].startswith("Be brief.\n\nGiven the following functions")
    assert len(messages) == 2


def test_the_library_chat_uses_the_preamble_and_drops_a_cut_call(smollm2_dir) -> None:
    """LLM.chat takes the same path as the server: the preamble for SmolLM2, and a call cut by max_new_tokens is
    neither a call nor content."""
    import torch

    import nexttoken

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = nexttoken.load(smollm2_dir)  # no tool_call_parser: hermes' preamble is the default here
        use = llm.tool_use([WEATHER], "required")
        prompt = llm.tokenizer.decode(llm.tools_prompt(SECOND_TURN, use), skip_special_tokens=False)
        assert "<tools>" in prompt and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
        whole = llm.chat(SECOND_TURN[:1], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                         max_new_tokens=40)
        assert whole.finish_reason == "tool_calls" and json.loads(whole.tool_calls[0].arguments)
        cut = llm.chat(SECOND_TURN[:1], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                       max_new_tokens=len(whole.token_ids) // 2)  # inside the call
        assert cut.finish_reason == "length" and cut.tool_calls is None and cut.text == ""
    finally:
        torch.set_num_threads(before)
