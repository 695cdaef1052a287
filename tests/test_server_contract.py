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

from test_server import _model, client, model_dir, server, start_server, stop_server  # noqa: F401 - fixtures


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def _body(**extra) -> dict:  # noqa: ANN003
    return {"prompt": "Once upon a time", "max_tokens": 4, **extra}


# ---- 1. bounded and fair -------------------------------------------------------------------------------------------

def test_one_request_may_not_create_unbounded_sequences(server) -> None:  # noqa: F811
    r = httpx.post(server + "/v1/completions", json={"prompt": [[1, 366]] * 2000, "n": 4, "max_tokens": 8})
    error = _error(r, 400, "prompt")
    assert "8000 sequences" in error["message"] and "--max-seqs-per-request" in error["message"]


def test_a_small_request_is_not_starved_by_a_big_batch(model_dir) -> None:  # noqa: F811
    """Two slots. A batch request of 16 sequences x 120 tokens holds both; a small request sent during it takes
    the next free slot (its turn comes before the batch's remaining sequences): it waits for at most one running
    sequence, ~120 engine steps, where first-come-first-served admission would make it wait for the 14 queued
    ones (~840 steps). Counted in engine steps, not seconds; the margin covers the steps that run while the
    request travels through HTTP."""
    proc, url = start_server(model_dir, "--max-num-seqs", "2", "--max-seqs-per-request", "64")
    try:
        def metric(name: str) -> float:
            text = httpx.get(url + "/metrics").text
            return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

        small = {"prompt": "The dog", "max_tokens": 8, "temperature": 0}
        start = metric("nexttoken_engine_steps_total")
        assert httpx.post(url + "/v1/completions", json=small, timeout=120).status_code == 200
        alone = metric("nexttoken_engine_steps_total") - start
        big = {"prompt": [[1, 366, 471]] * 16, "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=300) as h:
            done = threading.Event()
            threading.Thread(target=lambda: (h.post(url + "/v1/completions", json=big), done.set()),
                             daemon=True).start()
            while metric("nexttoken_num_requests_waiting") < 10:  # the batch holds both slots, 14 wait
                time.sleep(0.005)
            sent = metric("nexttoken_engine_steps_total")
            r = httpx.post(url + "/v1/completions", json=small, timeout=300)
            waited = metric("nexttoken_engine_steps_total") - sent
            assert r.status_code == 200 and not done.is_set()  # served while the batch still runs
            assert done.wait(120)  # and the batch completes too
        assert waited <= alone + 120 + 150, (waited, alone)
    finally:
        stop_server(proc)


# ---- 2. and 3. bad input is a 400, an engine failure a 500, never an error inside a 200 ----------------------------

def test_a_non_ascii_digit_logit_bias_key_is_a_400_and_the_connection_lives(server) -> None:  # noqa: F811
    with httpx.Client(timeout=60) as h:
        error = _error(h.post(server + "/v1/completions", json=_body(logit_bias={"²": 5})), 400, "logit_bias")
        assert "'²'" in error["message"]
        assert h.post(server + "/v1/completions", json=_body(temperature=0)).status_code == 200  # same connection


def test_tiny_temperatures_are_greedy_and_bad_penalties_are_400s(server) -> None:  # noqa: F811
    greedy = httpx.post(server + "/v1/completions", json=_body(max_tokens=12, temperature=0)).json()
    for t in (1e-300, 1e-45, 5e-324, 1e-6):
        r = httpx.post(server + "/v1/completions", json=_body(max_tokens=12, temperature=t, seed=1))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        _error(httpx.post(server + "/v1/completions", json=_body(**{name: 1e-300})), 400, name)


def test_a_failure_inside_the_engine_is_a_500_for_that_request_alone(server) -> None:  # noqa: F811
    """bad_words_ids past the vocabulary passes the option check (ids >= 0) and fails in the processor, at run
    time: that request gets OpenAI's 500 body without internal text; others are served."""
    bad = _body(bad_words_ids=[[999999]])
    error = _error(httpx.post(server + "/v1/completions", json=bad), 500)
    assert error["type"] == "internal_server_error" and "Error" not in error["message"]
    stream = httpx.post(server + "/v1/completions", json={**bad, "stream": True}).text
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert events and events[-1]["error"]["type"] == "internal_server_error" and stream.rstrip().endswith("[DONE]")
    assert httpx.post(server + "/v1/completions", json=_body(temperature=0)).status_code == 200


# ---- 5. slow clients and shutdown ----------------------------------------------------------------------------------

def _half_sent(url: str) -> socket.socket:
    host = urlparse(url)
    s = socket.create_connection((host.hostname, host.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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
    proc, url = start_server(model_dir, "--shutdown-timeout", "2", "--body-timeout", "600")
    sockets = [_half_sent(url) for _ in range(3)]
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) is not None  # bounded: 2 s of grace, then the open requests are cut
    finally:
        for s in sockets:
            s.close()
        if proc.poll() is None:
            proc.kill()


# ---- 6. OpenAI's shape everywhere -----------------------------------------------------------------------------------

def test_404_405_model_by_id_and_head_health(server, client) -> None:  # noqa: F811
    _error(httpx.get(server + "/v1/nothing-here"), 404)
    _error(httpx.get(server + "/v1/completions"), 405)
    name = _model(client)
    assert httpx.get(server + f"/v1/models/{name}").json()["id"] == name
    assert client.models.retrieve(name).id == name
    _error(httpx.get(server + "/v1/models/nope"), 404, "model")
    assert httpx.head(server + "/health").status_code == 200


# ---- 7. known OpenAI fields are honoured, unknown ones refused ----------------------------------------------------

def test_openai_fields_langchain_and_litellm_send_are_accepted(server, client) -> None:  # noqa: F811
    messages = [{"role": "user", "content": "Tell me a story"}]
    r = client.chat.completions.create(
        model=_model(client), messages=messages, max_tokens=5, temperature=0, response_format={"type": "text"},
        tool_choice="none", parallel_tool_calls=False, store=False, metadata={"run": "1"}, service_tier="auto",
        reasoning_effort="low", user="u1", seed=1, n=1, tools=[],
    )
    plain = client.chat.completions.create(model=_model(client), messages=messages, max_tokens=5, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content  # no effect on a local model
    c = client.completions.create(model=_model(client), prompt="The dog", max_tokens=3, best_of=1, temperature=0)
    assert c.choices[0].finish_reason == "length"
    for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, None),
                         ({"tool_choice": "required"}, None), ({"audio": {"voice": "x"}}, None),
                         ({"temprature": 0.5}, "temprature")]:
        r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3, **extra})
        error = _error(r, 400, param)
        assert next(iter(extra)) in error["message"] or "json_schema" in error["message"]
    _error(httpx.post(server + "/v1/completions", json=_body(suffix="end")), 400)
    _error(httpx.post(server + "/v1/completions", json=_body(best_of=3)), 400)


