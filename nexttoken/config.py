"""The model's architecture, read once from a Hugging Face `config.json` and validated there.

One dataclass covers every supported family (docs/models.md): the families differ in switches (biases, norms and
where they sit, per-layer kinds: sliding windows, NoPE, RoPE variants, soft-caps, multipliers, a sparse MLP). What
each family's config means is its declaration's (nexttoken/families/: `Family.read` returns its switches); this
module reads the fields every family shares and validates the whole.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import MissingFileError, ModelLoadError
from .families import BY_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, FULL, LayerKind

# Derived views of the family registry (nexttoken/families/), for the messages and the callers that list them.
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# model_type -> architecture, for a config.json without `architectures` (transformers' AutoModelForCausalLM maps
# the model_type the same way: its MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).
ARCHITECTURE_OF_MODEL_TYPE = MappingProxyType({t: f.architecture for t, f in BY_MODEL_TYPE.items()})


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope only (Phi-3): per-frequency divisors below / beyond the original context, and the cos/sin scale
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # yarn only (gpt-oss): the band between beta_fast and beta_slow rotations is interpolated, by transformers' rule
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # the share of head_dim that rotates (GLM-4 MoE: 0.5): the first int(head_dim * factor) dims, the rest pass
    partial_rotary_factor: float = 1.0
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): how many of the head_dim / 2 angle pairs rotate by the temporal, height and
    # width positions (ForwardBatch.mrope_positions); () : one position per token
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # Qwen3-VL: the rows' pairs interleave (t h w t h w ...) instead of running


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP: each token runs `top_k` of `num_experts` experts chosen by a router."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the k chosen probabilities renormalised to sum to 1 (Mixtral always; Qwen: a flag)
    router_weights_float32: bool  # Mixtral weighs expert outputs in float32; Qwen casts the weights to the dtype
    shared_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, scaled by sigmoid(shared gate); 0: none
    sparse_layers: tuple[bool, ...] = ()  # which layers are MoE (the others a dense MLP of intermediate_size)
    # gpt-oss: the router has a bias and takes the softmax over the k chosen logits only (top k, then softmax)
    router_bias: bool = False
    softmax_after_topk: bool = False

    # GLM-4 MoE (DeepSeek-V3's router): "sigmoid" scores, a per-expert correction bias added for the choice only,
    # the choice limited to the `topk_group` best of `n_group` expert groups, the weights x routed_scaling_factor;
    # the shared expert(s) ungated. Defaults: the softmax router above.
    # "scaled_softmax" (Gemma 4): the router reads the residual RMS-normed x its scale / sqrt(hidden), and the chosen
    # weights are multiplied by per-expert scales; its experts run beside the dense MLP (model/gemma4.py)
    scoring: str = "softmax"
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_gate: bool = True  # Qwen2-MoE's sigmoid(shared_expert_gate(x)) on the shared expert
    topk_norm_eps: float = 1e-20  # the sigmoid router's renormalisation: w / (sum w + eps) (LFM2-MoE: 1e-6)


@dataclass(frozen=True)
class RecurrentConfig:
    """The sizes of the layers that keep a recurrent state (issue 41; model/recurrent/): a causal convolution of
    `conv_kernel` taps before each of them, then the kind's own recurrence. Unused sizes stay 0."""

    conv_kernel: int
    conv_bias: bool = False
    # the gated delta rule (Qwen3.5, Qwen3-Next): key heads x key dim, value heads x value dim
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # Qwen3-Next: in_proj_qkvz / in_proj_ba rows grouped per key head ([q k v z] and [b a] of each), read into
    # Qwen3.5's [q; k; v; z; b; a] order at load (delta_rule.GatedDeltaNet)
    linear_grouped_by_key_head: bool = False
    # Mamba2's SSD (Granite 4.0-H, Falcon-H1, Nemotron-H, Mamba2): heads x head dim = the inner width, state size,
    # groups of B / C, the scan's chunk, biases, dt's clamp, the gated norm's groups (n_groups: per group)
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 1
    mamba_chunk_size: int = 256
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    mamba_norm_groups: int = 1


