"""The server under abuse, as an attacker tries it (issue 28): every case through a real `nexttoken serve` on
loopback, bounded in count and time. Slow headers and idle connections cannot hold it, running out of file
descriptors is logged once, a full queue answers 429 with Retry-After, a web page cannot reach it (JSON only, the
Host checked, CORS by --allowed-origins), the API key is checked before the body is read, and values that used to
end in a 500 are 400s or finite."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.server import free_port, start_server, stop_server

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--max-num-seqs", "2", "--max-waiting-seqs", "16", "--header-timeout", "1",
                             "--max-connections", "40", "--allowed-hosts", "myhost.example",
                             "--allowed-origins", ORIGIN)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def keyed(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--api-key", "sesame")
    yield url
    stop_server(proc)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


# ---- connections -------------------------------------------------------------------------------------------------

def test_slow_headers_and_idle_connections_cannot_hold_the_server(server) -> None:
    """60 connections (over --max-connections 40) that send half a request line, or nothing: /health still
    answers at once (the longest-waiting slow one makes room), and every slow one is closed after the header
    timeout (1 s). Before, they were held forever and ~20,000 of them exhausted the descriptors."""
    slow = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)
        if i % 2:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.")  # never finished
        slow.append(s)
    try:
        assert httpx.get(server + "/health", timeout=5).status_code == 200
        time.sleep(1.5)
        assert all(_closed_by_server(s, 3) for s in slow)
        assert httpx.get(server + "/health", timeout=5).status_code == 200
    finally:
        for s in slow:
            s.close()


def test_a_keep_alive_connection_gets_the_header_timeout_again(server) -> None:
    """After a response, the next request's headers on the same connection have the same time limit."""
    s = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(1024).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request, stalled
        assert _closed_by_server(s, 4)
    finally:
        s.close()


def test_running_out_of_descriptors_is_logged_once_and_the_server_recovers(model_dir, tmp_path) -> None:  # noqa: F811
    """An open-files limit of 128 and 200 idle connections: accept() fails for want of descriptors. The log names
    it once (with a count), not a traceback per attempt (129 MB in 40 s before); once the connections go, the
    server answers again."""
    port, log = free_port(), tmp_path / "server.log"
    cmd = [sys.executable, "-m", "nexttoken.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--threads", "1", "--max-connections", "1000", "--header-timeout", "30"]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    held = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        for _ in range(200):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        time.sleep(3)  # asyncio retries the accept every second
        for s in held:
            s.close()
        held = []
        deadline = time.monotonic() + 30
        status = None
        while time.monotonic() < deadline and status != 200:
            try:
                status = httpx.get(url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.5)
        assert status == 200
    finally:
        for s in held:
            s.close()
        stop_server(proc)
    text = log.read_text(errors="replace")
    assert "the open-files limit (128) is below --max-connections" in text
    assert text.count("accepting connections failed") == 1, text[-3000:]
    assert text.count("Traceback") == 0, text[-3000:]


# ---- the queue ---------------------------------------------------------------------------------------------------

def _waiting(server: str) -> float:
    """The server's own count of waiting sequences (its Prometheus gauge)."""
    text = httpx.get(server + "/metrics", timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("nexttoken_num_requests_waiting")))


def test_a_full_waiting_queue_answers_429_with_retry_after(server) -> None:
    """--max-num-seqs 2, --max-waiting-seqs 16: a request of 4 prompts x n=4 = 16 sequences fills the queue; while
    its sequences wait (the server's own gauge says so), nine more such requests sent at once are all refused with
    429 and Retry-After (before, 50 such requests queued 12,768 sequences and kept their memory). Once it has
    drained, a request is admitted again. (The first runs 300 tokens a sequence, two sequences at a time, so its
    queue stays full for seconds whatever the machine's load: the nine never race its draining.)"""
    body = {"prompt": [[1, 366]] * 4, "n": 4, "max_tokens": 12, "ignore_eos": True, "temperature": 0}

    def send(b: dict) -> httpx.Response:
        return httpx.post(server + "/v1/completions", json=b, timeout=120)

    with ThreadPoolExecutor(10) as pool:
        first = pool.submit(send, dict(body, max_tokens=300))
        deadline = time.monotonic() + 60
        while _waiting(server) < 8:  # its sequences are queued
            assert time.monotonic() < deadline and not first.done(), "the first request's sequences never queued"
            time.sleep(0.01)
        answers = list(pool.map(send, [body] * 9))
        assert first.result().status_code == 200
    assert [r.status_code for r in answers] == [429] * 9
    error = _error(answers[0], 429)
    assert error["type"] == "rate_limit_error" and "--max-waiting-seqs" in error["message"]
    assert int(answers[0].headers["retry-after"]) >= 1
    assert send(body).status_code == 200


