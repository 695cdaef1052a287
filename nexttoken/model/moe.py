"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the block's MLP where a layer is sparse.

A router scores every expert per token; the top k are run, weighted by their softmax probabilities (renormalised
over the k where the family does), and summed. Only the chosen experts run, each on the tokens that chose it.
Each expert is an ordinary gated MLP of `Linear` layers, so decode-sized products take the native weight-streaming
kernel and int8 quantization covers the experts like any other layer. The router (and Qwen2-MoE's shared-expert
gate) are `KeptLinear`s in the model's dtype: quantizing them would move tokens to other experts.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..families import family
from .linear import KeptLinear


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: Callable[[int], nn.Module]) -> None:
        """`mlp(intermediate)` builds one gated MLP of that width (the model's own MLP class)."""
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.norm_topk, self.float32_weights = moe.top_k, moe.norm_topk_prob, moe.router_weights_float32
        self.gate = KeptLinear(cfg.hidden_size, moe.num_experts, bias=moe.router_bias)  # the router: (E, C)
        self.softmax_after_topk = moe.softmax_after_topk
        self.experts = nn.ModuleList(mlp(moe.intermediate_size) for _ in range(moe.num_experts))
        self.shared = mlp(moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        gated = self.shared is not None and moe.shared_gate
        self.shared_gate = KeptLinear(cfg.hidden_size, 1, bias=False) if gated else None
        # GLM-4 MoE's sigmoid router (see route): a float32 per-expert bias that moves the choice, not the weights
        self.scoring, self.groups, self.topk_group = moe.scoring, moe.n_group, moe.topk_group
        self.routed_scale, self.norm_eps = moe.routed_scaling_factor, moe.topk_norm_eps
        rows = (1,) if family(cfg.architecture).correction_rows else ()  # ERNIE 4.5 keeps it as one row
        self.correction = nn.Parameter(torch.zeros(*rows, moe.num_experts)) if moe.correction_bias else None
        # Tensor parallelism (model/parallel.py): sums the ranks' partial outputs, once per layer; None: one process.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, C) -> (weights (N, k), chosen experts (N, k)), by transformers' rules for the family."""
        if self.softmax_after_topk:  # gpt-oss: top k of the logits, softmax over those k, in the activations' dtype
            top, chosen = torch.topk(self.gate(x), self.top_k, dim=-1)  # (N, k)
            return torch.softmax(top, dim=-1, dtype=top.dtype), chosen
        if self.scoring == "sigmoid":
            return self._grouped_sigmoid(x)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        if self.correction is not None:  # ERNIE 4.5: the bias moves the choice; the weights are the probabilities
            chosen = torch.topk(probs + self.correction.float().view(-1), self.top_k, dim=-1)[1]  # (N, k)
            weights = probs.gather(1, chosen)
        else:
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), chosen

    def _grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """GLM-4 MoE's router (transformers' Glm4MoeTopkRouter), in float32: sigmoid scores; the choice among the
        experts of the `topk_group` groups whose two best scores (+ correction bias) sum highest; the chosen experts'
        plain scores as weights, renormalised where configured, x routed_scaling_factor. Float32 weights."""
        scores = torch.sigmoid(self.gate(x).float())  # (N, E); the router's few-row products are row-invariant
        choice = scores if self.correction is None else scores + self.correction.float().view(-1)
        N, E = scores.shape
        if self.groups > 1:
            groups = choice.view(N, self.groups, E // self.groups).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
            best = torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(groups).scatter_(1, best, 1).bool()  # (N, G)
            keep = keep[..., None].expand(N, self.groups, E // self.groups).reshape(N, E)
            choice = choice.masked_fill(~keep, float("-inf"))
        chosen = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # (N, k), transformers' call
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        return weights * self.routed_scale, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)  # (N, C)
        # Experts in ascending order, each adding into its tokens' rows: transformers' order of the sums, so the
        # float results agree to the last bit. One device sync (the list of chosen experts) per layer.
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)  # the tokens that chose expert e, and where in their top k
            y = self.experts[e](x[rows]) * weights[rows, slot, None]  # (n_e, C)
            out.index_add_(0, rows, y.to(out.dtype))
        # the shared expert sees the batch's (B, T, C) rows (a LoRA wrapper applies each row's adapter: lora/layers.py)
        shared = None if self.shared is None else self.shared(x.view(shape)).reshape(x.shape)
        if self.shared_gate is not None:  # Qwen2-MoE: an expert every token runs, scaled by its own sigmoid gate
            out = out + torch.sigmoid(self.shared_gate(x)) * shared
        elif shared is not None:  # GLM-4 MoE: the shared experts as one ungated MLP
            out = out + shared
        if self.reduce is not None:
            out = self.reduce(out)
        return out.view(shape)


