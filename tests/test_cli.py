"""The command line, run as a user runs it: a subprocess, real model folders, stdin and stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nexttoken.llm import DEFAULT_MODEL_DIR


def nexttoken_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nexttoken.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def stories(shared_dir) -> str:
    return str(shared_dir / "models" / "stories260k")


def test_generate_streams_the_prompt_and_continuation(stories) -> None:
    r = nexttoken_cli("generate", "Once upon a time", "--model", stories, "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was a little girl named Lily.")


def test_generate_reads_the_prompt_from_stdin(stories) -> None:
    r = nexttoken_cli("generate", "--model", stories, "--max-new-tokens", "12", stdin="Once upon a time")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was a little girl")


def test_generate_json(stories) -> None:
    r = nexttoken_cli("generate", "Once upon a time", "--model", stories, "--json", "--max-new-tokens", "30",
                      "--stop", " Lily")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["text"] == ", there was a little girl named"
    assert result["finish_reason"] == "stop"
    assert result["prompt_token_ids"][0] == 1 and len(result["logprobs"]) == len(result["token_ids"])


def test_sampling_flags_are_seeded(stories) -> None:
    args = ("generate", "Tom", "--model", stories, "--json", "--do-sample", "--temperature", "1.1",
            "--top-k", "40", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "30")
    first, second = nexttoken_cli(*args), nexttoken_cli(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


def test_bad_option_value_is_a_clear_error(stories) -> None:
    r = nexttoken_cli("generate", "Tom", "--model", stories, "--do-sample", "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    r = nexttoken_cli("generate", "Tom", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_without_model_uses_the_packaged_default_or_says_model_is_needed() -> None:
    r = nexttoken_cli("generate", "Once upon a time", "--max-new-tokens", "8")
    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("Once upon a time") and len(r.stdout) > len("Once upon a time")
    else:
        assert r.returncode == 2 and "--model" in r.stderr


@pytest.fixture(scope="module")
def chat_model(shared_dir, tmp_path_factory) -> str:
    src = shared_dir / "models" / "stories260k"
    d = tmp_path_factory.mktemp("chat")
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            os.symlink(f, d / f.name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ bos_token if loop.first }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


def test_chat_repl_answers_each_line_and_exits_on_eof(chat_model) -> None:
    r = nexttoken_cli("chat", "--model", chat_model, "--max-new-tokens", "10", stdin="Hello\nTell me more\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.strip("\n").split("\n")
    assert len(replies) >= 2 and all(replies)
