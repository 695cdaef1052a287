"""`nexttoken bench --matrix --model M [--model M2 ...]`: real model files side by side with llama.cpp on the same
GGUF file, interleaved round by round.

Per model, each round measures nexttoken (the model loaded as `nexttoken.load` would, by its default rule) then
llama.cpp (llamacpp.FilePeer), so load that comes and goes on a shared machine skews both alike:
- decode tok/s at batch 1 and at each larger batch, after a prompt of `decode_prompt` tokens per sequence
  (llama-bench's tg at that depth; llama-batched-bench for batches);
- prefill tok/s of one `prefill_len`-token prompt (llama-bench's pp);
- load time (to the first token of a one-token prompt) and peak RSS of a whole process running batch 1
  (nexttoken: a fresh memprobe process; llama.cpp: its llama-bench process's ru_maxrss);
- for a GGUF file, agreement with the file's own weights computed in float32 (accuracy.gguf_agreement: top-1 and
  the next token's log-prob error over real text) of nexttoken's default arithmetic and of llama.cpp's (8-bit
  activations on the blocks and bf16 prompt products, as nexttoken computes it with --gguf-activations int8
  --prefill bfloat16).
A model is a folder, a .gguf file or a Hub id; `FOLDER::FILE.gguf` compares a folder with a GGUF of the same
weights (llama.cpp runs the file), and a .gguf model is compared with itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .engines import make_engine
from .llamacpp import FilePeer
from .output import median, pyplot
from .runner import Measurement, measure_round


@dataclass(frozen=True)
class ModelSpec:
    """One row of the matrix: what nexttoken loads (a folder or .gguf file) and the GGUF llama.cpp runs."""

    label: str
    path: Path
    peer: Path | None


def parse_spec(text: str, resolve: Callable[[str], Path]) -> ModelSpec:
    """`MODEL` or `MODEL::PEER.gguf`; MODEL resolved by `resolve` (local paths and Hub ids)."""
    model, _, peer = text.partition("::")
    path = resolve(model)
    peer_path = Path(peer) if peer else (path if path.suffix == ".gguf" else None)
    if peer_path is not None and (peer_path.suffix != ".gguf" or not peer_path.is_file()):
        raise ValueError(f"--model {text}: the llama.cpp peer {peer_path} is not a .gguf file")
    return ModelSpec(model, path, peer_path)


@dataclass
class Options:
    prefill_len: int
    decode_prompt: int
    new_tokens: int
    batch_sizes: list[int]
    rounds: int
    threads: int
    llama_bench: Path | None


def precision(model: torch.nn.Module) -> str:
    """How a loaded model holds its weights, in words."""
    kind = getattr(model, "quantization", None)
    names = {"bf16": "bf16 weights, fp32 activations", "int8": "int8 (per row)", "int4": "int4 (groups of 32)"}
    return names.get(kind, kind) if kind else str(model.dtype).removeprefix("torch.")


def process_probe(path: Path, opts: Options) -> dict:
    """Load time and whole-process peak RSS of nexttoken at batch 1 (prefill_len prompt, new_tokens), in a fresh
    process (memprobe.py)."""
    spec = dict(engine="nexttoken", path=str(path), dtype=None, batch=1, prompt_len=opts.prefill_len,
                new_tokens=opts.new_tokens, threads=opts.threads, vocab=None)
    done = subprocess.run([sys.executable, "-m", "nexttoken.bench.memprobe", json.dumps(spec)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["memprobe failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_model(spec: ModelSpec, opts: Options, progress: Callable[[str], None]) -> dict:
    """One model's row: nexttoken and llama.cpp, interleaved round by round, medians."""
    torch.set_num_threads(opts.threads)
    progress(f"{spec.label}: loading ...")
    engine = make_engine("nexttoken", spec.path, None)  # type: ignore[arg-type]
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(3, vocab, (1, opts.prefill_len), generator=gen)
    decode_ids = {b: torch.randint(3, vocab, (b, opts.decode_prompt), generator=gen) for b in opts.batch_sizes}
    peer = None
    if opts.llama_bench is not None and spec.peer is not None:
        peer = FilePeer(opts.llama_bench, spec.peer, opts.prefill_len, opts.decode_prompt, opts.new_tokens,
                        opts.threads, opts.batch_sizes)
    peer_error = None
    prefill, decode = Measurement("nexttoken", 1), {b: Measurement("nexttoken", b) for b in opts.batch_sizes}
    engine.generate(prefill_ids[:, :8], 2)  # warm-up
    for r in range(opts.rounds):
        measure_round(engine, prefill_ids, 1, prefill)
        for b in opts.batch_sizes:
            measure_round(engine, decode_ids[b], opts.new_tokens, decode[b])
        ours = ", ".join(f"b{b} {decode[b].decode_tps[-1]:.1f}" for b in opts.batch_sizes if decode[b].decode_tps)
        progress(f"{spec.label} round {r + 1}/{opts.rounds} nexttoken: prefill "
                 f"{opts.prefill_len / prefill.prefill_s[-1]:.1f} tok/s, decode {ours} tok/s")
        if peer is not None:
            try:
                got = peer.measure_round()
            except RuntimeError as e:  # llama.cpp refuses the file: the row keeps nexttoken's figures and says why
                progress(f"{spec.label}: llama.cpp failed, measured alone: {e}")
                peer, peer_error = None, str(e)
                continue
            theirs = ", ".join(f"b{b} {v:.1f}" for b, v in got["decode_tok_s"].items())
            progress(f"{spec.label} round {r + 1}/{opts.rounds} llama.cpp: prefill {got['prefill_tok_s']:.1f} tok/s, "
                     f"decode {theirs} tok/s")
    label = precision(engine.model)
    del engine
    agreement = None
    if spec.path.suffix == ".gguf":
        from .accuracy import gguf_agreement

        progress(f"{spec.label}: agreement with its dequantized float32 run ...")
        agreement = {"nexttoken": gguf_agreement(spec.path),
                     "llama_cpp_arithmetic": gguf_agreement(spec.path, activations="int8", prefill="bfloat16")}
    progress(f"{spec.label}: load time and peak RSS (fresh process) ...")
    probe = process_probe(spec.path, opts)
    ours = {"precision": label, "prefill_tok_s": opts.prefill_len / median(prefill.prefill_s),
            "decode_tok_s": {b: median(m.decode_tps) for b, m in decode.items()},
            "load_s": probe.get("load_s"), "peak_rss_mib": probe.get("process_peak_mib"),
            "peak_above_interpreter_mib": probe.get("peak_mib"), "probe_error": probe.get("error"),
            "rounds": {"prefill_tok_s": [opts.prefill_len / s for s in prefill.prefill_s],
                       "decode_tok_s": {b: m.decode_tps for b, m in decode.items()}}}
    row = {"model": spec.label, "path": str(spec.path), "nexttoken": ours,
           "llama_cpp": peer.result() if peer is not None else None, "llama_cpp_error": peer_error,
           "agreement": agreement}
    row["ratios"] = ratios(ours, row["llama_cpp"])
    return row


