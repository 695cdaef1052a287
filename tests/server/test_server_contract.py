"""The server keeps OpenAI's contract under abuse: bounded and fair, no 500 from bad input, no error inside a 200,
OpenAI's shape for every answer, known fields honoured, clean shutdown. Each test sends the exact repro against
the real server on loopback."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import pytest

from support.server import model_id, start_server, stop_server
from support.http_errors import expect_error




def _body(**extra) -> dict:  # noqa: ANN003
    return {"prompt": "Once upon a time", "max_tokens": 4, **extra}


# ---- 1. bounded and fair -------------------------------------------------------------------------------------------

def test_one_request_may_not_create_unbounded_sequences(server) -> None:  # noqa: F811
    """The issue's 20 KB request: 2000 prompts x n=8 would be 16,000 sequences."""
    r = httpx.post(server + "/v1/completions", json={"prompt": [[1, 366]] * 2000, "n": 8})
    error = expect_error(r, 400, "prompt")
    assert "16000 sequences" in error["message"] and "--max-seqs-per-request" in error["message"]


def test_a_small_request_waits_for_one_slot_not_for_a_big_batch(shared_dir) -> None:
    """In the engine, counted in steps (its unit of latency): 8 slots, a batch request of 256 sequences x 16 tokens
    (the issue's shape at the default bound), and an 8-token request sent while the batch runs. The small one gets
    the next free slot, so it finishes within a small multiple of its steps alone; first come, first served would
    make it wait for the batch's 248 queued sequences (~500 steps)."""
    import torch

    import nexttoken
    from nexttoken.engine import EngineConfig, LLMEngine, expand
    from nexttoken.generation.config import GenerationConfig

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = nexttoken.load(shared_dir / "models" / "stories260k")
        engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=8, chunk_size=16))
        small = GenerationConfig(max_new_tokens=8, ignore_eos=True, top_k=None)
        prompt = llm.tokenizer.encode("The dog")

        def steps_until_done(seq) -> int:  # noqa: ANN001
            steps = 0
            while not seq.is_finished:
                engine.step()
                steps += 1
            return steps

        alone = steps_until_done(engine.add_request(prompt, small))
        batch = GenerationConfig(max_new_tokens=16, ignore_eos=True, top_k=None, num_return_sequences=8)
        for i, (ids, cfg) in enumerate(expand([[1, 366]] * 32, batch)):
            engine.add_request(ids, cfg, f"big-{i}", group="big")
        for _ in range(21):  # the batch is running, its slots staggered
            engine.step()
        loaded = steps_until_done(engine.add_request(prompt, small, group="small"))
        print(f"small request: {alone} steps alone, {loaded} during the batch")
        assert engine.scheduler.num_waiting > 200  # the batch was still queued when the small one finished
        assert loaded <= 4 * alone, (loaded, alone)
    finally:
        torch.set_num_threads(before)


def test_a_small_request_is_served_during_a_big_batch(model_dir) -> None:  # noqa: F811
    """Over HTTP: two slots, a streamed batch of 12 sequences x 300 tokens, and a small request sent once the
    batch streams. The small one takes the next free slot: when it is answered at most a few of the batch's
    sequences have finished (first come, first served: at least the 10 queued before it)."""
    proc, url = start_server(model_dir, "--max-num-seqs", "2", "--max-seqs-per-request", "64")
    try:
        small = {"prompt": "The dog", "max_tokens": 8, "temperature": 0}
        began = time.monotonic()
        assert httpx.post(url + "/v1/completions", json=small, timeout=60).status_code == 200
        alone = time.monotonic() - began
        big = {"prompt": [[1, 366, 471]] * 12, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
               "stream": True}
        finished: list[int] = []
        streaming = threading.Event()

        def run_big() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=big, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
                        finished.extend(c["index"] for c in json.loads(line[6:])["choices"] if c["finish_reason"])

        batch = threading.Thread(target=run_big, daemon=True)
        batch.start()
        assert streaming.wait(60)
        began = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=small, timeout=120)
        during, done_before = time.monotonic() - began, len(finished)
        batch.join(120)
        assert r.status_code == 200 and sorted(finished) == list(range(12))
        print(f"small request: {alone * 1e3:.0f} ms alone, {during * 1e3:.0f} ms during the batch; "
              f"{done_before} of its 12 sequences had finished")
        assert done_before <= 5, done_before
    finally:
        stop_server(proc)


