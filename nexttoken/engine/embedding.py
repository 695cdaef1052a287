"""Embeddings: prompts through the model's prefill, the final hidden states pooled into one vector each.

Pooling is the model's where it says (sentence-transformers' `modules.json` -> its Pooling module's
`config.json`), else the caller's choice: "last" (the last token's state: decoder embedding models such as
Qwen3-Embedding and e5-mistral), "mean" (the average over the prompt's tokens), "cls" (the first token's). The
vectors are L2-normalized by default; `dimensions` keeps the first N and normalizes again (Matryoshka truncation,
as OpenAI's `dimensions` does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import NextTokenError
from ..model.batch import ForwardBatch

POOLINGS = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
BATCH_TOKENS = 8192  # padded tokens per forward pass
# padded tokens per slice of a request that a server runs between two decode steps: small enough that streams keep
# flowing (a slice of 512 is ~0.1 s of stories260K on the busy 2-core machine), large enough to batch
SLICE_TOKENS = 512


class EmbeddingError(NextTokenError):
    """An embedding request that cannot be served as asked (names the option and what is allowed)."""


def model_pooling(folder: str | Path | None) -> str | None:
    """The pooling a sentence-transformers folder declares (its Pooling module's config); None without one."""
    if folder is None:
        return None
    modules = Path(folder) / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((Path(folder) / module.get("path", "") / "config.json").read_text())
            modes = [name for key, name in _ST_MODES.items() if config.get(key)]
            if len(modes) != 1:
                raise EmbeddingError(f"{folder}: the Pooling module asks for {modes or 'no mode'}; nexttoken pools "
                                     f"one of {POOLINGS}")
            return modes[0]
    return None


def check_options(pooling: str, dimensions: int | None, hidden_size: int) -> None:
    if pooling not in POOLINGS:
        raise EmbeddingError(f"pooling {pooling!r} is not offered: use one of {POOLINGS}")
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise EmbeddingError(f"dimensions={dimensions} is outside [1, {hidden_size}] (this model's hidden size)")


def slices(prompts: list[list[int]], budget: int = SLICE_TOKENS) -> list[list[int]]:
    """The prompts' indices in groups of similar length whose padded size stays within `budget` tokens (a prompt
    longer than it alone): a long request embedded a group at a time, with decoding steps in between."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups: list[list[int]] = []
    for i in order:  # sorted by length: the newest prompt is the group's longest
        if groups and len(prompts[i]) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.inference_mode()
def embed(model: Any, prompts: list[list[int]], pooling: str, normalize: bool = True,
          dimensions: int | None = None) -> list[torch.Tensor]:
    """One (C,) float32 vector per prompt (C: the hidden size, or `dimensions`). Prompts of similar length share a
    right-padded forward pass; causal attention keeps every real token blind to the padding after it."""
    check_options(pooling, dimensions, model.config.hidden_size)
    if any(not p for p in prompts):
        raise EmbeddingError("an input is empty (it encodes to no tokens)")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    start = 0
    while start < len(order):
        end = start + 1  # grow the batch while its padded size stays within the budget
        while end < len(order) and len(prompts[order[end]]) * (end - start + 1) <= BATCH_TOKENS:
            end += 1
        rows = [prompts[i] for i in order[start:end]]
        for i, vector in zip(order[start:end], _pooled(model, rows, pooling)):
            out[i] = vector
        start = end
    vectors = [v[:dimensions] if dimensions is not None else v for v in out]  # type: ignore[index]
    return [F.normalize(v, dim=0) if normalize else v for v in vectors]


def _pooled(model: Any, rows: list[list[int]], pooling: str) -> list[torch.Tensor]:
    device = model.device
    lengths = torch.tensor([len(r) for r in rows], device=device)  # (B,)
    T = int(lengths.max())
    ids = torch.zeros(len(rows), T, dtype=torch.long, device=device)  # (B, T) right-padded with token 0
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r, device=device)
    cols = torch.arange(T, device=device)  # (T,)
    valid = cols[None] < lengths[:, None]  # (B, T) real tokens
    positions = cols[None].expand(len(rows), T)  # (B, T)
    batch = ForwardBatch.build(positions, positions, valid, T, model.config.sliding_window, write_start=0,
                               last_only=False)
    hidden = model.last_hidden_state(ids, batch, model.new_cache(len(rows), T)).float()  # (B, T, C)
    if pooling == "last":
        return list(hidden[torch.arange(len(rows)), lengths - 1])
    if pooling == "cls":
        return list(hidden[:, 0])
    weights = valid.to(hidden.dtype)[:, :, None]  # (B, T, 1)
    return list((hidden * weights).sum(1) / lengths[:, None].to(hidden.dtype))