def checkpoint_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of a sparse layer's MLP (Mixtral's and Qwen's names) and their shapes."""
    moe, C = cfg.moe, cfg.hidden_size
    assert moe is not None
    I, p = moe.intermediate_size, _prefix(cfg, layer)
    names = _expert_names(cfg)
    shapes = {p + "gate.weight": (moe.num_experts, C)}
    if moe.router_bias:
        shapes[p + "gate.bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes |= {f"{p}experts.{e}.{names[0]}.weight": (I, C), f"{p}experts.{e}.{names[1]}.weight": (I, C),
                   f"{p}experts.{e}.{names[2]}.weight": (C, I)}
        if cfg.mlp_bias:  # gpt-oss: every expert's projections have biases
            shapes |= {f"{p}experts.{e}.{names[0]}.bias": (I,), f"{p}experts.{e}.{names[1]}.bias": (I,),
                       f"{p}experts.{e}.{names[2]}.bias": (C,)}
    if moe.shared_intermediate_size:
        S, x = moe.shared_intermediate_size, p + family(cfg.architecture).shared_expert + "."
        shapes |= {x + "gate_proj.weight": (S, C), x + "up_proj.weight": (S, C), x + "down_proj.weight": (C, S)}
        if moe.shared_gate:
            shapes[p + "shared_expert_gate.weight"] = (1, C)
    if moe.correction_bias:
        declared = family(cfg.architecture)
        shapes[p + declared.correction_bias] = (1, moe.num_experts) if declared.correction_rows else (moe.num_experts,)
    return shapes


def checkpoint_parts(cfg: ModelConfig, layer: int) -> dict[str, list[str]]:
    """A sparse layer's tensors under layers.{layer}.mlp, each as the checkpoint tensors it is made of
    (concatenated along dim 0): gate and up fused per expert."""
    moe = cfg.moe
    assert moe is not None
    p, o = _prefix(cfg, layer), f"layers.{layer}.mlp."
    gate, up, down = _expert_names(cfg)
    sd = {o + "gate.weight": [p + "gate.weight"]}
    if moe.router_bias:
        sd[o + "gate.bias"] = [p + "gate.bias"]
    for e in range(moe.num_experts):
        x = f"{p}experts.{e}."
        for kind in ("weight", "bias") if cfg.mlp_bias else ("weight",):
            sd[f"{o}experts.{e}.w13.{kind}"] = [f"{x}{gate}.{kind}", f"{x}{up}.{kind}"]
            sd[f"{o}experts.{e}.w2.{kind}"] = [f"{x}{down}.{kind}"]
    if moe.shared_intermediate_size:
        x = p + family(cfg.architecture).shared_expert + "."
        sd[o + "shared.w13.weight"] = [x + "gate_proj.weight", x + "up_proj.weight"]
        sd[o + "shared.w2.weight"] = [x + "down_proj.weight"]
        if moe.shared_gate:
            sd[o + "shared_gate.weight"] = [p + "shared_expert_gate.weight"]
    if moe.correction_bias:
        sd[o + "correction"] = [p + family(cfg.architecture).correction_bias]
    return sd


def _prefix(cfg: ModelConfig, layer: int) -> str:
    return f"model.layers.{layer}." + family(cfg.architecture).moe_prefix


def _expert_names(cfg: ModelConfig) -> tuple[str, str, str]:
    """(gate, up, down) projections of one expert: Mixtral's w1 / w3 / w2, Qwen's gate_proj / up_proj / down_proj."""
    return family(cfg.architecture).expert_names
