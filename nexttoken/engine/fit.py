"""Memory that fits itself (llama.cpp's --fit): the KV pool and the context of a model sized so that its weights, the
pool and the engine's working memory fit a budget of bytes.

    fit = fit_memory(model, config, budget)          # what is left of the server's --memory-budget for this model
    config = dataclasses.replace(config, kv_cache_memory=fit.kv_cache_bytes, max_model_len=fit.max_model_len)

The pool gets what `max_num_seqs` sequences of the whole context need, or all the room the budget leaves, whichever
is less; where the room holds less than one sequence of the model's whole context, the context shrinks to what it
holds (unless `max_model_len` was set: then that length is kept, or the fit is refused). The working memory is an
estimate of one step's activations (see `runtime_bytes`), not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import GenerationConfigError
from ..model import PagedKVCache
from ..model.memory import available_memory

HEADROOM_BYTES = 1 << 30  # left to the rest of the machine by the default budget (llama.cpp's --fit-target)
HEADROOM_FRACTION = 0.1  # or this much of what is available, if less
MIN_CONTEXT = 256  # tokens: a fitted context shorter than this is refused (a model that cannot hold a chat turn)
FLOAT_BYTES = 4  # activations are float32 on CPU (bf16 elsewhere: the estimate errs on the large side)


@dataclass(frozen=True)
class Fit:
    """A model's share of the budget, in bytes, and the context and pool it was given."""

    weights_bytes: int
    kv_cache_bytes: int
    runtime_bytes: int
    max_model_len: int
    kv_tokens: int  # tokens the pool holds
    budget_bytes: int  # what the model was fitted into
    block_bytes: int  # one KV block's (the pool holds kv_tokens / block size of them, and the null block)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.runtime_bytes

    def describe(self) -> str:
        """The load log line's account: weights + KV pool + runtime = total of the budget."""
        return (f"weights {_mib(self.weights_bytes)} + KV pool {_mib(self.kv_cache_bytes)} ({self.kv_tokens} tokens, "
                f"context {self.max_model_len}) + runtime {_mib(self.runtime_bytes)} = {_mib(self.total_bytes)} "
                f"of {_mib(self.budget_bytes)}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def default_budget(device: torch.device | str) -> int:
    """The memory budget when none is given: what `device` has available now (model/memory.py), less a headroom
    of 1 GiB or a tenth of it, whichever is less."""
    available = available_memory(device)
    return available - min(HEADROOM_BYTES, int(available * HEADROOM_FRACTION))


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage counted once: tied weights share one)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def runtime_bytes(model: nn.Module, config) -> int:  # noqa: ANN001 - EngineConfig
    """One engine step's working memory, estimated: `max_num_batched_tokens` rows through a layer (the residual,
    q/k/v, the MLP's gate and up), a prefill chunk's attention scores over the whole context, and the logits of
    `max_num_seqs` rows (twice: the processors' copy)."""
    c = model.config
    context = min(config.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
    q_kv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    rows = config.max_num_batched_tokens * (4 * c.hidden_size + q_kv + 3 * c.intermediate_size)
    scores = c.num_attention_heads * config.chunk_size * context
    logits = 2 * config.max_num_seqs * c.vocab_size
    return FLOAT_BYTES * (rows + scores + logits)


def fit_memory(model: nn.Module, config, budget: int, dtype: torch.dtype | None = None) -> Fit:  # noqa: ANN001
    """The pool and context of `model` under `config` (an EngineConfig without a pool size) that fit `budget` bytes
    with the weights and the working memory; `dtype`: the pool's element type (default the model's). Raises
    GenerationConfigError naming the bytes when not even MIN_CONTEXT tokens (or the set max_model_len) fit."""
    c = model.config
    block = config.tokens_per_block
    per_block = PagedKVCache.bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, block, c.head_dim,
                                             dtype or model.dtype)
    weights = weights_bytes(model)
    context = min(config.max_model_len or c.max_position_embeddings, c.max_position_embeddings)
    runtime = runtime_bytes(model, config)
    room = budget - weights - runtime
    room_blocks = max(0, room // per_block - 1)  # the pool's null block on top
    wanted = config.max_num_seqs * math.ceil(context / block)
    blocks = min(wanted, room_blocks)
    if blocks * block < context:  # not one whole-context sequence: the context shrinks to the room (--fit's n_ctx)
        fitted = blocks * block
        floor = config.max_model_len or min(MIN_CONTEXT, context)
        if fitted < floor:
            raise GenerationConfigError(
                f"the memory budget leaves {max(room, 0)} bytes ({max(room, 0) / 2**20:.1f} MiB) for the KV pool after "
                f"the weights ({_mib(weights)}) and the runtime ({_mib(runtime)}): {fitted} tokens, fewer than the "
                f"{floor} of one sequence; raise --memory-budget, unload other models, lower --max-num-batched-tokens "
                f"or use --kv-cache-dtype int8")
        context = fitted
    return Fit(weights, (blocks + 1) * per_block, runtime, context, blocks * block, budget, per_block)


def fitted_config(config, fit: Fit):  # noqa: ANN001, ANN201 - EngineConfig in and out
    """`config` with the fit's pool (in bytes) and context."""
    return dataclasses.replace(config, kv_cache_memory=fit.kv_cache_bytes - fit.block_bytes,
                               max_model_len=fit.max_model_len)
