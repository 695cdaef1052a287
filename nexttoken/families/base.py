"""What a model family declares: the `Family` record and the per-layer `LayerKind`.

A family is data plus two small readers, never code scattered over the tree: the config reader (`ModelConfig`), the
weight readers (safetensors and GGUF), tensor parallelism, LoRA, the fused native step and docs/models.md all ask
the declaration, and none keeps a list of architectures of its own. Declarations sit below `config` (they import
only `errors`), so `ModelConfig.from_dict` reads a checkpoint through them; their readers return plain values
(ModelConfig field names, raw RoPE parameter dicts) that config.py validates into its dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

# What mixes the tokens of a layer: attention over the KV cache (today), or, for issue 41's hybrids, a layer that
# keeps a fixed-size recurrent state per sequence (gated delta rule, short convolution, Mamba2's state space).
MIXERS = ("attention", "linear_attention", "convolution", "state_space")
# Which RoPE an attention layer rotates q and k with: the model's ("global"), the sliding layers' own base
# (Gemma 3's "local"), or none (NoPE: SmolLM3's every fourth layer).
ROPES = ("global", "local", None)


@dataclass(frozen=True)
class LayerKind:
    """The kind of one decoder layer: its mixer, whether it attends a sliding window only, and its RoPE."""

    mixer: str = "attention"
    window: bool = False  # attends only the last ModelConfig.sliding_window positions
    rope: str | None = "global"

    @property
    def keeps_kv(self) -> bool:
        """Whether the layer's per-sequence state is K/V columns (the paged pool); else a fixed-size state slot."""
        return self.mixer == "attention"


FULL = LayerKind()
SLIDING = LayerKind(window=True)
LOCAL_SLIDING = LayerKind(window=True, rope="local")  # Gemma 3: sliding layers rotate with their own RoPE
NOPE = LayerKind(rope=None)
NOPE_SLIDING = LayerKind(window=True, rope=None)  # SmolLM3 with use_sliding_window: its NoPE layers slide
# Issue 41's recurrent kinds (model/recurrent/): no RoPE, a fixed-size state per sequence instead of K/V columns.
LINEAR_ATTENTION = LayerKind(mixer="linear_attention", rope=None)  # gated delta rule (Qwen3.5, Qwen3-Next)
CONVOLUTION = LayerKind(mixer="convolution", rope=None)  # LFM2's gated short convolution
STATE_SPACE = LayerKind(mixer="state_space", rope=None)  # Mamba2's selective state space (SSD)

# What the engine does for a family whose layers keep a recurrent state (docs/models.md's feature table): the
# engine features that work on it, and those it refuses by name (engine/llm_engine.py checks the model's kinds).
RECURRENT_FEATURES = ("continuous batching (mixed lengths)", "chunked prefill (state carried across chunks)",
                      "preemption (recompute)",
                      "prefix caching (the state checkpointed where a cached prefix ends, a hit restores it)",
                      "n > 1 (the prompt prefilled once, the state copied at the fork)",
                      "speculative decoding (the state rolled back for rejected drafts; an attention-only draft "
                      "model or prompt lookup)",
                      "structured output", "traces")
RECURRENT_REFUSED = ("tensor parallelism",)
# LoRA, by the family's `lora`: on its attention and MLP matrices, never a recurrent layer's own
RECURRENT_LORA = ("LoRA on the attention and dense MLP matrices (a sparse MLP's experts and router refused)",
                  "LoRA (Mamba2: no attention or MLP matrices to adapt; LFM2-VL: not yet checked against PEFT)")
# The fused native step, by the family's `native_step` (model/fused.py; csrc/recurrent.cpp computes the mixers)
RECURRENT_NATIVE = ("the fused native decode step (csrc/recurrent.cpp; experts after a mixer included)",
                    "the fused native decode step (the modules path runs every step)")


