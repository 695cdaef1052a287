"""A real `nexttoken serve` subprocess on a free loopback port, for the tests that drive one (no tests here)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MAX_N = 4


def stories_with_chat_template(shared_dir: Path, folder: Path) -> Path:
    """stories260K in `folder` with CHAT_TEMPLATE as its chat template: the other files symlinked."""
    folder.mkdir(parents=True)
    src = shared_dir / "models" / "stories260k"
    for file in src.iterdir():
        if file.name != "tokenizer_config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, *extra: str, startup_s: float = 120, threads: int | None = 1,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`nexttoken serve` on a free port, answering /health; `threads` None: serve's own default, `env`: the
    process environment (default: this one's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nexttoken.cli", "serve", "--model", str(model_dir), "--port", str(port),
           *(["--threads", str(threads)] if threads is not None else []),
           "--chunk-size", "16", "--max-n", str(MAX_N), "--max-body-bytes", "20000", *extra]
    # The server's output goes to a file, never a pipe nobody drains (a request log would fill it and block the
    # server); proc.stdout reads that file, so a test can still read what the server printed.
    log = tempfile.NamedTemporaryFile(prefix="nexttoken-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or {**os.environ})
    log.close()
    proc.stdout = open(log.name, "rb")  # noqa: SIM115 - read by the tests, closed with the process
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read().decode()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {startup_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    if isinstance(getattr(proc.stdout, "name", None), str):  # start_server's log file (not a pipe)
        Path(proc.stdout.name).unlink(missing_ok=True)  # the open handle still reads it


def model_id(client) -> str:  # noqa: ANN001
    """The served model's name, as /v1/models lists it first."""
    return client.models.list().data[0].id
