"""Run the workload: every engine on every batch size, interleaved round by round, medians at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .engines import StepClock, make_engine
from .machine import matmul_peak, memory_bandwidth


@dataclass
class Workload:
    path: Path
    label: str  # shape name or model folder
    dtype: str
    prompt_len: int
    new_tokens: int
    batch_sizes: list[int]
    engines: list[str]  # "nexttoken", "nexttoken+int8", "transformers"
    rounds: int
    threads: int
    memory: bool = True
    clock: str = "wall"  # "cpu": this process's CPU time, robust to other load but meaningful only at 1 thread


@dataclass
class Measurement:
    engine: str
    batch: int
    prefill_s: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)  # aggregate tokens/s over the batch
    peak_mib: float | None = None
    load_peak_mib: float | None = None


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # decode.py keeps the same pair


def measure_round(engine, ids: torch.Tensor, new_tokens: int, m: Measurement, clock: str = "wall") -> None:
    """Prefill = start to the first step's logits; decode = the later steps, each timed as it happens."""
    now = CLOCKS[clock]
    steps = StepClock(now)
    start = now()
    engine.generate(ids, new_tokens, steps)
    m.prefill_s.append(steps.times[0] - start)
    if len(steps.times) > 1:
        m.decode_tps.append(ids.shape[0] * (len(steps.times) - 1) / max(steps.times[-1] - steps.times[0], 1e-9))


def peak_memory(w: Workload, engine: str, batch: int, vocab: int) -> dict:
    spec = dict(engine=engine, path=str(w.path), dtype=w.dtype, batch=batch, prompt_len=w.prompt_len,
                new_tokens=w.new_tokens, threads=w.threads, vocab=vocab)
    done = subprocess.run([sys.executable, "-m", "nexttoken.bench.memprobe", json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["memprobe failed"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(w: Workload, progress: Callable[[str], None], between_rounds: Callable[[int], None] | None = None) -> dict:
    """Every engine on every batch size, round by round; `between_rounds(r)` (a peer measured outside this process,
    e.g. llama.cpp) runs after round r's engines, so its rounds interleave with theirs."""
    torch.set_num_threads(w.threads)
    clock = CLOCKS[w.clock]
    progress(f"measuring the machine ({w.threads} threads): memory bandwidth, matmul peak ...")
    machine = {
        "threads": w.threads,
        "clock": w.clock,
        "load_average_start": os.getloadavg()[0],  # other processes on the machine skew every figure
        "bandwidth_gbs": [memory_bandwidth(clock=clock)],
        "matmul_gflops": {"float32": matmul_peak(torch.float32, clock=clock),
                          "bfloat16": matmul_peak(torch.bfloat16, clock=clock)},
    }
    engines = {}
    for name in w.engines:
        progress(f"loading {name} ({w.label}, {w.dtype}) ...")
        engines[name] = make_engine(name, w.path, w.dtype)
    vocab = engines[w.engines[0]].model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(3, vocab, (b, w.prompt_len), generator=gen) for b in w.batch_sizes}
    results = {(e, b): Measurement(e, b) for b in w.batch_sizes for e in w.engines}
    for b in w.batch_sizes:
        for name, engine in engines.items():
            progress(f"warm-up {name} batch {b}")
            engine.generate(prompts[b], 2)
    for r in range(w.rounds):
        for b in w.batch_sizes:
            for name, engine in engines.items():  # interleaved: each round runs every engine once
                m = results[(name, b)]
                measure_round(engine, prompts[b], w.new_tokens, m, w.clock)
                tps = f"{m.decode_tps[-1]:.1f} tok/s" if m.decode_tps else "-"
                progress(f"round {r + 1}/{w.rounds} batch {b} {name}: prefill {m.prefill_s[-1] * 1e3:.0f} ms, decode {tps}")
        if between_rounds is not None:
            between_rounds(r)
        machine["bandwidth_gbs"].append(memory_bandwidth(clock=clock))
    machine["load_average_end"] = os.getloadavg()[0]
    cfg = engines[w.engines[0]].model.config
    del engines
    if w.memory:
        for (name, b), m in results.items():
            progress(f"peak memory: {name} batch {b} (fresh process) ...")
            mem = peak_memory(w, name, b, vocab)
            m.peak_mib, m.load_peak_mib = mem.get("peak_mib"), mem.get("load_peak_mib")
    return {"machine": machine, "results": list(results.values()), "config": cfg}