# ---- a web page -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers,content", [
    ({"Content-Type": "text/plain"}, json.dumps({"prompt": "Hi", "max_tokens": 2})),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "prompt=Hi&max_tokens=2"),
    ({"Content-Type": "multipart/form-data; boundary=x"}, "--x\r\n\r\n--x--"),
    ({}, json.dumps({"prompt": "Hi", "max_tokens": 2})),
])
def test_bodies_a_web_page_can_send_unasked_are_refused(server, headers, content) -> None:
    """text/plain, form and multipart posts need no CORS preflight: any page could start generations with them."""
    r = httpx.post(server + "/v1/completions", content=content, headers=headers, timeout=30)
    error = _error(r, 415)
    assert "application/json" in error["message"]


def test_json_with_a_charset_is_json(server) -> None:
    r = httpx.post(server + "/v1/completions", content=json.dumps({"prompt": "Hi", "max_tokens": 2}),
                   headers={"Content-Type": "application/json; charset=utf-8"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host,status", [
    ("evil.example", 421), ("evil.example:80", 421), ("localhost", 200), ("127.0.0.1", 200), ("[::1]:8000", 200),
    ("myhost.example", 200), ("MyHost.Example:8000", 200),
])
def test_the_host_header_must_name_this_server(server, host, status) -> None:
    """DNS rebinding: a page at evil.example re-points its name at 127.0.0.1 and its requests carry its name."""
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"Host": host},
                   timeout=30)
    assert r.status_code == status, r.text
    if status == 421:
        assert "--allowed-hosts" in _error(r, 421)["message"]


def test_cors_answers_only_the_allowed_origins(server) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    evil = httpx.options(server + "/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in evil.headers
    ok = httpx.options(server + "/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_origin_is_allowed_by_default(keyed) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = httpx.options(keyed + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers


# ---- the key -------------------------------------------------------------------------------------------------------

def test_the_api_key_is_checked_before_the_body_is_read(keyed) -> None:
    """A request without the key that announces a body and never sends it is refused at once (401), instead of
    holding the connection for the body timeout (30 s) first."""
    s = socket.create_connection(("127.0.0.1", _port(keyed)), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 401")
    finally:
        s.close()


def test_openapi_is_behind_the_key(keyed) -> None:
    assert httpx.get(keyed + "/openapi.json").status_code == 401
    r = httpx.get(keyed + "/openapi.json", headers={"Authorization": "Bearer sesame"})
    assert r.status_code == 200 and "/v1/completions" in r.json()["paths"]
    assert httpx.get(keyed + "/health").status_code == 200  # probes stay open


def test_ollamas_routes_are_behind_the_key(keyed) -> None:
    """/api/ needs the key too (in Ollama's error body), and the `ollama` client passes it as it does for
    OLLAMA_API_KEY: Authorization: Bearer."""
    ollama = pytest.importorskip("ollama")
    r = httpx.post(keyed + "/api/chat", json={"model": "m", "messages": []})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=keyed).list()
    assert e.value.status_code == 401
    assert ollama.Client(host=keyed, headers={"Authorization": "Bearer sesame"}).list().models


# ---- values -------------------------------------------------------------------------------------------------------

def test_integral_floats_are_integers(server) -> None:
    """JSON Schema's integer: 4.0 is 4 (many clients write every number as a float); 4.5 stays an error."""
    r = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4.0, "n": 1.0, "seed": 7.0,
                                                      "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert _error(httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4.5}), 400)["param"] \
        == "max_tokens"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hi", "max_tokens": 4, "grammar": "root ::= foo"}, "grammar"),
    ({"prompt": "Hi", "max_tokens": 4, "guided_grammar": "root ::= foo"}, "guided_grammar"),
])
def test_a_grammar_the_converter_rejects_is_a_400(server, body, param) -> None:
    error = _error(httpx.post(server + "/v1/completions", json=body, timeout=30), 400)
    assert error["param"] == param and "foo" in error["message"]


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 1, "seed": 3}, {"ignore_eos": True},
                                   {"ignore_eos": True, "temperature": 0}])
