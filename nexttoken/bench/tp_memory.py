"""`nexttoken bench tp-memory MODEL_DIR --tensor-parallel-size N`: per-rank memory of a tensor-parallel model
(resident set VmRSS, peak VmHWM, parameter bytes) and its greedy tokens/s (CPU; noisy on a shared machine).

Run each N as its own command (a fresh process): the figures of N=1 are the baseline of the same folder in one
process. Linux only (it reads /proc/PID/status of every rank's process).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .output import BenchError, progress_printer, write_report


def proc_status(pid: int) -> dict[str, int]:
    """{"VmRSS", "VmHWM"} of process `pid` in MiB, from /proc/PID/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) // 1024  # kB -> MiB
    return fields


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tp-memory", help="a tensor-parallel model's memory per rank and its greedy tokens/s")
    p.add_argument("model", help="a Hugging Face model folder")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks (1: one process)")
    p.add_argument("--threads", type=int, help="torch threads per rank (default: the cores / N)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens timed")
    p.add_argument("--out", default="bench-tp-memory", help="output prefix: writes OUT.json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `nexttoken --help` must not import torch

    import nexttoken

    from ..model.parallel import parameter_bytes

    n = args.tensor_parallel_size
    if n < 1 or args.new_tokens < 1:
        raise BenchError("--tensor-parallel-size and --new-tokens must be >= 1")
    if not Path("/proc/self/status").is_file():
        raise BenchError("bench tp-memory reads /proc/PID/status: it runs on Linux only")
    progress = progress_printer()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // n))
    llm = nexttoken.load(args.model, tensor_parallel_size=n)
    try:
        pids = [os.getpid()] + [p.pid for p in getattr(getattr(llm.model, "cluster", None), "workers", [])]
        ranks = [{"rank": rank, "rss_mib": s["VmRSS"], "peak_mib": s["VmHWM"]}
                 for rank, s in enumerate(proc_status(pid) for pid in pids)]
        prompt = [1, 5, 17, 33, 90]
        llm.generate(prompt, max_new_tokens=min(8, args.new_tokens), do_sample=False)  # warm-up
        t = time.perf_counter()
        out = llm.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False, ignore_eos=True)
        tok_s = len(out.token_ids) / (time.perf_counter() - t)
        param_mib = parameter_bytes(llm.model) / 2**20
    finally:
        llm.close()
    print(f"N={n}: parameter bytes per rank {param_mib:.0f} MiB")
    for r in ranks:
        print(f"  rank {r['rank']}: VmRSS {r['rss_mib']} MiB, peak VmHWM {r['peak_mib']} MiB")
    print(f"  greedy: {tok_s:.1f} tokens/s (torch threads per rank: {torch.get_num_threads()})")
    report = {"model": str(args.model), "tensor_parallel_size": n, "threads_per_rank": torch.get_num_threads(),
              "parameter_mib_per_rank": param_mib, "ranks": ranks, "greedy_tok_s": tok_s}
    progress(f"wrote {write_report(report, Path(args.out).with_suffix('.json'))}")
    return 0
