"""From raw timings to the bench's table, JSON and plot: medians, ratios to transformers, shares of the limits."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from ..config import ModelConfig
from .output import pyplot

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def linear_params(cfg: ModelConfig, experts: float | None = None) -> tuple[int, int]:
    """(parameters of all linear layers read per forward incl. lm_head, output rows of them). In a mixture of
    experts' sparse layers, `experts` of them (default: all, what memory holds) plus the router."""
    C, I, D, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    attention, attention_rows = C * (q + 2 * kv) + q * C, (q + 2 * kv) + C
    params, rows = cfg.vocab_size * C, cfg.vocab_size
    for layer in range(L):
        moe = cfg.moe
        if moe is not None and moe.sparse_layers[layer]:
            n = moe.num_experts if experts is None else experts
            J, S = moe.intermediate_size, moe.shared_intermediate_size
            params += attention + n * 3 * J * C + 3 * S * C + moe.num_experts * C
            rows += attention_rows + int(n * (2 * J + C)) + (2 * S + C if S else 0) + moe.num_experts
        else:
            params += attention + 3 * I * C
            rows += attention_rows + 2 * I + C
    return int(params), rows


def experts_read(cfg: ModelConfig, batch: int) -> float | None:
    """Expected distinct experts a decode step of `batch` tokens reads per sparse layer, routing uniform:
    E (1 - (1 - k/E)^batch). None for a dense model."""
    if cfg.moe is None:
        return None
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    return E * (1 - (1 - k / E) ** batch)


def _linear_bytes(cfg: ModelConfig, engine: str, dtype: str, experts: float | None = None) -> float:
    params, rows = linear_params(cfg, experts)
    if "int4" in engine:  # blocks at 4.5 bits (a float16 scale per 32 weights), the LM head int8 with row scales
        head = cfg.vocab_size * cfg.hidden_size
        return float((params - head) * 4.5 / 8 + head + cfg.vocab_size * 4)
    if "bf16" in engine:  # bfloat16 weights, float32 activations
        return float(params * 2)
    return float(params + rows * 4 if "int8" in engine else params * _BYTES[dtype])


def _weights_and_kv(cfg: ModelConfig, engine: str, dtype: str, batch: int, context: int) -> tuple[float, float]:
    embed = 0.0  # an untied embedding is a table of its own (int8: with a float32 scale per row)
    if not cfg.tie_word_embeddings:
        V, C = cfg.vocab_size, cfg.hidden_size
        embed = V * C + V * 4 if "int8" in engine or "int4" in engine else V * C * _BYTES[dtype]
        embed = V * C * 2 if "bf16" in engine else embed
    weights = _linear_bytes(cfg, engine, dtype) + embed
    kv = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * context * cfg.head_dim * _BYTES[dtype]
    return float(weights), float(kv)


def prefill_flops(cfg: ModelConfig, batch: int, prompt: int) -> float:
    params, _ = linear_params(cfg, cfg.moe.top_k if cfg.moe else None)  # a token runs its top k experts
    body = params - cfg.vocab_size * cfg.hidden_size
    attention = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * prompt * prompt / 2
    return batch * (2 * body * prompt + 2 * cfg.vocab_size * cfg.hidden_size + attention)


