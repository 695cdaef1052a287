"""Tensor parallelism (Megatron's layout, as vLLM and gpt-fast's tp.py shard a Llama): each of N ranks holds a
slice of every large matrix, and two all-reduces per block put the slices' partial products back together.

    q/k/v, gate/up        column-parallel: each rank computes its own heads / its share of the MLP's columns
    o, down               row-parallel: each rank multiplies its input slice; the partial (B, T, C) sums are
                          all-reduced, then the bias (once) is added
    embedding             vocab-parallel: each rank looks up the ids in its rows (zeros elsewhere); all-reduce
    LM head               vocab-parallel: each rank's (B, V/N) logits, all-gathered into (B, V) on every rank
    MoE experts           each expert's gate/up by columns, down by rows (the shared expert too); the router and
                          the shared expert's gate replicated; one all-reduce of the weighted partial sum per block

KV heads are split like the q heads; where a model has fewer KV heads than ranks, each rank keeps the one KV head
its q heads read (replicated). Norms, RoPE tables and the KV cache layout are per rank and need no traffic.

The sharded model is still a `Transformer` (the same blocks and forward), built from a *rank-local* config (its
heads, KV heads and MLP width divided by N) with the layers above swapped in. `model.parallel` describes the rank;
`shard.load_model_shard` reads only this rank's slices from the safetensors files.

Collectives run only while the ranks step together: `RankGroup.active` is set by the engine on every rank around
one step. A forward outside such a step (rank 0 alone, e.g. beam search) raises instead of waiting forever on
ranks that are not listening.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..families import BY_ARCHITECTURE, FAMILIES
from ..errors import ModelLoadError, TensorParallelError
from .quant.int8 import Int8Linear, quantize_rows
from .linear import Linear
from .memory import release_freed_memory, repack
from .moe import MoE

__all__ = ["RankGroup", "Shards", "TensorParallelError", "check_divisible", "shard_modules", "quantize_int8_sharded"]


@dataclass
class RankGroup:
    """This process's place among the ranks of one sharded model."""

    rank: int
    size: int
    group: Any = None  # the torch.distributed ProcessGroup (None: the default group)
    active: bool = False  # True while every rank runs the same step (set by the engine on each rank)
    device: torch.device = torch.device("cpu")  # where this rank's tensors (and NCCL's buffers) live

    def check_active(self) -> None:
        if not self.active:
            raise TensorParallelError(
                f"this model is sharded over {self.size} ranks, and only the engine's steps drive them all: run it "
                "through LLM.generate / the server with greedy or sampled decoding (beam, group-beam and "
                "contrastive search, and processors that run the model themselves, need tensor_parallel_size=1)"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in float32 (bfloat16 partial sums would round once per rank), in x's dtype."""
        self.check_active()
        y = x.float() if x.dtype != torch.float32 else x.contiguous()
        dist.all_reduce(y, group=self.group)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        self.check_active()
        y = x.float().contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.MAX, group=self.group)
        return y

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (..., n) concatenated along the last dimension: (..., N * n)."""
        self.check_active()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class Shards:
    """Which rows and columns of each checkpoint matrix one rank holds (`(start, end)` along the split dimension)."""

    rank: int
    size: int
    q: tuple[int, int]  # rows of q_proj, columns of o_proj
    kv: tuple[int, int]  # rows of k_proj and v_proj
    mlp: tuple[int, int]  # rows of gate_proj and up_proj, columns of down_proj
    vocab: tuple[int, int]  # rows of the embedding and the LM head held (the last rank's may run short: padded)
    vocab_rows: int  # rows per rank (padded): ceil(V / N)
    expert: tuple[int, int] = (0, 0)  # rows of every MoE expert's gate and up, columns of its down
    shared: tuple[int, int] = (0, 0)  # the same of Qwen2-MoE's shared expert

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, size: int) -> "Shards":
        check_divisible(cfg, size)
        D, H, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        q_heads = H // size
        if Hkv >= size:
            kv_heads = Hkv // size
            kv = (rank * kv_heads * D, (rank + 1) * kv_heads * D)
        else:  # fewer KV heads than ranks: each rank keeps the KV head its q heads belong to
            head = rank * Hkv // size
            kv = (head * D, (head + 1) * D)
        I = cfg.intermediate_size // size
        rows = -(-cfg.vocab_size // size)
        vocab = (min(rank * rows, cfg.vocab_size), min((rank + 1) * rows, cfg.vocab_size))
        E = cfg.moe.intermediate_size // size if cfg.moe else 0
        S = cfg.moe.shared_intermediate_size // size if cfg.moe else 0
        return cls(rank, size, (rank * q_heads * D, (rank + 1) * q_heads * D), kv, (rank * I, (rank + 1) * I),
                   vocab, rows, (rank * E, (rank + 1) * E), (rank * S, (rank + 1) * S))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config one rank's modules are built from: its heads, KV heads and MLP (and expert) widths."""
        D = cfg.head_dim
        moe = cfg.moe and dataclasses.replace(cfg.moe, intermediate_size=self.expert[1] - self.expert[0],
                                              shared_intermediate_size=self.shared[1] - self.shared[0])
        return dataclasses.replace(
            cfg,
            num_attention_heads=(self.q[1] - self.q[0]) // D,
            num_key_value_heads=(self.kv[1] - self.kv[0]) // D,
            intermediate_size=self.mlp[1] - self.mlp[0],
            moe=moe,
        )


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ModelLoadError unless this model splits over `size` ranks."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    declared = BY_ARCHITECTURE.get(cfg.architecture)
    if size > 1 and not (declared and declared.tensor_parallel):
        splits = ", ".join(f.architecture for f in FAMILIES if f.tensor_parallel)
        raise ModelLoadError(
            f"tensor parallelism does not split {cfg.architecture} yet (it splits {splits}): "
            "load it with tensor_parallel_size=1"
        )
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if H % size:
        problems.append(f"num_attention_heads={H}")
    if Hkv % size and size % Hkv:
        problems.append(f"num_key_value_heads={Hkv} (nor does {size} split into copies of them)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate_size={cfg.intermediate_size}")
    if cfg.moe and cfg.moe.intermediate_size % size:
        problems.append(f"the experts' intermediate size {cfg.moe.intermediate_size}")
    if cfg.moe and cfg.moe.shared_intermediate_size % size:
        problems.append(f"shared_expert_intermediate_size={cfg.moe.shared_intermediate_size}")
    if problems:
        raise ModelLoadError(
            f"tensor_parallel_size={size} does not divide {', '.join(problems)} of {cfg.architecture}: choose a "
            f"size that divides them (e.g. {_sizes(cfg)})"
        )
    if size > 1 and Hkv < size and cfg.qk_norm == "projection":
        raise ModelLoadError(
            f"{cfg.architecture} normalises k over the whole projection, which ranks holding copies of its "
            f"{Hkv} KV heads cannot split: use tensor_parallel_size <= {Hkv}"
        )


