"""The fused native decode step's test helpers (no tests here)."""

from __future__ import annotations

import torch

from nexttoken.model import ForwardBatch

# Variants the native step does not cover (their declarations keep the modules: Family.native_step): none since
# Gemma 4's own block fuses. Every family's block, windows, sinks, routers and experts included, fuses.
MODULES_ONLY: set[str] = set()


@torch.inference_mode()
def step_logits(model, rows: int = 2) -> torch.Tensor:  # noqa: ANN001
    """Logits of one plain decode step after a 6-token prefill (positions 0..5, new token at column 6): past the
    sliding window (5) of the variants that have one."""
    P, S = 6, 12
    window = model.config.sliding_window
    ids = torch.randint(5, model.config.vocab_size, (rows, P + 1), generator=torch.Generator().manual_seed(7))
    valid = torch.ones(rows, S, dtype=torch.bool)
    cache = model.new_cache(rows, S)
    cols = torch.arange(P).expand(rows, P)
    model(ids[:, :P], ForwardBatch.build(cols, cols, valid, P, window, write_start=0), cache)
    pos = torch.full((rows, 1), P)
    return model(ids[:, P:], ForwardBatch.build(pos, pos, valid, P + 1, window, write_start=P), cache)