# ---- 2. and 3. bad input is a 400, an engine failure a 500, never an error inside a 200 ----------------------------

def test_a_non_ascii_digit_logit_bias_key_is_a_400_and_the_connection_lives(server) -> None:  # noqa: F811
    with httpx.Client(timeout=60) as h:
        error = expect_error(h.post(server + "/v1/completions", json=_body(logit_bias={"²": 5})), 400, "logit_bias")
        assert "'²'" in error["message"]
        assert h.post(server + "/v1/completions", json=_body(temperature=0)).status_code == 200  # same connection


def test_tiny_temperatures_are_greedy_and_bad_penalties_are_400s(server) -> None:  # noqa: F811
    greedy = httpx.post(server + "/v1/completions", json=_body(max_tokens=12, temperature=0)).json()
    for t in (1e-300, 1e-45, 5e-324, 1e-6):
        r = httpx.post(server + "/v1/completions", json=_body(max_tokens=12, temperature=t, seed=1))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        expect_error(httpx.post(server + "/v1/completions", json=_body(**{name: 1e-300})), 400, name)


def test_options_that_would_fail_inside_the_engine_are_400s(server) -> None:  # noqa: F811
    """Token ids past the vocabulary (stories260k has 512) and biases or scales that overflow float32 scores are
    refused by name before they reach the engine (they used to be 500s from inside a processor)."""
    for name, value in [("bad_words_ids", [[999999]]), ("bad_words_ids", [[1, 515]]), ("suppress_tokens", [513]),
                        ("begin_suppress_tokens", [513]), ("sequence_bias", [[[513], 1.0]]),
                        ("forced_eos_token_id", 513), ("dry_sequence_breakers", [600]), ("stop_token_ids", [512]),
                        ("logit_bias", {"512": 1})]:
        error = expect_error(httpx.post(server + "/v1/completions", json=_body(**{name: value})), 400, name)
        assert "outside the vocabulary" in error["message"], error
    for name, value in [("sequence_bias", [[[5], 1e308]]), ("sequence_bias", [[[5], -1e308]]),
                        ("guidance_scale", 1e300), ("watermarking_config", {"bias": 1e308})]:
        expect_error(httpx.post(server + "/v1/completions", json=_body(**{name: value})), 400, name)


def test_a_failure_inside_the_engine_is_a_500_for_that_request_alone(server) -> None:  # noqa: F811
    """Suppressing every token but one, which no_repeat_ngram_size=1 bans once written, leaves nothing to sample
    from at run time (suppressing every token outright is a 400 before it runs: test_client_mistakes.py). It gets
    OpenAI's 500 body without internal text (a stream: an error event, then [DONE]); the same connection and every
    other request go on."""
    bad = _body(suppress_tokens=[i for i in range(512) if i != 5], no_repeat_ngram_size=1, temperature=1)
    with httpx.Client(timeout=60) as h:
        error = expect_error(h.post(server + "/v1/completions", json=bad), 500)
        assert error["type"] == "internal_server_error" and "Error" not in error["message"]
        assert "probability" not in error["message"]
        stream = h.post(server + "/v1/completions", json={**bad, "stream": True}).text
        events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
        assert events and events[-1]["error"]["type"] == "internal_server_error" and stream.rstrip().endswith("[DONE]")
        assert h.post(server + "/v1/completions", json=_body(temperature=0)).status_code == 200


