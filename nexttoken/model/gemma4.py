"""Gemma 4's text decoder (families/gemma4.py): the parts the shared block does not have, as modules of their own.

- Attention with per-layer shapes: the full layers' own head_dim and KV heads, keys reused as values there
  (`values_from_keys`), values RMS-normed without a scale, scale 1. Its K/V go to the layer's cache slot
  (ModelConfig.kv_layout: slots as wide as the widest layer; a narrower layer writes its first heads and dims, zeros
  beyond, and reads back only its own part).
- KV sharing: the last `kv_shared_layers` layers keep no slot; the last earlier layer of their kind hands its
  (B, Hkv, S, D) keys and values to them within the forward (transformers' `shared_kv_states`), so the slot cache,
  the engine's pool and its views serve them through the source layer's slot and blocks, unchanged.
- Per-layer input embeddings, the layer scalar, the MoE block beside the dense MLP (Gemma4Experts).

Norms are transformers' Gemma4RMSNorm: float32, x * pow(mean(x^2) + eps, -0.5), times the weight (not 1 + w).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import kernels
from .batch import ForwardBatch
from .cache import KVCache
from .layers import MLP, activation
from .linear import KeptLinear, Linear
from .llama import Transformer
from .rope import apply_rope, inverse_frequencies, rope_cos_sin
from .state import SequenceState

# A GGUF file's matrices are kept as stored (weights/gguf_packed.py): this network uses the file's values as they are
GGUF_PACKED = True


class Norm(nn.Module):
    """transformers' Gemma4RMSNorm (with or without a weight), in float32, cast back to the input's dtype."""

    native_form = "rms_norm"  # the fused native step's plain RMSNorm (x normed, times w): model/fused.py

    def __init__(self, dim: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


def kv_sources(cfg: ModelConfig) -> list[int | None]:
    """For each layer, the earlier layer whose K/V it attends (None: its own): each of the last kv_shared_layers
    layers reads the last layer before them of its kind (sliding or full), as transformers' kv_sharing_modes."""
    first = cfg.num_hidden_layers - cfg.kv_shared_layers
    out: list[int | None] = []
    for i in range(cfg.num_hidden_layers):
        if i < first:
            out.append(None)
            continue
        window = cfg.layer(i).window
        out.append(max(j for j in range(first) if cfg.layer(j).window == window))
    return out


def cache_slots(cfg: ModelConfig) -> list[int | None]:
    """Each layer's slot of the cache (ModelConfig.kv_layout): the layers with K/V of their own, in order."""
    sources, slots, n = kv_sources(cfg), [], 0
    for source in sources:
        slots.append(None if source is not None else n)
        n += source is None
    return slots


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.kind = cfg.layer(layer)
        self.sliding = self.kind.window
        full = not self.sliding
        self.head_dim = cfg.global_head_dim if full and cfg.global_head_dim else cfg.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.global_kv_heads if full and cfg.global_kv_heads else cfg.num_key_value_heads
        self.source = kv_sources(cfg)[layer]  # None: this layer computes and caches its own K/V
        self.slot = cache_slots(cfg)[layer]
        self.values_from_keys = cfg.values_from_keys and full
        _, self.slot_heads, self.slot_dim = cfg.kv_layout
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        own = 0 if self.source is not None else kv * (1 if self.values_from_keys else 2)
        self.split = (q, own)
        self.wqkv = Linear(cfg.hidden_size, q + own, bias=cfg.attention_bias)  # q [; k [; v]]
        self.wo = Linear(q, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = Norm(self.head_dim, cfg.rms_norm_eps)
        if self.source is None:
            self.k_norm = Norm(self.head_dim, cfg.rms_norm_eps)
            self.v_norm = Norm(self.head_dim, cfg.rms_norm_eps, scaled=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor,
                sin: torch.Tensor, shared: dict) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C); `shared` carries each K/V-sharing source's (keys, values) to its readers."""
        B, T, _ = x.shape
        D, Hkv = self.head_dim, self.n_kv_heads
        qkv = self.wqkv(x)
        q = self.q_norm(qkv[..., : self.split[0]].view(B, T, self.n_heads, D))
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        if self.source is not None:  # a KV-shared layer: the source layer's columns, this forward's
            keys, values = shared[self.source]
        else:
            k = qkv[..., self.split[0] : self.split[0] + Hkv * D].view(B, T, Hkv, D)
            v = k if self.values_from_keys else qkv[..., self.split[0] + Hkv * D :].view(B, T, Hkv, D)
            k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
            v = self.v_norm(v).transpose(1, 2)
            keys, values = self._cached(batch, state, k, v)
            shared[self.layer_index] = (keys, values)
        mask = batch.window_mask if self.sliding else batch.mask
        if batch.rowwise and B > 1:  # each row alone: its numbers cannot depend on its batch-mates
            y = torch.cat([self._attend(q[b : b + 1], keys[b : b + 1], values[b : b + 1],
                                        None if mask is None else mask[b : b + 1]) for b in range(B)])
        else:
            y = self._attend(q, keys, values, mask)  # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def _cached(self, batch: ForwardBatch, state: SequenceState, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, Hkv, T, D) into this layer's slot (zero-padded to the slot's heads and dims) and read back
        this layer's part of its columns, (B, Hkv, S, D) each."""
        pad = (0, self.slot_dim - self.head_dim, 0, 0, 0, self.slot_heads - self.n_kv_heads)
        if any(pad):
            k, v = F.pad(k, pad), F.pad(v, pad)
        keys, values = state.update(self.slot, batch, k, v)
        if any(pad):
            keys = keys[:, : self.n_kv_heads, :, : self.head_dim]
            values = values[:, : self.n_kv_heads, :, : self.head_dim]
        return keys, values

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0,
                                              enable_gqa=self.n_heads != self.n_kv_heads)


