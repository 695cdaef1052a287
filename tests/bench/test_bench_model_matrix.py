"""`nexttoken bench --matrix --model ...`: real model files beside llama.cpp. The llama.cpp side is read from
recorded outputs (llama-bench 0c1e570 on the SmolLM2 Q4_0 GGUF: tg8 at depth 16) and its peak RSS from a real
child's rusage; nexttoken's side runs end to end on tiny models (a float32 and a bf16 folder), the peer skipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from nexttoken.bench.llamacpp import parse_tests, run_child
from nexttoken.bench.model_matrix import ModelSpec, model_matrix_table, parse_spec, ratios
from nexttoken.cli import main
from support.tiny_models import save_variant

RECORDED_DEPTH = Path(__file__).resolve().parents[1] / "data" / "llama_bench_tg8_depth16_q4_0.json"


def test_parse_tests_reads_depth_and_model_type() -> None:
    (test,) = parse_tests(RECORDED_DEPTH.read_text())
    assert (test["n_prompt"], test["n_gen"], test["n_depth"]) == (0, 8, 16)
    assert test["avg_ts"] == json.loads(RECORDED_DEPTH.read_text())[0]["avg_ts"] and "Q4_0" in test["model_type"]


def test_run_child_reports_that_childs_peak_rss() -> None:
    held = torch.ones(100 << 18)  # 100 MiB resident here: a child spawned directly would inherit this peak
    small = run_child([sys.executable, "-I", "-S", "-c", "print('hi')"])
    big = run_child([sys.executable, "-c", "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096])"])
    assert small.stdout.strip() == "hi" and held.sum() > 0
    assert big.peak_rss_mib >= 300 and small.peak_rss_mib < 50  # its own peak, not this process's nor the last's
    with pytest.raises(RuntimeError, match="exit 3"):
        run_child([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_parse_spec(tmp_path: Path) -> None:
    folder, gguf = tmp_path / "model", tmp_path / "m.gguf"
    folder.mkdir()
    gguf.write_bytes(b"GGUF")
    assert parse_spec(str(folder), Path) == ModelSpec(str(folder), folder, None)
    assert parse_spec(f"{folder}::{gguf}", Path) == ModelSpec(str(folder), folder, gguf)
    assert parse_spec(str(gguf), Path).peer == gguf  # a GGUF model is compared with itself
    with pytest.raises(ValueError, match="not a .gguf file"):
        parse_spec(f"{folder}::{tmp_path / 'absent.gguf'}", Path)


def test_ratios_and_table_with_a_peer() -> None:
    ours = {"precision": "bf16 weights, fp32 activations", "prefill_tok_s": 90.0, "decode_tok_s": {1: 60.0, 8: 200.0},
            "load_s": 0.5, "peak_rss_mib": 700.0}
    theirs = {"gguf": "/m/smollm2-bf16.gguf", "model_type": "llama 256M BF16", "prefill_tok_s": 120.0,
              "decode_tok_s": {1: 50.0, 8: 250.0}, "load_s": 0.25, "peak_rss_mib": 400.0}
    x = ratios(ours, theirs)
    assert x == {"prefill": 0.75, "load_time": 2.0, "peak_rss_diff_mib": 300.0, "decode_b1": 1.2, "decode_b8": 0.8}
    report = {"batch_sizes": [1, 8], "prefill_len": 512, "decode_prompt": 128, "new_tokens": 64, "threads": 2,
              "rounds": 2, "rows": [{"model": "smollm2", "nexttoken": ours, "llama_cpp": theirs, "ratios": x}]}
    table = model_matrix_table(report)
    assert "| smollm2 | nexttoken | bf16 weights, fp32 activations | 60.0 | 200.0 | 90.0 | 0.50 | 700 |" in table
    assert "|  | llama.cpp | llama 256M BF16 (smollm2-bf16.gguf) | 50.0 | 250.0 | 120.0 | 0.25 | 400 |" in table
    assert "| 1.20x | 0.80x | 0.75x | 2.00x | +300 |" in table


def test_matrix_runs_real_models_end_to_end(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("NEXTTOKEN_LLAMA_BENCH", raising=False)
    save_variant("llama-gqa", tmp_path / "f32")
    save_variant("llama-tied-mha", tmp_path / "bf16").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    out = tmp_path / "mm"
    rc = main(["bench", "--matrix", "--model", str(tmp_path / "f32"), "--model", str(tmp_path / "bf16"),
               "--rounds", "1", "--prefill-len", "12", "--prompt-len", "6", "--new-tokens", "3", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {Path(r["path"]).name: r for r in report["rows"]}
    assert rows["f32"]["nexttoken"]["precision"] == "float32"
    assert rows["bf16"]["nexttoken"]["precision"] == "bf16 weights, fp32 activations"  # the default rule
    for r in rows.values():
        ours = r["nexttoken"]
        assert ours["prefill_tok_s"] > 0 and all(v > 0 for v in ours["decode_tok_s"].values())
        assert set(ours["decode_tok_s"]) == {"1", "8"}
        assert ours["load_s"] > 0 and ours["peak_rss_mib"] > 50 and ours["probe_error"] is None
        assert r["llama_cpp"] is None and r["ratios"] == {}
    assert "| nexttoken | bf16 weights, fp32 activations |" in out.with_suffix(".md").read_text()
    assert "llama.cpp not run" in capsys.readouterr().err


def test_several_models_need_the_matrix(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--model", str(tmp_path), "--model", str(tmp_path)]) == 2
    assert "only --matrix compares several models" in capsys.readouterr().err


def test_a_file_llama_cpp_refuses_keeps_our_row_and_says_why(tmp_path: Path, capsys) -> None:
    """A llama-bench that fails on the file (a real child exiting 1, as llama.cpp does on a file it cannot load)
    leaves that row with nexttoken's figures and llama.cpp's error; the run goes on."""
    save_variant("llama-gqa", tmp_path / "f32")
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho \"llama_bench: error: failed to load model '$3'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    gguf = tmp_path / "same.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "mm"
    rc = main(["bench", "--matrix", "--llama-bench", str(fake), "--model", f"{tmp_path / 'f32'}::{gguf}",
               "--rounds", "2", "--prefill-len", "12", "--prompt-len", "6", "--new-tokens", "3", "--out", str(out)])
    assert rc == 0
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert row["llama_cpp"] is None and "failed to load model" in row["llama_cpp_error"]
    assert len(row["nexttoken"]["rounds"]["prefill_tok_s"]) == 2  # both rounds measured
    assert "llama.cpp failed, measured alone" in capsys.readouterr().err
