"""What every `nexttoken bench` subcommand hands back, written once: its typed error, its progress lines on stderr,
its JSON report, its plot backend and its percentiles."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import NextTokenError


class BenchError(NextTokenError):
    """A bench option or input that cannot run (the message names the option and what it takes)."""


def progress_printer() -> Callable[[str], None]:
    """A progress callback: each message on stderr behind the seconds since this call, `[   1.2s] message`."""
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return progress


def write_report(report: Any, path: str | Path) -> Path:
    """`report` as indented JSON at `path` (its folder made); returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return path


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed (the `bench`
    extra): a bench writes its JSON either way and says that the plot was skipped."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99"} of `values` times `scale` (nearest rank), rounded to 3 places; {} when empty."""
    if not values:
        return {}
    s = sorted(values)

    def pick(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] * scale, 3)

    return {"mean": round(sum(s) / len(s) * scale, 3), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def median(xs: list[float]) -> float | None:
    """The median of the rounds, or None when there were none."""
    import statistics

    return statistics.median(xs) if xs else None
