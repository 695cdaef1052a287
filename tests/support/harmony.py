"""gpt-oss's harmony format for tests (no tests here): a tokenizer with harmony's special tokens and the real
gpt-oss chat template, conversations with reasoning, tool calls and tool results, and realistic harmony answers.

gpt-oss's own vocabulary (o200k_harmony) is not on this machine (tiktoken fetches it from the network), so the
tokenizer is the real Qwen2.5 one with harmony's special tokens added as gpt-oss's tokenizer has them (special:
each one token, left out of text unless skip_special_tokens is off) and gpt-oss's generation config's stop tokens
(`<|return|>`, `<|call|>`)."""

from __future__ import annotations

import json
from pathlib import Path

from support.llama_cpp import template

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
TEMPLATE = "openai-gpt-oss-120b"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

# Conversations as clients send them back: past reasoning (`thinking`, as gpt-oss's template reads it, or
# reasoning_content), a call and its result, a final answer after it.
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "reasoning_then_answer": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "thinking": "The user greets me."},
        {"role": "user", "content": "And now?"}],
    "call_pending": [
        *QUESTION,
        {"role": "assistant", "content": None, "reasoning_content": "I should call get_weather.",
         "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'}],
    "call_answered": [
        *QUESTION,
        {"role": "assistant", "content": "", "thinking": "I should call get_weather.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        {"role": "assistant", "content": "It is 21 C and sunny in Paris."},
        {"role": "user", "content": "Thanks. And in Rome?"}],
}

# Answers as gpt-oss writes them after the prompt's `<|start|>assistant` (its stop tokens, <|call|> and
# <|return|>, end them; the server leaves them out of the text, a client may see them).
ANSWERS = {
    "final": ("<|channel|>analysis<|message|>The user says hi. Reply briefly.<|end|>"
              "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>"),
    "call": ("<|channel|>analysis<|message|>Need weather; call the tool.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             '{"city":"Paris","unit":"c"}<|call|>'),
    "call_in_role": ("<|channel|>analysis<|message|>Call it.<|end|>"
                     "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                     '{"city":"Rome"}<|call|>'),
    "preamble_then_call": ("<|channel|>commentary<|message|>Let me check the weather.<|end|>"
                           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                           '<|message|>{"city":"Paris"}<|call|>'),
    "answer_after_result": ("<|channel|>analysis<|message|>It is 21 C, say so <b>plainly</b>.<|end|>"
                            "<|start|>assistant<|channel|>final<|message|>It is 21 °C in Paris | sunny.<|return|>"),
}
EXPECTED = {  # (reasoning, content, calls) of each answer
    "final": ("The user says hi. Reply briefly.", "Hello! How can I help?", []),
    "call": ("Need weather; call the tool.", "", [("get_weather", '{"city":"Paris","unit":"c"}')]),
    "call_in_role": ("Call it.", "", [("get_weather", '{"city":"Rome"}')]),
    "preamble_then_call": ("", "Let me check the weather.", [("get_weather", '{"city":"Paris"}')]),
    "answer_after_result": ("It is 21 C, say so <b>plainly</b>.", "It is 21 °C in Paris | sunny.", []),
}
# What no field may ever hold: harmony's markup
MARKUP = (*SPECIALS, "<|", "|>", "analysis", "commentary", "final<", "to=functions", "functions.")


def harmony_tokenizer(folder: Path, shared_dir: Path) -> Path:
    """Qwen2.5's tokenizer with harmony's special tokens, gpt-oss's chat template, eos and stop tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    src = shared_dir / "tokenizers" / "qwen2.5-instruct"
    tok = json.loads((src / "tokenizer.json").read_text())
    first = max(t["id"] for t in tok["added_tokens"]) + 1
    ids = {t: first + i for i, t in enumerate(SPECIALS)}
    entry = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    tok["added_tokens"] += [{"id": i, "content": t, **entry} for t, i in ids.items()]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"].update({str(i): {"content": t, **entry} for t, i in ids.items()})
    config["chat_template"] = template(TEMPLATE)
    config["eos_token"] = "<|return|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|return|>"], ids["<|call|>"]]}))
    return folder


def special_ids(folder: Path) -> dict[str, int]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tok["added_tokens"] if t["content"] in SPECIALS}
