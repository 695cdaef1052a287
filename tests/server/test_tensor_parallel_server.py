"""`nexttoken serve --tensor-parallel-size 2` for real (2 gloo ranks on loopback), driven by the openai client;
two "hosts" through `torchrun --nnodes 2`; a rank killed or frozen mid-generation ends the server.

The reference for every result is the Python API on the same folder in one process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from nexttoken.engine.distributed import free_port
from support.server import model_id, start_server, stop_server

openai = pytest.importorskip("openai")

PROMPTS = [f"{name} {verb} the {thing}" for name in ("Lily", "Tom", "The cat", "A bird")
           for verb in ("saw", "liked") for thing in ("ball", "tree")]


def _request(i: int) -> dict:
    sampled = i % 3 == 2
    return dict(prompt=PROMPTS[i], max_tokens=8 + (i * 7) % 25, temperature=0.9 if sampled else 0,
                seed=100 + i if sampled else None)


@pytest.fixture(scope="module")
def tp_server(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--tensor-parallel-size", "2")
    yield url
    stop_server(proc)


def test_openai_client_and_concurrency_equal_one_process(tp_server, llm) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=tp_server + "/v1", api_key="x", max_retries=0, timeout=120)
    model = model_id(client)
    expected = [llm.generate(**_options(i)).text for i in range(len(PROMPTS))]
    alone = [client.completions.create(model=model, **_request(i)).choices[0].text for i in range(len(PROMPTS))]
    assert alone == expected

    async def one(aclient, i: int) -> str:  # noqa: ANN001
        stream = await aclient.completions.create(model=model, stream=True, **_request(i))
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=tp_server + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(len(PROMPTS))))

    assert asyncio.run(run_all()) == expected
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
                                          temperature=0)
    assert chat.choices[0].message.content == llm.chat([{"role": "user", "content": "Hi"}], max_new_tokens=10,
                                                       do_sample=False).text


def _options(i: int) -> dict:
    r = _request(i)
    out = dict(prompt=r["prompt"], max_new_tokens=r["max_tokens"], do_sample=r["temperature"] > 0)
    if r["seed"] is not None:
        out |= dict(temperature=r["temperature"], seed=r["seed"])
    return out


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_a_lost_rank_ends_the_server_with_a_clear_error(model_dir, how) -> None:  # noqa: F811
    """SIGKILL: the peer's sockets close; SIGSTOP: it stays connected but silent until the 3 s timeout."""
    proc, url = start_server(model_dir, "--tensor-parallel-size", "2", "--tensor-parallel-timeout", "3")
    worker = _children(proc.pid)[0]
    try:
        model = model_id(openai.OpenAI(base_url=url + "/v1", api_key="x"))
        body = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "stream": True,
                "ignore_eos": True, "model": model}
        chunks = 0
        with pytest.raises(httpx.HTTPError), httpx.Client(timeout=60) as h:  # the connection ends mid-stream
            with h.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:  # it is decoding: take a rank away
                        os.kill(worker, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        assert 3 <= chunks < 480
        code = proc.wait(timeout=30)  # bounded: the timeout (3 s) plus the heartbeat's period at most
        if how == "freeze":
            os.kill(worker, signal.SIGKILL)  # a frozen worker would hold the server's output pipe open
        output = proc.stdout.read().decode()
        assert code == 3, output
        assert "nexttoken serve: stopping:" in output
        if how == "kill":
            assert f"rank 1 (pid {worker}) exited with code -9" in output
        else:
            assert "a rank died or hung (nothing for 3 s)" in output
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_worker_stops_when_rank_0_dies(model_dir) -> None:  # noqa: F811
    proc, _ = start_server(model_dir, "--tensor-parallel-size", "2")
    worker = _children(proc.pid)[0]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and _state(worker) != "Z" and time.monotonic() < deadline:
        time.sleep(0.1)
    output = proc.stdout.read().decode()  # the worker writes to the server's output, which it inherited
    assert "rank 1: rank 0 died or fell silent" in output, output


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_two_hosts_through_torchrun_give_the_same_tokens(model_dir, llm) -> None:  # noqa: F811
    port = free_port()
    prompt = "Once upon a time"

    def node(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "nexttoken", "generate", "--model", str(model_dir), "--tensor-parallel-size", "2",
               "--greedy", "--max-new-tokens", "30", prompt]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})

    nodes = [node(0), node(1)]
    try:
        outs = [n.communicate(timeout=120) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [o[1].decode()[-2000:] for o in outs]
    expected = prompt + llm.generate(prompt, max_new_tokens=30, do_sample=False).text + "\n"
    assert outs[0][0].decode() == expected
    assert outs[1][0].decode() == ""  # rank 1 only computes