class GGUFMeta(Protocol):
    """What a family's GGUF reader sees of an opened file (weights/gguf.py's GGUFFile)."""

    path: Any
    tensors: Mapping[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key without its prefix: get("block_count") reads "<arch>.block_count"."""


# raw transformers config, source (for messages), layer count -> this family's ModelConfig fields (see config.py)
ConfigReader = Callable[[dict[str, Any], str, int], dict[str, Any]]
# opened GGUF file, the shared part of the config dict -> the family's keys of a transformers config dict
GGUFReader = Callable[[GGUFMeta, dict[str, Any]], dict[str, Any]]


def no_switches(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    """Llama's block as it is: every layer full attention with the model's RoPE."""
    return {}


def no_gguf_keys(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One architecture, declared once (a module per family under nexttoken/families/)."""

    architecture: str  # transformers' class name, config.json's `architectures`
    model_types: tuple[str, ...]  # config.json's `model_type` (read where `architectures` is absent)
    examples: str  # docs/models.md: the checkpoints people know it by
    summary: str  # docs/models.md: what the config switches on
    read: ConfigReader = no_switches
    gguf: str | None = None  # llama.cpp's `general.architecture`; None: no GGUF file of its own
    # other architectures llama.cpp's converter writes this family's files under (Nemotron-H: nemotron_h_moe, which
    # it picks whenever transformers' config carries MoE fields, as transformers 5's always does)
    gguf_also: tuple[str, ...] = ()
    read_gguf: GGUFReader = no_gguf_keys
    gguf_permuted: bool = False  # llama.cpp's converter permuted q / k rows for its interleaved RoPE (LlamaModel)
    gguf_norm_shift: bool = False  # llama.cpp stores RMSNorm weights as 1 + w (Gemma)
    # the family's GGUF reader reads the per-layer shapes (KV heads, MLP widths) and the RoPE keys itself (Gemma 4:
    # its `rope_freqs` marks the full layers' unrotated dims, not Llama 3's scaling)
    gguf_per_layer: bool = False
    fused_checkpoint: bool = False  # q/k/v as `qkv_proj`, gate/up as `gate_up_proj` (Phi-3): our layout already
    moe_prefix: str = "mlp."  # where a sparse layer's router and experts sit under model.layers.{i}.
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # one expert's gate, up, down
    shared_expert: str = "shared_expert"  # the shared expert's module under moe_prefix (GLM-4: shared_experts)
    # the router's correction bias under moe_prefix (GLM-4 MoE's; ERNIE 4.5's moe_statics one), and whether it is
    # stored as one row (1, experts) rather than (experts,)
    correction_bias: str = "gate.e_score_correction_bias"
    correction_rows: bool = False
    # q / k rows rotate by RoPE in adjacent pairs of each head's dims (ERNIE 4.5): the loader reorders them into
    # the halves the model rotates (model/weights/loader.py's pairs_to_halves)
    rope_pairs: bool = False
    # the fused native step (model/fused.py) computes its blocks; False: they run the modules (parts it lacks)
    native_step: bool = True
    network: str = "decoder"  # which network model/network.py builds: the shared decoder, or a family's own
    mtp_layers: bool = False  # the checkpoint's layers past num_hidden_layers are MTP heads, left out (GLM-4 MoE)
    tensor_parallel: bool = True  # model/parallel.py splits its checkpoints and blocks (tested against one process)
    # gpt-oss: each projection's experts stacked in one checkpoint tensor (model/weights/stacked.py unstacks them)
    stacked_experts: bool = False
    lora: bool = True  # PEFT adapters on q/k/v/o and gate/up/down (attention only on sparse MLP layers)
    # Checkpoint tensor names -> the Llama names the loader reads ((regex, replacement) pairs, applied in order):
    # LFM2's `feed_forward.w1` is Llama's `mlp.gate_proj`. Recurrent layers' tensors keep their own names.
    renames: tuple[tuple[str, str], ...] = ()
    # What the family's recurrent layers keep per sequence (docs/models.md); "": attention only.
    state: str = ""
    # Other `architectures` whose config.json nests this family's under `text_config` (a vision-language checkpoint
    # whose text model nexttoken runs alone, as transformers' AutoModelForCausalLM does; its renames drop the rest).
    text_of: tuple[str, ...] = ()
    # Checkpoint tensor names (after renames) -> the name llama.cpp's tensor map knows them by, for a GGUF file
    # ((regex, replacement) pairs): LFM2's final norm is our `model.norm`, llama.cpp's `token_embd_norm`.
    gguf_aliases: tuple[tuple[str, str], ...] = ()
    # A tensor as llama.cpp's converter rearranged it -> the checkpoint's layout: (config, checkpoint name, tensor)
    # -> tensor (Qwen3.5's value heads, which the converter tiles for ggml's broadcast). None: as stored. It depends
    # on the config and the kind of tensor (its name under model.layers.{i}.), never on the layer: the packed
    # loader probes how it moves rows once per kind and shape (model/weights/gguf.py's order_of).
    gguf_tensor: Callable[[Any, str, Any], Any] | None = None
    # Checkpoint tensors the converter wrote as several GGUF tensors, read back as their rows stacked (then through
    # gguf_tensor): (the checkpoint name's ending under model.layers.{i}., the GGUF tensors' names under blk.{i}.).
    # Granite 4.0-H's [gate; up] (ffn_gate, ffn_up); Qwen3-Next's in_proj_qkvz (attn_qkv, attn_gate).
    gguf_joined: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # config.json fields a family's configs leave out, filled before the shared fields are read (Mamba2: no
    # attention heads, no MLP)
    config_defaults: tuple[tuple[str, Any], ...] = ()
    # Issue 43: the vision kind of a vision-language checkpoint ("gemma3", "qwen2_5_vl", ...): its text model is read
    # from config.json's `text_config` (renames drop the tower's tensors from the decoder's), and model/vision/<kind>
    # builds the tower beside it (images/<kind>.py prepares its images). None: a text model.
    vision: str | None = None
