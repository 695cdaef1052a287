"""A whole decode step in one native call (csrc/decode.cpp): the fast path for float32-activation models on CPU.

A plain decode step of the PyTorch modules is ~280 small operations; for a 15M-parameter model their dispatch
costs about as much as streaming the weights. `decode_step` instead hands the embedded tokens, the weights and
the KV cache to one C++ function that runs every layer, the final norm and the LM head, and returns the logits.

It takes what it computes exactly like the modules: float32 activations on CPU, one new token per row at the
last cache column with every column visible (no padding) but for the sliding layers' window, which the native
attention computes itself, weights that are `Linear`, `BF16Linear`, `Int8Linear`, `Int4Linear` or GGUF's packed `GGUFLinear` layers
of the stock blocks. Every family's block is a set of switches there (q/k norms, Gemma's (1 + w) sandwich norms, OLMo 2's
norms after each branch, Granite's multipliers, GeGLU, soft-caps, local RoPE, LongRoPE, MoE experts, gpt-oss's
attention sinks and clamped SwiGLU; Gemma 4's own block: per-layer shapes, KV sharing, per-layer inputs, the experts
beside the MLP), and LoRA
rows add their adapter's products. Everything else returns None and runs the modules, which are the reference the
tests hold this path to (same tokens; logits within float32 rounding).

A tensor-parallel rank (model/parallel.py) needs an all-reduce after every o and down projection, so it runs the
same native code a part at a time (csrc/decode.cpp's nt_decode_part): per layer, the attention half and the MLP
half each return this rank's partial sum, which Python all-reduces and joins to the residual (with the branch's
post-norm or multiplier); then the final norm and this rank's rows of the LM head, all-gathered. The same
operations as the rank's modules, in their order.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import operator
from typing import Iterator

import torch

from ..families import family
from . import arithmetic, kernels
from .batch import ForwardBatch
from .cache import KVCache
from .layers import MLP, Attention, Block, RMSNorm
from .moe import MoE
from .native_abi import describe, describe_table, weight_rows
from .native_abi import (KV_F32, KV_I8, NT_GELU, NT_NORM_AFTER, NT_PLUS_ONE, NT_RELU2, NT_SANDWICH, QK_HEAD,
                         QK_NONE, QK_PROJECTION)
from .native_abi import NtExpert as _Expert
from .native_abi import NtLayer as _Layer
from .native_abi import NtLinear as _Linear
from .native_abi import NtLora as _Lora
from .native_abi import NtModel as _Model
from .native_abi import (MIX_ATTENTION, MIX_DELTA_RULE, MIX_SHORT_CONV, MIX_SSD, ROUTE_SIGMOID, ROUTE_SOFTMAX,
                         ROUTE_TOPK_SOFTMAX)
from .native_abi import NtRecurrent as _Recurrent
from .recurrent import GatedDeltaNet, Mamba2Mixer, ShortConvolution, StateSlots

_KV_KIND = {torch.float32: KV_F32, torch.int8: KV_I8}  # the cache's (NtModel.kv_kind)


@contextlib.contextmanager
def disabled(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Run the PyTorch modules for decode steps too (the reference the fused step is tested against): `model`'s
    policy with fused_step=False inside the block, or without a model every model's in this thread
    (arithmetic.changed). NEXTTOKEN_FUSED=0 makes it the default of the models built after."""
    if model is None:
        with arithmetic.changed(fused_step=False):
            yield
        return
    before = model.arithmetic
    model.arithmetic = before.replace(fused_step=False)
    try:
        yield
    finally:
        model.arithmetic = before


def _fused_on(model: torch.nn.Module) -> bool:
    """Whether the model's arithmetic (model.arithmetic, with any enclosing arithmetic.changed) takes the fused
    step."""
    return arithmetic.in_force(model.__dict__.get("_arithmetic")).fused_step


# csrc/nt_abi.h's NtModel.flags and qk_norm codes
_PLUS_ONE, _SANDWICH, _NORM_AFTER, _GELU = NT_PLUS_ONE, NT_SANDWICH, NT_NORM_AFTER, NT_GELU
_QK_NORM = {None: QK_NONE, "head": QK_HEAD, "projection": QK_PROJECTION}


def _linear(module: torch.nn.Module) -> _Linear | None:
    """A weight layer as an NtLinear: what the layer says of itself (native_abi.describe, the one chooser of
    kinds), or None where the native step does not compute it."""
    return describe(module)


def _embedding(module: torch.nn.Module, vocab: int) -> _Linear | None:
    """The token table as the native step reads it (csrc/decode.cpp's embed: ids in [0, vocab)), or None: a
    float32 nn.Embedding, bf16.BF16Embedding's bfloat16 rows or quant.Int8Embedding's int8 rows and scales (a
    tensor-parallel rank's vocab-parallel table is looked up in Python; native_abi.describe_table chooses)."""
    w = _table(module)
    if not w.is_contiguous() or w.dim() != 2 or w.shape[0] < vocab:
        return None
    return describe_table(module)


class _Reads:
    """What one `_read` walk read: each dict lookup with the object it gave, each dict iterated with its values, each
    tensor's data pointer. While all of them still hold, nothing the native description was built from has moved,
    so `holds` checks them instead of walking the model again: a few passes in C over flat lists (~50 us on a
    30-layer model, where the walk in Python cost ~0.5 ms a step, 5% of SmolLM2's decode step)."""

    def __init__(self) -> None:
        self._gets: dict[tuple[int, object], tuple[dict, object, object]] = {}  # (id(dict), key) -> its read
        self._views: dict[int, tuple[dict, tuple]] = {}  # id(dict) -> (dict, its values when iterated)
        self._ptrs: dict[int, tuple[torch.Tensor, int]] = {}  # id(tensor) -> (tensor, its data pointer)

    def of(self, d: dict) -> "_Recorded":
        return _Recorded(d, self)

    def ptr(self, t: torch.Tensor) -> None:
        self._ptrs.setdefault(id(t), (t, t.data_ptr()))

    def freeze(self) -> "_Reads":
        """The reads as flat lists for `holds`."""
        gets = list(self._gets.values())
        self.dicts, self.keys, self.objects = [g[0] for g in gets], [g[1] for g in gets], [g[2] for g in gets]
        self.viewed = [d for d, _ in self._views.values()]
        self.sizes = [len(v) for _, v in self._views.values()]
        self.values = [x for _, v in self._views.values() for x in v]
        self.tensors = [t for t, _ in self._ptrs.values()]
        self.pointers = [p for _, p in self._ptrs.values()]
        return self

    def holds(self) -> bool:
        return (all(map(operator.is_, map(dict.get, self.dicts, self.keys, itertools.repeat(_MISSING)), self.objects))
                and list(map(len, self.viewed)) == self.sizes
                and all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self.viewed)), self.values))
                and list(map(torch.Tensor.data_ptr, self.tensors)) == self.pointers)


