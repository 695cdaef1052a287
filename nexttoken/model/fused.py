"""A whole decode step in one native call (csrc/decode.cpp): the fast path for small float32 models.

A plain decode step of the PyTorch modules is ~280 small operations; for a 15M-parameter model their dispatch
costs about as much as streaming the weights. `decode_step` instead hands the embedded tokens, the weights and
the KV cache to one C++ function that runs every layer, the final norm and the LM head, and returns the logits.

It takes only what it computes exactly like the modules: float32 activations on CPU, one new token per row at
the last cache column with every column visible (no padding, no sliding window in reach), weights that are plain
`Linear`, `BF16Linear`, `Int8Linear`, `Int4Linear` or GGUF's packed `GGUFLinear` layers of the stock blocks. Everything else returns None and runs the modules, which
are the reference the tests hold this path to (same tokens; logits within float32 rounding).

A tensor-parallel rank (model/parallel.py) needs an all-reduce after every o and down projection, so it runs the
same native code a part at a time (csrc/decode.cpp's nt_decode_part): per layer, the attention half and the MLP
half each return this rank's partial sum, which Python all-reduces and adds to the residual; then the final norm
and this rank's rows of the LM head, all-gathered. The same operations as the rank's modules, in their order.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Iterator

import torch

from . import kernels
from .batch import ForwardBatch
from .cache import KVCache
from .quant.bf16 import BF16Embedding, BF16Linear
from .quant.ggml import GGUFLinear
from .quant.int4 import Int4Linear
from .quant.int8 import Int8Embedding, Int8Linear
from .layers import MLP, Attention, Block, RMSNorm
from .linear import Linear

_ENABLED = os.environ.get("NEXTTOKEN_FUSED", "1") != "0"  # NEXTTOKEN_FUSED=0: decode steps run the modules
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the PyTorch modules for decode steps too (the reference the fused step is tested against)."""
    global _ENABLED
    before, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = before


