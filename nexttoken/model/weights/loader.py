"""Reading a Hugging Face checkpoint's safetensors into our Transformer (never pickle)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ...config import ModelConfig
from ...errors import MissingFileError, ModelLoadError
from ...families import family
from ..linear import KeptLinear, Linear
from ..llama import Transformer
from ..network import checkpoint_of, network, own_checkpoint
from ..memory import copy_into_arena, empty_in_arena, release_freed_memory
from ..moe import checkpoint_parts as moe_parts, checkpoint_shapes as moe_shapes
from ..recurrent import MIXERS as RECURRENT_MIXERS
from ..rope import pairs_to_halves
from ..quant.quantize import apply_quantization, quantize_bf16
from .reader import Entry, Reader, check_dtypes, read_headers, stored_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Tensors some checkpoints carry that hold nothing we need (RoPE tables are recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """float32 on CPU by default, bfloat16 on accelerators; names or torch dtypes accepted."""
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ModelLoadError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: a single file, or the shards named by the index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise MissingFileError(f"{f} is listed in {index.name} but does not exist; the download is incomplete")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise MissingFileError(
            f"{path} has only pickle checkpoints (*.bin/*.pt); nexttoken loads safetensors only, since pickle "
            "can run code. Convert with transformers: model.save_pretrained(dir, safe_serialization=True)"
        )
    raise MissingFileError(
        f"{path} has no model.safetensors (or model.safetensors.index.json with shards); "
        "point --model at a Hugging Face model folder"
    )


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the files by name, read whole (a test's or tool's view; loading reads into place)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if not name.endswith(_IGNORED_SUFFIXES):
                        tensors[name] = sf.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file ({e}); re-download or re-export it") from e
    return tensors


def renamed(cfg: ModelConfig, names: dict) -> dict:
    """A checkpoint's tensors under the Llama names the loader reads (Family.renames: LFM2's feed_forward.w1 is
    mlp.gate_proj); as they are for the families that need none."""
    rules = family(cfg.architecture).renames
    if not rules:
        return names
    out = {}
    for name, value in names.items():
        for pattern, replacement in rules:
            name = re.sub(pattern, replacement, name)
        if name:  # a rule that leaves nothing drops the tensor (a vision tower the text model does not use)
            out[name] = value
    return out


def _rotate_halves(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our fused [q; k; v] rows of a family whose RoPE rotates pairs (Family.rope_pairs), reordered in place."""
    if not family(cfg.architecture).rope_pairs:
        return state
    qk = (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
    with torch.no_grad():
        for name, t in state.items():
            if name.endswith(("attention.wqkv.weight", "attention.wqkv.bias")):
                t[:qk] = pairs_to_halves(t[:qk], cfg.head_dim)  # (a copy: reshape of the swapped view)
    return state


def _gate_up(cfg: ModelConfig) -> bool:
    """Whether the family's renames give the MLP's gate and up as one `mlp.gate_up_proj` tensor."""
    return any(r.endswith(".mlp.gate_up_proj.") for _, r in family(cfg.architecture).renames)


def _recurrent(cfg: ModelConfig, layer: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """A recurrent layer's tensors (model/recurrent/): our names under layers.{layer}.attention -> the checkpoint's
    (name, shape), joined along dim 0."""
    return RECURRENT_MIXERS[cfg.layer(layer).mixer].checkpoint(cfg, layer)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    if own_checkpoint(cfg):  # a network with checkpoint names of its own (Gemma 4, Falcon-H1)
        return checkpoint_of(cfg).checkpoint_shapes(cfg)
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, C),
        "model.norm.weight": (C,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, C)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        norms = ("post_attention_layernorm", "post_feedforward_layernorm") if cfg.norm_after else (
            "input_layernorm", "post_attention_layernorm")
        shapes |= {
            p + norms[0] + ".weight": (C,),
            p + norms[1] + ".weight": (C,),
            p + "self_attn.q_proj.weight": (q, C),
            p + "self_attn.k_proj.weight": (kv, C),
            p + "self_attn.v_proj.weight": (kv, C),
            p + "self_attn.o_proj.weight": (C, q),
        }
        if cfg.attention_output_gate:  # Qwen3.5: [query; gate] rows per head
            shapes[p + "self_attn.q_proj.weight"] = (2 * q, C)
        if not cfg.layer(i).keeps_kv:  # a recurrent layer: its own tensors instead of attention's
            for x in "qkvo":
                del shapes[p + f"self_attn.{x}_proj.weight"]
            shapes |= {name: shape for parts in _recurrent(cfg, i).values() for name, shape in parts}
        if _fused_checkpoint(cfg):  # Phi-3 stores q/k/v and gate/up fused, in our layout already
            for x in "qkv":
                del shapes[p + f"self_attn.{x}_proj.weight"]
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, C), p + "mlp.gate_up_proj.weight": (2 * I, C),
                       p + "mlp.down_proj.weight": (C, I)}
            continue
        if cfg.sandwich_norm:
            shapes |= {p + "pre_feedforward_layernorm.weight": (C,), p + "post_feedforward_layernorm.weight": (C,)}
        if cfg.moe and cfg.moe.sparse_layers[i]:
            shapes |= moe_shapes(cfg, i)
        elif not I:  # Mamba2: no MLP, nor its norm
            del shapes[p + norms[1] + ".weight"]
        elif family(cfg.architecture).renames and _gate_up(cfg):  # Granite 4.0-H: [gate; up] as one tensor
            shapes |= {p + "mlp.gate_up_proj.weight": (2 * I, C), p + "mlp.down_proj.weight": (C, I)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                       p + "mlp.down_proj.weight": (C, I)}
        if not cfg.layer(i).keeps_kv:
            pass
        elif cfg.qk_norm:
            qn, kn = (D, D) if cfg.qk_norm == "head" else (q, kv)
            shapes |= {p + "self_attn.q_norm.weight": (qn,), p + "self_attn.k_norm.weight": (kn,)}
        if (cfg.qkv_bias or cfg.attention_bias) and cfg.layer(i).keeps_kv:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if cfg.attention_bias and cfg.layer(i).keeps_kv:
            shapes[p + "self_attn.o_proj.bias"] = (C,)
        if cfg.attention_sinks:  # gpt-oss (stacked.py names them as llama.cpp does: a `.weight`)
            shapes[p + "self_attn.sinks.weight"] = (cfg.num_attention_heads,)
        if cfg.mlp_bias and not (cfg.moe and cfg.moe.sparse_layers[i]):
            shapes |= {p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (C,)}
    return shapes


