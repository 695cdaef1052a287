"""`nexttoken bench --matrix`: llama.cpp's table, sizes x precisions, each figure also as a share of the machine's
measured limits (decode vs the memory-bandwidth bound, prefill vs the matmul peak).

Every shape is one run of the ordinary workload (runner.py) with one engine per precision and transformers as
the same-run peer, so the ratios in a row come from interleaved rounds on the same machine state. Precisions:
the checkpoint's own dtype (float32 for tiny/small, bfloat16 for 1b), bf16 (bfloat16 weights, float32
activations: what llama.cpp runs for bf16), int8 (per-row scales; llama.cpp's q8_0 is per 32) and int4 (groups of
32, llama.cpp's Q4_0 scheme).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..config import ModelConfig
from . import llamacpp
from .output import pyplot
from .report import _linear_bytes, linear_params, summarize
from .runner import Workload, run
from .shapes import SHAPES, random_checkpoint

PRECISIONS = ("none", "bf16", "int8", "int4")  # "none": the checkpoint's dtype


def run_matrix(shapes: list[str], precisions: list[str], base: dict, cache_dir: Path, with_transformers: bool,
               progress: Callable[[str], None], llama_bench: Path | None = None,
               gguf_dir: Path | None = None, dtype: str | None = None) -> dict:
    """One summary per shape (report.summarize's), every precision and the peer measured in the same run.
    `base`: the Workload fields shared by all shapes (prompt_len, new_tokens, batch_sizes, rounds, ...).
    With `llama_bench` and `gguf_dir`, llama.cpp runs on the shape's GGUF files after every round of its engines
    (llamacpp.Peer), and its rows (medians of those rounds) follow theirs. `dtype`: the dtype every engine loads
    the checkpoint in (its activations; default the checkpoint's own): float32 runs a bf16 checkpoint's int8 /
    int4 rows with float32 activations, as llama.cpp does, and so on the fused native step."""
    summaries = []
    for shape in shapes:
        stored = SHAPES[shape][1]
        progress(f"random-weight checkpoint for {shape} ({stored}) ...")
        path = random_checkpoint(shape, stored, cache_dir / f"{shape}-{stored}")
        loaded = dtype or stored
        engines = ["nexttoken" if p == "none" else f"nexttoken+{p}" for p in precisions]
        engines += ["transformers"] if with_transformers else []
        workload = Workload(path, shape, loaded, engines=engines, **base)
        peer = None
        if llama_bench is not None and gguf_dir is not None:
            peer = llamacpp.Peer(llama_bench, gguf_dir, shape, base["prompt_len"], base["new_tokens"],
                                 base["threads"], base["batch_sizes"], progress)
        summary = summarize(run(workload, progress, peer.measure_round if peer else None), workload)
        cfg = ModelConfig.from_dir(path)
        params, _ = linear_params(cfg)
        for row in summary["rows"]:
            row["precision"] = precision_label(row["engine"], loaded)
            row["bits_per_weight"] = 8 * _linear_bytes(cfg, row["engine"], loaded) / params
        if peer is not None:
            summary["llama_cpp"] = peer.rows()
        summaries.append(summary)
    return {"shapes": summaries, "llama_cpp": str(llama_bench) if llama_bench else None}


def precision_label(engine: str, dtype: str) -> str:
    if engine == "transformers":
        return f"{dtype} (transformers)"
    if "+" not in engine:
        return dtype
    quantize = engine.split("+", 1)[1]
    return {"bf16": "bf16 weights, fp32 activations", "int8": "int8 (per row)", "int4": "int4 (groups of 32)"}[quantize]


def matrix_table(report: dict) -> str:
    """The llama.cpp-style table: one line per size and precision."""
    lines = ["| model | precision | bits/weight | prefill ms (batch 1) | % matmul peak | decode tok/s batch 1 | "
             "% bandwidth bound | decode tok/s batch 8 | % bandwidth bound | x transformers (batch 1) |",
             "|" + "---|" * 10]
    for s in report["shapes"]:
        rows = s["rows"]
        for engine in dict.fromkeys(r["engine"] for r in rows):
            by_batch = {r["batch"]: r for r in rows if r["engine"] == engine}
            one, eight = by_batch.get(1), by_batch.get(8)
            first = one or next(iter(by_batch.values()))
            lines.append(
                f"| {s['model']} | {first['precision']} | {first['bits_per_weight']:.1f} | "
                f"{_f(one and one['prefill_ms'], '.0f')} | {_pct(one and one['prefill_share_of_matmul_peak'])} | "
                f"{_f(one and one['decode_tok_s'], '.1f')} | {_pct(one and one['share_of_bandwidth_bound'])} | "
                f"{_f(eight and eight['decode_tok_s'], '.1f')} | {_pct(eight and eight['share_of_bandwidth_bound'])} | "
                f"{_f(one and one['vs_transformers'], '.2f')} |")
        peer = next((r for r in rows if r["engine"] == "transformers" and r["batch"] == 1), None)
        peer_rows = s.get("llama_cpp", [])
        for engine in dict.fromkeys(r["engine"] for r in peer_rows):
            by_batch = {r["batch"]: r for r in peer_rows if r["engine"] == engine}
            one, eight = by_batch.get(1), by_batch.get(8)
            vs = one["decode_tok_s"] / peer["decode_tok_s"] if peer and one and one["decode_tok_s"] else None
            lines.append(f"| {s['model']} | {one['precision']} | - | {_f(one['prefill_ms'], '.0f')} | - | "
                         f"{_f(one['decode_tok_s'], '.1f')} | - | {_f(eight and eight['decode_tok_s'], '.1f')} | - | "
                         f"{_f(vs, '.2f')} |")
    m = report["shapes"][0]
    mach = m["machine"]
    lines.append(
        f"\nprompt {m['prompt_len']}, {m['new_tokens']} new tokens, greedy, {m['threads']} threads, {m['clock']} clock, "
        f"{m['rounds']} rounds (medians). Limits measured in the run: memory bandwidth "
        f"{mach['bandwidth_gbs_median']:.1f} GB/s, matmul peak fp32 {mach['matmul_gflops']['float32']:.0f} / bf16 "
        f"{mach['matmul_gflops']['bfloat16']:.0f} GFLOP/s; 1-min load average {mach['load_average'][0]:.1f} -> "
        f"{mach['load_average'][1]:.1f}. " + (
            f"llama.cpp: its llama-bench ({report['llama_cpp']}, batch 1) and llama-batched-bench beside it (larger "
            f"batches), one run after every round of the engines, wall clock, medians."
            if report.get("llama_cpp") else
            "llama.cpp not run: pass --llama-bench PATH (or set NEXTTOKEN_LLAMA_BENCH) and --gguf-dir DIR."))
    return "\n".join(lines)


def plot_matrix(report: dict, path: Path) -> bool:
    """Decode tokens/s at batch 1 per size (one panel each), a bar per precision with its bandwidth bound dotted;
    False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = report["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4.6), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        rows = [r for r in s["rows"] if r["batch"] == 1]
        peers = [r for r in s.get("llama_cpp", []) if r["batch"] == 1]
        for i, r in enumerate(rows):
            ax.bar(i, r["decode_tok_s"] or 0, color=f"C{i}")
            ax.hlines(r["bandwidth_bound_tok_s"], i - 0.4, i + 0.4, colors="k", linestyles=":")
        for j, r in enumerate(peers):  # llama.cpp's, hatched, after ours
            ax.bar(len(rows) + j, r["decode_tok_s"] or 0, color="lightgrey", hatch="//", edgecolor="k")
        labels = [r["precision"] for r in rows + peers]
        ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=40, ha="right")
        ax.set_title(f"{s['model']} (prompt {s['prompt_len']}, {s['threads']} thread(s), {s['clock']} clock): decode "
                     f"tok/s, batch 1\n(dotted: bandwidth bound; hatched: llama.cpp)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