def ratios(ours: dict, theirs: dict | None) -> dict:
    """nexttoken / llama.cpp for the rates (above 1: nexttoken faster), the load times (below 1: nexttoken
    faster), and the peak RSS difference in MiB (nexttoken minus llama.cpp)."""
    if not theirs:
        return {}

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = {"prefill": div(ours["prefill_tok_s"], theirs["prefill_tok_s"]),
           "load_time": div(ours["load_s"], theirs["load_s"]),
           "peak_rss_diff_mib": (ours["peak_rss_mib"] - theirs["peak_rss_mib"])
           if ours["peak_rss_mib"] is not None and theirs["peak_rss_mib"] is not None else None}
    for b, rate in ours["decode_tok_s"].items():
        out[f"decode_b{b}"] = div(rate, theirs["decode_tok_s"].get(b))
    return out


def run_model_matrix(specs: list[ModelSpec], opts: Options, progress: Callable[[str], None]) -> dict:
    """Every model's row (run_model), with the settings they were measured under."""
    load_start = os.getloadavg()[0]  # other processes on the machine skew every figure
    rows = [run_model(s, opts, progress) for s in specs]
    return {"load_average": [load_start, os.getloadavg()[0]],"prefill_len": opts.prefill_len, "decode_prompt": opts.decode_prompt, "new_tokens": opts.new_tokens,
            "batch_sizes": opts.batch_sizes, "rounds": opts.rounds, "threads": opts.threads,
            "llama_bench": str(opts.llama_bench) if opts.llama_bench else None, "rows": rows}


