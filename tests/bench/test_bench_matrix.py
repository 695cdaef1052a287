"""`nexttoken bench --matrix` smoke run on the micro shape: every precision measured with the peer, the bytes per
weight each precision reads, and each figure as a share of the measured limits."""

from __future__ import annotations

import json

from nexttoken.bench.report import linear_params
from nexttoken.bench.shapes import config_for
from nexttoken.cli import main
from nexttoken.config import ModelConfig


def test_matrix_table_covers_every_precision(tmp_path, capsys) -> None:
    out = tmp_path / "matrix"
    rc = main(["bench", "--matrix", "--shapes", "micro", "--prompt-len", "4", "--new-tokens", "3",
               "--batch-sizes", "1,8", "--rounds", "1", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    (shape,) = report["shapes"]
    rows = shape["rows"]
    assert {r["precision"] for r in rows} == {"float32", "bf16 weights, fp32 activations", "int8 (per row)",
                                              "int4 (groups of 32)", "float32 (transformers)"}
    assert {r["batch"] for r in rows} == {1, 8}
    for r in rows:
        assert r["decode_tok_s"] > 0 and 0 < r["share_of_bandwidth_bound"] and r["prefill_share_of_matmul_peak"] > 0
    bits = {r["precision"]: r["bits_per_weight"] for r in rows}
    assert bits["float32"] == 32 and bits["bf16 weights, fp32 activations"] == 16
    # int8: 8 bits + a float32 scale per row; int4: 4.5 bits in the blocks, the LM head (micro: 512 x 64) int8.
    cfg = ModelConfig.from_dict(config_for("micro", "float32"))
    params, rows_out = linear_params(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    assert abs(bits["int8 (per row)"] - 8 * (params + 4 * rows_out) / params) < 1e-9
    expected_int4 = 8 * ((params - head) * 4.5 / 8 + head + 4 * cfg.vocab_size) / params
    assert abs(bits["int4 (groups of 32)"] - expected_int4) < 1e-9
    assert out.with_suffix(".png").stat().st_size > 1000
    table = capsys.readouterr().out
    assert "| micro | int4 (groups of 32) |" in table and "% bandwidth bound" in table


def test_matrix_dtype_is_the_dtype_the_engines_load_in(tmp_path) -> None:
    """--dtype loads the (float32) micro checkpoint in bfloat16: the checkpoint's own row is then bf16, 16 bits."""
    out = tmp_path / "matrix"
    rc = main(["bench", "--matrix", "--shapes", "micro", "--dtype", "bfloat16", "--precisions", "none,int8",
               "--no-transformers", "--prompt-len", "4", "--new-tokens", "3", "--batch-sizes", "1", "--rounds", "1",
               "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert rc == 0
    rows = json.loads(out.with_suffix(".json").read_text())["shapes"][0]["rows"]
    assert {(r["precision"], r["bits_per_weight"] == 16) for r in rows} == {("bfloat16", True),
                                                                            ("int8 (per row)", False)}
    assert (tmp_path / "c" / "micro-float32").is_dir()  # the checkpoint stays as written