def _sizes(cfg: ModelConfig) -> str:
    """The sizes that split this model, for the error message."""
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    widths = [cfg.intermediate_size]
    if cfg.moe:  # the experts' and the shared expert's widths split too
        widths += [cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size]
    fits = [n for n in range(1, H + 1) if not H % n and not any(w % n for w in widths) and not (Hkv % n and n % Hkv)]
    return ", ".join(map(str, fits[:6]))


class RowParallel(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: this rank's input columns of a row-split matrix (o, down)."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, ranks: RankGroup) -> None:
        super().__init__()
        self.inner, self.ranks = inner, ranks  # inner: a Linear / Int8Linear without bias
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ranks.all_reduce(self.inner(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)


class ParallelHead(nn.Module):
    """(..., C) -> (..., V) logits: this rank's V/N rows of the LM head, all-gathered (padding rows dropped)."""

    def __init__(self, inner: nn.Module, vocab_size: int, ranks: RankGroup) -> None:
        super().__init__()
        self.inner, self.vocab_size, self.ranks = inner, vocab_size, ranks

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ranks.all_gather_last(self.inner(x))[..., : self.vocab_size]


class ParallelEmbedding(nn.Module):
    """Embedding rows [start, start + rows) on this rank; other ids give zeros here, their own row elsewhere, so
    the all-reduced sum is each id's row exactly (x + 0)."""

    def __init__(self, weight: torch.Tensor, start: int, ranks: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (V/N, C)
        self.start, self.ranks = start, ranks

    def _local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        return local.clamp(0, self.weight.shape[0] - 1), inside  # (B, T) each

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, inside = self._local(ids)
        rows = F.embedding(local, self.weight) * inside[..., None].to(self.weight.dtype)  # (B, T, C)
        return self.ranks.all_reduce(rows)


class ParallelInt8Embedding(nn.Module):
    """ParallelEmbedding over int8 rows with per-row scales (quant.Int8Embedding's arithmetic, per rank)."""

    def __init__(self, table: Int8Linear, start: int, dtype: torch.dtype, ranks: RankGroup) -> None:
        super().__init__()
        self.table, self.start, self.dtype, self.ranks = table, start, dtype, ranks

    @property
    def weight(self) -> torch.Tensor:  # the model's dtype/device are read from embed.weight
        return torch.empty(0, dtype=self.dtype, device=self.table.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.table.weight.shape[0])
        local = local.clamp(0, self.table.weight.shape[0] - 1)
        rows = F.embedding(local, self.table.weight).to(torch.float32) * self.table.scale[local][..., None]
        rows = (rows * inside[..., None]).to(self.dtype)  # (B, T, C)
        return self.ranks.all_reduce(rows)


class ParallelProjectionNorm(nn.Module):
    """OLMo 2's RMSNorm over a whole q or k projection whose columns are split over the ranks: the sum of squares
    is all-reduced, so every rank divides by the full projection's mean square."""

    def __init__(self, weight: torch.Tensor, full_dim: int, eps: float, ranks: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (local,)
        self.full_dim, self.eps, self.ranks = full_dim, eps, ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        square = self.ranks.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.full_dim
        xf = xf * square.add_(self.eps).rsqrt_()
        return self.weight * (xf if dtype == torch.float32 else xf.to(dtype))


@dataclass(frozen=True)
class ParallelInfo:
    ranks: RankGroup
    shards: Shards
    full_config: ModelConfig  # the checkpoint's config (model.config is the rank-local one)


def shard_modules(model: nn.Module, full: ModelConfig, shards: Shards, ranks: RankGroup) -> None:
    """Swap a rank-local Transformer's (built on the meta device) embedding, head, o and down projections and
    whole-projection norms for their parallel forms, in place; the loader then assigns the slices."""
    meta = torch.device("meta")
    C, V = full.hidden_size, shards.vocab_rows
    model.embed = ParallelEmbedding(torch.empty(V, C, device=meta), shards.vocab[0], ranks)
    model.lm_head = ParallelHead(Linear(C, V, bias=False, device=meta), full.vocab_size, ranks)
    for block in model.layers:
        att, mlp = block.attention, block.mlp
        att.wo = RowParallel(Linear(att.wo.in_features, C, bias=False, device=meta),
                             torch.empty(C, device=meta) if full.attention_bias else None, ranks)
        if isinstance(mlp, MoE):
            # Every expert (and the shared one) holds its columns of gate/up and rows of down, with no all-reduce of
            # its own: the router (and the shared expert's gate) is replicated, so every rank picks the same experts
            # with the same weights, and the weighted sum of partial outputs is all-reduced once, after the block.
            if full.mlp_bias:
                raise ModelLoadError(f"{full.architecture} with mlp_bias: tensor parallelism splits bias-free experts")
            mlp.reduce = ranks.all_reduce
        else:
            mlp.w2 = RowParallel(Linear(mlp.w2.in_features, C, bias=False, device=meta),
                                 torch.empty(C, device=meta) if full.mlp_bias else None, ranks)
        if full.qk_norm == "projection" and ranks.size > 1:
            q, kv = shards.q[1] - shards.q[0], shards.kv[1] - shards.kv[0]
            kv_full = full.num_key_value_heads * full.head_dim
            att.q_norm = ParallelProjectionNorm(torch.empty(q, device=meta), full.num_attention_heads * full.head_dim,
                                                full.rms_norm_eps, ranks)
            att.k_norm = ParallelProjectionNorm(torch.empty(kv, device=meta), kv_full, full.rms_norm_eps, ranks)


@torch.no_grad()
def quantize_int8_sharded(model: nn.Module) -> nn.Module:
    """quant.quantize_int8 for a sharded model, giving each weight exactly the single-process int8 values: row
    scales of column-split and vocab-split matrices are whole rows already; a row-split matrix's row scale comes
    from the all-reduced maximum over every rank's part of the row."""

    info: ParallelInfo = model.parallel
    dtype = model.dtype
    tied = model.lm_head.weight is model.embed.weight
    row_split = [(m, "inner") for m in model.modules() if isinstance(m, RowParallel)]
    for moe in (m for m in model.modules() if isinstance(m, MoE)):  # every expert's down projection is row-split
        row_split += [(mlp, "w2") for mlp in [*moe.experts, moe.shared] if mlp is not None]
    for module, name in row_split:
        if type(getattr(module, name)) is Linear:
            w = getattr(module, name).weight.detach().float()
            scale = info.ranks.all_reduce_max(w.abs().amax(dim=1)).clamp(min=1e-12) / 127.0  # (N,)
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            setattr(module, name, Int8Linear(q, scale, None))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is Linear:
                setattr(module, name, Int8Linear.from_linear(child))
    if tied:
        table = model.lm_head.inner
    else:
        q, scale = quantize_rows(model.embed.weight.detach())
        table = Int8Linear(q, scale, None)
    model.embed = ParallelInt8Embedding(table, model.embed.start, dtype, info.ranks)
    model.quantization = "int8"
    release_freed_memory()
    repack(model)
    release_freed_memory()
    return model


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters and buffers (tied tensors once)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())
