"""`nexttoken run-batch` (server/run_batch.py, server/batch/): a file of 200 OpenAI batch lines on stories260K gives,
for each of its 197 requests, the answer a real server on loopback gives for the same body (greedy), and a 400 for
each of its 3 bad lines; a run killed halfway and run again answers each line once, the earlier lines unchanged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from nexttoken.cli import main

ENGINE_FLAGS = ("--threads", "1", "--chunk-size", "16")  # as support/server.py starts the reference server
WORDS = ["cat", "dog", "tree", "ball", "sun", "boat", "cake", "bird", "frog", "moon", "star", "shoe"]
BAD = {3: "{\"custom_id\": \"broken\", \"method\": ", 77: "unknown url", 150: "invalid body"}  # line -> what


def _request(i: int, model: str) -> dict:
    """Line i's request: chat, completions, embeddings and responses in turn, short and greedy."""
    word = WORDS[i % len(WORDS)]
    kind = i % 4
    if kind == 0:
        body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about the {word} number {i}."}],
                "max_tokens": 5, "temperature": 0, **({"logprobs": True, "top_logprobs": 2} if i % 8 == 0 else {})}
        return {"url": "/v1/chat/completions", "body": body}
    if kind == 1:
        body = {"model": model, "prompt": f"Once upon a time a {word} saw {i}", "max_tokens": 5, "temperature": 0,
                **({"echo": True, "logprobs": 1} if i % 8 == 1 else {})}
        return {"url": "/v1/completions", "body": body}
    if kind == 2:
        return {"url": "/v1/embeddings", "body": {"model": model, "input": [f"a {word}", f"the {word} {i}"]}}
    return {"url": "/v1/responses", "body": {"model": model, "input": f"Where is the {word}? {i}",
                                             "max_output_tokens": 5, "temperature": 0}}


def _lines(model: str) -> list[str]:
    lines = []
    for i in range(1, 201):
        line = {"custom_id": f"req-{i}", "method": "POST", **_request(i, model)}
        if BAD.get(i) == "unknown url":
            line["url"] = "/v1/images/generations"
        elif BAD.get(i) == "invalid body":
            line["body"] = {"model": model, "messages": "not a list", "max_tokens": 5}
        lines.append(BAD[i] if i == 3 else json.dumps(line))
    return lines


