"""`nexttoken bench load | decode | gguf | lora | tp-memory`: each subcommand runs end to end on a tiny model with
tiny sizes, and its JSON report parses with the keys docs/performance.md relies on. llama.cpp is not built on this
machine: `bench gguf` says so in its report, and its peer plumbing runs on llama-bench's recorded output (the same
recording tests/bench/test_bench_model_matrix.py reads)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from nexttoken.cli import main
from support.tiny_models import save_variant

RECORDED_TG8 = Path(__file__).resolve().parents[1] / "data" / "llama_bench_tg8_depth16_q4_0.json"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama-gqa"
    save_variant("llama-gqa", folder)
    return folder


@pytest.fixture(scope="module")
def stories_server(shared_dir: Path):
    """`nexttoken serve` on stories260k (one thread), on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nexttoken.cli", "serve", "--model", str(shared_dir / "models" / "stories260k"),
           "--port", str(port), "--threads", "1", "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_bench_load_reports_each_concurrency(stories_server: str, tmp_path: Path) -> None:
    report = tmp_path / "load.json"
    rc = main(["bench", "load", "--url", stories_server, "--concurrency", "3", "--num-requests", "6",
               "--max-tokens", "5", "--compare", "--priority-every", "3", "--json", str(report)])
    assert rc == 0
    runs = json.loads(report.read_text())
    assert [r["concurrency"] for r in runs] == [1, 3]
    for r in runs:
        assert r["num_requests"] == 6 and r["failed"] == 0 and r["completion_tokens"] == 6 * 5
        assert set(r["ttft_ms"]) == set(r["itl_ms"]) == set(r["latency_s"]) == {"mean", "p50", "p90", "p99"}
        assert r["throughput_tok_s"] == pytest.approx(30 / r["wall_s"], rel=0.01)
        assert set(r["high_priority_latency_s"]) == {"mean", "p50", "p90", "p99"}  # requests 2 and 5
        assert r["server"]["kv_blocks_total"] > 0 and r["server"]["rss_peak_mib"] > 0


def test_loadtest_is_an_alias_of_bench_load(stories_server: str, tmp_path: Path) -> None:
    report = tmp_path / "alias.json"
    assert main(["loadtest", "--url", stories_server, "--concurrency", "2", "--num-requests", "2", "--max-tokens",
                 "3", "--json", str(report)]) == 0
    (run,) = json.loads(report.read_text())
    assert run["concurrency"] == 2 and run["completion_tokens"] == 6


def test_bench_load_without_a_server_is_a_typed_error(capsys) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "load", "--url", f"http://127.0.0.1:{port}"]) == 2
    assert "start one with `nexttoken serve`" in capsys.readouterr().err


