"""A stand-in model for hand-worked decoding tests (no tests here): next-token logits from a bigram table,
last hidden states from a per-token embedding, so every step can be computed by hand."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from nexttoken.model import KVCache


class BigramModel(nn.Module):
    """logits(next | ..., t) = log(table[t]); hidden(t) = hidden[t] (read by contrastive search via `norm`)."""

    def __init__(self, table: list[list[float]], hidden: list[list[float]] | None = None) -> None:
        super().__init__()
        probs = torch.tensor(table, dtype=torch.float32)
        self.log_table = probs.log()
        V = probs.shape[0]
        self.hidden = torch.tensor(hidden if hidden is not None else torch.eye(V).tolist(), dtype=torch.float32)
        self.norm = nn.Identity()  # the "final norm": its output is the last hidden state
        self.config = SimpleNamespace(vocab_size=V, max_position_embeddings=64, sliding_window=None,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
        self.calls: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        return KVCache(1, batch_size, 1, max_len, 1, torch.float32, "cpu")

    def forward(self, input_ids, batch, cache, **extra):  # noqa: ANN001, ANN201
        self.calls.append(input_ids.clone())
        self.norm(self.hidden[input_ids] if not batch.last_only else self.hidden[input_ids[:, -1]])
        logits = self.log_table[input_ids]  # (B, T, V)
        return logits[:, -1] if batch.last_only else logits
