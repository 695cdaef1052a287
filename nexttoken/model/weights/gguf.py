"""Reading a GGUF file (llama.cpp's format, from llama.cpp, Ollama, LM Studio, GGUF-my-repo) into our Transformer.

The file's header is read by gguf_reader.py (one pass; the `gguf` package's reader for big-endian files), its
tensors dequantized by the `gguf` package (ggml's own dequantizer). Its metadata becomes the
transformers-style config dict that `ModelConfig.from_dict` validates (so a GGUF model and the same model's folder
make one `ModelConfig`); its tensors are dequantized into the requested dtype and renamed to the Hugging Face
checkpoint names, so `loader.py`'s shape checks and fusing apply unchanged. What llama.cpp's converter changed is
undone as transformers undoes it: the q/k row permutation of Llama-style RoPE, Gemma's `1 + weight` norms, the
experts stacked in one tensor per projection.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import ModelConfig
from ...errors import MissingFileError, ModelLoadError
from ...families import BY_GGUF, Family
from ..llama import Transformer
from .gguf_reader import BigEndian, read_gguf
from .loader import _expected_shapes as expected_shapes, build_model, resolve_dtype

# Weight types llama-quantize and GGUF-my-repo write for the families we run; dequantized by `gguf.quants`.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "MXFP4", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")

@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata as Python values and its tensors (still packed, memory-mapped)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor
    mapped: Any = None  # the whole file's memory map (numpy), whose pages gguf_packed.release_pages gives back

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key without its prefix: get("block_count") reads "llama.block_count"."""
        return self.metadata.get(f"{self.arch}.{key}", default)


