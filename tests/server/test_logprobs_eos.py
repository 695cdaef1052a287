"""Log-probs report the tokens of the answer and nothing else: when an answer ends at EOS (`<|im_end|>`), the
stop token is left out of `logprobs` as OpenAI and vLLM leave it out, so the tokens' bytes join to exactly the
answer's text. Chat, Completions and Responses, each whole and streamed, with the `openai` client on the real
SmolLM2 GGUF."""

from __future__ import annotations

import openai
import pytest
from conftest import SMOLLM2_GGUF, requires_shared
from support.server import start_server, stop_server

pytestmark = requires_shared

ASK = [{"role": "user", "content": "Say hello in one short sentence."}]
# The same turn as a raw prompt for the completions API (SmolLM2's chat template, no system prompt)
RAW = "<|im_start|>user\nSay hello in one short sentence.<|im_end|>\n<|im_start|>assistant\n"
END = "<|im_end|>"


@pytest.fixture(scope="module")
def client():
    proc, url = start_server(SMOLLM2_GGUF)
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c, c.models.list().data[0].id
    stop_server(proc)


def _joined(content) -> str:
    return b"".join(bytes(t.bytes) for t in content).decode("utf-8")


def test_chat_logprobs_join_to_the_answer(client) -> None:
    c, model = client
    r = c.chat.completions.create(model=model, messages=ASK, max_tokens=200, temperature=0, logprobs=True,
                                  top_logprobs=2)
    choice = choice0 = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content
    assert END not in [t.token for t in choice.logprobs.content]
    assert _joined(choice.logprobs.content) == choice.message.content
    assert r.usage.completion_tokens == len(choice.logprobs.content) + 1  # usage still counts the EOS

    chunks = list(c.chat.completions.create(model=model, messages=ASK, max_tokens=200, temperature=0,
                                            logprobs=True, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert text == choice0.message.content and _joined(streamed) == text
    assert [t.token for t in streamed] == [t.token for t in choice0.logprobs.content]


def test_completions_logprobs_join_to_the_text(client) -> None:
    c, model = client
    r = c.completions.create(model=model, prompt=RAW, max_tokens=200, temperature=0, logprobs=1)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.text
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and END not in lp.tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)

    chunks = list(c.completions.create(model=model, prompt=RAW, max_tokens=200, temperature=0, logprobs=1,
                                       stream=True))
    tokens = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text and tokens == lp.tokens


def test_responses_logprobs_join_to_the_text(client) -> None:
    c, model = client
    r = c.responses.create(model=model, input=ASK, max_output_tokens=200, temperature=0, top_logprobs=2,
                           include=["message.output_text.logprobs"])
    assert r.status == "completed"
    part = r.output[-1].content[0]
    assert part.text and _joined(part.logprobs) == part.text and END not in [t.token for t in part.logprobs]

    deltas, done = [], None
    for event in c.responses.create(model=model, input=ASK, max_output_tokens=200, temperature=0,
                                    top_logprobs=2, include=["message.output_text.logprobs"], stream=True):
        if event.type == "response.output_text.delta":
            deltas += event.logprobs
        elif event.type == "response.output_text.done":
            done = event
    assert done.text == part.text and _joined(deltas) == part.text and _joined(done.logprobs) == part.text