def model_matrix_table(report: dict) -> str:
    """Markdown: per model a nexttoken line, a llama.cpp line and a ratio line."""
    batches = report["batch_sizes"]
    head = (["model", "engine", "precision"] + [f"decode b{b} tok/s" for b in batches]
            + [f"prefill {report['prefill_len']} tok/s", "load s", "peak RSS MiB", "top-1 vs float32",
               "max abs d-logp"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        ours, theirs, x = row["nexttoken"], row["llama_cpp"], row["ratios"]
        agreement = row.get("agreement") or {}
        lines.append(_line(_short(row["model"]), "nexttoken", ours["precision"], ours, batches,
                           agreement.get("nexttoken")))
        if theirs:
            lines.append(_line("", "llama.cpp", f"{theirs['model_type']} ({Path(theirs['gguf']).name})", theirs,
                               batches, agreement.get("llama_cpp_arithmetic")))
            cells = [_f(x.get(f"decode_b{b}"), ".2f", "x") for b in batches]
            diff = x.get("peak_rss_diff_mib")
            lines.append("| | **ratio** | nexttoken / llama.cpp | " + " | ".join(cells) + f" | "
                         f"{_f(x.get('prefill'), '.2f', 'x')} | {_f(x.get('load_time'), '.2f', 'x')} | "
                         f"{'-' if diff is None else f'{diff:+.0f}'} | | |")
    lines.append(
        f"\ndecode after a {report['decode_prompt']}-token prompt per sequence, {report['new_tokens']} new tokens; "
        f"prefill of one {report['prefill_len']}-token prompt; {report['threads']} threads; {report['rounds']} "
        "interleaved rounds (medians). Load: to the first token of a one-token prompt. Peak RSS: the whole process "
        "at batch 1 (prefill + decode). Agreement: with the file's own weights in float32 over every next-token "
        "position of real text, decode steps and one prefill (llama.cpp's row: its arithmetic, 8-bit activations "
        "and bf16 prompts, as nexttoken computes it)." + (" 1-minute load average {:.1f} -> {:.1f}.".format(*report["load_average"])
                                           if report.get("load_average") else ""))
    return "\n".join(lines)


def _line(model: str, engine: str, prec: str, r: dict, batches: list[int], agreement: dict | None = None) -> str:
    cells = [model, engine, prec] + [_f(r["decode_tok_s"].get(b), ".1f") for b in batches]
    cells += [_f(r["prefill_tok_s"], ".1f"), _f(r["load_s"], ".2f"), _f(r["peak_rss_mib"], ".0f")]
    cells += ([f"{100 * agreement['top1_agreement']:.2f}%", f"{agreement['max_logprob_error']:.1e}"] if agreement
              else ["-", "-"])
    return "| " + " | ".join(cells) + " |"


def _short(label: str) -> str:
    """A model's name for the table and plot: a path's last part (a Hub id stays whole)."""
    return Path(label).name if Path(label).exists() else label


def _f(x: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def plot_model_matrix(report: dict, path: Path) -> bool:
    """One panel per figure (decode per batch, prefill, load time, peak RSS), a pair of bars per model:
    nexttoken and llama.cpp (hatched). False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    figures = [(f"decode tok/s, batch {b}", lambda r, b=b: r["decode_tok_s"].get(b)) for b in report["batch_sizes"]]
    figures += [(f"prefill tok/s ({report['prefill_len']} tokens)", lambda r: r["prefill_tok_s"]),
                ("load s (lower is better)", lambda r: r["load_s"]),
                ("peak RSS MiB (lower is better)", lambda r: r["peak_rss_mib"])]
    rows = report["rows"]
    fig, axes = plt.subplots(1, len(figures), figsize=(3.2 * len(figures), 3.8), squeeze=False)
    for ax, (title, get) in zip(axes[0], figures):
        for i, row in enumerate(rows):
            ax.bar(i - 0.2, get(row["nexttoken"]) or 0, 0.4, color="C0", label="nexttoken" if i == 0 else None)
            if row["llama_cpp"]:
                ax.bar(i + 0.2, get(row["llama_cpp"]) or 0, 0.4, color="lightgrey", hatch="//", edgecolor="k",
                       label="llama.cpp" if i == 0 else None)
        ax.set_xticks(range(len(rows)), [_short(r["model"]) for r in rows], fontsize=6, rotation=30, ha="right")
        ax.set_title(title, fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{report['threads']} threads, {report['rounds']} interleaved rounds (medians)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
