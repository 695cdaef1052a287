"""Structured output's masks computed ahead: while the engine's forward pass runs, a worker thread computes the
next grammar mask of every constrained request (llguidance releases the GIL while it computes), so that when the
logits come the processors only apply them (GrammarMask.mask_for finds them ready)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

from .structured import GrammarMask


class Pending:
    """The masks being computed; `wait` returns once they are ready (it never raises: a grammar that fails here
    fails again in its processor, which ends that request alone)."""

    def __init__(self, future: Future | None) -> None:
        self.future = future

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class MaskPrefetch:
    """One worker thread (started on first use) that computes the masks of a step's constrained rows."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, rows: Sequence[tuple[GrammarMask, list[int]]]) -> Pending:
        """Compute each (grammar, generated ids)'s next mask on the worker; nothing to do without rows."""
        if not rows:
            return Pending(None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nexttoken-grammar")
        return Pending(self._pool.submit(_prefetch, list(rows)))


def _prefetch(rows: list[tuple[GrammarMask, list[int]]]) -> None:
    for grammar, generated in rows:
        try:
            grammar.mask_for(generated)
        except Exception:  # noqa: BLE001 - the same error comes back from the processor, and ends that request only
            pass
