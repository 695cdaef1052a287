"""Decode tokens/s (batch 1, 64 tokens), load time and peak RSS of nexttoken on GGUF files against llama.cpp's
`llama-bench` on the same files, interleaved round by round (docs/performance.md's GGUF table).

    python scripts/gguf_speed.py LLAMA_BENCH FILE.gguf [FILE.gguf ...]
    THREADS=2 ROUNDS=2 ACTIVATIONS=int8 (or int16) DEQUANTIZE=1 (also the float32 model) in the environment

Each nexttoken round runs in a fresh process (its RSS is the whole process's: Python and torch included); the
llama-bench rounds run under /usr/bin/time -v for theirs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

THREADS = os.environ.get("THREADS", "2")
ROUNDS = int(os.environ.get("ROUNDS", "2"))
OURS = r'''
import os, sys, time, resource, torch
torch.set_num_threads(int(os.environ["THREADS"]))
t0 = time.time()
import nexttoken
llm = nexttoken.load(sys.argv[1], dequantize=sys.argv[2] == "1", gguf_activations=sys.argv[3])
load = time.time() - t0
ids = [1, 504, 3458, 282]
llm.generate(ids, max_new_tokens=8, do_sample=False, ignore_eos=True)
best = 0.0
for _ in range(2):
    t = time.time()
    llm.generate(ids, max_new_tokens=64, do_sample=False, ignore_eos=True)
    best = max(best, 64 / (time.time() - t))
print(f"RESULT {best:.1f} {load:.2f} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
'''


def ours(path: str, dequantize: bool = False) -> str:
    env = {**os.environ, "THREADS": THREADS, "OMP_NUM_THREADS": THREADS,
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", OURS, path, "1" if dequantize else "0",
                           os.environ.get("ACTIVATIONS", "int8")], capture_output=True, text=True, env=env)
    m = re.search(r"RESULT (\S+) (\S+) (\S+)", done.stdout)
    return f"{m[1]} tok/s, load {m[2]} s, peak RSS {m[3]} MiB" if m else done.stderr[-400:]


def llama(bench: str, path: str) -> str:
    done = subprocess.run(["/usr/bin/time", "-v", bench, "-m", path, "-p", "0", "-n", "64", "-t", THREADS, "-o",
                           "json"], capture_output=True, text=True)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return f"{json.loads(done.stdout)[0]['avg_ts']:.1f} tok/s, peak RSS {int(rss[1]) / 1024:.0f} MiB"


def main() -> None:
    bench, files = sys.argv[1], sys.argv[2:]
    for path in files:
        for r in range(ROUNDS):
            print(f"{Path(path).name} round {r}: nexttoken {ours(path)} | llama-bench {llama(bench, path)}", flush=True)
        if os.environ.get("DEQUANTIZE") == "1":
            print(f"{Path(path).name} dequantized: nexttoken {ours(path, True)}", flush=True)


if __name__ == "__main__":
    main()