def _run_batch(model_dir: Path, requests: Path, results: Path, *extra: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nexttoken", "run-batch", "-i", str(requests), "-o", str(results), "--model",
           str(model_dir), *ENGINE_FLAGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _run_here(model_dir: Path, requests: Path, results: Path, capsys) -> tuple[int, str]:
    """run-batch in this process (no interpreter to start): its exit code and stderr."""
    code = main(["run-batch", "-i", str(requests), "-o", str(results), "--model", str(model_dir), *ENGINE_FLAGS])
    return code, capsys.readouterr().err


def _finished(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return err


def _without_ids(value):
    """An answer without what differs between two runs of one request: ids and creation times."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "created", "created_at")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


@pytest.fixture(scope="module")
def batch(model_dir, tmp_path_factory):
    """The requests file, and the output of one whole run."""
    folder = tmp_path_factory.mktemp("batch")
    requests = folder / "requests.jsonl"
    requests.write_text("\n".join(_lines(model_dir.name)) + "\n")
    results = folder / "results.jsonl"
    err = _finished(_run_batch(model_dir, requests, results))
    return requests, results, err


def test_each_answer_is_the_servers_and_bad_lines_get_their_400(batch, server):
    requests, results, err = batch
    answers = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(answers) == 200
    by_id = {a["custom_id"]: a for a in answers}
    assert len(by_id) == 200  # 199 custom_ids and the line without one (None)
    assert "200/200" in err  # the progress bar, on stderr
    errors = [a for a in answers if a["response"]["status_code"] != 200]
    assert sorted(str(a["custom_id"]) for a in errors) == ["None", "req-150", "req-77"]  # and 197 answers
    assert by_id[None]["response"]["body"]["error"]["message"].startswith("line 3: not valid JSON")
    assert by_id["req-77"]["response"]["body"]["error"]["param"] == "url"
    with httpx.Client(base_url=server, timeout=120) as http:
        for number, text in enumerate(requests.read_text().splitlines(), 1):
            if number == 3:
                continue
            line = json.loads(text)
            answer = by_id[line["custom_id"]]
            assert answer["id"].startswith("batch_req_") and answer["error"] is None
            assert answer["response"]["request_id"]
            if line["url"] not in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
                assert answer["response"]["status_code"] == 400
                continue
            served = http.post(line["url"], json=line["body"])
            assert answer["response"]["status_code"] == served.status_code, line["custom_id"]
            got, want = answer["response"]["body"], served.json()
            if line["url"] == "/v1/embeddings" and served.status_code == 200:  # a prefill batched with others:
                # equal to rounding
                for g, w in zip(got["data"], want["data"], strict=True):
                    np.testing.assert_allclose(g["embedding"], w["embedding"], rtol=1e-4, atol=1e-5)
                    g["embedding"] = w["embedding"]
            assert _without_ids(got) == _without_ids(want), line["custom_id"]


def test_a_killed_run_resumes_without_redoing_lines(model_dir, batch, tmp_path, capsys, one_thread):
    requests, complete, _ = batch
    results = tmp_path / "results.jsonl"
    # one request at a time, so that the kill lands halfway through the file
    proc = _run_batch(model_dir, requests, results, "--concurrency", "1", start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if results.exists() and results.read_text().count("\n") >= 60:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = results.read_text()
    kept = before[: before.rfind("\n") + 1].splitlines()  # a line cut by the kill is written again
    assert 60 <= len(kept) < 200
    assert _run_here(model_dir, requests, results, capsys)[0] == 0
    after = results.read_text().splitlines()
    assert after[: len(kept)] == kept  # the earlier answers are untouched
    ids = [json.loads(line)["custom_id"] for line in after]
    assert sorted(map(str, ids)) == sorted(str(json.loads(line)["custom_id"]) for line in complete.read_text().splitlines())
    assert len(set(map(str, ids))) == 200  # each line answered once
    # a third run has nothing left to do
    assert _run_here(model_dir, requests, results, capsys) == (0, f"all 200 requests are answered in {results}\n")
    assert results.read_text().splitlines() == after


def test_a_duplicate_custom_id_is_refused_by_name(model_dir, tmp_path, capsys):
    line = {"custom_id": "twice", "method": "POST", "url": "/v1/completions",
            "body": {"model": model_dir.name, "prompt": "a", "max_tokens": 1}}
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(line) + "\n" + json.dumps({**line, "custom_id": "once"}) + "\n"
                        + json.dumps(line) + "\n")
    code, err = _run_here(model_dir, requests, tmp_path / "out.jsonl", capsys)
    assert code == 2
    assert "custom_id 'twice' is on line 1 and line 3" in err
    assert not (tmp_path / "out.jsonl").exists()  # refused before any work


# ---- the same machinery over HTTP: /v1/files and /v1/batches, driven by the `openai` SDK ------------------------

def _finish(client, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    batch = client.batches.retrieve(batch_id)
    while batch.status in ("validating", "in_progress", "finalizing", "cancelling") and time.monotonic() < deadline:
        time.sleep(0.1)
        batch = client.batches.retrieve(batch_id)
    return batch


def test_the_sdks_batch_gives_the_servers_answers(batch, server, client):
    requests, _, _ = batch
    chat = [line for line in requests.read_text().splitlines()[:40] if '"/v1/chat/completions"' in line]
    lines = chat + ["not json", chat[0].replace('"custom_id": "req-', '"custom_id": "other-').replace(
        "/v1/chat/completions", "/v1/completions")]
    upload = client.files.create(file=("requests.jsonl", "\n".join(lines).encode()), purpose="batch")
    assert (upload.purpose, upload.bytes) == ("batch", len("\n".join(lines).encode()))
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"run": "test"})
    done = _finish(client, created.id)
    assert done.status == "completed" and done.metadata == {"run": "test"}
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        len(lines), len(chat), 2)
    answers = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(str(e["custom_id"]) for e in errors) == ["None", "other-4"]
    assert {e["response"]["body"]["error"]["param"] for e in errors} == {None, "url"}
    bodies = {json.loads(line)["custom_id"]: json.loads(line)["body"] for line in chat}
    assert sorted(a["custom_id"] for a in answers) == sorted(bodies)
    with httpx.Client(base_url=server, timeout=120) as http:
        for a in answers:
            want = http.post("/v1/chat/completions", json=bodies[a["custom_id"]]).json()
            assert _without_ids(a["response"]["body"]) == _without_ids(want), a["custom_id"]
    assert created.id in [b.id for b in client.batches.list()]
    assert {upload.id, done.output_file_id, done.error_file_id} <= {f.id for f in client.files.list()}


def test_a_cancelled_batch_stops_and_the_server_goes_on(server, client, model_dir):
    body = {"model": model_dir.name, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body})
             for i in range(100)]  # within the test server's 20,000-byte bodies
    upload = client.files.create(file=("long.jsonl", "\n".join(lines).encode()), purpose="batch")
    created = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    cancelled = client.batches.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.request_counts.completed < 100
    assert client.completions.create(**{**body, "max_tokens": 2}).choices[0].finish_reason == "length"


def test_batch_mistakes_are_the_apis_errors(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError, match="no file 'file-nope'"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    line = json.dumps({"custom_id": "twice", "method": "POST", "url": "/v1/completions", "body": {}})
    upload = client.files.create(file=("dup.jsonl", f"{line}\n{line}\n".encode()), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="custom_id 'twice' is on line 1 and line 2"):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError, match="no batch"):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="limit must be an integer from 1 to 100, got '0'"):
        client.batches.list(limit=0)
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(upload.id)


def test_only_files_take_a_multipart_body(server):
    """A page may post multipart without a preflight: it can store a file, never start a batch (JSON only)."""
    multipart = {"Content-Type": "multipart/form-data; boundary=x"}
    refused = httpx.post(server + "/v1/batches", content="--x\r\n\r\n--x--", headers=multipart, timeout=30)
    assert refused.status_code == 415 and "application/json" in refused.json()["error"]["message"]
    broken = httpx.post(server + "/v1/files", content="--x\r\n\r\n--x--", headers=multipart, timeout=30)
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    no_file = httpx.post(server + "/v1/files", data={"purpose": "batch"}, files={"x": ("a", b"")}, timeout=30)
    assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"


def test_a_batch_on_a_server_with_a_key_runs_with_that_key(model_dir, one_thread):
    """The batch's own requests pass the server's key guard (the app in this process, through ASGI)."""
    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.loading import load
    from nexttoken.loadspec import LoadSpec
    from nexttoken.server import ServerSettings, build_app
    from nexttoken.server.batch.runner import started

    loaded = load(LoadSpec(model=model_dir)).main
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4, chunk_size=16),
                       loaded.generation_config)
    app = build_app(engine, ServerSettings(loaded.name, api_key="sesame", webui=False))
    line = json.dumps({"custom_id": "k", "method": "POST", "url": "/v1/completions",
                       "body": {"model": loaded.name, "prompt": "Once", "max_tokens": 2, "temperature": 0}})

    async def run() -> tuple[int, dict, list[dict]]:
        async with started(app), httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                                   headers={"authorization": "Bearer sesame"}) as http:
            keyless = (await http.post("/v1/files", files={"file": ("r.jsonl", b"x")}, data={"purpose": "batch"},
                                       headers={"authorization": ""})).status_code
            upload = (await http.post("/v1/files", files={"file": ("r.jsonl", line.encode())},
                                      data={"purpose": "batch"})).json()
            batch = (await http.post("/v1/batches", json={"input_file_id": upload["id"], "completion_window": "24h",
                                                          "endpoint": "/v1/completions"})).json()
            while batch["status"] == "in_progress":
                await asyncio.sleep(0.05)
                batch = (await http.get(f"/v1/batches/{batch['id']}")).json()
            content = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text
            return keyless, batch, [json.loads(x) for x in content.splitlines()]

    keyless, batch, answers = asyncio.run(run())
    assert keyless == 401
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 1
    assert answers[0]["custom_id"] == "k" and answers[0]["response"]["status_code"] == 200