def open_gguf(path: str | Path, mmap: bool = True) -> GGUFFile:
    """Open a GGUF file; a missing, truncated or damaged file raises ModelLoadError naming it. mmap=False: the
    file's bytes are read into anonymous memory, not mapped (read_gguf), and nothing refers to the file after."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                             "pass a .gguf written by llama.cpp, or a Hugging Face model folder")
    try:
        try:
            metadata, tensors, mapped = read_gguf(path, mmap)  # one pass: GGUFReader takes seconds on a vocabulary
            mapped = mapped if mmap else None  # anonymous memory: its pages are the weights, never given back
        except BigEndian:
            if not mmap:
                raise ModelLoadError(f"{path} is a big-endian GGUF file: it is read through its map only; load it "
                                     "with mmap (the default)") from None
            reader = GGUFReader(str(path), mode="c")  # copy-on-write: writable views, the file untouched
            metadata = {key: field.contents() for key, field in reader.fields.items()}
            tensors, mapped = reader.tensors, reader.data
    except (ValueError, IndexError, KeyError, OSError, EOFError, TypeError, OverflowError, struct.error) as e:
        raise ModelLoadError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}: {e}); "
                             "download it again") from e
    if int(metadata.get("split.count", 1) or 1) > 1:
        raise ModelLoadError(f"{path} is part {int(metadata.get('split.no', 0)) + 1} of a GGUF split into "
                             f"{metadata['split.count']} files; merge them first with llama.cpp's "
                             "`llama-gguf-split --merge FIRST.gguf OUT.gguf`")
    return GGUFFile(path, metadata, {t.name: t for t in tensors}, mapped)


# ---- metadata -> config --------------------------------------------------------------------------------------


def writer_family(g: GGUFFile) -> Family:
    """The family whose llama.cpp architecture wrote the file (its permutation and norm-shift rules)."""
    family = BY_GGUF.get(g.arch)
    if family is None:
        raise ModelLoadError(f"{g.path}: GGUF architecture {g.arch!r} is not supported; nexttoken runs GGUF files "
                             f"of {', '.join(BY_GGUF)}")
    return family


def config_dict(g: GGUFFile) -> dict[str, Any]:
    """The GGUF's hyperparameters as a transformers config dict (what `ModelConfig.from_dict` reads): the keys
    every llama.cpp architecture writes here, the family's own through its declaration (Family.read_gguf)."""
    family = writer_family(g)

    def need(key: str) -> Any:
        value = g.get(key)
        if value is None:
            raise ModelLoadError(f"{g.path}: the GGUF metadata has no {g.arch}.{key}; the file is incomplete")
        return value

    hidden, heads, layers = int(need("embedding_length")), int(need("attention.head_count")), int(need("block_count"))
    kv_heads = g.get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts: one value is all our attention takes
        kv_heads = [k for k in kv_heads if k] or [heads]  # 0: a layer without attention (LFM2's convolutions)
        if len(set(kv_heads)) != 1 and not family.gguf_per_layer:
            raise ModelLoadError(f"{g.path}: KV heads differ between layers ({sorted(set(kv_heads))}); not supported")
        kv_heads = kv_heads[0]  # (a family with per-layer shapes reads them itself: Family.gguf_per_layer)
    head_dim = g.get("attention.key_length") or (g.get("rope.dimension_count") if family.gguf_permuted else None)
    head_dim = int(head_dim or hidden // heads)
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    embed = g.tensors.get("token_embd.weight")
    vocab = g.get("vocab_size") or (len(tokens) if tokens else None) or (int(embed.shape[-1]) if embed else None)
    cfg: dict[str, Any] = {
        "model_type": family.model_types[0],
        "architectures": [family.architecture],
        "hidden_size": hidden,
        "intermediate_size": int(_first(g.get("feed_forward_length")) or g.get("expert_feed_forward_length") or 0),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab) if vocab else None,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_output.bias" in g.tensors,
        "mlp_bias": "blk.0.ffn_down.bias" in g.tensors,
        "rope_parameters": {} if family.gguf_per_layer else _rope(g, head_dim),
        "bos_token_id": g.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": g.metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": g.metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if g.get("attention.sliding_window") is not None:
        cfg["sliding_window"] = int(g.get("attention.sliding_window"))
    return cfg | family.read_gguf(g, cfg)


def _first(value: Any) -> Any:
    """A per-layer array's first entry (Gemma 4's feed_forward_length), or the value itself."""
    return value[0] if isinstance(value, list) and value else value


def _rope(g: GGUFFile, head_dim: int) -> dict[str, Any]:
    """RoPE parameters: theta, linear scaling, Llama 3's frequency factors (stored as the `rope_freqs` tensor)
    and Phi-3's LongRoPE factors (the `rope_factors_long` / `_short` tensors)."""
    params: dict[str, Any] = {"rope_theta": float(g.get("rope.freq_base", 10000.0)), "rope_type": "default"}
    kind = g.get("rope.scaling.type")
    if kind not in (None, "none", "linear", "yarn"):
        raise ModelLoadError(f"{g.path}: RoPE scaling {kind!r} is not supported (supported: linear, yarn, Llama 3's, "
                             "Phi-3's LongRoPE)")
    if kind == "yarn":  # the family's reader adds what llama.cpp does not store (gpt-oss: no truncation)
        original = g.get("rope.scaling.original_context_length")
        params |= {"rope_type": "yarn", "factor": float(g.get("rope.scaling.factor", 1.0)),
                   "beta_fast": float(g.get("rope.scaling.yarn_beta_fast", 32.0)),
                   "beta_slow": float(g.get("rope.scaling.yarn_beta_slow", 1.0)),
                   "original_max_position_embeddings": int(original or g.get("context_length"))}
    if kind == "linear" and float(g.get("rope.scaling.factor", 1.0)) != 1.0:
        params |= {"rope_type": "linear", "factor": float(g.get("rope.scaling.factor"))}
    if "rope_freqs.weight" in g.tensors:
        params = _llama3_rope(g, params, head_dim)
    if "rope_factors_long.weight" in g.tensors:
        original = int(g.get("rope.scaling.original_context_length") or g.get("context_length"))
        params |= {"rope_type": "longrope", "original_max_position_embeddings": original,
                   "long_factor": _tensor(g, "rope_factors_long.weight", torch.float32).tolist(),
                   "short_factor": _tensor(g, "rope_factors_short.weight", torch.float32).tolist()}
        if g.get("rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(g.get("rope.scaling.attn_factor"))
    return params


def _llama3_rope(g: GGUFFile, params: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Llama 3.1+'s RoPE from llama.cpp's `rope_freqs` (the per-frequency divisors it precomputed from the
    checkpoint's rope_scaling): the llama3 parameters that give exactly these divisors (Meta's released values)."""
    stored = _tensor(g, "rope_freqs.weight", torch.float32)
    factor = float(stored.max())
    candidate = {**params, "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
    theta = params["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    low, high = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    divisor = torch.where(wavelen < high, torch.ones_like(inv), torch.where(
        wavelen > low, torch.full_like(inv, factor), 1 / ((1 - smooth) / factor + smooth)))
    if stored.numel() != divisor.numel() or not torch.allclose(stored.double(), divisor, rtol=1e-5, atol=1e-5):
        raise ModelLoadError(f"{g.path}: rope_freqs holds frequency factors that are not Llama 3's scheme; "
                             "this RoPE scaling is not supported")
    return candidate


# ---- tensors --------------------------------------------------------------------------------------------------


def _tensor(g: GGUFFile, name: str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor dequantized as ggml defines it (`gguf.quants.dequantize`), in PyTorch's (rows, columns) order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t = g.tensors[name]
    kind = GGMLQuantizationType(t.tensor_type).name
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{g.path}: tensor {name} is of quantization type {kind}, which nexttoken does not read; "
                             f"supported: {', '.join(SUPPORTED_TYPES)}")
    try:
        # a plain ndarray view of the mapped bytes: numpy's memmap subclass costs a Python call per row group
        values = dequantize(t.data.view(np.ndarray), t.tensor_type)  # (..., columns) float32, ggml's formulas
    except (ValueError, IndexError, AssertionError) as e:
        raise ModelLoadError(f"{g.path}: tensor {name} ({kind}) cannot be dequantized ({e}); the file is damaged") from e
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
    if values.size != math.prod(shape):
        raise ModelLoadError(f"{g.path}: tensor {name} holds {values.size} values for its shape {shape}; "
                             "the file is truncated or damaged")
    values = values.reshape(shape)
    if not (values.flags.writeable and values.flags.c_contiguous):  # F32 tensors come back as the file mapping
        values = np.array(values, order="C")
    return torch.from_numpy(values).to(dtype)


def dequantize_tensor(path: str | Path, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One tensor of a GGUF file dequantized into `dtype`, in PyTorch's (rows, columns) order."""
    return _tensor(open_gguf(path), name, dtype)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q / k permutation (convert_hf_to_gguf.py's `permute`): within each head, llama.cpp
    interleaved the two rotary halves; transformers' `_reverse_permute_weights` puts them back."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # (H, half, 2, ...) -> (H, 2, half, ...)


@functools.lru_cache(maxsize=8)
def _name_map(arch, blocks: int):  # noqa: ANN001, ANN202 - gguf.MODEL_ARCH -> gguf.TensorNameMap
    """gguf's name map of an architecture and block count (built once: ~50 ms of regular expressions each)."""
    import gguf

    return gguf.get_tensor_name_map(arch, blocks)


def gguf_names(g: GGUFFile, cfg: ModelConfig, names: list[str]) -> dict[str, str]:
    """Checkpoint name -> the GGUF tensor holding it, for the dense names (not the experts' slices) the file has."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == g.arch)
    # the file's blocks: more than our layers where a family pairs them (Nemotron-H's MLP blocks)
    name_map = _name_map(arch, max(cfg.num_hidden_layers, int(g.get("block_count") or 0)))
    out = {}
    for hf in names:
        if re.search(r"\.experts\.\d+\.", hf):  # one expert's slice of a stacked tensor (checkpoint_tensors)
            continue
        full = hf
        for pattern, alias in writer_family(g).gguf_aliases:  # a name llama.cpp's map knows in another spelling
            full = re.sub(pattern, alias, full)
        if full.startswith("blk.") and full in g.tensors:  # an alias to the file's own name (Gemma 4's experts)
            out[hf] = full
            continue
        base, suffix = full.rsplit(".", 1)
        gname = name_map.get_name(base)
        if gname is None and base.endswith("block_sparse_moe.gate"):  # Mixtral's router
            gname = f"blk.{base.split('.')[2]}.ffn_gate_inp"
        whole = name_map.get_name(full)  # a parameter without .weight (Mamba2's A_log, D: blk.N.ssm_a, ssm_d)
        if gname is not None and f"{gname}.{suffix}" in g.tensors:
            out[hf] = f"{gname}.{suffix}"
        elif whole is not None and whole in g.tensors:
            out[hf] = whole
        elif suffix == "e_score_correction_bias":  # GLM-4 MoE's router bias: llama.cpp's exp_probs_b.bias
            if f"blk.{base.split('.')[2]}.exp_probs_b.bias" in g.tensors:
                out[hf] = f"blk.{base.split('.')[2]}.exp_probs_b.bias"
    return out


def _as_checkpoint(g: GGUFFile, cfg: ModelConfig, gname: str, t: torch.Tensor) -> torch.Tensor:
    """A GGUF tensor's rows (float values or packed rows) in the checkpoint's layout: llama.cpp's q / k row
    permutation undone (it moves whole rows, so packed rows too)."""
    if writer_family(g).gguf_permuted and gname.rsplit(".", 1)[0].endswith(("attn_q", "attn_k")):
        t = _unpermute(t, cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads)
    return t


def _joined(g: GGUFFile, hf: str) -> list[str] | None:
    """The GGUF tensors whose rows stacked are checkpoint tensor `hf` (Family.gguf_joined), where the file has them."""
    for ending, parts in writer_family(g).gguf_joined:
        if hf.startswith("model.layers.") and hf.endswith("." + ending):
            names = [f"blk.{hf.split('.')[2]}.{p}" for p in parts]
            if all(n in g.tensors for n in names):
                return names
    return None


_LAYER = re.compile(r"\.layers\.\d+\.")  # a checkpoint name's layer index (order_of's probes skip it)


def checkpoint_tensors(g: GGUFFile, cfg: ModelConfig, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The GGUF's tensors under the Hugging Face checkpoint names `names` (what loader.py expects for `cfg`),
    dequantized into `dtype`. A checkpoint name with no GGUF tensor is left out (the shape check then names it)."""
    dense = gguf_names(g, cfg, names)
    shapes = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    stacked: dict[str, torch.Tensor] = {}  # ffn_{gate,up,down}_exps, read once per layer
    for hf in names:
        base, suffix = hf.rsplit(".", 1)
        if ".experts." in base:  # model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{proj}: one expert's slice
            layer, expert, proj = int(base.split(".")[2]), int(base.split(".")[-2]), base.split(".")[-1]
            part = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
                    "w2": "down"}[proj]
            key = f"blk.{layer}.ffn_{part}_exps.{suffix}"  # (experts, out, in) weights, (experts, out) biases
            if key not in g.tensors:
                continue
            if key not in stacked:
                stacked[key] = _tensor(g, key, dtype)  # (experts, out, in)
            out[hf] = stacked[key][expert]
            continue
        joined = _joined(g, hf)
        if joined is not None:  # one checkpoint tensor written as several (Family.gguf_joined)
            t = torch.cat([_tensor(g, p, torch.float32) for p in joined])
            if writer_family(g).gguf_tensor is not None:
                t = writer_family(g).gguf_tensor(cfg, hf, t)
            out[hf] = t.to(dtype)
            continue
        if hf not in dense:
            continue
        gname = dense[hf]
        t = _as_checkpoint(g, cfg, gname, _tensor(g, gname, torch.float32))
        if gname.endswith(".ssm_a"):  # llama.cpp stores Mamba2's A = -exp(A_log)
            t = torch.log(-t)
        if writer_family(g).gguf_norm_shift and gname.endswith("norm.weight") and not gname.endswith("ssm_norm.weight"):
            t = t - 1  # (Qwen3.5's gated delta-rule norm is a plain RMSNorm: llama.cpp leaves it as it is)
        if writer_family(g).gguf_tensor is not None:
            t = writer_family(g).gguf_tensor(cfg, hf, t)
        if hf.endswith("shared_expert_gate.weight") and t.dim() == 1:  # llama.cpp keeps the (C,) vector
            t = t.unsqueeze(0)
        want = shapes.get(hf)
        if want is not None and tuple(t.shape) != want and t.numel() == math.prod(want):
            t = t.reshape(want)  # a convolution's (C, 1, K) weight that the converter squeezed to (C, K)
        out[hf] = t.to(dtype)
    return out


def load_gguf_model(path: str | Path, dtype: str | torch.dtype | None = None,
                    device: str | torch.device | None = None,
                    dequantize: bool = False, activations: str | None = None,
                    mmap: bool = True) -> tuple[Transformer, GGUFFile]:
    """Build our Transformer from a GGUF file; returns it with the opened file (its tokenizer metadata).

    By default a quantized file's matrices stay in their ggml blocks (and BF16 ones in bfloat16), multiplied
    natively with float32 activations (gguf_packed.py): the file's size in memory and llama.cpp's arithmetic.
    MoE experts stay packed too where the kernels read their type (MXFP4 on any CPU, the ggml block types where
    those kernels run).
    dequantize=True (also implied by a dtype other than float32, a non-CPU device, or no AVX-512 VNNI here) gives
    the float model of exactly gguf's dequantized values, the reference transformers' GGUF loader agrees with.
    activations="int16": the packed product quantizes its inputs to int16 per block of 32 instead of llama.cpp's
    int8: close to the float model's choices, at up to twice the kernel's arithmetic (docs/performance.md).
    None: the arithmetic policy's default (model/arithmetic.py), which the model holds (model.arithmetic).
    mmap=False (llama.cpp's --no-mmap): the file is read into anonymous memory; packed matrices are otherwise read
    from the file's map, so truncating the file under a running process kills it (SIGBUS on the next read)."""
    from ..arithmetic import ACTIVATIONS, Arithmetic
    from ..quant.ggml import native_blocks

    if activations is not None and activations not in ACTIVATIONS:
        raise ModelLoadError(f"gguf_activations={activations!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
    policy = Arithmetic.from_env()
    policy = policy if activations is None else policy.replace(gguf_activations=activations)

    g = open_gguf(path, mmap)
    device = torch.device(device or "cpu")
    torch_dtype = resolve_dtype(dtype, device)
    cfg = ModelConfig.from_dict(config_dict(g), source=str(g.path))
    names = list(expected_shapes(cfg))
    # a model with recurrent layers (issue 41) keeps its attention and MLP matrices packed as the other families
    # do, and so do its recurrent mixers' in_proj / out_proj (gguf_packed.mixer_groups; their small vectors and
    # convolution taps are read as floats).
    # A network of its own keeps them too where its matrices hold the file's values as they are (gguf_packed's
    # packable: Gemma 4, Nemotron-H); Falcon-H1, which folds its multipliers into rows at load, loads dequantized.
    from .gguf_packed import packable

    if not dequantize and packable(cfg) and device.type == "cpu" and torch_dtype == torch.float32:
        from .gguf_packed import (build_packed_model, file_rows, keepable, keepable_experts, keepable_stacked,
                                  mixer_groups, release_pages, row_order)

        dense = gguf_names(g, cfg, names)
        hook = writer_family(g).gguf_tensor  # Qwen3.5's untiled value heads: followed on packed rows (row_order)
        orders: dict[tuple[str, tuple[int, ...]], torch.Tensor | None | bool] = {}

        def order_of(hf: str, shape: tuple[int, ...]) -> torch.Tensor | None | bool:
            # Probed once per kind of matrix (its name with the layer left out) and shape: a hook moves rows by
            # the matrix's kind and the config, never by its layer (Family.gguf_tensor). Each probe builds two
            # (rows, columns) index matrices, ~10 ms for a Qwen3.5-0.8B in_proj: once per layer, 90 of them were
            # ~0.9 s of that file's load.
            key = (_LAYER.sub(".layers.#.", hf), shape)
            if key not in orders:
                orders[key] = row_order(hook, cfg, hf, shape)
            return orders[key]

        kept = keepable(g, cfg, dense, order_of) if native_blocks() else {}
        kept |= keepable_stacked(g, cfg, dense)  # Gemma 4's stacked experts, one GGUFLinear per expert
        experts = keepable_experts(g, cfg)  # (stacked tensor, expert, type) by checkpoint name
        mixers = {n for group in mixer_groups(cfg).values() for n in group}  # recurrent in_proj / out_proj
        if kept or experts:
            floats = checkpoint_tensors(g, cfg, [n for n in names if n not in kept and n not in experts],
                                        torch.float32)

            def rows_of(hf: str) -> tuple[torch.Tensor, str]:
                if hf in experts:  # one expert's rows of the stacked (experts, rows, row bytes) tensor
                    key, expert, kind = experts[hf]
                    t = g.tensors[key]
                    return file_rows(g, key).reshape(int(t.shape[2]), int(t.shape[1]), -1)[expert], kind
                gname = dense[hf]
                if len(g.tensors[gname].shape) == 3:  # stacked experts: (experts, rows, row bytes)
                    t = g.tensors[gname]
                    return file_rows(g, gname).reshape(int(t.shape[2]), int(t.shape[1]), -1), t.tensor_type.name
                rows = _as_checkpoint(g, cfg, gname, file_rows(g, gname))
                order = order_of(hf, shape(gname)) if hf in mixers else None
                return (rows if order is None else rows[order]), g.tensors[gname].tensor_type.name

            def shape(gname: str) -> tuple[int, ...]:
                return tuple(int(d) for d in reversed(g.tensors[gname].shape))

            shapes = {hf: shape(dense[hf]) for hf in kept}
            expert_shapes = {hf: shape(key)[1:] for hf, (key, _, _) in experts.items()}
            model = build_packed_model(g, cfg, floats, shapes, rows_of, policy.gguf_activations, expert_shapes)
            model.arithmetic = policy
            release_pages(g.mapped)  # the pages read while copying: decode faults back the ones it uses
            return model, g
    tensors = checkpoint_tensors(g, cfg, names, torch_dtype)
    model = build_model(cfg, tensors, g.path, device, torch_dtype)
    model.arithmetic = policy
    return model, g