def _fused_checkpoint(cfg: ModelConfig) -> bool:
    return family(cfg.architecture).fused_checkpoint


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: Path) -> None:
    expected = _expected_shapes(cfg)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{source}: tensor {', '.join(missing[:3])}{more} missing from the checkpoint")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, but config.json implies {shape}"
            )
    unexpected = [n for n in tensors if n not in expected and not (cfg.tie_word_embeddings and n == "lm_head.weight")
                  and not _mtp_layer(cfg, n)]
    if unexpected:
        raise ModelLoadError(
            f"{source}: unexpected tensors {', '.join(unexpected[:3])}: the checkpoint does not match config.json "
            f"({cfg.architecture})"
        )


def _mtp_layer(cfg: ModelConfig, name: str) -> bool:
    """A checkpoint tensor transformers leaves out too: the multi-token-prediction layers some families store
    after the last layer (GLM-4 MoE's model.layers.{num_hidden_layers}...), Gemma 4's KV-shared layers' k / v."""
    parts = name.split(".")
    if own_checkpoint(cfg) and checkpoint_of(cfg).ignored(cfg, name):  # Gemma 4's KV-shared layers' unused k / v tensors
        return True
    return (family(cfg.architecture).mtp_layers and len(parts) > 3 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= cfg.num_hidden_layers)