def test_an_unexpected_error_is_a_500_without_its_text_and_the_connection_lives(model_dir, monkeypatch) -> None:  # noqa: F811
    """An exception no handler expected (injected into /detokenize, in process on loopback): OpenAI's 500 body
    without the exception's text, and the keep-alive connection serves the next request."""
    import http.client

    import uvicorn

    import nexttoken.server.api.models as server_app
    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.pretrained import load_pretrained
    from nexttoken.server import ServerSettings, build_app
    from support.server import free_port

    loaded = load_pretrained(model_dir)
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=2), loaded.generation_config)
    app = build_app(engine, ServerSettings("m"))

    def boom(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        raise RuntimeError("secret: /etc/shadow at 0xdeadbeef")

    monkeypatch.setattr(server_app, "check_ids", boom)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        h = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        h.request("POST", "/detokenize", body=json.dumps({"tokens": [1, 2]}),
                  headers={"Content-Type": "application/json"})
        r = h.getresponse()
        body = r.read().decode()
        assert r.status == 500 and json.loads(body)["error"]["type"] == "internal_server_error", body
        assert "secret" not in body and "RuntimeError" not in body
        h.request("GET", "/health")  # the same connection
        assert h.getresponse().status == 200
        h.close()
    finally:
        server.should_exit = True
        thread.join(30)


# ---- 5. slow clients and shutdown ----------------------------------------------------------------------------------

def _half_sent(url: str) -> socket.socket:
    host = urlparse(url)
    s = socket.create_connection((host.hostname, host.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    return s


def test_a_body_that_never_arrives_gets_408(model_dir) -> None:  # noqa: F811
    proc, url = start_server(model_dir, "--body-timeout", "1")
    try:
        s = _half_sent(url)
        s.settimeout(30)
        answer = b""
        while b'"code"' not in answer:  # the status line and the body may come in separate packets
            chunk = s.recv(4096)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b'"code": "timeout"' in answer, answer
        s.close()
    finally:
        stop_server(proc)


def test_sigterm_with_half_sent_bodies_exits_within_the_shutdown_timeout(model_dir) -> None:  # noqa: F811
    """The issue's repro (SIGTERM with three half-sent bodies) plus generations in flight, one slot: the short
    request finishes, what is still running or queued at the deadline gets OpenAI's 503 body (a stream: an error
    event, then [DONE]), the half-sent bodies get 503 too, and the process exits at the deadline."""
    timeout = 2.0
    proc, url = start_server(model_dir, "--shutdown-timeout", str(timeout), "--body-timeout", "600",
                             "--max-num-seqs", "1")
    sockets = [_half_sent(url) for _ in range(3)]
    answers: dict[str, httpx.Response | str] = {}
    long = {"prompt": ["Once"] * 32, "max_tokens": 480, "ignore_eos": True}  # ~15k tokens: far past the deadline

    def send(name: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                r.read()
                answers[name] = r
        except httpx.HTTPError as e:
            answers[name] = repr(e)

    threads = [threading.Thread(target=send, args=args) for args in [
        ("short", {"prompt": "Once", "max_tokens": 4}), ("long", long), ("streamed", {**long, "stream": True})]]
    try:
        for t in threads:
            t.start()
            time.sleep(0.05)  # in this order: the short request runs first
        time.sleep(0.3)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        exited = time.monotonic() - signalled
        for t in threads:
            t.join(30)
        half_sent = [_read_answer(s) for s in sockets]
    finally:
        for s in sockets:
            s.close()
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read().decode()
    print(f"exited {exited:.2f} s after SIGTERM (--shutdown-timeout {timeout:g})")
    assert exited < timeout + 2, exited  # not the 45 s of half-sent bodies, nor uvicorn's backstop after it
    assert answers["short"].status_code == 200, answers  # finished within the timeout
    error = expect_error(answers["long"], 503)
    assert error["code"] == "server_shutting_down", error
    lines = [line for line in answers["streamed"].text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
    for answer in half_sent:
        assert answer.startswith(b"HTTP/1.1 503") and b'"server_shutting_down"' in answer, answer
    assert "Traceback" not in log, log


def _read_answer(s: socket.socket) -> bytes:
    s.settimeout(10)
    answer = b""
    while b'"code"' not in answer:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer


# ---- 6. OpenAI's shape everywhere -----------------------------------------------------------------------------------

def test_404_405_model_by_id_and_head_health(server, client) -> None:  # noqa: F811
    expect_error(httpx.get(server + "/v1/nothing-here"), 404)
    expect_error(httpx.get(server + "/v1/completions"), 405)
    name = model_id(client)
    assert httpx.get(server + f"/v1/models/{name}").json()["id"] == name
    assert client.models.retrieve(name).id == name
    expect_error(httpx.get(server + "/v1/models/nope"), 404, "model")
    assert httpx.head(server + "/health").status_code == 200


# ---- 7. known OpenAI fields are honoured, unknown ones refused ----------------------------------------------------

def test_openai_fields_langchain_and_litellm_send_are_accepted(server, client) -> None:  # noqa: F811
    messages = [{"role": "user", "content": "Tell me a story"}]
    plain = client.chat.completions.create(model=model_id(client), messages=messages, max_tokens=5, temperature=0)
    expected = plain.choices[0].message.content
    r = client.chat.completions.create(
        model=model_id(client), messages=messages, max_tokens=5, temperature=0, response_format={"type": "text"},
        tool_choice="none", parallel_tool_calls=False, store=False, metadata={"run": "1"}, service_tier="auto",
        reasoning_effort="low", user="u1", seed=1, n=1, tools=[], verbosity="low", prompt_cache_key="k",
        safety_identifier="s", prediction={"type": "content", "content": "x"}, modalities=["text"],
    )
    assert r.choices[0].message.content == expected  # no effect on a local model
    # The list one field at a time, over raw HTTP (no client fills anything in).
    for field, value in [("response_format", {"type": "text"}), ("tool_choice", "none"),
                         ("parallel_tool_calls", True), ("store", True), ("metadata", {"a": "b"}),
                         ("service_tier", "default"), ("reasoning_effort", "medium")]:
        r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 5,
                                                               "temperature": 0, field: value})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected, (field, r.text)
    # null is "not given" (OpenAI's optional fields are nullable); parts and past turns as OpenAI sends them.
    nulls = {"n": None, "stream": None, "temperature": 0, "top_p": None, "stop": None, "logprobs": None,
             "max_completion_tokens": None, "max_tokens": 5, "stream_options": None, "tools": None}
    history = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "tool_calls": []},
               {"role": "user", "content": "Tell me a story"}]
    # A past call whose arguments are not JSON (one cut by max_tokens, sent back as it came) passes as text.
    cut = [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f",
                                                                                          "arguments": "{x"}}]},
           {"role": "tool", "tool_call_id": "1", "content": "cut off"}, *messages]
    for body in [{"messages": messages, **nulls}, {"messages": history, "max_tokens": 5},
                 {"messages": cut, "max_tokens": 3}]:
        assert httpx.post(server + "/v1/chat/completions", json=body).status_code == 200, body
    stream = httpx.post(server + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert stream.status_code == 200 and stream.text.rstrip().endswith("[DONE]")
    c = client.completions.create(model=model_id(client), prompt="The dog", max_tokens=3, best_of=1, temperature=0)
    assert c.choices[0].finish_reason == "length"
    # Refused by value, with the value and the reason; a field OpenAI does not have is refused as unknown.
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    call = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for extra, param, said in [
        ({"response_format": {"type": "json_schema"}}, None, "json_schema"),  # offered, with its schema
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"), ({"audio": {"voice": "x"}}, None, "audio"),
        ({"functions": [{"name": "f"}]}, None, "send tools"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "'extreme'"),
        ({"messages": [{"role": "user", "content": image}]}, "messages.0.content.0", "'image_url'"),
        ({"temprature": 0.5}, "temprature", "temprature"),
    ]:
        r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3, **extra})
        error = expect_error(r, 400, param)
        assert said in error["message"], error
    # This model's template renders no tools and no --tool-call-parser is set: with the default flags a request's
    # tools reach the model in Hermes' tools preamble, said in a header (tests/chat/test_tools.py: a template that
    # renders tools in no known format is refused, naming --tool-call-parser).
    r = httpx.post(server + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 200 and r.headers["x-nexttoken-tools-preamble"] == "hermes", r.text
    assert r.json()["usage"]["prompt_tokens"] > httpx.post(server + "/v1/chat/completions", json={
        "messages": messages, "max_tokens": 3}).json()["usage"]["prompt_tokens"] + 50  # the preamble is in
    expect_error(httpx.post(server + "/v1/completions", json=_body(suffix="end")), 400)
    expect_error(httpx.post(server + "/v1/completions", json=_body(best_of=3)), 400)


# ---- 8. the API key --------------------------------------------------------------------------------------------------

def test_bearer_is_case_insensitive_and_a_public_host_without_key_warns(model_dir) -> None:  # noqa: F811
    proc, url = start_server(model_dir, "--api-key", "sekret")
    try:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.post(url + "/v1/completions", json=_body(), headers={"Authorization": f"{scheme} sekret"})
            assert r.status_code == 200, scheme
        expect_error(httpx.post(url + "/v1/completions", json=_body(), headers={"Authorization": "Bearer nope"}), 401)
    finally:
        stop_server(proc)
    proc, url = start_server(model_dir, "--host", "0.0.0.0")  # reached over loopback only
    try:
        assert httpx.get(url + "/health").status_code == 200
    finally:
        stop_server(proc)
    said = proc.stdout.read().decode()
    assert "WARNING: listening on 0.0.0.0 without --api-key" in said


# ---- 8. untrusted template work off the event loop, bounded -------------------------------------------------------

LOOPING_TEMPLATE = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}{{ bos_token }}"