def test_bench_decode_families(tmp_path: Path) -> None:
    out = tmp_path / "decode"
    rc = main(["bench", "decode", "--families", "qwen3-micro,gemma3-micro", "--rounds", "2", "--prompt-len", "4",
               "--new-tokens", "4", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["clock"] == "cpu" and report["threads"] == 1 and report["new_tokens"] == 4
    assert [r["family"] for r in report["rows"]] == ["qwen3-micro", "gemma3-micro"]
    for r in report["rows"]:
        assert r["fused_tok_s"] > 0 and r["modules_tok_s"] > 0
        assert r["fused_vs_modules"] == pytest.approx(r["fused_tok_s"] / r["modules_tok_s"])
        assert len(r["rounds"]["fused"]) == len(r["rounds"]["modules"]) == 2


def test_bench_decode_rejects_an_unknown_family(tmp_path: Path, capsys) -> None:
    assert main(["bench", "decode", "--families", "qwen9", "--out", str(tmp_path / "x")]) == 2
    assert "qwen9" in capsys.readouterr().err


def test_bench_gguf_without_llama_cpp_says_so(shared_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("NEXTTOKEN_LLAMA_BENCH", raising=False)
    gguf = shared_dir / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "gguf"
    assert main(["bench", "gguf", str(gguf), "--rounds", "1", "--new-tokens", "3", "--threads", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["llama_bench"] is None and "llama.cpp not run" in report["llama_cpp_note"]
    (row,) = report["files"]
    ours = row["nexttoken"]
    assert ours["decode_tok_s"] > 0 and ours["load_s"] > 0 and ours["peak_rss_mib"] > 50
    assert len(ours["rounds"]) == 1 and row["llama_cpp"] is None and row["nexttoken_dequantized"] is None
    assert "llama.cpp not run" in capsys.readouterr().err


def test_bench_gguf_reads_llama_bench_beside_ours(shared_dir: Path, tmp_path: Path) -> None:
    """The peer side from llama-bench's recorded `-o json` output (tg8, 11.86 tok/s), printed by a real child
    process whose own peak RSS the report carries."""
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat {RECORDED_TG8}\n")
    fake.chmod(0o755)
    gguf = shared_dir / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = tmp_path / "gguf"
    assert main(["bench", "gguf", str(gguf), "--llama-bench", str(fake), "--rounds", "2", "--new-tokens", "3",
                 "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["llama_bench"] == str(fake) and report["llama_cpp_note"] is None
    peer = report["files"][0]["llama_cpp"]
    assert peer["decode_tok_s"] == pytest.approx(11.86243) and len(peer["rounds"]) == 2
    assert 0 < peer["peak_rss_mib"] < 50  # `sh` and `cat`, not this process's peak
    assert len(report["files"][0]["nexttoken"]["rounds"]) == 2


def test_bench_gguf_rejects_a_missing_file(tmp_path: Path, capsys) -> None:
    assert main(["bench", "gguf", str(tmp_path / "none.gguf")]) == 2
    assert "no such .gguf file" in capsys.readouterr().err


def test_bench_lora(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora"
    assert main(["bench", "lora", str(tiny_dir), "--rank", "2", "--steps", "2", "--repeats", "1", "--threads", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["batch"] == 8 and report["rank"] == 2
    rows = {r["scenario"]: r for r in report["rows"]}
    assert list(rows) == ["base x8 (native step)", "4 adapters x2 rows", "base x8 (modules path)"]
    assert rows["base x8 (native step)"]["vs_native_base"] == 1.0
    assert rows["base x8 (modules path)"]["vs_modules_base"] == 1.0
    native = rows["base x8 (native step)"]["median_step_ms"]
    for r in rows.values():
        assert r["median_step_ms"] > 0 and r["vs_native_base"] == pytest.approx(r["median_step_ms"] / native)


@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_tp_memory(tiny_dir: Path, tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "tp"
    assert main(["bench", "tp-memory", str(tiny_dir), "--tensor-parallel-size", str(ranks), "--threads", "1",
                 "--new-tokens", "4", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["tensor_parallel_size"] == ranks and [r["rank"] for r in report["ranks"]] == list(range(ranks))
    assert all(r["peak_mib"] >= r["rss_mib"] > 0 for r in report["ranks"])
    assert report["parameter_mib_per_rank"] > 0 and report["greedy_tok_s"] > 0


def test_bench_keeps_its_flags_without_a_subcommand() -> None:
    from nexttoken.cli import build_parser

    args = build_parser().parse_args(["bench", "--shape", "micro", "--batch-sizes", "1,2"])
    assert args.run.__name__ == "cmd_bench" and args.bench_command is None and args.batch_sizes == [1, 2]
    args = build_parser().parse_args(["bench", "decode", "--families", "qwen3-micro"])
    assert args.bench_command == "decode" and args.run.__module__ == "nexttoken.bench.decode"
    assert build_parser().parse_args(["bench", "decode", "--families"]).families == "qwen3-0.6b,gemma3-270m"


def test_bench_decode_a_hybrid_shape_at_two_batch_sizes(tmp_path: Path) -> None:
    """LFM2's short convolutions with attention (the native recurrent step), batch 1 and 2: a row per batch size."""
    out = tmp_path / "decode"
    rc = main(["bench", "decode", "--families", "lfm2-micro", "--batch", "1,2", "--rounds", "1", "--prompt-len", "4",
               "--new-tokens", "4", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["batches"] == [1, 2] and [r["batch"] for r in report["rows"]] == [1, 2]
    assert all(r["fused_tok_s"] > 0 and r["modules_tok_s"] > 0 for r in report["rows"])
    assert main(["bench", "decode", "--families", "lfm2-micro", "--batch", "0", "--out", str(out)]) == 2