_MISSING = object()


class _Unrecorded:
    """Reads that are not remembered (what builds the description): each dict as it is."""

    @staticmethod
    def of(d: dict) -> dict:
        return d


_UNRECORDED = _Unrecorded()


class _Recorded:
    """A dict whose reads are remembered by a `_Reads` (what `_read` walks through)."""

    __slots__ = ("d", "reads")

    def __init__(self, d: dict, reads: _Reads) -> None:
        self.d, self.reads = d, reads

    def get(self, k: object, default: object = None) -> object:
        v = self.d.get(k, _MISSING)
        self.reads._gets.setdefault((id(self.d), k), (self.d, k, v))
        return default if v is _MISSING else v

    def __getitem__(self, k: object) -> object:
        v = self.d[k]
        self.reads._gets.setdefault((id(self.d), k), (self.d, k, v))
        return v

    def __contains__(self, k: object) -> bool:
        return self.get(k, _MISSING) is not _MISSING

    def values(self):  # noqa: ANN201
        self.reads._views.setdefault(id(self.d), (self.d, tuple(self.d.values())))
        return self.d.values()


def _cache_key(cache: KVCache, states: StateSlots | None) -> tuple:
    """What the native description depends on outside the model (`_read` covers the model): the cache (shape
    too: a new cache of another length can be allocated where a freed one was) and the recurrent layers' state
    slots (issue 41: read and updated in place). Computed each step (a few attributes); never held, so a dropped
    cache is freed."""
    key = [cache.k.shape, cache.k.dtype, cache.k.data_ptr(), cache.v.data_ptr()]
    if states is not None:
        key += [t.data_ptr() for ts in states.tensors.values() for t in ts]
    return tuple(key)


def _read(model: torch.nn.Module, r: _Reads) -> None:
    """Read, through `r`, every module and weight the native step reads inside the model (the modules' own dicts:
    nn.Module attribute lookups would cost more); `_Reads.holds` then tells each step whether any of them moved."""
    d = r.of(model.__dict__)
    for f in ("inv_freq", "local_inv_freq", "long_inv_freq", "global_inv_freq"):
        if d.get(f) is not None:
            r.ptr(d[f])
    modules = r.of(model._modules)
    r.ptr(_table(modules["embed"], r))
    for m in (modules["norm"], modules["lm_head"]):
        r.ptr(_weight(m, r))
    for block in r.of(modules["layers"]._modules).values():
        parts = r.of(block._modules)
        mlp = {} if parts.get("mlp") is None else r.of(parts["mlp"]._modules)  # None: Mamba2's block, the mixer alone
        for m in (parts["attention_norm"], parts.get("ffn_norm"), parts.get("attention_post_norm"),
                  parts.get("ffn_post_norm"), mlp.get("w13"), mlp.get("w1"), mlp.get("w2")):
            if m is not None:
                r.ptr(_weight(m, r))
        for mixer in (parts["attention"], parts.get("mamba")):  # mamba: Falcon-H1's mixer beside the attention
            if mixer is not None:
                _read_mixer(mixer, r)
        sinks = r.of(parts["attention"]._parameters).get("sinks")  # gpt-oss's per-head logits (NtLayer.sinks)
        if sinks is not None:
            r.ptr(sinks)
        if "experts" in mlp:  # a MoE block: its router, experts and shared expert
            _read_modules(parts["mlp"], r)
        if _form(block) == "gemma4":  # its per-layer input, layer scalar, and experts beside the MLP
            _read_modules(block, r)
            for p in r.of(block._parameters).values():
                r.ptr(p)
            if parts.get("experts") is not None:
                for p in r.of(parts["experts"]._parameters).values():
                    if p is not None:
                        r.ptr(p)


def _read_mixer(mixer: torch.nn.Module, r: _Reads) -> None:
    """An attention's or a recurrent mixer's matrices, norms and own tensors (taps, decays, norm), through r."""
    att = r.of(mixer._modules)
    for m in (att.get("wqkv"), att.get("wi"), att["wo"], att.get("q_norm"), att.get("k_norm")):
        if m is not None:
            r.ptr(_weight(m, r))
    if "wi" in att:  # a recurrent mixer
        for t in r.of(mixer._parameters).values():
            if t is not None:
                r.ptr(t)


def _read_modules(module: torch.nn.Module, r: _Reads) -> None:
    """Every module under `module` that holds a weight (routers, experts' linears), through r."""
    for m in r.of(module._modules).values():
        if m is None:
            continue
        w = r.of(m._parameters).get("weight")
        if w is None:
            w = r.of(m._buffers).get("weight")
        if w is not None:
            r.ptr(w)
        else:
            _read_modules(m, r)


def _weight(m: torch.nn.Module, r: "_Reads | _Unrecorded" = _UNRECORDED) -> torch.Tensor:
    m = _local(m, r)
    w = r.of(m._parameters).get("weight")
    return r.of(m._buffers)["weight"] if w is None else w  # Int8Linear keeps its weight as a buffer


def _table(embed: torch.nn.Module, r: "_Reads | _Unrecorded" = _UNRECORDED) -> torch.Tensor:
    """The tensor an embedding module's rows live in (BF16Embedding / Int8Embedding: their shared table's)."""
    table = r.of(embed._modules).get("table")
    return _weight(table, r) if table is not None else _weight(embed, r)


def _local(m: torch.nn.Module, r: "_Reads | _Unrecorded" = _UNRECORDED) -> torch.nn.Module:
    """The rank's own matrix inside a tensor-parallel wrapper (parallel.RowParallel / ParallelHead), or the base
    matrix inside a LoRA wrapper (lora.LoraLinear: the native step computes the base model's rows), else m."""
    inner = r.of(m._modules).get("inner")
    return m if inner is None else inner