def test_a_runaway_chat_template_is_stopped_and_health_keeps_answering(model_dir, tmp_path) -> None:  # noqa: F811
    """A template looping 10^8 times: the request is refused (400, the template was stopped) within the render
    budget, and /health answers meanwhile: rendering runs off the event loop."""
    folder = tmp_path / "looping"
    folder.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    config["chat_template"] = LOOPING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    proc, url = start_server(folder)
    try:
        result: dict = {}
        chat = threading.Thread(target=lambda: result.update(r=httpx.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)))
        chat.start()
        answered = 0
        while chat.is_alive():
            answered += httpx.get(url + "/health", timeout=60).status_code == 200
        assert answered >= 3  # health answered while the template ran
        error = expect_error(result["r"], 400, "messages")
        assert "longer than 2 s" in error["message"]
    finally:
        stop_server(proc)


# ---- real clients with their default requests ----------------------------------------------------------------------

def test_langchain_chat_openai_invoke_stream_batch(server, client) -> None:  # noqa: F811
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server + "/v1", api_key="unused", model=model_id(client), temperature=0, max_tokens=12,
                      max_retries=0)
    said = chat.invoke("Tell me a story")
    assert said.content and said.response_metadata["finish_reason"] in ("stop", "length")
    streamed = "".join(chunk.content for chunk in chat.stream("Tell me a story"))
    assert streamed == said.content
    batch = chat.batch(["Tell me a story", "A cat"])
    assert batch[0].content == said.content and batch[1].content


