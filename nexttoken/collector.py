"""The cyclic garbage collector around loading and serving (no torch import: `nexttoken/__init__` uses it).

With torch imported a process holds ~500k objects the collector tracks, and each full collection walks them all:
~60-90 ms on these machines, several times per load (imports, the vocabulary, the modules), none of which makes
garbage cycles. So:
- `paused()`: a load and the imports it triggers run with the collector off; what it defers is collected after,
  as usual (a cheap young-generation pass: the long-lived objects are not re-walked until the next full one).
- `freeze_heap()`: the server, once started, moves everything alive into the permanent generation that
  collections skip (vLLM's `freeze_gc_heap` after its engine starts), so full collections during serving walk only
  what requests make. `thaw_heap()` hands the frozen objects back before a model is unloaded, so that its
  memory is collected.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off for the block, restored after (nested uses keep the outermost state)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_heap() -> int:
    """Collect what is garbage now, then freeze every surviving object; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Unfreeze: the frozen objects go back to the oldest generation, so unreachable ones can be collected."""
    gc.unfreeze()