class _Plan:
    """The ctypes description of one model + cache, kept while none of their tensors move."""

    def __init__(self, model: torch.nn.Module, cache: KVCache, states: StateSlots | None = None) -> None:
        cfg = model.config
        self.cache_key = _cache_key(cache, states)
        self.reads = _Reads()
        _read(model, self.reads)
        self.reads.freeze()
        self.ok = False
        self.states, self.recurrent = states, []  # the recurrent layers' slots and NtRecurrents, kept with the plan
        self.biases: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []  # a rank's o / down biases per layer
        if not _rms(model.norm) or cfg.head_dim > 512 or cfg.hidden_act not in _ACTIVATIONS:
            return
        if not _native_parts(cfg):  # a family whose declaration keeps the modules (parts the native step lacks)
            return
        sharded = _sharded(model)
        self.local_rope = model.__dict__.get("local_inv_freq") is not None
        self.mup = cfg.mup  # Falcon-H1's multipliers (its parallel blocks')
        # Nemotron-H's ungated squared-ReLU MLPs (NtFlag NT_RELU2: every dense MLP of the model is one)
        self.relu2 = any(_form(block.mlp) == "relu2" for block in model.layers)
        layers, self.experts = [], []  # experts: each MoE layer's (E,) _Expert array, kept alive with the plan
        for i, block in enumerate(model.layers):
            if _form(block) == "parallel":  # Falcon-H1: its attention and mixer layers in one NtLayer
                layer = self._parallel_layer(block, cache, sharded)
            elif _form(block) == "gemma4":  # Gemma 4's block: its own shapes, KV sharing, per-layer input, experts
                layer = None if sharded else self._gemma4_layer(model, block, cache)
            else:
                build = _NATIVE_KINDS.get(cfg.layer(i).mixer)  # the declared kind's native layer, if it has one
                layer = None if build is None else build(self, block, cache, i, sharded)
            if layer is None:
                return
            layers.append(layer)
            # a rank's row-parallel o / down add their bias once, after the all-reduce (None in one process)
            dense = type(block.mlp) is MLP  # a MoE's experts have no bias (nor an all-reduce of their own)
            self.biases.append((block.attention.wo.bias, block.mlp.w2.bias if dense else None) if sharded
                               else (None, None))
        head = _linear(_local(model.lm_head))
        if head is None:
            return
        _, _, Hkv, S, D = cache.k.shape
        vocab = model.parallel.shards.vocab_rows if sharded else cfg.vocab_size  # a rank: its rows of the head
        self.layers = (_Layer * len(layers))(*layers)  # kept alive with the plan
        # Gemma 4's per-layer inputs are computed from the embeddings in Python (_per_layer): no native lookup then
        embed = None if sharded or cfg.per_layer_input else _embedding(model.embed, vocab)
        self.embeds = embed is not None  # the native step then reads the token table itself
        moe = cfg.moe
        flags = ((_PLUS_ONE if cfg.norm_plus_one else 0) | (_SANDWICH if cfg.sandwich_norm else 0)
                 | (_NORM_AFTER if cfg.norm_after else 0) | (_GELU if cfg.hidden_act == "gelu_pytorch_tanh" else 0)
                 | (NT_RELU2 if self.relu2 else 0))
        # Gemma's sqrt(hidden) rounded to float32, as _trunk's torch.tensor(embed_scale, dtype=x.dtype) does
        embed_scale = 1.0 if cfg.embed_scale is None else float(torch.tensor(cfg.embed_scale, dtype=torch.float32))
        local, long = model.__dict__.get("local_inv_freq"), model.__dict__.get("long_inv_freq")
        # Gemma 4's full layers rotate their whole (global_head_dim) heads by their own frequencies (proportional:
        # zeros past the rotated share), its sliding layers by local_inv_freq
        inv_freq = model.__dict__.get("global_inv_freq", model.inv_freq)
        self.model = _Model(
            len(layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size, vocab, embed or _Linear(None, 0, None, None), Hkv * S * D, S * D,
            cfg.rms_norm_eps, inv_freq.data_ptr(), model.norm.weight.data_ptr(), head, self.layers,
            _KV_KIND[cache.k.dtype], flags, _QK_NORM[cfg.qk_norm], cfg.embedding_multiplier, embed_scale,
            cfg.attention_multiplier or 0.0, cfg.attn_logit_softcapping or 0.0, cfg.residual_multiplier,
            cfg.final_logit_softcapping or 0.0, cfg.logits_scaling, cfg.sliding_window or 0,
            None if local is None else local.data_ptr(), None if long is None else long.data_ptr(),
            cfg.rope.original_max_position_embeddings or 0, cfg.rope.attention_factor,
            moe.num_experts if moe else 0, moe.top_k if moe else 0, int(bool(moe and moe.norm_topk_prob)),
            moe.intermediate_size if moe else 0, moe.shared_intermediate_size if moe else 0,
            **_routing(moe),
            swiglu_limit=cfg.swiglu_limit or 0.0, swiglu_alpha=cfg.swiglu_alpha,  # gpt-oss's clamped SwiGLU
            kv_dim=D, per_layer_dim=cfg.per_layer_input,  # Gemma 4's widest layer's columns, per-layer inputs' P
        )
        # The same model for a forward whose batch carries no window (mask None past the window: the modules then
        # attend over every column of the sliding layers too).
        if cfg.rotary_dim and cfg.rotary_dim < cfg.head_dim:  # Qwen3.5's partial RoPE: the first rotary_dim dims
            self.model.rotary_dim = cfg.rotary_dim
        elif cfg.rope.type == "proportional":  # Gemma 4's: the whole head (zero frequencies past the share)
            self.model.rotary_dim = 2 * inv_freq.numel()
            self.model.rope_scaling = 1.0  # Gemma4Transformer's tables take no attention factor
        elif cfg.rope.partial_rotary_factor < 1.0:  # GLM-4 MoE's: the first share of each head (rope.py's tables)
            self.model.rotary_dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
        self.no_window = _Model.from_buffer_copy(self.model)
        self.no_window.window = 0
        self.ok = True

    def _attention_layer(self, block: torch.nn.Module, cache: KVCache, i: int, sharded: bool) -> _Layer | None:
        """Attention block i as csrc/decode.cpp's NtLayer, or None where it holds a part the native step does not
        compute. Its kind's RoPE: the model's, none (NoPE: no_rope), or the local one, which the native step ties
        to the sliding layers (NtModel.local_inv_freq)."""
        att, mlp = block.attention, block.mlp
        kind = att.kind
        if (kind.rope == "local") != (kind.window and self.local_rope):
            return None
        if att.gated and att.qk_norm == "projection":  # the native gated rows norm each head (Qwen3.5's)
            return None
        if att.gated and "lora_A" in att.wqkv._buffers:  # adapters on gated q rows (Qwen3.5): the modules apply them
            return None
        if (_form(block) not in ("block", "parallel") or (type(att), type(block.attention_norm)) != (Attention, RMSNorm)
                or type(block.ffn_norm) is not (RMSNorm if mlp is not None else type(None))):
            return None
        norms = [getattr(att, "q_norm", None), getattr(att, "k_norm", None),
                 getattr(block, "attention_post_norm", None), getattr(block, "ffn_post_norm", None)]
        if any(n is not None and type(n) is not RMSNorm for n in norms):
            return None
        sinks = _sinks(att, sharded)
        if sinks is False:
            return None
        linears = [_linear(_local(m)) for m in (att.wqkv, att.wo)]
        moe = _no_moe()
        dense = self._dense_mlp(mlp)
        if dense is not None:
            linears += dense
        elif type(mlp) is MoE and (mlp.reduce is None) != sharded:  # a rank: _rank_step all-reduces its sum
            linears += [_Linear(), _Linear()]  # no dense MLP: the experts'
            moe = self._moe(mlp)
            if moe is None:
                return None
        else:
            return None
        if any(lin is None for lin in linears):
            return None
        up = getattr(mlp, "w1" if self.relu2 else "w13", None)  # Nemotron-H's ungated up, else gate and up
        loras = [_lora(m) for m in (att.wqkv, att.wo, up, getattr(mlp, "w2", None))]
        return _Layer(block.attention_norm.weight.data_ptr(),
                      None if block.ffn_norm is None else block.ffn_norm.weight.data_ptr(), *linears,
                      cache.k[i].data_ptr(), cache.v[i].data_ptr(), *_scales(cache, i),
                      *[None if n is None else n.weight.data_ptr() for n in norms], int(att.sliding),
                      no_rope=int(kind.rope is None), **moe,
                      lora_qkv=loras[0], lora_o=loras[1], lora_w13=loras[2], lora_w2=loras[3],
                      gated=int(att.gated), sinks=sinks)

    def _recurrent_layer(self, block: torch.nn.Module, cache: KVCache, i: int, sharded: bool) -> _Layer | None:
        """Recurrent block i (issue 41: LFM2's short convolution, the gated delta rule, Mamba2's SSD) as an NtLayer
        whose mixer reads `recurrent` (csrc/recurrent.cpp): its weights and layer i's state slots, which the native
        step updates in place. None where a part is not one the native step computes, or no slots are held."""
        mixer, mlp = block.attention, block.mlp
        if sharded or _form(block) != "block" or type(block.attention_norm) is not RMSNorm:
            return None
        if type(block.ffn_norm) not in (RMSNorm, type(None)) or getattr(block, "sandwich", False):
            return None
        kind, recurrent = self._mixer(mixer, i)
        moe = _no_moe()
        if type(mlp) is MoE:  # a sparse MLP after the mixer (LFM2-MoE, Qwen3.5-MoE, Qwen3-Next, Granite 4.0-H)
            moe, linears = self._moe(mlp), [_Linear(), _Linear()]
        else:
            linears = self._dense_mlp(mlp)
        if recurrent is None or moe is None or linears is None or any(lin is None for lin in linears):
            return None
        # the MLP's adapters (LoRA on hybrids adapts attention and MLP matrices, never the mixer's own)
        loras = [_lora(getattr(mlp, "w1" if self.relu2 else "w13", None)), _lora(getattr(mlp, "w2", None))]
        return _Layer(block.attention_norm.weight.data_ptr(),
                      None if block.ffn_norm is None else block.ffn_norm.weight.data_ptr(), _Linear(), _Linear(),
                      *linears, mixer=kind, recurrent=ctypes.pointer(recurrent), lora_w13=loras[0], lora_w2=loras[1],
                      **moe)

    def _moe(self, mlp: MoE) -> dict | None:
        """A sparse MLP's NtLayer fields (router, experts, shared expert and its gate, correction bias), or None
        where a part is not one the native step computes. The experts' array is kept alive with the plan."""
        if any("lora_A" in m._buffers for m in mlp.modules()):  # adapters on a shared expert: the modules apply them
            return None
        experts = [_expert(e) for e in mlp.experts]
        shared = None if mlp.shared is None else _expert(mlp.shared)
        router = _kept(mlp.gate)
        gate = None if mlp.shared_gate is None else _kept(mlp.shared_gate)
        correction = mlp.correction
        if router is None or any(e is None for e in experts) or (mlp.shared is not None and shared is None) or (
                mlp.shared_gate is not None and gate is None):
            return None
        if correction is not None and (correction.dtype != torch.float32 or not correction.is_contiguous()):
            return None
        self.experts.append((_Expert * len(experts))(*experts))
        return dict(router=router, experts=self.experts[-1], shared=shared or _Expert(),
                    shared_gate=gate or _Linear(), correction=None if correction is None else correction.data_ptr())

    def _mixer(self, mixer: torch.nn.Module, i: int) -> tuple[int, _Recurrent | None]:
        """Recurrent mixer `mixer` of layer i as (its NtMixer, its NtRecurrent, kept with the plan), or (0, None)
        where it is not a kind the native step computes or no float32 slots of layer i are held."""
        if self.states is None or i not in self.states.tensors:
            return MIX_ATTENTION, None
        kind, norm_first = _RECURRENT.get(type(mixer)) or _RECURRENT_FORMS.get(_form(mixer), (None, 0))
        tensors = self.states.tensors[i]
        if kind is None or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            return MIX_ATTENTION, None
        recurrent = _recurrent(kind, mixer, tensors, norm_first)
        if recurrent is not None:
            self.recurrent.append(recurrent)
        return kind, recurrent

    def _dense_mlp(self, mlp: torch.nn.Module | None) -> list[_Linear | None] | None:
        """A block's dense MLP as NtLayer's w13 and w2: layers.MLP's gate and up then down, Nemotron-H's
        squared-ReLU up then down (the model's NT_RELU2), no MLP (two empty NtLinears); None for another MLP (a
        MoE's experts: _attention_layer's), or one whose kind is not the model's."""
        if mlp is None:
            return [_Linear(), _Linear()]
        form = "gated" if type(mlp) is MLP else _form(mlp)
        if form != ("relu2" if self.relu2 else "gated"):
            return None
        return [_linear(_local(mlp.w1 if self.relu2 else mlp.w13)), _linear(_local(mlp.w2))]

    def _parallel_layer(self, block: torch.nn.Module, cache: KVCache, sharded: bool) -> _Layer | None:
        """Falcon-H1's block (FalconBlock: its class's native_form "parallel") as one NtLayer: its attention
        (layer block.attention.layer, K/V) with its recurrent mixer (layer block.mamba.layer, a state slot) beside
        it as NtLayer.parallel, and the branches' µP multipliers (config.py's MupConfig); then its gated MLP."""
        layer = self._attention_layer(block, cache, block.attention.layer, sharded)
        kind, recurrent = self._mixer(block.mamba, block.mamba.layer)
        if layer is None or recurrent is None or self.mup is None:
            return None
        mup = self.mup
        layer.parallel, layer.parallel_mixer = ctypes.pointer(recurrent), kind
        layer.parallel_in, layer.parallel_out = mup.ssm_in, mup.ssm_out
        layer.attn_in, layer.attn_out = mup.attention_in, mup.attention_out
        return layer

    def _gemma4_layer(self, model: torch.nn.Module, block: torch.nn.Module, cache: KVCache) -> _Layer | None:
        """Gemma 4's block (model/gemma4.py's Gemma4Block: its class's native_form "gemma4") as one NtLayer: its
        attention's own head_dim and KV heads (the first of its cache slot's), a KV-shared layer reading its source
        layer's slot, keys as values, the unscaled value norm; its dense MLP (double-wide on the shared layers), the
        per-layer input and layer scalar, and the experts beside the MLP. None where a part is not one the native
        step computes."""
        att, cfg = block.attention, model.config
        kind = att.kind
        if (kind.rope == "local") != bool(kind.window and self.local_rope) or kind.rope is None:
            return None
        slot = att.slot if att.source is None else model.layers[att.source].attention.slot
        if slot is None:
            return None
        norms = [block.attention_norm, block.ffn_norm, att.q_norm, getattr(att, "k_norm", None),
                 block.attention_post_norm, block.ffn_post_norm]
        extras = [getattr(block, n, None) for n in ("input_norm", "mlp_post_norm", "experts_norm",
                                                    "experts_post_norm")]
        if not all(_rms(n) for n in norms[:3] + norms[4:]) or any(n is not None and not _rms(n)
                                                                   for n in [norms[3]] + extras):
            return None
        linears = [_linear(_local(m)) for m in (att.wqkv, att.wo)] + (self._dense_mlp(block.mlp) or [None])
        scalar = block.layer_scalar
        if any(lin is None for lin in linears) or not _float32(scalar, 1):
            return None
        layer = _Layer(block.attention_norm.weight.data_ptr(), block.ffn_norm.weight.data_ptr(), *linears,
                       cache.k[slot].data_ptr(), cache.v[slot].data_ptr(), *_scales(cache, slot),
                       *[None if n is None else n.weight.data_ptr() for n in norms[2:]], int(att.sliding),
                       **_no_moe(), head_dim=att.head_dim, n_kv_heads=att.n_kv_heads,
                       intermediate=cfg.intermediate_size * (2 if cfg.double_wide_mlp and att.source is not None
                                                             else 1),
                       kv_shared=int(att.source is not None), values_from_keys=int(att.values_from_keys),
                       v_norm=int(att.source is None), layer_scalar=scalar.data_ptr())
        if cfg.per_layer_input:
            gate, projection = _linear(_local(block.input_gate)), _linear(_local(block.input_projection))
            if gate is None or projection is None:
                return None
            layer.input_gate, layer.input_projection = gate, projection
            layer.input_norm = block.input_norm.weight.data_ptr()
        if block.experts is not None and not self._gemma4_experts(block, layer):
            return None
        return layer

    def _gemma4_experts(self, block: torch.nn.Module, layer: _Layer) -> bool:
        """Gemma 4's experts beside the dense MLP (Gemma4Experts: stacked (E, 2I, C) gate/up and (E, C, I) down
        tensors, each expert's rows a view) into `layer`; False where the native step cannot read them."""
        experts = block.experts
        router = _kept(experts.gate)
        E = experts.expert_scale.numel()
        if router is None or not (_float32(experts.router_scale, None) and _float32(experts.expert_scale, E)):
            return False
        parts = [(_expert_rows(experts, "gate_up", e), _expert_rows(experts, "down", e)) for e in range(E)]
        if any(a is None or b is None for a, b in parts):
            return False
        self.experts.append((_Expert * E)(*[_Expert(a, b) for a, b in parts]))
        layer.router, layer.experts = router, self.experts[-1]
        layer.router_scale, layer.expert_scale = experts.router_scale.data_ptr(), experts.expert_scale.data_ptr()
        layer.mlp_post_norm, layer.experts_norm = block.mlp_post_norm.weight.data_ptr(), block.experts_norm.weight.data_ptr()
        layer.experts_post_norm = block.experts_post_norm.weight.data_ptr()
        return True


def _routing(moe) -> dict:  # noqa: ANN001
    """The MoE layers' routing rule as NtModel's fields (csrc/nt_abi.h's NtRouter; model/moe.py's route)."""
    if moe is None:
        return dict(router=ROUTE_SOFTMAX, routed_scaling=1.0)
    rule = ROUTE_TOPK_SOFTMAX if moe.softmax_after_topk else (ROUTE_SIGMOID if moe.scoring == "sigmoid" else
                                                              ROUTE_SOFTMAX)
    return dict(router=rule, n_group=moe.n_group, topk_group=moe.topk_group,
                routed_scaling=moe.routed_scaling_factor, topk_norm_eps=moe.topk_norm_eps)


def _expert_rows(experts: torch.nn.Module, part: str, e: int) -> _Linear | None:
    """Expert e's `part` ("gate_up" / "down") of Gemma 4's experts as an NtLinear: its rows of the stacked tensor,
    or the layer a GGUF file's blocks keep for it (Gemma4Experts.keep)."""
    stacked = getattr(experts, part)
    return weight_rows(stacked[e]) if stacked is not None else _linear(getattr(experts, part + "_layers")[e])


def _rms(norm: torch.nn.Module | None) -> bool:
    """Whether a norm is one csrc/decode.cpp's rms_norm computes with its weight: layers.RMSNorm, or a family's
    norm whose class declares native_form "rms_norm" (Gemma 4's Norm, scaling by w) with a float32 weight."""
    if type(norm) is RMSNorm:
        return True
    return _form(norm) == "rms_norm" and norm.weight is not None and _float32(norm.weight, None)


def _float32(t: torch.Tensor, numel: int | None) -> bool:
    """A contiguous float32 tensor (of numel elements, where given), as the native step reads it."""
    return t.dtype == torch.float32 and t.is_contiguous() and (numel is None or t.numel() == numel)


def _no_moe() -> dict:
    """A layer with a dense MLP (or none): no router, experts or shared expert."""
    return dict(router=_Linear(None, 0, None, None), experts=None, shared=_Expert(), shared_gate=_Linear())


# The recurrent mixers' native kinds (csrc/nt_abi.h's NtMixer) and their NtRecurrent.norm_first
_RECURRENT = {ShortConvolution: (MIX_SHORT_CONV, 0), GatedDeltaNet: (MIX_DELTA_RULE, 0), Mamba2Mixer: (MIX_SSD, 0)}
# ... and those of the families' own mixers, by the form their class declares (_form): Falcon-H1's FalconMixer, the
# SSD whose gated norm normalises first (or, without a norm weight, gates alone)
_RECURRENT_FORMS = {"ssd_norm_first": (MIX_SSD, 1)}


def _form(module: torch.nn.Module | None) -> str | None:
    """How the native step reads a module of a family's own network: layers.Block as "block", or what the module's
    class declares itself in its own dict (`native_form`; a subclass that changes the forward declares its own):
    Nemotron-H's NemotronBlock "block" (norm, mixer, residual; then norm, MLP, residual where it has one) and
    ReluSquaredMLP "relu2", Falcon-H1's FalconBlock "parallel" and FalconMixer "ssd_norm_first", Gemma 4's
    Gemma4Block "gemma4" and Norm "rms_norm". None: neither."""
    if module is None:
        return None
    return "block" if type(module) is Block else type(module).__dict__.get("native_form")


def _recurrent(kind: int, mixer: torch.nn.Module, slots: list[torch.Tensor], norm_first: int = 0) -> _Recurrent | None:
    """A recurrent mixer's weights and its layer's state slots (window (N, channels, K - 1), and the delta rule's
    (N, Hv, Dk, Dv) or the SSD's (N, H, P, N) matrices) as an NtRecurrent, or None."""
    wi, wo = _linear(_local(mixer.wi)), _linear(_local(mixer.wo))
    params = [mixer.conv, getattr(mixer, "conv_bias", None), getattr(mixer, "dt_bias", None),
              getattr(mixer, "A_log", None), getattr(mixer, "D", None), getattr(mixer, "norm", None)]
    if wi is None or wo is None or any(p is not None and (p.dtype != torch.float32 or not p.is_contiguous())
                                       for p in params):
        return None
    channels, _, K = mixer.conv.shape
    sizes = dict(heads=0, groups=0, head_k=0, head_v=0, norm_groups=0)
    if kind == MIX_DELTA_RULE:
        sizes = dict(heads=mixer.hv, groups=mixer.hk, head_k=mixer.dk, head_v=mixer.dv, norm_groups=1)
    elif kind == MIX_SSD:
        sizes = dict(heads=mixer.heads, groups=mixer.groups, head_k=mixer.head_dim, head_v=mixer.n,
                     norm_groups=mixer.norm_groups)
    ptrs = [None if p is None else p.data_ptr() for p in params]
    return _Recurrent(wi, wo, *ptrs, slots[0].data_ptr(), slots[1].data_ptr() if len(slots) > 1 else None,
                      channels, K, **sizes, norm_first=norm_first)


# The declared layer kinds (families/base.py's LayerKind.mixer) the native step computes, and how each becomes an
# NtLayer; a model with a layer of any other kind runs the modules (issue 41's recurrent kinds add theirs here).
_NATIVE_KINDS = {"attention": _Plan._attention_layer, "convolution": _Plan._recurrent_layer,
                 "linear_attention": _Plan._recurrent_layer, "state_space": _Plan._recurrent_layer}


class _Refused:
    """The plan of a model the native step does not compute (no description is built)."""

    ok = False


_REFUSED = _Refused()


def _native_parts(cfg) -> bool:  # noqa: ANN001
    """Whether the declaration lets the native step run this model (families/base.py's Family.native_step), and
    its config holds no part the native step does not compute: partial RoPE, a sigmoid (GLM-4) router."""
    return (family(cfg.architecture).native_step
            and (cfg.rope_local is None or cfg.rope_local.partial_rotary_factor == 1.0)
            and (cfg.moe is None or cfg.moe.scoring in ("softmax", "sigmoid", "scaled_softmax")))


def _lora(module: torch.nn.Module | None) -> _Lora:
    """A LoraLinear's adapter stacks (lora/layers.py: A (slots, R, in), B^T (slots, R, out), float32, written in
    place when adapters load, so their addresses hold), or none."""
    buffers = {} if module is None else module._buffers
    A, Bt = buffers.get("lora_A"), buffers.get("lora_Bt")
    if A is None or Bt is None:
        return _Lora()
    return _Lora(A.data_ptr(), Bt.data_ptr(), A.shape[1])


def _with_slots(description: _Model, slots: torch.Tensor | None, state_rows: torch.Tensor | None = None) -> _Model:
    """The description for one call whose rows apply the adapter slots `slots` ((B,) int64, kept alive by the
    caller; -1: the base alone) and read the recurrent state slots `state_rows` ((B,) int64; None: row b's is
    slot b), or the description itself when neither is given."""
    if slots is None and state_rows is None:
        return description
    one = _Model.from_buffer_copy(description)
    if slots is not None:
        one.lora_slots = slots.data_ptr()
    if state_rows is not None:
        one.state_slots = state_rows.data_ptr()
    return one


_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gates csrc/decode.cpp computes (layers.activation's)


def _sinks(att: torch.nn.Module, sharded: bool) -> int | None | bool:
    """The address of gpt-oss's per-head sink logits ((H,) float32: NtLayer.sinks), None where the layer has none,
    False where the native step cannot read them (another dtype; a tensor-parallel rank's heads)."""
    sinks = att.sinks
    if sinks is None:
        return None
    if sharded or sinks.dtype != torch.float32 or not sinks.is_contiguous() or sinks.numel() != att.n_heads:
        return False
    return sinks.data_ptr()


def _expert(mlp: torch.nn.Module) -> _Expert | None:
    """One expert's (or the shared expert's) gated MLP as an NtExpert, or None."""
    if type(mlp) is not MLP:
        return None
    w13, w2 = _linear(_local(mlp.w13)), _linear(_local(mlp.w2))
    return None if w13 is None or w2 is None else _Expert(w13, w2)


def _kept(module: torch.nn.Module) -> _Linear | None:
    """A router (or shared-expert gate): a float32 KeptLinear, its bias too (its native()), or what a replaced
    layer says of itself."""
    return describe(_local(module))


def _scales(cache: KVCache, layer: int) -> tuple[int | None, int | None]:
    """An int8 pool's per token and head scales of one layer (model/cache.py's PagedKVCache), else (None, None)."""
    k_scale = getattr(cache, "k_scale", None)
    return (None, None) if k_scale is None else (k_scale[layer].data_ptr(), cache.v_scale[layer].data_ptr())


def _cache_ok(cache: KVCache) -> bool:
    """A float32 cache, or an int8 pool with its scales (the native step reads both)."""
    return cache.k.device.type == "cpu" and (
        cache.k.dtype == torch.float32 or (cache.k.dtype == torch.int8 and getattr(cache, "k_scale", None) is not None))


def applies(model: torch.nn.Module, input_ids: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> bool:
    """Whether this forward is a plain float32 CPU decode step the native function computes as the modules do.
    Only conditions of this call (one token per row, no grad, CPU float32, no observer): what the model's layers are
    is decided once per plan, by their declared kinds (_NATIVE_KINDS), and decode_step returns None for a model whose
    plan refuses."""
    return (
        _fused_on(model)
        and isinstance(cache, KVCache)  # a view of the engine's pool (a one-token prefill chunk) runs the modules
        and input_ids.shape[1] == 1
        and input_ids.shape[0] <= kernels.MAX_ROWS
        and batch.last_only
        and (batch.lora is None or not _sharded(model))  # the native step adds each row's adapter products
        and (batch.mask is None or batch.window_only)  # the native step computes a sliding window itself
        and batch.write_start == batch.kv_len - 1
        and batch.mrope_positions is None  # the native step rotates by batch.positions alone
        and batch.embeds is None  # an encoder's rows in place of token embeddings (images): the modules' prefill
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
    slots = None if batch.lora is None else batch.lora.reshape(-1).to(torch.int64).contiguous()  # (B,)
    description = _with_slots(plan.model if batch.window_only else plan.no_window, slots)
    if _reads_table(plan, model):  # no embedding operations here
        ids = input_ids.reshape(-1).to(torch.int64).contiguous()  # (B,)
        logits = torch.empty((ids.shape[0], model.config.vocab_size), dtype=torch.float32)
        rc = kernels.library().nt_decode_step_ids(
            ctypes.byref(description), ids.data_ptr(), ids.shape[0], positions.data_ptr(), batch.write_start,
            batch.kv_len, logits.data_ptr(),
        )
        return logits if rc == 0 else None
    x = model.embed(input_ids)[:, 0].contiguous()  # (B, C): a fresh tensor, updated in place as the residual
    B = x.shape[0]
    per_layer = _per_layer(model, input_ids, x)
    if per_layer is not None:
        description = _with_per_layer(description, per_layer)
    if _sharded(model):
        if _longrope_straddles(model, positions):
            return None  # a rank's parts choose LongRoPE's set row by row; this forward's rows choose by their max
        slots = torch.arange(B, dtype=torch.int64)
        return _rank_step(plan, description, model, x, positions, (slots, 1),
                          torch.full((B,), batch.kv_len, dtype=torch.int64))
    logits = torch.empty((B, model.config.vocab_size), dtype=torch.float32)
    rc = kernels.library().nt_decode_step(
        ctypes.byref(description), x.data_ptr(), B, positions.data_ptr(), batch.write_start, batch.kv_len,
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


def rows_plan(model: torch.nn.Module, cache: KVCache, states: StateSlots | None = None) -> RowsPlan | None:
    """The native description when the engine's decode rows of this model and slot cache take the native step,
    else None. A property of the model and the cache alone (never of which requests share a step), so a request's
    numbers do not depend on its batch-mates. Checked once per step (the weights may have been replaced).
    `states`: the recurrent layers' slots (the engine's, one per running sequence; default: cache.states)."""
    if not (getattr(model, "native_step", False) and _fused_on(model) and _cache_ok(cache) and model.dtype == torch.float32 and not torch.is_grad_enabled()
            and not _observed(model) and kernels.library() is not None):
        return None
    plan = _plan(model, cache, states)
    return plan if plan.ok else None


def decode_rows(plan: RowsPlan, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                tables: torch.Tensor, kv_lens: torch.Tensor, lora: torch.Tensor | None = None,
                state_rows: torch.Tensor | None = None) -> torch.Tensor | None:
    """(B, V) float32 logits for B rows that each own cache blocks: row b's new token (input_ids (B, 1)) at
    rotary position positions[b] writes its K/V at column kv_lens[b] - 1 and attends over its first kv_lens[b]
    columns. `tables` (B, W): row b's column s lives in cache block tables[b, s // block_size] (a paged pool,
    model/cache.py's PagedKVCache); or (B,): row b owns slot tables[b] of a slot cache. `lora` (B,): the adapter
    slot each row applies (-1: the base alone; None: no row has one). `plan` comes from rows_plan for this step.
    None when the native step fails."""
    if input_ids.shape[0] > kernels.MAX_ROWS:
        return None
    B = input_ids.shape[0]
    stride = tables.shape[1] if tables.dim() == 2 else 1
    positions, tables, kv_lens = (t.reshape(-1).to(torch.int64).contiguous() for t in (positions, tables, kv_lens))
    if _sharded(model):
        if lora is not None:
            return None  # adapters are refused on tensor-parallel models (lora.attach)
        x = model.embed(input_ids)[:, 0].contiguous()  # (B, C): a fresh tensor, updated in place as the residual
        return _rank_step(plan, plan.model, model, x, positions, (tables, stride), kv_lens)
    slots = None if lora is None else lora.reshape(-1).to(torch.int64).contiguous()  # (B,)
    if state_rows is not None:
        state_rows = state_rows.reshape(-1).to(torch.int64).contiguous()  # (B,)
    description = _with_slots(plan.model, slots, state_rows)
    logits = torch.empty((B, model.config.vocab_size), dtype=torch.float32)
    lib = kernels.library()
    if _reads_table(plan, model):  # the table read natively: no embedding operations here
        ids = input_ids.reshape(-1).to(torch.int64).contiguous()  # (B,)
        if lib.nt_decode_rows_ids(ctypes.byref(description), ids.data_ptr(), B, positions.data_ptr(),
                                  tables.data_ptr(), stride, kv_lens.data_ptr(), logits.data_ptr()) == 0:
            return logits
        # refused before anything is written (an id outside the table: the module's lookup below names it)
    x = model.embed(input_ids)[:, 0].contiguous()  # (B, C): a fresh tensor, updated in place as the residual
    per_layer = _per_layer(model, input_ids, x)
    if per_layer is not None:
        description = _with_per_layer(description, per_layer)
    rc = lib.nt_decode_rows(ctypes.byref(description), x.data_ptr(), B, positions.data_ptr(), tables.data_ptr(),
                            stride, kv_lens.data_ptr(), logits.data_ptr())
    return logits if rc == 0 else None


def _per_layer(model: torch.nn.Module, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """Gemma 4's (B, L, P) per-layer inputs of the new tokens (input_ids (B, 1), x (B, C) their embeddings before
    the model's scale), by its own modules (Gemma4Transformer._per_layer_inputs, on the scaled embeddings as its
    _trunk computes them), for NtModel.per_layer; None for a model without them."""
    cfg = model.config
    if not cfg.per_layer_input:
        return None
    scaled = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)  # (B, C), _trunk's float32 product
    return model._per_layer_inputs(input_ids, scaled[:, None])[:, 0].contiguous()  # (B, L, P)


def _with_per_layer(description: _Model, per_layer: torch.Tensor) -> _Model:
    """The description for one call with these per-layer inputs ((B, L, P) float32, kept alive by the caller)."""
    one = _Model.from_buffer_copy(description)
    one.per_layer = per_layer.data_ptr()
    return one


def _rank_step(plan: _Plan, description: _Model, model: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor,
               tables: tuple[torch.Tensor, int], kv_lens: torch.Tensor) -> torch.Tensor:
    """(B, V) logits of a tensor-parallel rank's step, rows as in decode_rows: x (B, C) is the all-reduced
    embedding. Every rank calls this in the same step, so each part's all-reduce meets the other ranks' (the same
    collectives, in the same order, as the modules' step). A refused part raises: every rank has the same rows and
    shapes, so every rank raises at the same part. What Block and Transformer do around the all-reduced sums (the
    embedding's multipliers, the branch's post-norm or multiplier, the final soft-cap and scaling) runs here, with
    the modules' own operations."""
    lib, ranks, cfg = kernels.library(), model.parallel.ranks, model.config
    B = x.shape[0]
    if cfg.embedding_multiplier != 1.0:  # _trunk's order
        x = x * cfg.embedding_multiplier
    if cfg.embed_scale is not None:
        x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
    ptrs = (positions.data_ptr(), tables[0].data_ptr(), tables[1], kv_lens.data_ptr())
    part = torch.empty_like(x)  # (B, C) this rank's partial sum of one o or down projection (or experts' sum)
    for layer, (block, biases) in enumerate(zip(model.layers, plan.biases)):
        for half, bias in enumerate(biases):
            if lib.nt_decode_part(ctypes.byref(description), layer, half, x.data_ptr(), B, *ptrs, part.data_ptr()):
                raise RuntimeError(f"the native step refused layer {layer} of this rank's step")
            y = ranks.all_reduce(part)
            if bias is not None:  # RowParallel's bias, once after the all-reduce
                y = y + bias
            x += _branch(block, half, y)  # the residual, as Block adds the branch
    local = torch.empty((B, plan.model.vocab), dtype=torch.float32)  # this rank's rows of the head (padded)
    if lib.nt_decode_part(ctypes.byref(description), 0, 2, x.data_ptr(), B, *ptrs, local.data_ptr()):
        raise RuntimeError("the native step refused the LM head of this rank's step")
    logits = ranks.all_gather_last(local)[:, : cfg.vocab_size]
    if cfg.final_logit_softcapping is not None:  # Transformer._forward's order
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits / cfg.logits_scaling if cfg.logits_scaling != 1.0 else logits


def _branch(block: torch.nn.Module, half: int, y: torch.Tensor) -> torch.Tensor:
    """A branch's all-reduced output (half 0 attention, 1 MLP) as Block adds it to the residual: Gemma's post-norm,
    OLMo 2's norm after, Granite's multiplier, or as it is."""
    if block.sandwich:
        return (block.attention_post_norm, block.ffn_post_norm)[half](y)
    if block.norm_after:
        return (block.attention_norm, block.ffn_norm)[half](y)
    return y * block.residual if block.residual != 1.0 else y


def _longrope_straddles(model: torch.nn.Module, positions: torch.Tensor) -> bool:
    """Whether LongRoPE's per-forward choice (by the furthest row) differs from some row's own choice."""
    if model.__dict__.get("long_inv_freq") is None:
        return False
    limit = model.config.rope.original_max_position_embeddings
    return bool(int(positions.max()) + 1 > limit >= int(positions.min()) + 1)


def _plan(model: torch.nn.Module, cache: KVCache, states: StateSlots | None = None) -> _Plan:
    cfg = model.config
    if any(cfg.layer(i).mixer not in _NATIVE_KINDS for i in range(cfg.num_hidden_layers)):
        return _REFUSED  # a kind without a native layer: the modules run every step
    states = getattr(cache, "states", None) if states is None else states  # generate()'s: one slot per row
    plan: _Plan | None = getattr(model, "_fused_plan", None)
    if plan is not None and plan.cache_key == _cache_key(cache, states) and plan.reads.holds():
        return plan  # nothing the description was built from has moved
    plan = _Plan(model, cache, states)
    model._fused_plan = plan
    return plan