# ---- a bounded soak ---------------------------------------------------------------------------------------------------

def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_soak_mixed_traffic_keeps_the_contract(model_dir) -> None:  # noqa: F811
    """~330 requests at concurrency 32: plain, streamed, chat, ~10% bad (issue 28's abuse cases among them: grammars
    past the grammar engine's limits, a web page's body and Host), some clients leaving mid-stream. Every
    good request completes, every bad one is a 4xx in OpenAI's body, no 5xx, a greedy probe answers the same
    throughout, and the server's memory after the run is within a few MB of where it was after a warm-up."""
    import asyncio
    import random

    # A KV pool the warm-up cycles through whole: the pool's pages are committed as blocks are first written, so a
    # larger pool would grow RSS during the soak by design (docs/serving.md), which is not what this test measures.
    proc, url = start_server(model_dir, "--max-num-seqs", "16", "--num-kv-blocks", "96")
    probe = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    bad = [
        (b'{"prompt": "x",', None), (json.dumps(_body(temprature=1)).encode(), "temprature"),
        (json.dumps(_body(temperature=-1)).encode(), "temperature"),
        (json.dumps(_body(logit_bias={"\u00b2": 1})).encode(), "logit_bias"),
        (json.dumps(_body(prompt=[1] * 600)).encode(), "prompt"),
        (json.dumps(_body(bad_words_ids=[[999999]])).encode(), "bad_words_ids"),
        (json.dumps(_body(n=None, stream=None, temperature=1e-300, repetition_penalty=1e-300)).encode(),
         "repetition_penalty"),
        # the abuse cases of issue 28: grammars past the grammar engine's limits (they stopped the engine for
        # good), a GBNF grammar the converter rejects, a fractional integer, a web page's body and Host
        (json.dumps(_body(temperature=0, guided_choice=[f"x{i}" for i in range(2001)])).encode(), "guided_choice"),
        (json.dumps(_body(n=2, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
            "$ref": "#/$defs/n"}}})).encode(), "response_format"),
        (json.dumps(_body(grammar="root ::= foo")).encode(), "grammar"),
        (json.dumps(_body(max_tokens=4.5)).encode(), "max_tokens"),
        (json.dumps(_body()).encode(), None, {"Content-Type": "text/plain"}),
        (json.dumps(_body()).encode(), None, {"Content-Type": "application/json", "Host": "evil.example"}),
    ]
    rng = random.Random(0)
    tally = {"good": 0, "bad": 0, "left": 0, "probe": 0}

    async def one(h: httpx.AsyncClient, i: int, expected_probe: str | None) -> None:
        kind = rng.random()
        if i % 25 == 0:
            r = await h.post(url + "/v1/completions", json=probe)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_probe
            tally["probe"] += 1
        elif kind < 0.10:
            body, param, *headers = bad[i % len(bad)]
            r = await h.post(url + "/v1/completions", content=body,
                             headers=headers[0] if headers else {"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and (param is None or error["param"] == param)
            tally["bad"] += 1
        elif kind < 0.18:  # a client that leaves after its first chunk
            async with h.stream("POST", url + "/v1/completions", json={**probe, "max_tokens": 200, "stream": True,
                                                                        "ignore_eos": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            tally["left"] += 1
        elif kind < 0.40:
            body = {"prompt": f"Tom had {i} apples", "max_tokens": 12, "stream": True, "seed": i}
            async with h.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and all("error" not in line for line in lines)
            tally["good"] += 1
        elif kind < 0.55:
            r = await h.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 10})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            tally["good"] += 1
        else:
            r = await h.post(url + "/v1/completions", json={"prompt": f"Lily saw {i} birds", "max_tokens": 10,
                                                             "n": 1 + i % 3, "seed": i})
            assert r.status_code == 200 and len(r.json()["choices"]) == 1 + i % 3
            tally["good"] += 1

    async def run(count: int, expected_probe: str | None) -> None:
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as h:
            async def bounded(i: int) -> None:
                async with gate:
                    await one(h, i, expected_probe)
            await asyncio.gather(*(bounded(i) for i in range(count)))

    async def warm_bad() -> None:
        """Every bad request, 8 at once, 4 rounds: the grammar engine's tokenizer is built once, and each of the
        threads that compile grammars off the event loop grows its allocator arena once."""
        async with httpx.AsyncClient(timeout=120) as h:
            for _ in range(4):
                await asyncio.gather(*(h.post(url + "/v1/completions", content=body, headers=headers[0] if headers
                                              else {"Content-Type": "application/json"})
                                       for body, _, *headers in bad for _ in range(2)))

    try:
        expected = httpx.post(url + "/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
        asyncio.run(run(60, expected))  # warm-up: every kind of request once at least, allocator pools filled
        asyncio.run(warm_bad())
        start = _rss_kib(proc.pid)
        host = urlparse(url)
        slow = [socket.create_connection((host.hostname, host.port)) for _ in range(20)]  # half-sent headers
        for s in slow:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        asyncio.run(run(135, expected))
        middle = _rss_kib(proc.pid)
        asyncio.run(run(135, expected))
        for s in slow:
            s.close()
        assert tally["bad"] >= 20 and tally["left"] >= 15 and tally["good"] >= 200 and tally["probe"] >= 12, tally
        metrics = httpx.get(url + "/metrics").text
        assert 'finish_reason="error"' not in metrics
        end = _rss_kib(proc.pid)
        print(f"soak: {tally}, RSS {start} -> {middle} -> {end} KiB")
        # A leak grows with the requests: the second half of the soak must not grow RSS as much as a leak would. (The
        # first half may still fill allocator arenas of threads the warm-up did not reach: the thread pool that
        # tokenizes and renders off the event loop hands work to whichever thread is free.)
        assert end - middle < 16 * 1024, f"RSS grew by {end - middle} KiB over the soak's second half"
        assert end - start < 32 * 1024, f"RSS grew by {end - start} KiB over the soak"
    finally:
        stop_server(proc)


# ---- 4. log-probs as OpenAI returns them ---------------------------------------------------------------------------

def test_logprob_tokens_are_output_text_and_offsets_index_the_returned_text(server, client) -> None:  # noqa: F811
    """The issue's repro: "Once upon a" echoed had text_offset [0, 3, 8, 13] (counting "<s>" and raw pieces)."""
    r = httpx.post(server + "/v1/completions", json={"prompt": "Once upon a", "max_tokens": 6, "temperature": 0,
                                                      "echo": True, "logprobs": 1}).json()["choices"][0]
    text, lp = r["text"], r["logprobs"]
    # BOS is listed first (by name, log-prob null, adding no text); the text's first token reads as it appears
    # there: the decoder drops its leading space, so "▁Once" is "Once", and " upon" keeps its space.
    assert lp["tokens"][:4] == ["<s>", "Once", " upon", " a"] and lp["text_offset"][:4] == [0, 0, 4, 9]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "Once" in lp["top_logprobs"][1]  # alternatives are read in the same context
    assert "".join(lp["tokens"][1:]) == text
    for token, at in list(zip(lp["tokens"], lp["text_offset"]))[1:]:
        assert text[at : at + len(token)] == token  # every offset points at its token in the returned text
    plain = httpx.post(server + "/v1/completions", json={"prompt": "Once upon a", "max_tokens": 6, "temperature": 0,
                                                          "logprobs": 0}).json()["choices"][0]
    assert "".join(plain["logprobs"]["tokens"]) == plain["text"] and plain["text"].startswith(" time")
    assert plain["logprobs"]["text_offset"][:2] == [0, len(" time")]
    chat = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 6, "temperature": 0, "logprobs": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == chat["message"]["content"]
    assert all(bytes(t["bytes"]) == t["token"].encode() for t in content)


@pytest.mark.parametrize("name", ["llama-2-chat", "llama-3.2-instruct", "qwen2.5-instruct", "phi-3-mini-instruct"])
def test_echoed_token_texts_and_offsets_on_real_tokenizers(shared_dir, name) -> None:
    """Every conformance text, echoed (BOS included where the tokenizer adds one): a whole-character token's text
    is exactly what the returned text holds at its offset; the byte tokens of one character (byte fallback or
    byte-level pieces) point at that character, and their bytes are the character's; offsets never go back."""
    from nexttoken.server.openai.outputs import echo_token_texts
    from nexttoken.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(shared_dir / "tokenizers" / name)
    cases = json.loads((shared_dir / "tokenizers" / "conformance_cases.json").read_text())[name]["cases"]
    for case in [c for c in cases if c["text"]]:
        ids = tok.encode(case["text"])
        shown = tok.decode(ids, skip_special_tokens=True)  # the echoed text
        texts, last, pieces = echo_token_texts(tok, ids, True), 0, b""
        for token_id in ids:
            text, at = texts.text(token_id), texts.advance(token_id)
            assert last <= at <= len(shown), (case, token_id, at)
            last = at
            if token_id in tok.skipped_special_ids:
                continue
            raw = tok.token_bytes(token_id)
            if text.encode() == raw or len(text) < len(raw.decode("utf-8", "replace")):  # whole characters
                assert shown[at : at + len(text)] == text, (case, token_id, text, at)
            else:  # a piece of a character: written \xNN, its bytes inside the character at its offset
                assert text == raw.decode("utf-8", "backslashreplace") and raw in shown[at:at + 2].encode(), case
                pieces += raw
        assert texts.advance(ids[-1]) >= last


def test_logprob_bytes_of_split_characters(shared_dir, tmp_path) -> None:
    """Byte-level pieces of 🦙 and 𝄞: each token's `bytes` are its own (not valid UTF-8 alone), they join to the
    content's bytes, and the completions offsets point at where the character they belong to starts."""
    from support.chain_model import build_chain_model, chain_ids

    tokenizers = shared_dir / "tokenizers" / "llama-3.2-instruct"
    chain = chain_ids(tokenizers, " 🦙 Grüße 𝄞 日本")
    folder = build_chain_model(tmp_path / "chain", tokenizers, chain, 128009)
    proc, url = start_server(folder)
    try:
        chat = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(chain), "temperature": 0,
            "logprobs": True}).json()["choices"][0]
        content = chat["logprobs"]["content"]
        assert b"".join(bytes(t["bytes"]) for t in content) == chat["message"]["content"].encode()
        assert content[1]["bytes"] == [0xA6] and content[1]["token"] == "\\xa6"  # a middle byte of 🦙
        comp = httpx.post(url + "/v1/completions", json={"prompt": " 日本", "max_tokens": len(chain),
                                                         "temperature": 0, "logprobs": 0}).json()["choices"][0]
        text, offsets = comp["text"], comp["logprobs"]["text_offset"]
        assert text == " 🦙 Grüße 𝄞 日本" and offsets[:4] == [0, 1, 1, 2]  # " " + 🦙's bytes, then " Grü"
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def hf_stories(shared_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(shared_dir / "models" / "stories260k").eval()


def _hf_logprobs(hf, ids: list[int]) -> tuple[list[float], list[bool]]:  # noqa: ANN001
    """transformers' log-prob of each token after the first given the ones before it, and whether it is the argmax."""
    import torch

    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))], [
        logp[i - 1].argmax().item() == ids[i] for i in range(1, len(ids))]


