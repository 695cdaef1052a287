"""Per-rank memory of a tensor-parallel model: resident set (VmRSS, peak VmHWM) and parameter bytes of every rank,
against the same folder in one process; plus greedy tokens/s (CPU, noisy on a shared machine).

    python scripts/tp_memory.py MODEL_DIR N [THREADS]   (N = 1: one process; run each N in its own process;
                                                         THREADS: torch threads per rank, default cores / N)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import nexttoken
from nexttoken.model.parallel import parameter_bytes


def status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) // 1024  # MiB
    return fields


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else max(1, torch.get_num_threads() // n))
    llm = nexttoken.load(path, tensor_parallel_size=n)
    pids = [os.getpid()] + [p.pid for p in getattr(getattr(llm.model, "cluster", None), "workers", [])]
    print(f"N={n}: parameter bytes per rank {parameter_bytes(llm.model) / 2**20:.0f} MiB")
    for rank, pid in enumerate(pids):
        s = status(pid)
        print(f"  rank {rank}: VmRSS {s['VmRSS']} MiB, peak VmHWM {s['VmHWM']} MiB")
    prompt = [1, 5, 17, 33, 90]
    llm.generate(prompt, max_new_tokens=8, do_sample=False)  # warm-up
    t = time.perf_counter()
    out = llm.generate(prompt, max_new_tokens=64, do_sample=False, ignore_eos=True)
    print(f"  greedy: {len(out.token_ids) / (time.perf_counter() - t):.1f} tokens/s "
          f"(torch threads per rank: {torch.get_num_threads()})")
    llm.close()


if __name__ == "__main__":
    main()