@dataclass(frozen=True)
class MupConfig:
    """Falcon-H1's µP multipliers (model/falcon_h1.py): its keys', each branch's input and output, the five parts of
    the Mamba2 in_proj's output (z, x, B, C, dt) and the MLP's gate and down projections."""

    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)
    mamba_rms_norm: bool = True  # the Mamba2 output normed (then gated: norm_before_gate) or only gated


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v and o (Llama's `attention_bias`)
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2)
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (each head: Qwen3), "projection" (OLMo 2)
    norm_after: bool = False  # OLMo 2: the block norms the attention / MLP output before the residual add
    # Granite's multipliers (1.0 and None elsewhere): embeddings x, attention scale (None: 1/sqrt(head_dim)),
    # residual branches x, logits / logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    mlp_bias: bool = False
    # Each layer's kind (families/base.py's LayerKind: its mixer, a sliding window of the last `sliding_window`
    # positions, its RoPE: the model's, Gemma 3's local one, or none); () means every layer full attention.
    sliding_window: int | None = None
    layers: tuple[LayerKind, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # Gemma 2 / 3: RMSNorm scales by (1 + weight) in float32; norms before and after each branch ("sandwich");
    # embeddings x sqrt(hidden) rounded to the weights' dtype; tanh soft-capping of attention scores and final
    # logits (cap * tanh(x / cap)); sliding layers with a RoPE of their own base (Gemma 3's local RoPE).
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    embed_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local: RopeConfig | None = None
    moe: MoeConfig | None = None
    # gpt-oss: a learned logit per head joins each softmax (attention sinks); the experts' SwiGLU clamped
    # (gate <= limit, |up| <= limit) and computed as (up + 1) * gate * sigmoid(alpha * gate); None: the plain gate.
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Issue 41's hybrids: the recurrent layers' sizes; Qwen3.5's sigmoid gate on the attention output (q_proj
    # rows doubled, [query; gate] per head); the rotated part of each head (None: all of it; Qwen3.5: a quarter).
    recurrent: RecurrentConfig | None = None
    attention_output_gate: bool = False
    rotary_dim: int | None = None
    # Gemma 4 (model/gemma4.py): the full layers' own head_dim and KV heads (None: the model's); keys reused as values
    # on them; the last kv_shared_layers layers attend the K/V of the last earlier layer of their kind (no cache of
    # their own; their MLP double-wide where double_wide_mlp); per-layer input embeddings of per_layer_input dims
    # over per_layer_vocab tokens (0: none).
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    values_from_keys: bool = False
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    # Falcon-H1: attention and Mamba2 side by side in each layer (its layer i is our layers 2i: the Mamba2 mixer,
    # and 2i + 1: the attention), with its µP multipliers; None elsewhere.
    mup: MupConfig | None = None
    # Nemotron-H: the checkpoint's layers, one character each ('M' Mamba2, '*' attention, '-' MLP; its
    # hybrid_override_pattern); our layers are its mixers, each with the MLP after it (model/nemotron_h.py)
    layer_pattern: str = ""

    def layer(self, i: int) -> LayerKind:
        """Layer i's kind (full attention with the model's RoPE when the config names none)."""
        return self.layers[i] if self.layers else FULL

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers that keep K/V, KV heads, head_dim) of the caches and the engine's pool: every layer with the
        model's shapes, but Gemma 4's: no slots for its KV-shared layers, each slot as wide as its widest layer (a
        narrower layer uses the first heads and dims of its slot)."""
        heads = max(self.num_key_value_heads, self.global_kv_heads or 0)
        return (self.num_hidden_layers - self.kv_shared_layers, heads, max(self.head_dim, self.global_head_dim or 0))

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Which layers attend only the last `sliding_window` positions (Mistral: all; Qwen2: from
        max_window_layers; Gemma: alternating)."""
        return tuple(kind.window for kind in self.layers)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise MissingFileError(
                f"{file} does not exist: a model folder needs the config.json of a Hugging Face checkpoint"
            )
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{file} is not valid JSON ({e}); re-download or re-export the model") from e
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        archs = raw.get("architectures") or []
        family = next((BY_ARCHITECTURE[a] for a in archs if a in BY_ARCHITECTURE), None)
        family = family or next((f for a in archs for f in FAMILIES if a in f.text_of), None)
        if family is None and not archs:  # no `architectures`: the model_type names it, as transformers reads it
            family = BY_MODEL_TYPE.get(raw.get("model_type"))  # type: ignore[arg-type]
        if family is not None and (family.text_of or family.vision) and isinstance(raw.get("text_config"), dict):
            # a vision-language checkpoint: its text model's config (Qwen3.5's Qwen3_5ForConditionalGeneration)
            untold = dict(family.config_defaults).get("tie_word_embeddings", False)  # the family's default
            tied = raw.get("tie_word_embeddings", raw["text_config"].get("tie_word_embeddings", untold))
            raw = {**raw["text_config"], "architectures": [family.architecture], "tie_word_embeddings": tied}
        if family is not None and family.config_defaults:
            raw = {**dict(family.config_defaults), **raw}
        if family is None:
            what = f"architecture {archs!r}" if archs else f"model_type {raw.get('model_type')!r} (no architectures)"
            raise ModelLoadError(
                f"{source}: unsupported {what}; nexttoken supports {', '.join(SUPPORTED_ARCHITECTURES)} (model "
                f"types {', '.join(ARCHITECTURE_OF_MODEL_TYPE)})"
            )

        def need(key: str) -> Any:
            if key not in raw:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        layers = int(need("num_hidden_layers"))
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        switches = {"layers": (FULL,) * layers} | family.read(raw, source, layers)  # families/<family>.py's fields
        # a family that reads its own rotary_dim (Qwen3.5) hands the RoPE that many dims of each head
        rope = _rope_config(switches.pop("rope", raw), source, switches.get("rotary_dim", head_dim),
                            partial="rotary_dim" in switches)
        recurrent = switches.pop("recurrent", None)
        intermediate = switches.pop("intermediate_size", None)  # LFM2 derives its own from block_ff_dim
        local = switches.pop("rope_local", None)
        moe = switches.pop("moe", None)
        mup = switches.pop("mup", None)
        fields = dict(
            architecture=family.architecture,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(intermediate if intermediate is not None else need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(switches.pop("rms_norm_eps", raw.get("rms_norm_eps", 1e-6))),
            rope=rope,
            tie_word_embeddings=bool(switches.pop("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            attention_bias=bool(switches.pop("attention_bias", raw.get("attention_bias", False))),
            mlp_bias=bool(switches.pop("mlp_bias", raw.get("mlp_bias", False))),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            rope_local=None if local is None else _rope_config(local, source, head_dim),
            moe=None if moe is None else _moe_config(moe, source),
            recurrent=None if recurrent is None else RecurrentConfig(**recurrent),
            mup=None if mup is None else MupConfig(**mup),
        )
        cfg = cls(**(fields | switches))  # a family's switches override the shared reading (GLM's attention_bias)
        if len(cfg.layers) != cfg.num_hidden_layers:  # (Falcon-H1 declares two of ours per layer of its own)
            raise ModelLoadError(f"{source}: {len(cfg.layers)} layer kinds for num_hidden_layers={layers}")
        if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"{source}: hidden activation {cfg.hidden_act!r} is not supported; "
                                 f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if raw.get("use_bidirectional_attention") not in (None, False, "vision"):  # "vision": images only (Gemma 4)
            raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported (decoders attend causally)")
        return cfg


def _moe_config(fields: dict[str, Any], source: str) -> MoeConfig:
    """A family's MoE fields (families/reading.py), the expert counts checked."""
    experts, top_k = fields["num_experts"], fields["top_k"]
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts):
        raise ModelLoadError(f"{source}: a mixture of experts needs 1 <= num_experts_per_tok <= the number of "
                             f"experts, got num_experts_per_tok={top_k!r} of {experts!r}")
    return MoeConfig(**fields)


def _rope_config(raw: dict[str, Any], source: str, head_dim: int, partial: bool = False) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs write `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # older Qwen2-VL configs; transformers reads it as the default RoPE + mrope_section
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    share = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial:  # the family reads it as its rotary_dim (Qwen3.5): the RoPE rotates what it is handed
        share = 1.0
    if rope_type == "proportional":  # Gemma 4's full layers: a share of the frequencies rotates, the rest are zero
        if not 0.0 <= share <= 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor must be in [0, 1], got {share}")
        return RopeConfig(theta=theta, type=rope_type, factor=float(params.get("factor", 1.0)),
                          partial_rotary_factor=share)
    if not (0.0 < share <= 1.0 and int(head_dim * share) % 2 == 0):
        raise ModelLoadError(f"{source}: partial_rotary_factor must be in (0, 1] and rotate an even number of the "
                             f"{head_dim} head dims, got {share}")
    if share != 1.0 and rope_type != "default":
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is supported with the default RoPE only, "
                             f"not {rope_type!r}")
    if rope_type == "longrope":
        return _longrope_config(raw, params, theta, source, head_dim)
    if rope_type == "yarn":
        return _yarn_config(raw, params, theta, source)
    factor = float(params.get("factor", 1.0))
    if not (math.isfinite(factor) and factor >= 1.0):
        raise ModelLoadError(f"{source}: rope scaling factor must be >= 1, got {factor}")
    if rope_type == "llama3":
        return RopeConfig(
            theta=theta,
            type=rope_type,
            factor=factor,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    section = tuple(int(n) for n in params.get("mrope_section") or ())
    interleaved = bool(section) and bool(params.get("mrope_interleaved", False))
    # interleaved (Qwen3-VL, Qwen3.5): section[1] / section[2] count every third pair from 1 / 2, clamped, any sum
    if section and (rope_type != "default" or (sum(section) != head_dim // 2 and not interleaved)):
        raise ModelLoadError(f"{source}: mrope_section {list(section)} must split the {head_dim // 2} angle pairs "
                             f"(head_dim / 2) of the default RoPE, got rope type {rope_type!r}")
    return RopeConfig(theta=theta, type=rope_type, factor=factor, partial_rotary_factor=share, mrope_section=section,
                      mrope_interleaved=interleaved)


def _longrope_config(raw: dict[str, Any], params: dict[str, Any], theta: float, source: str,
                     head_dim: int) -> RopeConfig:
    """Phi-3's LongRoPE, by transformers' rules: frequencies divided by short_factor while the sequence fits the
    original context and by long_factor beyond it; cos and sin scaled by attention_factor (default
    sqrt(1 + ln(factor) / ln(original context)), factor = max_position_embeddings / original context)."""
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    short, long = params.get("short_factor"), params.get("long_factor")
    if not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{source}: longrope needs original_max_position_embeddings, got {original!r}")
    for name, values in (("short_factor", short), ("long_factor", long)):
        if not (isinstance(values, list) and len(values) == head_dim // 2
                and all(isinstance(v, (int, float)) and v > 0 for v in values)):
            raise ModelLoadError(f"{source}: longrope {name} must be {head_dim // 2} positive numbers "
                                 f"(head_dim / 2), got {values!r}")
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, type="longrope", factor=float(factor), original_max_position_embeddings=original,
                      short_factor=tuple(map(float, short)), long_factor=tuple(map(float, long)),
                      attention_factor=float(attention))


def _yarn_config(raw: dict[str, Any], params: dict[str, Any], theta: float, source: str) -> RopeConfig:
    """YaRN (gpt-oss), by transformers' `_compute_yarn_parameters`: factor (default max_position_embeddings /
    original context), beta_fast / beta_slow (32 / 1), truncate (True), and the cos/sin scale attention_factor
    (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio where both are given)."""
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 1:
        raise ModelLoadError(f"{source}: yarn needs original_max_position_embeddings, got {original!r}")
    factor = params.get("factor")
    factor = float(int(raw.get("max_position_embeddings", original)) / original if factor is None else factor)
    if not (math.isfinite(factor) and factor > 0):
        raise ModelLoadError(f"{source}: yarn factor must be a positive number, got {factor}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig(theta=theta, type="yarn", factor=factor, original_max_position_embeddings=original,
                      attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
                      beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)))
