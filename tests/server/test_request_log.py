"""The request log: `nexttoken serve` writes one line per request on stderr (method, path, status, model, prompt /
completion tokens, duration, request id) and an error's cause; `--request-log-level warning` keeps only the
errors. A real server (the SmolLM2 GGUF) as a subprocess, driven by the `openai` client; its output is read back.
(The line's API, time to first token and finish reason, and its JSON form: test_observability.py.)"""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from conftest import SMOLLM2_GGUF, requires_shared
from support.server import start_server, stop_server

pytestmark = requires_shared

LINE = re.compile(r"(?P<level>INFO|WARNING|ERROR) nexttoken\.server\.requests: (?P<method>\w+) (?P<path>\S+) "
                  r"(?P<status>\d+) model=(?P<model>\S+) prompt_tokens=(?P<prompt>\d+) "
                  r"completion_tokens=(?P<completion>\d+) duration_ms=(?P<ms>\d+) request_id=(?P<id>\S+) "
                  r"api=(?P<api>\S+) ttft_ms=(?P<ttft>\d+|-) finish_reason=(?P<finish>\S+)"
                  r"(?: sampling=(?P<sampling>\S+))?(?: error=(?P<error>.*))?$")


def _lines(proc) -> list[dict]:
    stop_server(proc)
    text = proc.stdout.read().decode()
    return [m.groupdict() for line in text.splitlines() if (m := LINE.search(line))]


def test_a_line_per_request_and_each_error_with_its_cause() -> None:
    proc, url = start_server(SMOLLM2_GGUF)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        good = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0)
        streamed = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                                  temperature=0, stream=True, stream_options={"include_usage": True}))
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], temperature=-1)
        r = httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": []},
                       headers={"x-request-id": "client-chosen-id"}, timeout=30)
        assert r.status_code == 400
    finally:
        lines = _lines(proc)
    chat, stream, bad, empty = [x for x in lines if x["path"] != "/v1/models"]
    assert (chat["level"], chat["method"], chat["status"], chat["model"]) == ("INFO", "POST", "200", model)
    assert int(chat["prompt"]) == good.usage.prompt_tokens and int(chat["completion"]) == good.usage.completion_tokens
    assert chat["id"] and chat["error"] is None and "max_tokens=5" in chat["sampling"]
    assert (chat["api"], chat["finish"]) == ("openai.chat", good.choices[0].finish_reason)
    assert 0 <= int(chat["ttft"]) <= int(chat["ms"])
    assert (stream["path"], stream["status"]) == ("/v1/completions", "200")
    assert (int(stream["prompt"]), int(stream["completion"])) == (streamed[-1].usage.prompt_tokens,
                                                                  streamed[-1].usage.completion_tokens)
    assert (bad["level"], bad["status"], bad["model"], bad["completion"]) == ("WARNING", "400", "-", "0")
    assert "temperature" in bad["error"]
    assert (bad["api"], bad["ttft"], bad["finish"]) == ("openai.chat", "-", "-")
    assert empty["id"] == "client-chosen-id" and "messages" in empty["error"]
    assert not [x for x in lines if x["path"] == "/health"]  # polled: debug level only


def test_warning_level_logs_only_errors() -> None:
    proc, url = start_server(SMOLLM2_GGUF, "--request-log-level", "warning")
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": -1}, timeout=60).status_code == 400
    finally:
        lines = _lines(proc)
    assert [(x["level"], x["status"]) for x in lines] == [("WARNING", "400")] and "max_tokens" in lines[0]["error"]