class Gemma4Experts(nn.Module):
    """The MoE block beside the dense MLP: the router (transformers' Gemma4TextRouter) on the residual, the
    experts (Gemma4TextExperts: stacked (E, 2I, C) gate/up and (E, C, I) down tensors) on its pre-normed copy."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        E, I, C = moe.num_experts, moe.intermediate_size, cfg.hidden_size
        self.top_k, self.width = moe.top_k, I
        self.router_norm = Norm(C, cfg.rms_norm_eps, scaled=False)
        self.router_scale = nn.Parameter(torch.ones(C))
        self.gate = KeptLinear(C, E, bias=False)
        self.expert_scale = nn.Parameter(torch.ones(E))
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, C))
        self.down = nn.Parameter(torch.empty(E, C, I))
        # a GGUF file's experts kept in their blocks (weights/gguf_packed.py): one layer per expert in place of a
        # stacked tensor (keep)
        self.gate_up_layers: nn.ModuleList | None = None
        self.down_layers: nn.ModuleList | None = None
        self.root = C**-0.5
        self.act = activation(cfg.hidden_act)

    def keep(self, part: str, layers: list[nn.Module]) -> None:
        """Replace the stacked `part` ("gate_up" or "down") by one weight layer per expert (GGUF's kept blocks)."""
        assert part in ("gate_up", "down") and len(layers) == len(self.expert_scale)
        setattr(self, part, None)
        setattr(self, part + "_layers", nn.ModuleList(layers))

    def _expert(self, part: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x (n, in) through expert e's `part`: its rows of the stacked tensor, or its kept layer."""
        stacked = getattr(self, part)
        return _product(x, stacked[e]) if stacked is not None else getattr(self, part + "_layers")[e](x)

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual (N, C) chooses the experts; x (N, C) (its pre-normed copy) runs through them -> (N, C)."""
        scores = self.gate(self.router_norm(residual) * self.router_scale * self.root)  # (N, E)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.expert_scale[chosen]
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():  # ascending, each adding into its tokens' rows (transformers' order)
            rows, slot = torch.where(chosen == e)
            gate, up = self._expert("gate_up", e, x[rows]).chunk(2, dim=-1)
            y = self._expert("down", e, self.act(gate) * up) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (N, in) @ w (out, in)^T as `Linear` computes it: few rows through the native kernel, so a row's numbers
    never depend on how many rows share the call (the engine's batch invariance)."""
    return kernels.linear(x, w, None) if kernels.usable(x, w) else F.linear(x, w)


class Gemma4Block(nn.Module):
    native_form = "gemma4"  # the fused native step computes this block (model/fused.py's _gemma4_layer)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attention = Gemma4Attention(cfg, layer)
        self.attention.layer_index = layer
        wide = cfg.double_wide_mlp and self.attention.source is not None
        self.mlp = MLP(cfg, cfg.intermediate_size * (2 if wide else 1))
        self.attention_norm, self.attention_post_norm = Norm(C, eps), Norm(C, eps)
        self.ffn_norm, self.ffn_post_norm = Norm(C, eps), Norm(C, eps)
        self.experts = Gemma4Experts(cfg) if cfg.moe else None
        if self.experts is not None:
            self.mlp_post_norm, self.experts_norm, self.experts_post_norm = Norm(C, eps), Norm(C, eps), Norm(C, eps)
        P = cfg.per_layer_input
        if P:
            self.input_gate, self.input_projection = Linear(C, P, bias=False), Linear(P, C, bias=False)
            self.input_norm = Norm(C, eps)
            self.act = activation(cfg.hidden_act)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor,
                sin: torch.Tensor, per_layer: torch.Tensor | None, shared: dict) -> torch.Tensor:
        """x (B, T, C), per_layer (B, T, P) or None -> (B, T, C): transformers' Gemma4TextDecoderLayer."""
        x = x + self.attention_post_norm(self.attention(self.attention_norm(x), batch, state, cos, sin, shared))
        h = self.mlp(self.ffn_norm(x))
        if self.experts is not None:  # the MoE branch on the same residual, both branches post-normed and summed
            flat = x.reshape(-1, x.shape[-1])
            moe = self.experts(flat, self.experts_norm(flat)).reshape(x.shape)
            h = self.mlp_post_norm(h) + self.experts_post_norm(moe)
        x = x + self.ffn_post_norm(h)
        if per_layer is not None:
            x = x + self.input_norm(self.input_projection(self.act(self.input_gate(x)) * per_layer))
        return x * self.layer_scalar


class Gemma4Transformer(Transformer):
    """The Transformer with Gemma 4's blocks, per-layer inputs, per-type RoPE tables and K/V slots."""

    def __init__(self, cfg: ModelConfig, arithmetic=None) -> None:  # noqa: ANN001
        super().__init__(cfg, arithmetic)
        self.layers = nn.ModuleList(Gemma4Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        P, L = cfg.per_layer_input, cfg.num_hidden_layers
        if P:
            table = torch.empty(cfg.per_layer_vocab, L * P)
            if table.device.type != "meta":
                nn.init.normal_(table)
            self.per_layer_embed = nn.Embedding(cfg.per_layer_vocab, L * P, _weight=table)
            self.per_layer_projection = Linear(cfg.hidden_size, L * P, bias=False)
            self.per_layer_norm = Norm(P, cfg.rms_norm_eps)
        self._frequencies()

    def _frequencies(self) -> None:
        cfg = self.config
        self.global_inv_freq = inverse_frequencies(cfg.rope, cfg.global_head_dim or cfg.head_dim)
        self.local_inv_freq = inverse_frequencies(cfg.rope_local, cfg.head_dim)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._frequencies()
        self.global_inv_freq = self.global_inv_freq.to(self.embed.weight.device)
        self.local_inv_freq = self.local_inv_freq.to(self.embed.weight.device)
        return self

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        slots, heads, dim = self.config.kv_layout
        return KVCache(slots, batch_size, heads, max_len, dim, self.dtype, self.device)

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """(B, T, L, P) per-layer inputs: the token's packed row of the per-layer table x sqrt(P), plus the
        embeddings' projection x hidden^-0.5, normed per layer; the sum x 2^-0.5 (transformers' order)."""
        cfg = self.config
        P, L = cfg.per_layer_input, cfg.num_hidden_layers
        if not P:
            return None
        B, T = input_ids.shape
        rows = self.per_layer_embed(input_ids) * torch.tensor(P**0.5, dtype=x.dtype)
        projected = self.per_layer_projection(x) * cfg.hidden_size**-0.5
        projected = self.per_layer_norm(projected.reshape(B, T, L, P))
        return (projected + rows.reshape(B, T, L, P)) * 2.0**-0.5

    def _trunk(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: SequenceState) -> torch.Tensor:
        cfg = self.config
        if batch.embeds is not None:  # images: placeholders read as the pad token (its per-layer row included)
            input_ids = input_ids.masked_fill(batch.embeds[0], cfg.pad_token_id or 0)
        x = self.embed(input_ids) * torch.tensor(cfg.embed_scale, dtype=self.dtype)  # (B, T, C)
        if batch.embeds is not None:  # issue 43: the encoder's rows replace their placeholders' embeddings
            where, rows = batch.embeds
            x = x.masked_scatter(where[..., None], rows.to(x.dtype))
        per_layer = self._per_layer_inputs(input_ids, x)  # projects the embeddings with the images' rows in
        tables = {True: rope_cos_sin(self.local_inv_freq, batch.positions, x.dtype),
                  False: rope_cos_sin(self.global_inv_freq, batch.positions, x.dtype)}
        shared: dict = {}  # source layer -> its (keys, values), for the KV-shared layers after it
        for i, block in enumerate(self.layers):
            x = block(x, batch, cache, *tables[block.attention.sliding], None if per_layer is None else
                      per_layer[:, :, i], shared)
        return x


# ---- the checkpoint's tensors (transformers' Gemma4ForCausalLM names) ------------------------------------------


def checkpoint_parts(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our state dict names -> the checkpoint tensors each is made of (concatenated along dim 0)."""
    sd = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_word_embeddings else ["lm_head.weight"]
    if cfg.per_layer_input:
        sd |= {"per_layer_embed.weight": ["model.embed_tokens_per_layer.weight"],
               "per_layer_projection.weight": ["model.per_layer_model_projection.weight"],
               "per_layer_norm.weight": ["model.per_layer_projection_norm.weight"]}
    sources = kv_sources(cfg)
    for i in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        qkv = [a + "q_proj.weight"]
        if sources[i] is None:
            qkv += [a + "k_proj.weight"] + ([] if cfg.values_from_keys and not cfg.layer(i).window
                                            else [a + "v_proj.weight"])
            sd[o + "attention.k_norm.weight"] = [a + "k_norm.weight"]
        sd |= {o + "attention.wqkv.weight": qkv, o + "attention.wo.weight": [a + "o_proj.weight"],
               o + "attention.q_norm.weight": [a + "q_norm.weight"],
               o + "attention_norm.weight": [p + "input_layernorm.weight"],
               o + "attention_post_norm.weight": [p + "post_attention_layernorm.weight"],
               o + "ffn_norm.weight": [p + "pre_feedforward_layernorm.weight"],
               o + "ffn_post_norm.weight": [p + "post_feedforward_layernorm.weight"],
               o + "layer_scalar": [p + "layer_scalar"],
               o + "mlp.w13.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
               o + "mlp.w2.weight": [p + "mlp.down_proj.weight"]}
        if cfg.per_layer_input:
            sd |= {o + "input_gate.weight": [p + "per_layer_input_gate.weight"],
                   o + "input_projection.weight": [p + "per_layer_projection.weight"],
                   o + "input_norm.weight": [p + "post_per_layer_input_norm.weight"]}
        if cfg.moe:
            sd |= {o + "experts.gate_up": [p + "experts.gate_up_proj"], o + "experts.down": [p + "experts.down_proj"],
                   o + "experts.gate.weight": [p + "router.proj.weight"],
                   o + "experts.router_scale": [p + "router.scale"],
                   o + "experts.expert_scale": [p + "router.per_expert_scale"],
                   o + "mlp_post_norm.weight": [p + "post_feedforward_layernorm_1.weight"],
                   o + "experts_norm.weight": [p + "pre_feedforward_layernorm_2.weight"],
                   o + "experts_post_norm.weight": [p + "post_feedforward_layernorm_2.weight"]}
    return sd


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's name and the shape config.json implies (the loader's check)."""
    C, V, L, P = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers, cfg.per_layer_input
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, C)
    if P:
        shapes |= {"model.embed_tokens_per_layer.weight": (cfg.per_layer_vocab, L * P),
                   "model.per_layer_model_projection.weight": (L * P, C),
                   "model.per_layer_projection_norm.weight": (P,)}
    sources = kv_sources(cfg)
    for i in range(L):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        full = not cfg.layer(i).window
        D = cfg.global_head_dim if full and cfg.global_head_dim else cfg.head_dim
        Hkv = cfg.global_kv_heads if full and cfg.global_kv_heads else cfg.num_key_value_heads
        H = cfg.num_attention_heads
        I = cfg.intermediate_size * (2 if cfg.double_wide_mlp and sources[i] is not None else 1)
        shapes |= {a + "q_proj.weight": (H * D, C), a + "o_proj.weight": (C, H * D), a + "q_norm.weight": (D,),
                   p + "layer_scalar": (1,), p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                   p + "mlp.down_proj.weight": (C, I)}
        shapes |= {p + n + ".weight": (C,) for n in ("input_layernorm", "post_attention_layernorm",
                                                     "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        if sources[i] is None:
            shapes |= {a + "k_proj.weight": (Hkv * D, C), a + "k_norm.weight": (D,)}
            if not (cfg.values_from_keys and full):
                shapes[a + "v_proj.weight"] = (Hkv * D, C)
        if P:
            shapes |= {p + "per_layer_input_gate.weight": (P, C), p + "per_layer_projection.weight": (C, P),
                       p + "post_per_layer_input_norm.weight": (C,)}
        if cfg.moe:
            E, J = cfg.moe.num_experts, cfg.moe.intermediate_size
            shapes |= {p + "experts.gate_up_proj": (E, 2 * J, C), p + "experts.down_proj": (E, C, J),
                       p + "router.proj.weight": (E, C), p + "router.scale": (C,), p + "router.per_expert_scale": (E,)}
            shapes |= {p + n + ".weight": (C,) for n in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                                                         "post_feedforward_layernorm_2")}
    return shapes


def ignored(cfg: ModelConfig, name: str) -> bool:
    """Tensors transformers ignores: a KV-shared layer's own k / v projections and norms (checkpoints keep them)."""
    parts = name.split(".")
    if len(parts) < 6 or parts[:2] != ["model", "layers"] or not parts[2].isdigit() or parts[3] != "self_attn":
        return False
    layer = int(parts[2])
    return (layer < cfg.num_hidden_layers and kv_sources(cfg)[layer] is not None
            and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"))
