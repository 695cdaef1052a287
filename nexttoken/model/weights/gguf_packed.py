"""A GGUF file's matrices kept as the file stores them (the default for a quantized file): ggml blocks become
quant/ggml.py's GGUFLinear / GGUFEmbedding, BF16 matrices BF16Linear / BF16Embedding (float32 activations, as
llama.cpp runs them); MoE experts stored as MXFP4 (gpt-oss) become quant/mxfp4.py's Mxfp4Linear, and experts of the
block types the kernels read GGUFLinear, one per expert projection (views of the file's stacked rows); everything
else (norms, biases, F32 / F16 matrices, a fused matrix whose parts are not all blocks or all BF16) is dequantized
to float32 as gguf.py does for the whole model with dequantize=True.

No float copy of a kept matrix is made: o, down, the LM head and the token table are views of the reader's
memory map (a private, copy-on-write mapping: pages are read from the page cache as decode touches them, as
llama.cpp's mmap does), and so are the parts of a fused q/k/v or gate/up (one GGUFLinear of several parts, read
in one pass); only q and k rows under llama.cpp's row permutation for Llama-style RoPE are a copy (the
permutation moves whole rows, so it is undone on the packed rows).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from ...config import ModelConfig
from ...families import family
from ..llama import Transformer
from ..network import checkpoint_of, network, own_checkpoint
from ..quant.bf16 import BF16Embedding, BF16Linear
from ..quant.ggml import GGML_TYPES, GGUFEmbedding, GGUFLinear, block_shape, native_blocks
from .experts import keep_experts, mxfp4_layer
from .loader import _owned, check_tensors, state_parts, to_state_dict


def packable(cfg: ModelConfig) -> bool:
    """Whether a GGUF file of this model can keep its matrices as stored: the shared decoder, or a network of its
    own whose matrices hold the file's values as they are (its module's GGUF_PACKED: Gemma 4, Nemotron-H; not
    Falcon-H1, which folds its multipliers into rows at load)."""
    return not own_checkpoint(cfg) or getattr(checkpoint_of(cfg), "GGUF_PACKED", False)


def tables(cfg: ModelConfig) -> dict[str, str]:
    """Our token tables and LM head -> their checkpoint names (the embedding, the LM head, Gemma 4's per-layer
    table)."""
    parts = state_parts(cfg, {})
    return {ours: parts[ours][0] for ours in ("embed.weight", "lm_head.weight", "per_layer_embed.weight")
            if ours in parts}


def keepable(g, cfg: ModelConfig, gguf_names: dict[str, str], order_of) -> dict[str, str]:  # noqa: ANN001
    """Checkpoint name -> "blocks" or "bf16" for the matrices kept as stored: the dense layers' and the
    embedding's 2-D weights whose GGUF type the kernels read, with every part of a fused matrix of one kind.
    `order_of(hf, shape)`: a recurrent mixer matrix's row_order under the writer family's hook."""
    kinds = {}
    table_names = set(tables(cfg).values())
    mixers = {n for group in mixer_groups(cfg).values() for n in group}
    for hf, gname in gguf_names.items():
        if not hf.endswith(".weight") or "expert" in hf or not (_dense(hf) or hf in table_names or hf in mixers):
            continue
        if hf in mixers and order_of(hf, tuple(int(d) for d in reversed(g.tensors[gname].shape))) is False:
            continue
        t = g.tensors[gname]
        name = t.tensor_type.name
        if name in GGML_TYPES and int(t.shape[0]) % block_shape(name)[0] == 0:
            kinds[hf] = "blocks"
        elif name == "BF16":
            kinds[hf] = "bf16"
    placed = set(table_names)
    for group in matrix_groups(cfg).values():
        placed.update(group)
        if len({kinds.get(n) for n in group}) != 1:  # mixed kinds (or missing): the whole group is dequantized
            for n in group:
                kinds.pop(n, None)
    # a matrix no group places stays float: Granite 4.0-H's [gate; up], which the file splits in two tensors
    return {hf: kind for hf, kind in kinds.items() if hf in placed}


_EXPERT_PARTS = {"gate": 0, "up": 1, "down": 2}  # ffn_{part}_exps -> Family.expert_names' index


def keepable_stacked(g, cfg: ModelConfig, gguf_names: dict[str, str]) -> dict[str, str]:  # noqa: ANN001
    """Checkpoint name -> its GGUF tensor, for a network of its own whose checkpoint stacks each layer's experts
    (Gemma 4's `experts.gate_up_proj` (E, 2I, C) and `experts.down_proj` (E, C, I)): kept in their blocks as one
    GGUFLinear per expert (the experts module's `keep`), a layer's stacked tensors all kept or none."""
    if cfg.moe is None or not own_checkpoint(cfg) or not native_blocks():
        return {}
    stacked = {hf: gname for hf, gname in gguf_names.items()
               if ".experts." in hf and len(g.tensors[gname].shape) == 3}
    layers: dict[str, list[str]] = {}
    for hf in stacked:
        layers.setdefault(hf.split(".experts.")[0], []).append(hf)

    def readable(gname: str) -> bool:  # a block type the kernels read, its rows a whole number of blocks
        t = g.tensors[gname]
        return t.tensor_type.name in GGML_TYPES and int(t.shape[0]) % block_shape(t.tensor_type.name)[0] == 0

    return {hf: stacked[hf] for group in layers.values() if all(readable(stacked[n]) for n in group) for hf in group}


def keepable_experts(g, cfg: ModelConfig) -> dict[str, tuple[str, int, str]]:  # noqa: ANN001 - a GGUFFile
    """Checkpoint name of an expert's weight -> (its stacked GGUF tensor, its expert, the GGUF type name) for the
    sparse layers whose three stacked projections the kept layers multiply: all MXFP4 (any CPU: Mxfp4Linear has a
    torch fallback), or all block types csrc/ggml.cpp reads (where it runs)."""
    moe = cfg.moe
    if moe is None:
        return {}
    names = family(cfg.architecture).expert_names
    kept = {}
    for i in range(cfg.num_hidden_layers):
        keys = {part: f"blk.{i}.ffn_{part}_exps.weight" for part in _EXPERT_PARTS}
        if not moe.sparse_layers[i] or any(k not in g.tensors for k in keys.values()):
            continue
        types = {part: g.tensors[k].tensor_type.name for part, k in keys.items()}
        widths = {part: int(g.tensors[k].shape[0]) for part, k in keys.items()}
        mxfp4 = all(t == "MXFP4" for t in types.values())
        blocks = native_blocks() and all(t in GGML_TYPES and widths[p] % block_shape(t)[0] == 0
                                         for p, t in types.items())
        if not (mxfp4 or blocks):
            continue
        prefix = f"model.layers.{i}.{family(cfg.architecture).moe_prefix}experts."
        for e in range(moe.num_experts):
            for part, key in keys.items():
                kept[f"{prefix}{e}.{names[_EXPERT_PARTS[part]]}.weight"] = (key, e, types[part])
    return kept


def _dense(hf: str) -> bool:
    return hf in ("model.embed_tokens.weight", "lm_head.weight") or hf.rsplit(".", 2)[-2] in (
        "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj",
        "per_layer_input_gate", "per_layer_projection", "per_layer_model_projection")  # Gemma 4's per-layer inputs


def matrix_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our matrix modules (dotted paths) -> the checkpoint weights whose rows each stacks: the shared decoder's
    four per block (_groups), or, for a network of its own, every weight of its state whose parts are all dense
    matrices (attention, MLP, per-layer inputs; not experts, routers or recurrent mixers)."""
    if not own_checkpoint(cfg):
        groups = {f"layers.{i}.{m}": group for i in range(cfg.num_hidden_layers) for m, group in _groups(cfg, i).items()}
        return groups | mixer_groups(cfg)
    skip = set(tables(cfg))
    return {ours[: -len(".weight")]: parts for ours, parts in state_parts(cfg, {}).items()
            if ours.endswith(".weight") and ours not in skip and parts
            and all(_dense(n) and "expert" not in n for n in parts)}


def _groups(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Our fused module (under layers.{i}.) -> the checkpoint weights whose rows it stacks (loader.to_state_dict)."""
    p = f"model.layers.{i}."
    if family(cfg.architecture).fused_checkpoint:
        return {"attention.wqkv": [p + "self_attn.qkv_proj.weight"], "attention.wo": [p + "self_attn.o_proj.weight"],
                "mlp.w13": [p + "mlp.gate_up_proj.weight"], "mlp.w2": [p + "mlp.down_proj.weight"]}
    return {"attention.wqkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            "attention.wo": [p + "self_attn.o_proj.weight"],
            "mlp.w13": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "mlp.w2": [p + "mlp.down_proj.weight"]}


def mixer_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """The recurrent mixers' in_proj / out_proj (our attention.wi / .wo of a layer that keeps a state) -> their
    checkpoint weights: LFM2's, Qwen3.5's, Granite 4.0-H's and Mamba2's. Not Qwen3-Next's (its rows are regrouped at
    load, by the module)."""
    from ..recurrent import MIXERS

    if cfg.recurrent is None or cfg.recurrent.linear_grouped_by_key_head:
        return {}
    out = {}
    for i in range(cfg.num_hidden_layers):
        if cfg.layer(i).keeps_kv:
            continue
        parts = MIXERS[cfg.layer(i).mixer].checkpoint(cfg, i)
        for ours in ("wi", "wo"):
            out[f"layers.{i}.attention.{ours}"] = [name for name, _ in parts[ours + ".weight"]]
    return out


def row_order(hook, cfg: ModelConfig, hf: str, shape: tuple[int, ...]) -> torch.Tensor | None | bool:  # noqa: ANN001
    """How the family's GGUF hook (Family.gguf_tensor: Qwen3.5's untiled value heads) moves a matrix's rows: None
    (it leaves them as they are), the (rows,) order it takes them in (a permutation of whole rows, which packed rows
    follow exactly), or False (it moves columns or changes values: the matrix is read as floats). Found by handing
    the hook the rows' and the columns' indices."""
    if hook is None:
        return None
    rows = hook(cfg, hf, torch.arange(shape[0], dtype=torch.int32)[:, None].expand(shape).contiguous())
    cols = hook(cfg, hf, torch.arange(shape[1], dtype=torch.int32)[None, :].expand(shape).contiguous())
    if tuple(rows.shape) != tuple(shape) or not bool((cols == torch.arange(shape[1], dtype=torch.int32)).all()):
        return False
    order = rows[:, 0]
    if not bool((rows == order[:, None]).all()):
        return False
    return None if bool((order == torch.arange(shape[0], dtype=torch.int32)).all()) else order.long()


def build_packed_model(g, cfg: ModelConfig, floats: dict[str, torch.Tensor], kept: dict[str, tuple[int, int]],  # noqa: ANN001
                       rows_of, activations: str | None = None,  # noqa: ANN001 - rows_of(hf name) -> (rows, type name)
                       experts: dict[str, tuple[int, int]] | None = None) -> Transformer:
    """The Transformer with the `kept` matrices (checkpoint name -> the file's (rows, columns)) as stored (rows_of
    gives each one's rows: uint8 blocks, or bfloat16 values, in PyTorch's row order) and the `floats` (checkpoint
    name -> float32 tensor) for the rest. `activations`: how GGUFLinear quantizes its inputs (quant/ggml.py; None: the arithmetic policy's default).
    `experts`: the MoE experts' weights kept as stored, by checkpoint name (keepable_experts), the same way."""
    experts = experts or {}
    kept = {**kept, **experts}
    shapes = dict(floats)
    for hf, shape in kept.items():  # stand-ins of the file's shapes: the checks and the state dict's names, no memory
        shapes[hf] = torch.empty(shape, device="meta")
    check_tensors(cfg, shapes, g.path)
    state = to_state_dict(cfg, shapes)
    real = {n: t for n, t in state.items() if t.device.type != "meta"}
    state = _owned(real, torch.device("cpu"), torch.float32)
    with torch.device("meta"):
        model = network(cfg)
    model.load_state_dict(state, assign=True, strict=False)
    for path, group in matrix_groups(cfg).items():
        if group[0] in kept:
            parent, attr = _parent(model, path)
            setattr(parent, attr, _kept_linear([rows_of(n) for n in group], getattr(parent, attr),
                                               activations=activations))
    keep_experts(model, cfg, experts, rows_of, lambda parts, old: _kept_expert(parts, old, activations))
    for ours, parts in state_parts(cfg, {}).items():  # stacked experts kept: one layer per expert (Gemma 4's keep)
        if len(parts) == 1 and parts[0] in kept and len(kept[parts[0]]) == 3:
            rows, kind = rows_of(parts[0])  # (E, rows, row bytes)
            owner, attr = _parent(model, ours)
            owner.keep(attr, [_kept_linear([(r, kind)], None, kept[parts[0]][2], activations) for r in rows])
    tied, names = cfg.tie_word_embeddings, tables(cfg)
    embed = names["embed.weight"]
    if embed in kept:
        table = _kept_linear([rows_of(embed)], None, cfg.hidden_size, activations)
        model.embed = BF16Embedding(table) if isinstance(table, BF16Linear) else GGUFEmbedding(table)
        if tied:
            model.lm_head = table
    if not tied and names["lm_head.weight"] in kept:
        model.lm_head = _kept_linear([rows_of(names["lm_head.weight"])], model.lm_head, activations=activations)
    elif tied and embed not in kept:
        model.lm_head.weight = model.embed.weight
    per_layer = names.get("per_layer_embed.weight")
    if per_layer in kept:  # Gemma 4's (vocab, layers x P) table: only the looked-up rows are dequantized
        width = model.per_layer_embed.embedding_dim
        table = _kept_linear([rows_of(per_layer)], None, width, activations)
        model.per_layer_embed = BF16Embedding(table) if isinstance(table, BF16Linear) else GGUFEmbedding(table)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    assert not left, f"not loaded: {left[:3]}"
    model.quantization = "gguf"
    return model.eval()


def _kept_expert(parts: list[tuple[torch.Tensor, str]], old: nn.Module, activations: str | None) -> nn.Module:
    """An expert projection of the row ranges `parts`: MXFP4 rows as one Mxfp4Linear, ggml blocks as GGUFLinear."""
    if all(name == "MXFP4" for _, name in parts):
        return mxfp4_layer(parts, old)
    return _kept_linear(parts, old, activations=activations)


def _parent(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner, attr = dotted.rsplit(".", 1) if "." in dotted else ("", dotted)
    return model.get_submodule(owner), attr


def _kept_linear(parts: list[tuple[torch.Tensor, str]], old: nn.Module | None, K: int | None = None,
                 activations: str | None = None) -> nn.Module:
    """One layer of the row ranges `parts` (rows, GGUF type name), stacked; the bias of `old` (the float layer it
    replaces) kept. GGUF blocks stay views of the file, one part each (a fused q/k/v or gate/up is read in one pass
    over its parts: ggml.cpp's linear_mixed), so loading copies none of them; BF16 parts are concatenated."""
    bias = None if old is None or old.bias is None else old.bias.detach()
    if parts[0][1] == "BF16":
        w = parts[0][0] if len(parts) == 1 else torch.cat([p for p, _ in parts])
        return BF16Linear(w, bias)
    K = K if K is not None else old.in_features
    # q / k rows with llama.cpp's permutation undone are a reordered view: those alone are copied
    return GGUFLinear([(rows.contiguous(), GGML_TYPES[name]) for rows, name in parts], K, bias, activations)


def file_rows(g, name: str) -> torch.Tensor:  # noqa: ANN001 - a GGUFFile
    """A tensor's rows as the file stores them, without a copy: (rows, row bytes) uint8 for ggml blocks, (rows,
    columns) bfloat16 for BF16."""
    t = g.tensors[name]
    data = t.data.view(np.ndarray)  # (rows, row bytes) uint8 / (rows, columns) for BF16's uint16
    if t.tensor_type.name == "BF16":
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(data)


def release_pages(mapped: np.ndarray | None) -> None:
    """Give back the resident pages of the file's private, never-written mapping (madvise MADV_DONTNEED): the
    copies made at load (permuted q/k rows, float tensors) read part of the file, and those pages would otherwise
    stay in this process's RSS beside the copies. Views into the mapping stay valid: their pages come back from the
    page cache when decode reads them (what llama.cpp's mmap holds resident). Linux only; elsewhere nothing is done."""
    if mapped is None or not hasattr(os, "sysconf"):
        return
    import ctypes
    import ctypes.util

    page = os.sysconf("SC_PAGE_SIZE")
    start = mapped.ctypes.data
    lo, hi = (start + page - 1) // page * page, (start + mapped.nbytes) // page * page
    if hi <= lo:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # 4: MADV_DONTNEED; a failure changes nothing