# ---- 8. the API key --------------------------------------------------------------------------------------------------

def test_bearer_is_case_insensitive_and_a_public_host_without_key_warns(model_dir) -> None:  # noqa: F811
    proc, url = start_server(model_dir, "--api-key", "sekret")
    try:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.post(url + "/v1/completions", json=_body(), headers={"Authorization": f"{scheme} sekret"})
            assert r.status_code == 200, scheme
        _error(httpx.post(url + "/v1/completions", json=_body(), headers={"Authorization": "Bearer nope"}), 401)
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
        error = _error(result["r"], 400, "messages")
        assert "longer than 2 s" in error["message"]
    finally:
        stop_server(proc)


# ---- real clients with their default requests ----------------------------------------------------------------------

def test_langchain_chat_openai_invoke_stream_batch(server, client) -> None:  # noqa: F811
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server + "/v1", api_key="unused", model=_model(client), temperature=0, max_tokens=12,
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
    """~330 requests at concurrency 32: plain, streamed, chat, ~10% bad, some clients leaving mid-stream. Every
    good request completes, every bad one is a 4xx in OpenAI's body, no 5xx, a greedy probe answers the same
    throughout, and the server's memory after the run is within a few MB of where it was after a warm-up."""
    import asyncio
    import random

    proc, url = start_server(model_dir, "--max-num-seqs", "16")
    probe = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    bad = [
        (b'{"prompt": "x",', None), (json.dumps(_body(temprature=1)).encode(), "temprature"),
        (json.dumps(_body(temperature=-1)).encode(), "temperature"),
        (json.dumps(_body(logit_bias={"\u00b2": 1})).encode(), "logit_bias"),
        (json.dumps(_body(prompt=[1] * 600)).encode(), "prompt"),
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
            body, param = bad[i % len(bad)]
            r = await h.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
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

    try:
        expected = httpx.post(url + "/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
        asyncio.run(run(60, expected))  # warm-up: every kind of request once at least, allocator pools filled
        start = _rss_kib(proc.pid)
        asyncio.run(run(270, expected))
        assert tally["bad"] >= 20 and tally["left"] >= 15 and tally["good"] >= 200 and tally["probe"] >= 12, tally
        metrics = httpx.get(url + "/metrics").text
        assert 'finish_reason="error"' not in metrics
        grown = _rss_kib(proc.pid) - start
        print(f"soak: {tally}, RSS {start} -> {start + grown} KiB")
        assert grown < 8 * 1024, f"RSS grew by {grown} KiB over the soak"
    finally:
        stop_server(proc)


# ---- 4. log-probs as OpenAI returns them ---------------------------------------------------------------------------

def test_logprob_tokens_are_output_text_and_offsets_index_the_returned_text(server, client) -> None:  # noqa: F811
    r = httpx.post(server + "/v1/completions", json={"prompt": "Once upon a", "max_tokens": 6, "temperature": 0,
                                                      "echo": True, "logprobs": 1}).json()["choices"][0]
    text, lp = r["text"], r["logprobs"]
    assert lp["tokens"][:4] == ["<s>", " Once", " upon", " a"]  # BOS listed (first, logprob null), adds no text
    assert lp["token_logprobs"][0] is None and lp["text_offset"][:4] == [0, 0, 4, 9]
    assert text.startswith("Once upon a")
    for token, at in list(zip(lp["tokens"], lp["text_offset"]))[2:]:
        assert text[at : at + len(token)] == token  # every offset points at its token in the returned text
    # The decoder drops the text's first space: the first text token, " Once", starts the text as "Once".
    assert text[: len(" Once") - 1] == "Once"


def test_logprob_bytes_of_split_characters(shared_dir, tmp_path) -> None:
    """Byte-level pieces of 🦙 and 𝄞: each token's `bytes` are its own (not valid UTF-8 alone), they join to the
    content's bytes, and the completions offsets point at where the character they belong to starts."""
    from chain_model import build_chain_model, chain_ids

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


def test_tokenized_loglikelihood_requests_equal_transformers(server, client, shared_dir) -> None:  # noqa: F811
    """lm-evaluation-harness's local-completions with tokenized_requests=True: token-id prompts, echo=True,
    logprobs=1, max_tokens=1; the log-likelihood of a continuation is the sum of its tokens' log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    import nexttoken

    hf = AutoModelForCausalLM.from_pretrained(shared_dir / "models" / "stories260k").eval()
    tok = nexttoken.load(shared_dir / "models" / "stories260k").tokenizer
    pairs = [("Once upon a time, there was a", " little girl"), ("The dog ran to the", " park and played")]
    prompts = [tok.encode(c) + tok.encode(x, add_special_tokens=False) for c, x in pairs]
    r = httpx.post(server + "/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                                      "temperature": 0}).json()
    for (context, cont), ids, choice in zip(pairs, prompts, r["choices"]):
        n = len(tok.encode(cont, add_special_tokens=False))
        got = choice["logprobs"]["token_logprobs"][len(ids) - n : len(ids)]
        with torch.no_grad():
            logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        want = [logp[i - 1, ids[i]].item() for i in range(len(ids) - n, len(ids))]
        assert got == pytest.approx(want, abs=1e-4)
        assert sum(got) == pytest.approx(sum(want), abs=1e-3)
