"""Several names for one model (`--served-model-name main small`, vLLM's list): the first is reported, every one is
accepted, /v1/models has a card for each. What Claude Code needs (docs/serving.md): it sends a main and a small
model name to one ANTHROPIC_BASE_URL. Driven by the real `anthropic` and `openai` SDKs against a real server on
loopback; the reference is the same server under its first name (the same model: the same tokens).

Model: random weights over the real Qwen2.5 tokenizer and chat template."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from conftest import requires_shared
from support.server import start_server, stop_server
from support.tiny_models import build_chat_model

pytestmark = requires_shared

KEY = "sk-local"
NAMES = ("local-main", "local-small")  # Claude Code's ANTHROPIC_MODEL and ANTHROPIC_DEFAULT_HAIKU_MODEL
CONTEXT = 256
NEW = 10
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def served(shared_dir, tmp_path_factory):
    folder = build_chat_model(tmp_path_factory.mktemp("qwen"), shared_dir / "tokenizers" / "qwen2.5-instruct", "qwen2")
    proc, url = start_server(folder, "--api-key", KEY, "--max-model-len", str(CONTEXT), "--served-model-name", *NAMES)
    yield url
    stop_server(proc)


def test_models_lists_every_name(served) -> None:
    client = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=120)
    cards = client.models.list().data
    assert [c.id for c in cards] == list(NAMES)
    assert all(c.parent is None and c.root == NAMES[0] and c.max_model_len == CONTEXT for c in cards)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("claude-opus-4-7")


def test_both_sdks_are_answered_under_each_name(served) -> None:
    chat = openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = anthropic.Anthropic(base_url=served, api_key=KEY, max_retries=0, timeout=120)  # sends x-api-key
    bearer = anthropic.Anthropic(base_url=served, auth_token=KEY, max_retries=0, timeout=120)  # ANTHROPIC_AUTH_TOKEN
    want = None
    for name in NAMES:
        c = chat.chat.completions.create(model=name, messages=QUESTION, max_tokens=NEW, temperature=0)
        assert c.model == name and c.choices[0].message.content
        text = c.choices[0].message.content
        want = want or text
        assert text == want, "one model under two names: the same tokens"
        for client in (messages, bearer):
            m = client.messages.create(model=name, max_tokens=NEW, messages=QUESTION, extra_body={"temperature": 0})
            assert m.model == name and m.content[0].text == want
        greedy = {"temperature": 0}
        with messages.messages.stream(model=name, max_tokens=NEW, messages=QUESTION, extra_body=greedy) as stream:
            assert "".join(stream.text_stream) == want
            assert stream.get_final_message().model == name
        assert messages.messages.count_tokens(model=name, messages=QUESTION).input_tokens == c.usage.prompt_tokens


def test_an_unknown_name_is_a_404_naming_the_served_ones(served) -> None:
    client = anthropic.Anthropic(base_url=served, api_key=KEY, max_retries=0, timeout=120)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4-7", max_tokens=NEW, messages=QUESTION)
    message = e.value.body["error"]["message"]
    assert "'claude-opus-4-7'" in message and all(f"'{n}'" in message for n in NAMES)


def test_a_prompt_longer_than_the_context_is_anthropics_400(served) -> None:
    """Claude Code's system prompt runs to thousands of tokens: a model whose context is shorter answers with a 400
    that says both numbers (docs/serving.md), never a cut prompt."""
    client = anthropic.Anthropic(base_url=served, api_key=KEY, max_retries=0, timeout=120)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAMES[1], max_tokens=NEW, system="You are a careful assistant. " * 100,
                               messages=QUESTION)
    message = e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert f"maximum context length is {CONTEXT} tokens" in message and "shorten it" in message
    with pytest.raises(anthropic.BadRequestError) as e:  # a short prompt with Claude Code's default max_tokens
        client.messages.create(model=NAMES[0], max_tokens=32000, messages=QUESTION)
    assert "lower max_tokens" in e.value.body["error"]["message"]
    assert httpx.get(served + "/health").status_code == 200
