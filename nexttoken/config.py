"""The model's architecture, read once from a Hugging Face `config.json` and validated there.

One dataclass covers every supported family (docs/models.md): Llama, Mistral, Qwen2/3, OLMo 2, Granite, Gemma 2/3,
Phi-3 and the mixtures of experts differ in switches (biases, norms and where they sit, sliding windows, RoPE
variants, soft-caps, multipliers, a sparse MLP), so one module with flags reads better than a copy per family.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import MissingFileError, ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM",
    "GraniteForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# model_type -> architecture, for a config.json without `architectures` (transformers' AutoModelForCausalLM maps
# the model_type the same way: its MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM", "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
}


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
    # Layers that attend only to the last `sliding_window` positions (Mistral: all; Qwen2: from max_window_layers).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
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

    @property
    def plain(self) -> bool:
        """Llama's block exactly: no q/k norms, norms before the attention and the MLP, no multipliers, SiLU, no
        soft-capping, a dense MLP (the fused native step computes this and every other family's block)."""
        return (self.qk_norm is None and not self.norm_after and self.embedding_multiplier == 1.0
                and self.attention_multiplier is None and self.residual_multiplier == 1.0 and self.logits_scaling == 1.0
                and self.hidden_act == "silu" and not self.norm_plus_one and not self.sandwich_norm
                and self.embed_scale is None and self.attn_logit_softcapping is None
                and self.final_logit_softcapping is None and self.rope_local is None and self.moe is None
                and self.rope.type != "longrope")

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
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:  # no `architectures`: the model_type names it, as transformers reads it
            arch = ARCHITECTURE_OF_MODEL_TYPE.get(raw.get("model_type"))  # type: ignore[arg-type]
        if arch is None:
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

        sliding_window, sliding_layers = _sliding_window(arch, raw, layers, source)
        gemma = arch in _GEMMA
        if arch == "Gemma3ForCausalLM":  # two RoPEs: the global layers' and the sliding layers'
            rope, rope_local = _gemma3_ropes(raw, source, head_dim)
        else:
            rope, rope_local = _rope_config(raw, source, head_dim), None
        cfg = cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(raw.get("qkv_bias", True))),
            qk_norm={"Qwen3ForCausalLM": "head", "Olmo2ForCausalLM": "projection", "Gemma3ForCausalLM": "head",
                     "Qwen3MoeForCausalLM": "head"}.get(arch),
            norm_after=arch == "Olmo2ForCausalLM",
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)) if arch == "GraniteForCausalLM" else 1.0,
            attention_multiplier=_attention_multiplier(arch, raw, source),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)) if arch == "GraniteForCausalLM" else 1.0,
            logits_scaling=float(raw.get("logits_scaling", 1.0)) if arch == "GraniteForCausalLM" else 1.0,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            norm_plus_one=gemma,
            sandwich_norm=gemma,
            embed_scale=hidden**0.5 if gemma else None,
            attn_logit_softcapping=_cap(raw, "attn_logit_softcapping", source) if arch == "Gemma2ForCausalLM" else None,
            final_logit_softcapping=_cap(raw, "final_logit_softcapping", source) if gemma else None,
            rope_local=rope_local,
            moe=_moe_config(arch, raw, layers, source) if arch in _MOE else None,
        )
        if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"{source}: hidden activation {cfg.hidden_act!r} is not supported; "
                                 f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported (decoders attend causally)")
        return cfg


def _attention_multiplier(arch: str, raw: dict[str, Any], source: str) -> float | None:
    """The attention scores' scale where it is not 1/sqrt(head_dim): Granite's multiplier, Gemma's
    query_pre_attn_scalar ** -0.5."""
    if arch == "GraniteForCausalLM":
        return float(raw["attention_multiplier"])
    if arch in _GEMMA:
        scalar = float(raw.get("query_pre_attn_scalar", 256))
        if not scalar > 0:
            raise ModelLoadError(f"{source}: query_pre_attn_scalar must be > 0, got {scalar}")
        return scalar**-0.5
    return None


def _cap(raw: dict[str, Any], key: str, source: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ModelLoadError(f"{source}: {key} must be a positive number or null, got {value!r}")
    return float(value)


def _gemma3_ropes(raw: dict[str, Any], source: str, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's two RoPEs: (global layers', sliding layers'). transformers 5 writes rope_parameters keyed by layer
    type; older configs write rope_theta + rope_scaling (global) and rope_local_base_freq (sliding)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {**params.get("full_attention", {})}
        local = {**params.get("sliding_attention", {})}
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    return (_rope_config({"rope_parameters": full}, source, head_dim),
            _rope_config({"rope_parameters": local}, source, head_dim))


def _moe_config(arch: str, raw: dict[str, Any], layers: int, source: str) -> MoeConfig:
    experts = raw.get("num_local_experts") if arch == "MixtralForCausalLM" else (
        raw.get("num_experts") or raw.get("num_local_experts"))
    top_k = raw.get("num_experts_per_tok")
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts):
        raise ModelLoadError(f"{source}: a mixture of experts needs 1 <= num_experts_per_tok <= the number of "
                             f"experts, got num_experts_per_tok={top_k!r} of {experts!r}")
    if arch == "MixtralForCausalLM":
        return MoeConfig(experts, top_k, int(raw["intermediate_size"]), True, True, 0, (True,) * layers)
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    if step < 1:
        raise ModelLoadError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    if arch == "Qwen2MoeForCausalLM" and shared <= 0:
        raise ModelLoadError(f"{source}: Qwen2-MoE needs shared_expert_intermediate_size > 0, got {shared}")
    return MoeConfig(experts, top_k, int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False)),
                     False, shared, sparse)


def _rope_config(raw: dict[str, Any], source: str, head_dim: int) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs write `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn") and raw.get("model_type") == "phi3":  # Phi-3's old names for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type == "longrope":
        return _longrope_config(raw, params, theta, source, head_dim)
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
    return RopeConfig(theta=theta, type=rope_type, factor=factor)


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


def _sliding_window(arch: str, raw: dict[str, Any], layers: int,
                    source: str = "config") -> tuple[int | None, tuple[bool, ...]]:
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return None, (False,) * layers
    if arch in _GEMMA:  # alternating sliding and global layers: layer_types, or Gemma 3's older pattern
        types = raw.get("layer_types")
        if types is None:
            pattern = 2 if arch == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        if len(types) != layers:
            raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
        return int(window), tuple(t == "sliding_attention" for t in types)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if not raw.get("use_sliding_window", False):
            return None, (False,) * layers
        types = raw.get("layer_types")
        if types is None:
            first = int(raw.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        return int(window), tuple(t == "sliding_attention" for t in types)
    return int(window), (True,) * layers  # Mistral: every layer