@pytest.mark.parametrize("decay", [[1, 1e308], [0, 1e30], [0, 2.0]])
def test_exponential_decay_never_makes_scores_infinite(server, extra, decay) -> None:
    """[1, 1e308] made the EOS score inf and the distribution nan (a 500); it saturates now: EOS as likely as a
    score can make it."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "exponential_decay_length_penalty": decay, **extra}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(model_dir) -> None:  # noqa: F811
    """Three 1 MB prompts (the context holds 512 tokens of at most a few bytes): each is a 400 naming its size
    without being tokenized, and /health answers meanwhile."""
    proc, url = start_server(model_dir, "--max-body-bytes", str(2 << 20))
    try:
        prompt = "word " * 200_000

        def send(_: int) -> httpx.Response:
            return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)

        with ThreadPoolExecutor(4) as pool:
            big = [pool.submit(send, i) for i in range(3)]
            health = pool.submit(lambda: httpx.get(url + "/health", timeout=30))
            answers = [f.result() for f in big]
            assert health.result().status_code == 200
        for r in answers:
            error = _error(r, 400)
            assert error["param"] == "prompt" and "1000000 bytes" in error["message"], error
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]},
                       timeout=60)
        assert _error(r, 400)["param"] == "messages"
    finally:
        stop_server(proc)


# ---- special tokens in content ---------------------------------------------------------------------------------------

def test_special_tokens_in_content_are_special_by_default_and_text_when_asked(model_dir, server) -> None:  # noqa: F811
    """A user message with "</s>" (EOS) in it: by default it is the special token, as transformers encodes a rendered
    chat (the documented default); with --no-special-tokens-in-content it is plain text (transformers'
    split_special_tokens), while the template's own BOS stays the special token, and the ids read back as the
    message's text."""
    messages = [{"role": "user", "content": "Hi </s> there"}]
    by_default = httpx.post(server + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert by_default[0] == 1 and 2 in by_default  # BOS from the template, EOS from the content
    proc, url = start_server(model_dir, "--no-special-tokens-in-content")
    try:
        ids = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
        assert ids[0] == 1 and 2 not in ids
        assert "Hi </s> there" in httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        plain = [{"role": "user", "content": "Hi there"}]  # without special text: the same ids either way
        assert httpx.post(url + "/tokenize", json={"messages": plain}).json()["tokens"] == \
            httpx.post(server + "/tokenize", json={"messages": plain}).json()["tokens"]
    finally:
        stop_server(proc)


@pytest.mark.parametrize("name", ["llama-2-chat", "llama-3.2-instruct", "phi-3-mini-instruct", "qwen2.5-instruct"])
def test_content_as_text_changes_nothing_else(shared_dir, name) -> None:
    """--no-special-tokens-in-content on real chat templates: a conversation without special text gets exactly the
    usual ids; one with a special token's text in a message gets it as plain text (tokenizers' own
    encode_special_tokens on that stretch), the template's special tokens kept."""
    from nexttoken.server.openai.prompts import chat_prompt
    from nexttoken.server.openai.protocol import TokenizeRequest
    from nexttoken.text.tokenizer import Tokenizer

    tk = Tokenizer.from_dir(shared_dir / "tokenizers" / name)
    plain = TokenizeRequest(messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi there,  how are you?\n ok"}])
    assert chat_prompt(plain, tk, special_in_content=False) == chat_prompt(plain, tk)
    special = sorted(t.content for t in tk.backend.get_added_tokens_decoder().values() if t.special)[-1]
    req = TokenizeRequest(messages=[{"role": "user", "content": f"say {special} now"}])
    usual, as_text = chat_prompt(req, tk), chat_prompt(req, tk, special_in_content=False)
    special_id = tk.backend.token_to_id(special)
    assert as_text.count(special_id) == usual.count(special_id) - 1
    assert f"say {special} now" in tk.decode(as_text)


def test_a_cache_larger_than_memory_is_refused_before_allocating(model_dir) -> None:  # noqa: F811
    """A KV pool far past the machine's memory: a message naming the bytes and the flags that lower them, and exit
    code 2, instead of a raw allocation traceback (or the machine swapping). (`--max-num-seqs` no longer reserves
    memory: the paged pool is sized by --kv-cache-memory, tests/engine/test_kv_pool.py.)"""
    cmd = [sys.executable, "-m", "nexttoken.cli", "serve", "--model", str(model_dir), "--port", str(free_port()),
           "--max-num-seqs", "1000000", "--kv-cache-memory", "1000TiB"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "the KV pool needs" in done.stderr and "GiB" in done.stderr and "--kv-cache-memory" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