class _Linear(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("kind", ctypes.c_int64), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("w13", _Linear), ("w2", _Linear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")] + [("embed", _Linear)] + [
        (name, ctypes.c_int64) for name in ("cache_row_stride", "cache_head_stride")] + [
        ("eps", ctypes.c_double), ("inv_freq", ctypes.c_void_p),
                                 ("final_norm", ctypes.c_void_p), ("lm_head", _Linear),
                                 ("layers", ctypes.POINTER(_Layer)), ("kv_kind", ctypes.c_int64)]


def _linear(module: torch.nn.Module) -> _Linear | None:
    if type(module) in (Linear, BF16Linear):
        w, scale, bias = module.weight, None, module.bias
    elif type(module) is Int8Linear:
        w, scale, bias = module.weight, module.scale, module.bias
    elif type(module) is GGUFLinear and kernels.ggml_available():  # kind 16 + ggml type: csrc/ggml.cpp's blocks
        if module.bias is not None and module.bias.dtype != torch.float32:
            return None
        return _Linear(module.native_weight.data_ptr(), module.native_kind, None,
                       None if module.bias is None else module.bias.data_ptr())
    elif type(module) is Int4Linear and kernels.int4_available():  # kind 3: csrc/int4.cpp's layout
        if module.bias is not None and module.bias.dtype != torch.float32:
            return None
        return _Linear(module.weight.data_ptr(), 3, module.scale.data_ptr(),
                       None if module.bias is None else module.bias.data_ptr())
    else:
        return None
    if w.dtype not in _KIND or not w.is_contiguous() or (bias is not None and bias.dtype != torch.float32):
        return None
    return _Linear(w.data_ptr(), _KIND[w.dtype], None if scale is None else scale.data_ptr(),
                   None if bias is None else bias.data_ptr())


def _embedding(module: torch.nn.Module, vocab: int) -> _Linear | None:
    """The token table as the native step reads it (csrc/decode.cpp's embed: ids in [0, vocab)), or None: a
    float32 nn.Embedding, bf16.BF16Embedding's bfloat16 rows or quant.Int8Embedding's int8 rows and scales (a
    tensor-parallel rank's vocab-parallel table is looked up in Python)."""
    
    w = _table(module)
    if not w.is_contiguous() or w.dim() != 2 or w.shape[0] < vocab:
        return None
    if type(module) is torch.nn.Embedding and w.dtype == torch.float32:
        return _Linear(w.data_ptr(), 0, None, None)
    if type(module) is BF16Embedding and w.dtype == torch.bfloat16:
        return _Linear(w.data_ptr(), 1, None, None)
    if type(module) is Int8Embedding and w.dtype == torch.int8 and module.dtype == torch.float32:
        return _Linear(w.data_ptr(), 2, module.table.scale.data_ptr(), None)
    return None


def _key(model: torch.nn.Module, cache: KVCache) -> tuple:
    """What the native description depends on: the cache (shape too: a new cache of another length can be
    allocated where a freed one was) and every module and weight the step reads. Checked every step, so it reads
    the modules' own dicts (nn.Module attribute lookups and model.parameters() would cost ~0.1 ms a step)."""
    key = [cache.k.shape, cache.k.dtype, cache.k.data_ptr(), cache.v.data_ptr(), model.inv_freq.data_ptr()]
    embed = model._modules["embed"]
    key += (id(embed), _table(embed).data_ptr())
    for m in (model._modules["norm"], model._modules["lm_head"]):
        key += (id(m), _weight(m).data_ptr())
    for block in model._modules["layers"]._modules.values():
        parts = block._modules
        att, mlp = parts["attention"]._modules, parts["mlp"]._modules
        for m in (parts["attention_norm"], parts["ffn_norm"], att["wqkv"], att["wo"], mlp.get("w13"), mlp.get("w2")):
            if m is not None:  # a MoE block has no w13 / w2 of its own (the plan then says no)
                key += (id(m), _weight(m).data_ptr())
    return tuple(key)


def _weight(m: torch.nn.Module) -> torch.Tensor:
    m = _local(m)
    w = m._parameters.get("weight")
    return m._buffers["weight"] if w is None else w  # Int8Linear keeps its weight as a buffer


def _table(embed: torch.nn.Module) -> torch.Tensor:
    """The tensor an embedding module's rows live in (BF16Embedding / Int8Embedding: their shared table's)."""
    table = embed._modules.get("table")
    return _weight(table) if table is not None else _weight(embed)


def _local(m: torch.nn.Module) -> torch.nn.Module:
    """The rank's own matrix inside a tensor-parallel wrapper (parallel.RowParallel / ParallelHead), or the base
    matrix inside a LoRA wrapper (lora.LoraLinear: the native step computes the base model's rows), else m."""
    inner = m._modules.get("inner")
    return m if inner is None else inner


class _Plan:
    """The ctypes description of one model + cache, kept while none of their tensors move."""

    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        cfg = model.config
        self.key = _key(model, cache)
        self.ok = False
        self.biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # a rank's o / down biases per layer
        if type(model.norm) is not RMSNorm or cfg.head_dim > 512:
            return
        sharded = _sharded(model)
        layers = []
        for i, block in enumerate(model.layers):
            parts = (type(block), type(block.attention), type(block.mlp), type(block.attention_norm),
                     type(block.ffn_norm))
            if parts != (Block, Attention, MLP, RMSNorm, RMSNorm) or block.attention.sliding:
                return
            if not cfg.plain:  # q/k norms, other norms, multipliers, soft-caps, GeGLU, MoE: not in the native step
                return
            linears = [_linear(_local(m)) for m in (block.attention.wqkv, block.attention.wo, block.mlp.w13,
                                                    block.mlp.w2)]
            if any(lin is None for lin in linears):
                return
            scales = _scales(cache, i)
            layers.append(_Layer(block.attention_norm.weight.data_ptr(), block.ffn_norm.weight.data_ptr(), *linears,
                                 cache.k[i].data_ptr(), cache.v[i].data_ptr(), *scales))
            # a rank's row-parallel o / down add their bias once, after the all-reduce (None in one process)
            self.biases.append((block.attention.wo.bias, block.mlp.w2.bias) if sharded else (None, None))
        head = _linear(_local(model.lm_head))
        if head is None:
            return
        _, _, Hkv, S, D = cache.k.shape
        vocab = model.parallel.shards.vocab_rows if sharded else cfg.vocab_size  # a rank: its rows of the head
        self.layers = (_Layer * len(layers))(*layers)  # kept alive with the plan
        embed = None if sharded else _embedding(model.embed, vocab)
        self.embeds = embed is not None  # the native step then reads the token table itself
        self.model = _Model(
            cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, vocab, embed or _Linear(None, 0, None, None), Hkv * S * D, S * D,
            cfg.rms_norm_eps, model.inv_freq.data_ptr(), model.norm.weight.data_ptr(), head, self.layers,
            _KIND[cache.k.dtype],
        )
        self.ok = True


def _scales(cache: KVCache, layer: int) -> tuple[int | None, int | None]:
    """An int8 pool's per token and head scales of one layer (model/cache.py's PagedKVCache), else (None, None)."""
    k_scale = getattr(cache, "k_scale", None)
    return (None, None) if k_scale is None else (k_scale[layer].data_ptr(), cache.v_scale[layer].data_ptr())


def _cache_ok(cache: KVCache) -> bool:
    """A float32 cache, or an int8 pool with its scales (the native step reads both)."""
    return cache.k.device.type == "cpu" and (
        cache.k.dtype == torch.float32 or (cache.k.dtype == torch.int8 and getattr(cache, "k_scale", None) is not None))


def applies(model: torch.nn.Module, input_ids: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> bool:
    """Whether this forward is a plain float32 CPU decode step the native function computes as the modules do."""
    return (
        _ENABLED
        and isinstance(cache, KVCache)  # a view of the engine's pool (a one-token prefill chunk) runs the modules
        and input_ids.shape[1] == 1
        and input_ids.shape[0] <= kernels.MAX_ROWS
        and batch.last_only
        and batch.lora is None  # rows with adapters run the modules (model/lora/layers.py adds their products)
        and batch.mask is None
        and batch.window_mask is None
        and batch.write_start == batch.kv_len - 1
        and input_ids.device.type == "cpu"
        and cache.k.dtype == torch.float32
        and model.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not _observed(model)
        and kernels.library() is not None
    )


def _reads_table(plan: "_Plan", model: torch.nn.Module) -> bool:
    """Whether the native step looks the tokens up itself: a table it reads (plan.embeds) and no forward hook on the
    embedding (examples/per_step_hook.py adds to its output), which needs the module called."""
    embed = model._modules["embed"]
    return plan.embeds and not (embed._forward_hooks or embed._forward_pre_hooks
                                or torch.nn.modules.module._global_forward_hooks
                                or torch.nn.modules.module._global_forward_pre_hooks)


def _sharded(model: torch.nn.Module) -> bool:
    """A tensor-parallel rank's model (model/parallel.py): its steps run part by part (_rank_step)."""
    return model.__dict__.get("parallel") is not None


def _observed(model: torch.nn.Module) -> bool:
    """A forward hook on the final norm (contrastive search reads the hidden states there) needs the modules: the
    native step never calls it."""
    norm = model._modules.get("norm")
    return norm is None or bool(norm._forward_hooks)


def decode_step(model: torch.nn.Module, input_ids: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor | None:
    """(B, V) float32 logits of the new tokens, or None when this model/cache cannot take the native step."""
    plan = _plan(model, cache)
    if not plan.ok:
        return None
    positions = batch.positions.reshape(-1).to(torch.int64).contiguous()  # (B,)
    if _reads_table(plan, model):  # no embedding operations here
        ids = input_ids.reshape(-1).to(torch.int64).contiguous()  # (B,)
        logits = torch.empty((ids.shape[0], model.config.vocab_size), dtype=torch.float32)
        rc = kernels.library().nt_decode_step_ids(
            ctypes.byref(plan.model), ids.data_ptr(), ids.shape[0], positions.data_ptr(), batch.write_start,
            batch.kv_len, logits.data_ptr(),
        )
        return logits if rc == 0 else None
    x = model.embed(input_ids)[:, 0].contiguous()  # (B, C): a fresh tensor, updated in place as the residual
    B = x.shape[0]
    if _sharded(model):
        slots = torch.arange(B, dtype=torch.int64)
        return _rank_step(plan, model, x, positions, (slots, 1), torch.full((B,), batch.kv_len, dtype=torch.int64))
    logits = torch.empty((B, model.config.vocab_size), dtype=torch.float32)
    rc = kernels.library().nt_decode_step(
        ctypes.byref(plan.model), x.data_ptr(), B, positions.data_ptr(), batch.write_start, batch.kv_len,
        logits.data_ptr(),
    )
    return logits if rc == 0 else None


def chains(model: torch.nn.Module, cache: KVCache) -> bool:
    """Whether greedy_chain can run this model and cache: one row whose native step (rows_plan's conditions)
    reads the token table itself (not a tensor-parallel rank, no hook on the embedding)."""
    if not isinstance(cache, KVCache) or cache.k.shape[1] != 1 or _sharded(model):
        return False
    plan = rows_plan(model, cache)
    return plan is not None and _reads_table(plan, model)


def greedy_chain(model: torch.nn.Module, cache: KVCache, token: int, position: int, col: int, n: int,
                 eos: torch.Tensor) -> list[int] | None:
    """Up to n greedy steps of one sequence in one native call (csrc/decode.cpp's nt_decode_greedy): `token`, at
    rotary position `position`, is written to cache column `col` and the argmax of each step's logits is the next
    step's token. The chosen tokens, ending early after one in `eos` (int64 ids); None when the native step
    refuses. Only for a model and cache that chains() accepts, with every column before `col` visible."""
    plan = _plan(model, cache)
    out = torch.empty(n, dtype=torch.int64)
    logits = torch.empty(model.config.vocab_size, dtype=torch.float32)  # the last step's, unused by the caller
    eos = eos.to(torch.int64).contiguous()
    got = kernels.library().nt_decode_greedy(ctypes.byref(plan.model), token, position, col, n, eos.data_ptr(),
                                             eos.numel(), out.data_ptr(), logits.data_ptr())
    return None if got < 1 else out[:got].tolist()


RowsPlan = _Plan  # a checked description of model + cache for the engine's rows


def rows_plan(model: torch.nn.Module, cache: KVCache) -> RowsPlan | None:
    """The native description when the engine's decode rows of this model and slot cache take the native step,
    else None. A property of the model and the cache alone (never of which requests share a step), so a request's
    numbers do not depend on its batch-mates. Checked once per step (the weights may have been replaced)."""
    if not (_ENABLED and getattr(model, "native_step", False) and _cache_ok(cache) and model.dtype == torch.float32 and not torch.is_grad_enabled()
            and not _observed(model) and kernels.library() is not None):
        return None
    plan = _plan(model, cache)
    return plan if plan.ok else None


def decode_rows(plan: RowsPlan, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                tables: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
    """(B, V) float32 logits for B rows that each own cache blocks: row b's new token (input_ids (B, 1)) at
    rotary position positions[b] writes its K/V at column kv_lens[b] - 1 and attends over its first kv_lens[b]
    columns. `tables` (B, W): row b's column s lives in cache block tables[b, s // block_size] (a paged pool,
    model/cache.py's PagedKVCache); or (B,): row b owns slot tables[b] of a slot cache. `plan` comes from rows_plan
    for this step. None when the native step fails."""
    if input_ids.shape[0] > kernels.MAX_ROWS:
        return None
    x = model.embed(input_ids)[:, 0].contiguous()  # (B, C): a fresh tensor, updated in place as the residual
    B = x.shape[0]
    stride = tables.shape[1] if tables.dim() == 2 else 1
    positions, tables, kv_lens = (t.reshape(-1).to(torch.int64).contiguous() for t in (positions, tables, kv_lens))
    if _sharded(model):
        return _rank_step(plan, model, x, positions, (tables, stride), kv_lens)
    logits = torch.empty((B, model.config.vocab_size), dtype=torch.float32)
    rc = kernels.library().nt_decode_rows(
        ctypes.byref(plan.model), x.data_ptr(), B, positions.data_ptr(), tables.data_ptr(), stride,
        kv_lens.data_ptr(), logits.data_ptr(),
    )
    return logits if rc == 0 else None


def _rank_step(plan: _Plan, model: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor,
               tables: tuple[torch.Tensor, int], kv_lens: torch.Tensor) -> torch.Tensor:
    """(B, V) logits of a tensor-parallel rank's step, rows as in decode_rows: x (B, C) is the all-reduced
    embedding. Every rank calls this in the same step, so each part's all-reduce meets the other ranks' (the same
    collectives, in the same order, as the modules' step). A refused part raises: every rank has the same rows and
    shapes, so every rank raises at the same part."""
    lib, ranks = kernels.library(), model.parallel.ranks
    B = x.shape[0]
    ptrs = (positions.data_ptr(), tables[0].data_ptr(), tables[1], kv_lens.data_ptr())
    part = torch.empty_like(x)  # (B, C) this rank's partial sum of one o or down projection
    for layer, biases in enumerate(plan.biases):
        for half, bias in enumerate(biases):
            if lib.nt_decode_part(ctypes.byref(plan.model), layer, half, x.data_ptr(), B, *ptrs, part.data_ptr()):
                raise RuntimeError(f"the native step refused layer {layer} of this rank's step")
            y = ranks.all_reduce(part)
            x += y if bias is None else y + bias  # the residual, as Block adds RowParallel's output
    local = torch.empty((B, plan.model.vocab), dtype=torch.float32)  # this rank's rows of the head (padded)
    if lib.nt_decode_part(ctypes.byref(plan.model), 0, 2, x.data_ptr(), B, *ptrs, local.data_ptr()):
        raise RuntimeError("the native step refused the LM head of this rank's step")
    return ranks.all_gather_last(local)[:, : model.config.vocab_size]


def _plan(model: torch.nn.Module, cache: KVCache) -> _Plan:
    plan: _Plan | None = getattr(model, "_fused_plan", None)
    if plan is None or plan.key != _key(model, cache):
        plan = _Plan(model, cache)
        model._fused_plan = plan
    return plan
