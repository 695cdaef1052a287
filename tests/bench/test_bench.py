"""`nexttoken bench` smoke run on a micro shape: the JSON report has every field the docs rely on."""

from __future__ import annotations

import json

import pytest

from nexttoken.cli import main


def test_bench_smoke_writes_json_and_plot(tmp_path, capsys) -> None:
    out = tmp_path / "micro"
    rc = main(["bench", "--shape", "micro", "--prompt-len", "4", "--new-tokens", "2", "--batch-sizes", "1",
               "--rounds", "1", "--quantize", "none,int8", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["machine"]["bandwidth_gbs_median"] > 0
    assert set(report["machine"]["matmul_gflops"]) == {"float32", "bfloat16"}
    engines = {r["engine"] for r in report["rows"]}
    assert {"nexttoken", "nexttoken+int8", "transformers"} <= engines
    for row in report["rows"]:
        for key in ("prefill_ms", "decode_tok_s", "bandwidth_bound_tok_s", "share_of_bandwidth_bound",
                    "prefill_share_of_matmul_peak", "peak_mib", "weights_plus_kv_mib", "peak_vs_weights_plus_kv"):
            assert row[key] is not None and row[key] > 0, key
    assert next(r for r in report["rows"] if r["engine"] == "nexttoken")["vs_transformers"] > 0
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "| nexttoken | 1 |" in capsys.readouterr().out


def test_bench_rejects_unknown_quantization(tmp_path, capsys) -> None:
    assert main(["bench", "--shape", "micro", "--quantize", "int3", "--out", str(tmp_path / "x")]) == 2
    assert "int3" in capsys.readouterr().err


def test_bench_batch_sizes_are_validated() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--batch-sizes", "0"])