def test_tokenized_loglikelihood_requests_equal_transformers(server, client, shared_dir, hf_stories) -> None:  # noqa: F811
    """lm-evaluation-harness's local-completions request shape by hand (token-id prompts, echo=True, logprobs=1,
    max_tokens=1), BOS included: every prompt token's log-prob equals transformers'."""
    import nexttoken

    tok = nexttoken.load(shared_dir / "models" / "stories260k").tokenizer
    pairs = [("Once upon a time, there was a", " little girl"), ("The dog ran to the", " park and played")]
    prompts = [tok.encode(c) + tok.encode(x, add_special_tokens=False) for c, x in pairs]
    r = httpx.post(server + "/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                                      "temperature": 0}).json()
    for ids, choice in zip(prompts, r["choices"]):
        got = choice["logprobs"]["token_logprobs"][1 : len(ids)]
        want, _ = _hf_logprobs(hf_stories, ids)
        assert got == pytest.approx(want, abs=1e-4)


def test_lm_eval_local_completions_loglikelihoods_equal_transformers(server, client, model_dir, hf_stories) -> None:  # noqa: F811
    """The real lm-evaluation-harness client: `local-completions` with tokenized_requests=True sends each
    (context, continuation) as token ids and sums the continuation's echoed log-probs; its log-likelihoods and
    is-greedy flags equal transformers' on the ids it sent."""
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    from lm_eval.api.instance import Instance

    sent: list[list[int]] = []

    class Recording(lm_eval.LocalCompletionsAPI):
        def _create_payload(self, messages, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            sent.extend(messages)
            return super()._create_payload(messages, *args, **kwargs)

    lm = Recording(base_url=server + "/v1/completions", model=model_id(client), tokenizer_backend="huggingface",
                   tokenizer=str(model_dir), tokenized_requests=True, max_retries=1, max_length=512)
    pairs = [("Once upon a time, there was a", " little girl"), ("The dog ran to the", " park and played"),
             ("Lily", " saw a big tree")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                               disable_tqdm=True)
    assert len(sent) == len(pairs)
    for (context, continuation), (loglikelihood, greedy) in zip(pairs, results):
        ids = lm.tok_encode(context + continuation)  # what lm-eval sends: the pair encoded whole
        assert ids in sent
        n = len(ids) - len(lm.tok_encode(context))
        want, argmax = _hf_logprobs(hf_stories, ids)
        assert loglikelihood == pytest.approx(sum(want[-n:]), abs=1e-3)
        assert greedy == all(argmax[-n:])