def summarize(raw: dict, workload) -> dict:  # noqa: ANN001
    cfg: ModelConfig = raw["config"]
    machine = raw["machine"]
    bw = statistics.median(machine["bandwidth_gbs"])
    peak = machine["matmul_gflops"][workload.dtype if workload.dtype in machine["matmul_gflops"] else "float32"]
    rows = []
    by_key = {(m.engine, m.batch): m for m in raw["results"]}
    for m in raw["results"]:
        prefill = statistics.median(m.prefill_s)
        tps = statistics.median(m.decode_tps) if m.decode_tps else None
        base = by_key.get(("transformers", m.batch))
        base_tps = statistics.median(base.decode_tps) if base and base.decode_tps else None
        loop = by_key.get(("nexttoken", m.batch))  # the padded-batch decode loop, for the engine's rows
        loop_tps = statistics.median(loop.decode_tps) if loop and loop.decode_tps else None
        weights, kv = _weights_and_kv(cfg, m.engine, workload.dtype, m.batch, workload.prompt_len + workload.new_tokens)
        # Read per step: every linear layer once (lm_head included, embedding rows negligible) + the KV cache
        # at its average length over the decode.
        kv_read = kv * (workload.prompt_len + workload.new_tokens / 2) / (workload.prompt_len + workload.new_tokens)
        step_bytes = _linear_bytes(cfg, m.engine, workload.dtype, experts_read(cfg, m.batch)) + kv_read
        flops = prefill_flops(cfg, m.batch, workload.prompt_len)
        rows.append({
            "engine": m.engine, "batch": m.batch,
            "prefill_ms": prefill * 1e3,
            "prefill_gflops": flops / prefill / 1e9,
            "prefill_share_of_matmul_peak": flops / prefill / 1e9 / peak,
            "decode_tok_s": tps,
            "decode_tok_s_rounds": m.decode_tps,
            "vs_transformers": (tps / base_tps) if tps and base_tps and m.engine != "transformers" else None,
            "vs_padded_loop": (tps / loop_tps) if tps and loop_tps and m.engine == "nexttoken-engine" else None,
            "bytes_per_step": step_bytes,
            "decode_gbs": (tps / m.batch * step_bytes / 1e9) if tps else None,
            "bandwidth_bound_tok_s": m.batch * bw * 1e9 / step_bytes,
            "share_of_bandwidth_bound": (tps / m.batch * step_bytes / 1e9 / bw) if tps else None,
            "peak_mib": m.peak_mib, "load_peak_mib": m.load_peak_mib,
            "weights_plus_kv_mib": (weights + kv) / 2**20,
            "peak_vs_weights_plus_kv": (m.peak_mib * 2**20 / (weights + kv)) if m.peak_mib else None,
        })
    return {
        "model": workload.label, "dtype": workload.dtype, "prompt_len": workload.prompt_len,
        "new_tokens": workload.new_tokens, "batch_sizes": workload.batch_sizes, "rounds": workload.rounds,
        "threads": workload.threads, "clock": workload.clock,
        "machine": {"load_average": [machine.get("load_average_start"), machine.get("load_average_end")],
                    "bandwidth_gbs_median": bw, "bandwidth_gbs_samples": machine["bandwidth_gbs"],
                    "matmul_gflops": machine["matmul_gflops"]},
        "rows": rows,
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(summary: dict) -> str:
    head = ("| engine | batch | prefill ms | prefill % matmul peak | decode tok/s | x transformers | "
            "GB/s | % bandwidth bound | peak MiB | / (weights+KV) |")
    lines = [head, "|" + "---|" * 10]
    for r in summary["rows"]:
        lines.append(
            f"| {r['engine']} | {r['batch']} | {r['prefill_ms']:.0f} | {100 * r['prefill_share_of_matmul_peak']:.0f}% | "
            f"{_f(r['decode_tok_s'], '.1f')} | {_f(r['vs_transformers'], '.2f')} | {_f(r['decode_gbs'], '.1f')} | "
            f"{_f(r['share_of_bandwidth_bound'] and 100 * r['share_of_bandwidth_bound'], '.0f')}% | "
            f"{_f(r['peak_mib'], '.0f')} | {_f(r['peak_vs_weights_plus_kv'], '.2f')} |"
        )
    m = summary["machine"]
    lines.append(
        f"\n{summary['model']} {summary['dtype']}, prompt {summary['prompt_len']}, {summary['new_tokens']} new tokens, "
        f"{summary['threads']} threads, {summary['clock']} clock, {summary['rounds']} rounds (medians). "
        f"Machine: memory bandwidth "
        f"{m['bandwidth_gbs_median']:.1f} GB/s (median of {len(m['bandwidth_gbs_samples'])}), matmul peak "
        f"fp32 {m['matmul_gflops']['float32']:.0f} / bf16 {m['matmul_gflops']['bfloat16']:.0f} GFLOP/s; "
        f"1-min load average {m['load_average'][0]:.1f} -> {m['load_average'][1]:.1f} on {os.cpu_count()} CPUs."
    )
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> bool:
    """Bars of decode tokens/s per engine and batch, the bandwidth bound marked; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = summary["rows"]
    batches = sorted({r["batch"] for r in rows})
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(engines)
    for i, e in enumerate(engines):
        for j, b in enumerate(batches):
            r = next((r for r in rows if r["engine"] == e and r["batch"] == b), None)
            if r is None:
                continue
            x = j + i * width
            axes[0].bar(x, r["decode_tok_s"] or 0, width, color=f"C{i}", label=e if j == 0 else None)
            axes[0].hlines(r["bandwidth_bound_tok_s"], x - width / 2, x + width / 2, colors="k", linestyles=":")
            axes[1].bar(x, r["prefill_ms"], width, color=f"C{i}", label=e if j == 0 else None)
    for ax, title in zip(axes, ["decode tokens/s (dotted: bandwidth bound)", "prefill ms"]):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle(f"{summary['model']} {summary['dtype']}, prompt {summary['prompt_len']}, "
                 f"{summary['new_tokens']} new tokens, {summary['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
