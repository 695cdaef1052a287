"""`nexttoken serve`'s default threads do not fight the event loop (issue 39, item 9): torch gets the usable cores
minus one, and with several threads OpenMP's idle ones sleep (OMP_WAIT_POLICY=PASSIVE), set before libgomp reads
it (the command imports no torch before it decides; were torch loaded already, it starts again with it). Real
servers; the policy as the server says it applied it at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.server import start_server, stop_server


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _answers(url: str) -> bool:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_several_threads_make_openmp_wait_passively_in_the_same_process(model_dir) -> None:  # noqa: F811
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc, url = start_server(model_dir, threads=2, env=env)
    try:
        assert _answers(url)
    finally:
        stop_server(proc)
    assert "threads: 2 (OMP_WAIT_POLICY=PASSIVE)" in proc.stdout.read().decode()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a process's environment from /proc")
def test_a_wait_policy_the_user_set_is_kept(model_dir) -> None:  # noqa: F811
    proc, url = start_server(model_dir, threads=2, env={**os.environ, "OMP_WAIT_POLICY": "ACTIVE"})
    try:
        assert _environ(proc.pid).get("OMP_WAIT_POLICY") == "ACTIVE" and _answers(url)
    finally:
        stop_server(proc)
    assert "threads: 2 (OMP_WAIT_POLICY=ACTIVE)" in proc.stdout.read().decode()


def test_help_states_the_default_threads() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = subprocess.run([sys.executable, "-m", "nexttoken", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    text = " ".join(out.split())
    assert f"the usable cores minus one, {max(1, cores - 1)} here" in text and "OMP_WAIT_POLICY=PASSIVE" in text