def state_parts(cfg: ModelConfig, names: set[str] | dict) -> dict[str, list[str]]:
    """Our module names -> the checkpoint tensors each is made of, concatenated along dim 0 (q/k/v and gate/up
    fused; one name: the tensor as it is). `names`: the checkpoint's tensor names (optional biases)."""
    if own_checkpoint(cfg):
        return checkpoint_of(cfg).checkpoint_parts(cfg)
    sd = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_word_embeddings else ["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        # The block's two norms: before attention and MLP (Llama), or after them (OLMo 2's post norms).
        first, second = ("post_attention_layernorm", "post_feedforward_layernorm") if cfg.norm_after else (
            "input_layernorm", "post_attention_layernorm")
        if cfg.sandwich_norm:  # Gemma 2 / 3: four norms, before and after each branch
            first, second = "input_layernorm", "pre_feedforward_layernorm"
            sd[o + "attention_post_norm.weight"] = [p + "post_attention_layernorm.weight"]
            sd[o + "ffn_post_norm.weight"] = [p + "post_feedforward_layernorm.weight"]
        sd[o + "attention_norm.weight"] = [p + first + ".weight"]
        if cfg.intermediate_size or cfg.moe:
            sd[o + "ffn_norm.weight"] = [p + second + ".weight"]
        if cfg.moe and cfg.moe.sparse_layers[i]:
            sd |= moe_parts(cfg, i)
        if cfg.attention_sinks:
            sd[o + "attention.sinks"] = [p + "self_attn.sinks.weight"]
        if not cfg.layer(i).keeps_kv:
            sd |= {o + "attention." + ours: [n for n, _ in parts] for ours, parts in _recurrent(cfg, i).items()}
        elif cfg.qk_norm:
            sd[o + "attention.q_norm.weight"] = [p + "self_attn.q_norm.weight"]
            sd[o + "attention.k_norm.weight"] = [p + "self_attn.k_norm.weight"]
        if _fused_checkpoint(cfg):  # [q; k; v] and [gate; up] rows: our fused matrices as they are
            sd[o + "attention.wqkv.weight"] = [p + "self_attn.qkv_proj.weight"]
            sd[o + "attention.wo.weight"] = [p + "self_attn.o_proj.weight"]
            sd[o + "mlp.w13.weight"] = [p + "mlp.gate_up_proj.weight"]
            sd[o + "mlp.w2.weight"] = [p + "mlp.down_proj.weight"]
            continue
        for kind in ("weight", "bias"):
            qkv = [p + f"self_attn.{x}_proj.{kind}" for x in "qkv"]
            if qkv[0] in names:
                sd[o + f"attention.wqkv.{kind}"] = qkv
            if p + f"self_attn.o_proj.{kind}" in names:
                sd[o + f"attention.wo.{kind}"] = [p + f"self_attn.o_proj.{kind}"]
            if p + f"mlp.gate_up_proj.{kind}" in names:  # Granite 4.0-H's shared_mlp.input_linear: [gate; up]
                sd[o + f"mlp.w13.{kind}"] = [p + f"mlp.gate_up_proj.{kind}"]
                sd[o + f"mlp.w2.{kind}"] = [p + f"mlp.down_proj.{kind}"]
            if p + f"mlp.gate_proj.{kind}" in names:
                sd[o + f"mlp.w13.{kind}"] = [p + f"mlp.gate_proj.{kind}", p + f"mlp.up_proj.{kind}"]
                sd[o + f"mlp.w2.{kind}"] = [p + f"mlp.down_proj.{kind}"]
    return sd


def to_state_dict(cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> our module names, fusing q/k/v and gate/up (tied names share one tensor)."""
    sd: dict[str, torch.Tensor] = {}
    made: dict[tuple[str, ...], torch.Tensor] = {}
    for name, parts in state_parts(cfg, t).items():
        key = tuple(parts)
        if key not in made:
            made[key] = t[parts[0]] if len(parts) == 1 else _cat([t[n] for n in parts])
        sd[name] = made[key]
    return sd


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along rows; shapes only for meta tensors (torch.cat's meta kernel imports torch._dynamo: ~3 s and
    ~70 MB resident the first time)."""
    if parts[0].is_meta:
        rows = sum(p.shape[0] for p in parts)
        return torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")
    return torch.cat(parts)


@dataclass(frozen=True)
class Precision:
    """What a load builds: `dtype` for activations, norms, the KV cache and (unless bf16_weights) the weights;
    `bf16_weights`: the matrices and the embedding stored bfloat16 (quant/bf16.py), activations float32."""

    dtype: torch.dtype
    bf16_weights: bool = False


def resolve_precision(dtype: str | torch.dtype | None, device: torch.device, stored: torch.dtype | None,
                      quantize: str | None = None) -> Precision:
    """The one rule for a checkpoint's default precision. An explicit dtype keeps its meaning (float32: the
    weights widened, exact against transformers float32; bfloat16: every module in bf16, exact against
    transformers bf16). By default on CPU a checkpoint stored in bfloat16 keeps bf16 weights with float32
    activations (memory about the file's size, the fused native step reading half the bytes; exact against
    transformers float32 on the same file, since widening bf16 to float32 is exact), anything else loads float32;
    on accelerators bfloat16. quantize="bf16" reads any checkpoint as bf16 weights straight from the file; int8 /
    int4 quantize the float32 (CPU default) model."""
    if quantize == "bf16":
        return Precision(torch.float32, True)
    if dtype is None or dtype == "auto":
        if device.type == "cpu" and stored == torch.bfloat16 and quantize in (None, "none"):
            return Precision(torch.float32, True)
    return Precision(resolve_dtype(dtype, device))


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
    quantize: str | None = None,
) -> Transformer:
    """Build our Transformer from a Hugging Face model folder (config.json + safetensors), each weight read from
    the file straight into its place (reader.py). `dtype` / `quantize`: resolve_precision's rule (by default a
    bf16 checkpoint keeps bf16 weights with float32 activations on CPU); `quantize` is applied here."""
    path, device, cfg = _open_folder(path, device)
    if family(cfg.architecture).stacked_experts and cfg.moe is not None:  # (dense Granite 4.0-H: no experts)
        return _load_stacked(path, cfg, dtype, device, quantize)
    entries = renamed(cfg, {n: e for n, e in read_headers(safetensors_files(path)).items()
                            if not n.endswith(_IGNORED_SUFFIXES) and not _mtp_layer(cfg, n)})
    check_tensors(cfg, entries, path)
    check_dtypes(entries)
    precision = resolve_precision(dtype, device, stored_dtype(entries), quantize)
    with torch.device("meta"):  # no throw-away random init: parameters are assigned from the checkpoint
        model = network(cfg)
    parts = state_parts(cfg, entries)
    dtypes = {name: _weight_dtype(model, name, precision) for name in parts}
    model.load_state_dict(_rotate_halves(cfg, _read_state(parts, entries, dtypes, device)), assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(device).eval()
    if precision.bf16_weights:  # the Linear modules already hold bf16 tensors: wrapped, not copied
        model = quantize_bf16(model, repack=False)
    model = apply_quantization(model, quantize)
    kind = family(cfg.architecture).vision
    if kind is not None:  # issue 43: the tower beside the decoder, float32, never quantized
        # kept beside the decoder's modules, not among them: quantization, LoRA, tensor parallelism and .to(dtype)
        # of the decoder leave the tower (float32) alone
        object.__setattr__(model, "vision", load_vision(path, kind, device))
    return model


def load_vision(path: Path, kind: str, device: torch.device) -> torch.nn.Module | None:
    """The vision tower and projector (model/vision/<kind>.py) of a vision-language checkpoint folder, float32
    (None: a text checkpoint of a family that also reads its vision-language ones, Qwen3.5's)."""
    from .. import vision

    prefixes = vision.tower_class(kind).prefixes
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.startswith(prefixes):
                    tensors[name] = sf.get_tensor(name)
    raw = json.loads((path / "config.json").read_text())
    tower = vision.build(kind, raw, tensors)
    return None if tower is None else tower.to(device)


def _load_stacked(path: Path, cfg: ModelConfig, dtype: str | torch.dtype | None, device: torch.device,
                  quantize: str | None) -> Transformer:
    """A checkpoint whose experts are stacked (gpt-oss): read whole and unstacked (stacked.py), then built as any
    checkpoint; precision by resolve_precision's rule. MXFP4 experts (the released checkpoints') stay packed
    (quant/mxfp4.py's Mxfp4Linear: 4.25 bits a weight, the exact values) where the activations are float32 on CPU
    (the other matrices float32, or bf16 as a bf16 checkpoint loads by default); for int8 / int4 and bfloat16
    activations they are dequantized exactly."""
    from .stacked import packed_experts, unstack

    files = safetensors_files(path)
    entries = read_headers(files)
    floats = {n: e for n, e in entries.items() if isinstance(e.dtype, torch.dtype)}
    precision = resolve_precision(dtype, device, stored_dtype(floats) if floats else None, quantize)
    tensors = read_tensors(files)
    keep = device.type == "cpu" and precision.dtype == torch.float32 and quantize in (None, "none", "bf16")
    packed = packed_experts(cfg, tensors) if keep else {}
    tensors = unstack(cfg, tensors, path)
    if packed:
        from .experts import keep_experts, mxfp4_layer

        shapes = {hf: torch.empty(rows.shape[0], rows.shape[1] // 17 * 32, device="meta")  # (N, K) stand-ins
                  for hf, rows in packed.items()}
        check_tensors(cfg, {**tensors, **shapes}, path)
        state = to_state_dict(cfg, {**tensors, **shapes})
        state = _owned({n: t for n, t in state.items() if not t.is_meta}, device, torch.float32)
        with torch.device("meta"):
            model = Transformer(cfg)
        model.load_state_dict(state, assign=True, strict=False)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed.weight
        keep_experts(model, cfg, packed, lambda hf: (packed[hf], "MXFP4"), mxfp4_layer)
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        assert not left, f"not loaded: {left[:3]}"
        model = model.eval()
        model.quantization = "mxfp4"  # the experts as the checkpoint stores them
        return quantize_bf16(model) if precision.bf16_weights else model  # (a bf16 checkpoint's default on CPU)
    model = build_model(cfg, tensors, path, device, precision.dtype)
    if precision.bf16_weights:
        model = quantize_bf16(model)
    return apply_quantization(model, quantize)


def _weight_dtype(model: Transformer, name: str, precision: Precision) -> torch.dtype:
    """bfloat16 for a matrix of a `Linear` (not a KeptLinear router) and the embedding when the precision keeps
    bf16 weights, else the precision's dtype."""
    if not precision.bf16_weights:
        return precision.dtype
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    is_matrix = name.endswith(".weight") and (isinstance(owner, Linear) and not isinstance(owner, KeptLinear))
    return torch.bfloat16 if is_matrix or name == "embed.weight" else torch.float32


def _read_state(parts: dict[str, list[str]], entries: dict[str, Entry], dtypes: dict[str, torch.dtype],
                device: torch.device) -> dict[str, torch.Tensor]:
    """Our state dict, every tensor read from the files into its slot of one huge-page arena (tied names share
    one); on an accelerator each is moved there as soon as it is read."""
    first: dict[tuple[str, ...], str] = {}
    owner = {name: first.setdefault(tuple(p), name) for name, p in parts.items()}
    specs = {}
    for name, p in parts.items():
        if owner[name] == name:
            shape = entries[p[0]].shape
            specs[name] = ((sum(entries[n].shape[0] for n in p), *shape[1:]), dtypes[name])
    slots = empty_in_arena(specs) if device.type == "cpu" else None
    state: dict[str, torch.Tensor] = {}
    with Reader() as reader:
        for name, (shape, dtype) in specs.items():
            t = slots[name] if slots is not None else torch.empty(shape, dtype=dtype)
            reader.fill(t, [entries[n] for n in parts[name]])
            state[name] = t if slots is not None else t.to(device)
    return {name: state[owner[name]] for name in parts}


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: Path, device: torch.device,
                torch_dtype: torch.dtype) -> Transformer:
    """The Transformer of a checkpoint's tensors (by checkpoint name), checked against `cfg`, in owned memory
    (every reader's last step: safetensors folders here, GGUF files in gguf.py)."""
    tensors = renamed(cfg, tensors)
    check_tensors(cfg, tensors, source)
    state = _owned(to_state_dict(cfg, tensors), device, torch_dtype)
    with torch.device("meta"):  # no throw-away random init: parameters are assigned from the checkpoint
        model = network(cfg)
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    del tensors, state
    release_freed_memory()
    return model.to(device).eval()


def _open_folder(path: str | Path, device: str | torch.device | None):  # noqa: ANN202
    """(folder, device, ModelConfig) of a model folder, checked."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"model folder {path} does not exist")
    return path, torch.device(device or "cpu"), ModelConfig.from_dir(path)


def _owned(state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Own memory for every weight, so the checkpoint's file mapping is released with the tensors read from it
    (they would otherwise keep every page of the file resident next to the fused copies). On CPU that memory is
    one huge-page arena (memory.py: decode streams it faster). One tensor at a time, so each fused temporary is
    freed as soon as its copy exists (load peak ~2x, not ~2.7x)."""
    if device.type == "cpu":
        return copy_into_arena(state, dtype)
    for name in state:  # replaced one at a time, so each source can go as soon as its copy exists
        state[name] = state[name].to(device=device, dtype=dtype, copy=True)
    return state
