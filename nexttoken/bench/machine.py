"""This machine's limits, measured: DRAM read bandwidth and matmul peak (the bounds the bench compares to)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def memory_bandwidth(mib: int = 512, repeats: int = 5, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median GB/s of a full read (sum) of a buffer far larger than the caches."""
    buf = torch.ones(mib * 2**18, dtype=torch.float32)  # mib MiB
    buf.sum()
    speeds = []
    for _ in range(repeats):
        start = clock()
        buf.sum()
        speeds.append(buf.numel() * 4 / (clock() - start) / 1e9)
    return statistics.median(speeds)


def matmul_peak(
    dtype: torch.dtype, n: int = 2048, repeats: int = 5, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Best GFLOP/s of an n x n x n matmul in `dtype`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = 0.0
    for _ in range(repeats):
        start = clock()
        a @ b
        best = max(best, 2 * n**3 / (clock() - start) / 1e9)
    return best
