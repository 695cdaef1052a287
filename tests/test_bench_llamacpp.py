"""llama.cpp as the matrix's peer: llama-bench's JSON (a real output, recorded from llama-bench 0c1e570 on a
q4_0 GGUF of the tiny shape) read into prefill and decode rates; a missing binary is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

from nexttoken.bench.llamacpp import find_llama_bench, parse
from nexttoken.cli import main

RECORDED = Path(__file__).parent / "data" / "llama_bench_q4_0.json"


def test_parse_reads_prompt_and_generation_tests() -> None:
    text = RECORDED.read_text()
    tests = json.loads(text)
    assert [(t["n_prompt"], t["n_gen"]) for t in tests] == [(16, 0), (0, 8)]
    assert parse(text) == {"prefill_tok_s": tests[0]["avg_ts"], "decode_tok_s": tests[1]["avg_ts"]}


def test_binary_from_option_or_environment(tmp_path, monkeypatch) -> None:
    binary = tmp_path / "llama-bench"
    binary.write_text("")
    monkeypatch.delenv("NEXTTOKEN_LLAMA_BENCH", raising=False)
    assert find_llama_bench(None) is None
    assert find_llama_bench(str(binary)) == binary
    assert find_llama_bench(str(tmp_path / "absent")) is None
    monkeypatch.setenv("NEXTTOKEN_LLAMA_BENCH", str(binary))
    assert find_llama_bench(None) == binary


def test_matrix_with_a_missing_llama_bench_is_a_typed_error(tmp_path, capsys) -> None:
    rc = main(["bench", "--matrix", "--shapes", "micro", "--llama-bench", str(tmp_path / "absent"), "--gguf-dir",
               str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    assert rc == 2  # the CLI's answer to a NextTokenError (BenchError), its message on stderr
    assert "needs both --llama-bench PATH" in capsys.readouterr().err
