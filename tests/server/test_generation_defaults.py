"""The model's generation_config.json defaults apply to requests that leave a field out (vLLM's
`--generation-config auto`), in every API; `--generation-config vllm` keeps OpenAI's defaults. The chat page shows
the values that will apply and sends none when its fields are blank: checked in a real headless Chromium (the
browser's own network log) against the server's request log, which reports the options each request ran with.

Model: the packaged default model, whose generation_config.json says temperature 0.8, top_p 0.95, top_k 0 (off),
max_new_tokens 256; its context is 512 tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from support.cdp import Browser, browser_or_skip
from support.server import start_server, stop_server
from support.webui import chat_bodies, page_requests, type_and_send, wait_for

from nexttoken.pretrained import DEFAULT_MODEL_DIR

FILE = json.loads((Path(DEFAULT_MODEL_DIR) / "generation_config.json").read_text())
SAMPLING = re.compile(r"POST (?P<path>\S+) 200 .* sampling=(?P<sampling>\S+)")


def _applied(proc) -> list[tuple[str, dict]]:
    """(path, the sampling options it ran with) per generating request, read off the stopped server's log."""
    stop_server(proc)
    lines = proc.stdout.read().decode().splitlines()
    return [(m["path"], dict(kv.split("=") for kv in m["sampling"].split(","))) for line in lines
            if (m := SAMPLING.search(line))]


def test_every_api_applies_the_models_defaults() -> None:
    proc, url = start_server(Path(DEFAULT_MODEL_DIR))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        card = client.models.list().data[0]
        assert card.generation_defaults == {
            "temperature": FILE["temperature"], "top_p": FILE["top_p"], "top_k": None, "min_p": None,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "max_tokens": FILE["max_new_tokens"], "from_model": ["temperature", "top_p", "top_k", "max_tokens"]}
        chat = client.chat.completions.create(model=card.id, messages=[{"role": "user", "content": "Hi"}])
        assert chat.usage.completion_tokens <= FILE["max_new_tokens"]
        client.completions.create(model=card.id, prompt="Once upon a time", max_tokens=None)
        client.responses.create(model=card.id, input="Hi")
        anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0).messages.create(
            model=card.id, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        client.chat.completions.create(model=card.id, messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0.3, top_p=0.5, max_tokens=4)  # the request's own win
    finally:
        applied = _applied(proc)
    model = {"temperature": "0.8", "top_p": "0.95", "top_k": "None", "max_tokens": "256"}
    paths = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]
    for (path, options), want in zip(applied, paths):
        assert path == want and {k: options[k] for k in ("temperature", "top_p", "top_k")} == {
            k: model[k] for k in ("temperature", "top_p", "top_k")}, (path, options)
    # Completions keep OpenAI's (and vLLM's) 16 when max_tokens is left out; Messages requires it
    assert [o["max_tokens"] for _, o in applied[:4]] == ["256", "16", "256", "8"]
    assert {k: applied[4][1][k] for k in ("temperature", "top_p", "max_tokens")} == {
        "temperature": "0.3", "top_p": "0.5", "max_tokens": "4"}


def test_generation_config_vllm_keeps_openais_defaults() -> None:
    proc, url = start_server(Path(DEFAULT_MODEL_DIR), "--generation-config", "vllm")
    try:
        defaults = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["generation_defaults"]
        assert (defaults["temperature"], defaults["top_p"], defaults["max_tokens"], defaults["from_model"]) == (
            1.0, 1.0, None, [])
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def page_and_server():
    proc, url = start_server(Path(DEFAULT_MODEL_DIR))
    b = Browser(browser_or_skip(), args=("--proxy-server=http://127.0.0.1:9",))
    b.call("Network.enable")
    b.server = url  # type: ignore[attr-defined]
    yield b, proc
    b.close()
    if proc.poll() is None:
        stop_server(proc)


def test_the_page_shows_the_defaults_and_a_blank_first_message_gets_them(page_and_server) -> None:
    page, proc = page_and_server
    page.open(page.server + "/")
    wait_for(page, "document.body.dataset.model === 'default_model'")
    shown = {name: page.eval(f"document.getElementById('opt-{name}').placeholder")
             for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "repetition_penalty")}
    assert shown == {"temperature": "0.8 (model)", "top_p": "0.95 (model)", "top_k": "off (model)",
                     "min_p": "off (default)", "max_tokens": "256 (model)", "repetition_penalty": "1 (default)"}
    assert all(page.eval(f"document.getElementById('opt-{n}').value") == "" for n in shown)
    type_and_send(page, "Tell me a story about a cat.")
    (body,) = chat_bodies(page)
    assert not {"temperature", "top_p", "top_k", "min_p", "max_tokens", "repetition_penalty"} & set(body)
    assert any(r["url"].endswith("/v1/chat/completions") for r in page_requests(page))
    (path, options), = [a for a in _applied(proc) if a[0] == "/v1/chat/completions"]
    assert (options["temperature"], options["top_p"], options["top_k"], options["max_tokens"]) == (
        "0.8", "0.95", "None", "256")
