"""The native boundary's Python side: ctypes mirrors of csrc/nt_abi.h's structs and codes, checked at load.

The kernels read weights, caches and switches through a handful of C structs (`NtLinear`, `NtLora`, `NtExpert`,
`NtLayer`, `NtModel`) filled here by position, and through small integer codes (a weight's kind, the output's
dtype, the family flags). Both sides are written by hand, so when the library loads (kernels.py) `check` compares
these mirrors with the layout the library was compiled with (csrc/abi.cpp's `nt_abi_layout`: each struct's size,
each field's offset and size, each code's value). A field added, moved or resized on one side only, or a code
renumbered, raises `NativeABIError` naming the struct, the field and both layouts: the native path is refused
then, never run on a misread struct.

Every field is 8 bytes wide (nt_abi.h), so the mirrors need no padding rules.
"""

from __future__ import annotations

import ctypes
import enum
import types
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..errors import NextTokenError


class NativeABIError(NextTokenError, RuntimeError):
    """The native library's structs or codes (csrc/nt_abi.h) differ from their Python mirrors (this module)."""


class Kind(enum.IntEnum):
    """nt_abi.h's NtKind: how a weight's rows are stored (NtLinear.kind, nt_linear's `kind`)."""

    W_F32 = 0
    W_BF16 = 1
    W_I8 = 2  # then NtLinear.scale holds one float32 scale per row
    W_I4 = 3  # int4.cpp's grouped layout, float16 scales per group of 32
    W_I8_F32 = 4  # W_I8 with float32 activations (exact; the default) instead of int16 per row
    W_I4_F32 = 5  # W_I4 with float32 activations (exact; the default) instead of int8 per group
    W_GGML = 16  # + the ggml type id (| the GGML_* flags below): GGUF's blocks


GGML_MIXED = 255  # ggml "type" of a matrix of several parts: the weight is their int64 description
GGML_Q16 = 256  # flag on a ggml type: int16 activations per block of 32 instead of int8
GGML_F32 = 512  # flag on a ggml type: float32 activations on the dequantized weights (exact; the default)
OUT_F32, OUT_BF16 = 0, 1  # an output's dtype
KV_F32, KV_I8 = 0, 2  # NtModel.kv_kind
NT_PLUS_ONE, NT_SANDWICH, NT_NORM_AFTER, NT_GELU, NT_RELU2 = 1, 2, 4, 8, 16  # NtModel.flags
QK_NONE, QK_HEAD, QK_PROJECTION = 0, 1, 2  # NtModel.qk_norm
MIX_ATTENTION, MIX_SHORT_CONV, MIX_DELTA_RULE, MIX_SSD = 0, 1, 2, 3  # NtLayer.mixer (issue 41's recurrent kinds)
ROUTE_SOFTMAX, ROUTE_TOPK_SOFTMAX, ROUTE_SIGMOID = 0, 1, 2  # NtModel.router: a MoE layer's routing rule

# Every code nt_abi.h defines, by its C name: what check compares with the library's.
CODES: Mapping[str, int] = types.MappingProxyType({
    **{k.name: int(k) for k in Kind}, "GGML_MIXED": GGML_MIXED, "GGML_Q16": GGML_Q16, "GGML_F32": GGML_F32, "OUT_F32": OUT_F32,
    "OUT_BF16": OUT_BF16, "KV_F32": KV_F32, "KV_I8": KV_I8, "NT_PLUS_ONE": NT_PLUS_ONE, "NT_SANDWICH": NT_SANDWICH,
    "NT_NORM_AFTER": NT_NORM_AFTER, "NT_GELU": NT_GELU, "NT_RELU2": NT_RELU2, "QK_NONE": QK_NONE, "QK_HEAD": QK_HEAD,
    "QK_PROJECTION": QK_PROJECTION, "MIX_ATTENTION": MIX_ATTENTION, "MIX_SHORT_CONV": MIX_SHORT_CONV,
    "MIX_DELTA_RULE": MIX_DELTA_RULE, "MIX_SSD": MIX_SSD, "ROUTE_SOFTMAX": ROUTE_SOFTMAX,
    "ROUTE_TOPK_SOFTMAX": ROUTE_TOPK_SOFTMAX, "ROUTE_SIGMOID": ROUTE_SIGMOID,
})

# The kinds a torch dtype's rows are read as (float32 / bfloat16 rows, int8 rows with their scales).
DTYPE_KIND: Mapping[torch.dtype, Kind] = types.MappingProxyType(
    {torch.float32: Kind.W_F32, torch.bfloat16: Kind.W_BF16, torch.int8: Kind.W_I8})
OUT_KIND: Mapping[torch.dtype, int] = types.MappingProxyType({torch.float32: OUT_F32, torch.bfloat16: OUT_BF16})

_p, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class NtLinear(ctypes.Structure):
    _fields_ = [("weight", _p), ("kind", _i64), ("scale", _p), ("bias", _p)]


class NtLora(ctypes.Structure):
    _fields_ = [("A", _p), ("Bt", _p), ("rank", _i64)]


class NtExpert(ctypes.Structure):
    _fields_ = [("w13", NtLinear), ("w2", NtLinear)]


class NtRecurrent(ctypes.Structure):
    _fields_ = [("wi", NtLinear), ("wo", NtLinear)] + [(name, _p) for name in (
        "conv", "conv_bias", "dt_bias", "A_log", "D", "norm", "window", "state")] + [(name, _i64) for name in (
        "channels", "kernel", "heads", "groups", "head_k", "head_v", "norm_groups", "norm_first")]


class NtLayer(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("ffn_norm", _p), ("qkv", NtLinear), ("o", NtLinear), ("w13", NtLinear),
                ("w2", NtLinear), ("k_cache", _p), ("v_cache", _p), ("k_scale", _p), ("v_scale", _p),
                ("q_norm", _p), ("k_norm", _p), ("attn_post_norm", _p), ("ffn_post_norm", _p), ("sliding", _i64),
                ("no_rope", _i64),
                ("router", NtLinear), ("experts", ctypes.POINTER(NtExpert)), ("shared", NtExpert),
                ("shared_gate", NtLinear), ("lora_qkv", NtLora), ("lora_o", NtLora), ("lora_w13", NtLora),
                ("lora_w2", NtLora), ("mixer", _i64), ("recurrent", ctypes.POINTER(NtRecurrent)), ("gated", _i64),
                ("correction", _p), ("sinks", _p), ("parallel", ctypes.POINTER(NtRecurrent)),
                ("parallel_mixer", _i64)] + [(name, _f64) for name in (
                "parallel_in", "parallel_out", "attn_in", "attn_out")] + [(name, _i64) for name in (
                "head_dim", "n_kv_heads", "intermediate", "kv_shared", "values_from_keys", "v_norm")] + [
                ("layer_scalar", _p), ("input_gate", NtLinear), ("input_projection", NtLinear)] + [
                (name, _p) for name in ("input_norm", "router_scale", "expert_scale", "mlp_post_norm",
                                        "experts_norm", "experts_post_norm")]


class NtModel(ctypes.Structure):
    _fields_ = [(name, _i64) for name in (
        "n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab")] + [
        ("embed", NtLinear), ("cache_row_stride", _i64), ("cache_head_stride", _i64), ("eps", _f64),
        ("inv_freq", _p), ("final_norm", _p), ("lm_head", NtLinear), ("layers", ctypes.POINTER(NtLayer)),
        ("kv_kind", _i64), ("flags", _i64), ("qk_norm", _i64)] + [(name, _f64) for name in (
        "embed_mult", "embed_scale", "attn_scale", "attn_softcap", "residual", "final_softcap", "logits_scaling")] + [
        ("window", _i64), ("local_inv_freq", _p), ("long_inv_freq", _p), ("rope_original_max", _i64),
        ("rope_scaling", _f64)] + [(name, _i64) for name in (
        "n_experts", "top_k", "norm_topk", "moe_intermediate", "shared_intermediate")] + [
        ("state_slots", _p), ("rotary_dim", _i64), ("lora_slots", _p), ("router", _i64), ("n_group", _i64),
        ("topk_group", _i64)] + [(name, _f64) for name in (
        "routed_scaling", "topk_norm_eps", "swiglu_limit", "swiglu_alpha")] + [
        ("kv_dim", _i64), ("per_layer", _p), ("per_layer_dim", _i64)]


STRUCTS: tuple[type[ctypes.Structure], ...] = (NtLinear, NtLora, NtExpert, NtLayer, NtModel, NtRecurrent)

Field = tuple[str, int, int]  # (name, offset, size) in bytes


@dataclass(frozen=True)
class Layout:
    """One side's view of the boundary: struct name -> (size, fields in order), and code name -> value."""

    structs: Mapping[str, tuple[int, tuple[Field, ...]]]
    codes: Mapping[str, int]


def parse(text: str) -> Layout:
    """The library's layout from nt_abi_layout()'s lines (csrc/abi.cpp: struct / field / code)."""
    sizes: dict[str, int] = {}
    fields: dict[str, list[Field]] = {}
    codes: dict[str, int] = {}
    for line in text.splitlines():
        kind, *rest = line.split()
        if kind == "struct":
            sizes[rest[0]] = int(rest[1])
        elif kind == "field":
            fields.setdefault(rest[0], []).append((rest[1], int(rest[2]), int(rest[3])))
        elif kind == "code":
            codes[rest[0]] = int(rest[1])
        else:
            raise NativeABIError(f"nt_abi_layout() line {line!r}: expected struct, field or code")
    return Layout({name: (size, tuple(fields.get(name, ()))) for name, size in sizes.items()}, codes)


def mirror(structs: Sequence[type[ctypes.Structure]] = STRUCTS, codes: Mapping[str, int] = CODES) -> Layout:
    """The Python side's layout: the ctypes structs (named as their C structs) and the codes."""
    out = {}
    for s in structs:
        fields = tuple((name, getattr(s, name).offset, getattr(s, name).size) for name, *_ in s._fields_)
        out[s.__name__] = (ctypes.sizeof(s), fields)
    return Layout(out, dict(codes))


def check(native: Layout, python: Layout | None = None) -> None:
    """Raise NativeABIError at the first difference between the library's layout and the Python mirrors'."""
    python = mirror() if python is None else python
    for name, (size, fields) in python.structs.items():
        if name not in native.structs:
            raise NativeABIError(f"struct {name}: the native library does not describe it (csrc/abi.cpp)")
        _check_struct(name, native.structs[name], (size, fields))
    for name, value in python.codes.items():
        if native.codes.get(name) != value:
            raise NativeABIError(f"code {name}: {value} in Python (model/native_abi.py) but "
                                 f"{native.codes.get(name, 'undefined')} in the native library (csrc/nt_abi.h); "
                                 "change both together")


def _check_struct(name: str, native: tuple[int, tuple[Field, ...]], python: tuple[int, tuple[Field, ...]]) -> None:
    (c_size, c_fields), (p_size, p_fields) = native, python
    if c_fields == p_fields and c_size == p_size:
        return
    where = "size"
    for i in range(max(len(c_fields), len(p_fields))):
        c = c_fields[i] if i < len(c_fields) else None
        p = p_fields[i] if i < len(p_fields) else None
        if c != p:
            where = f"field {i}: {_field(c)} in the native library, {_field(p)} in Python"
            break
    raise NativeABIError(
        f"struct {name} differs at {where} (csrc/nt_abi.h vs nexttoken/model/native_abi.py; change both together).\n"
        f"  native library: {_layout(c_size, c_fields)}\n  Python mirror:  {_layout(p_size, p_fields)}")


def _field(f: Field | None) -> str:
    return "nothing" if f is None else f"{f[0]!r} (offset {f[1]}, {f[2]} bytes)"


def _layout(size: int, fields: tuple[Field, ...]) -> str:
    return f"{size} bytes: " + ", ".join(f"{n}@{o}:{s}" for n, o, s in fields)


def check_library(lib: ctypes.CDLL) -> None:
    """Compare a loaded kernel library's nt_abi_layout() with the mirrors; NativeABIError on a difference."""
    try:
        describe = lib.nt_abi_layout
    except AttributeError as e:
        raise NativeABIError("the native library has no nt_abi_layout() (csrc/abi.cpp): it predates the checked "
                             "boundary; delete it from the kernel cache to rebuild") from e
    describe.restype = ctypes.c_char_p
    describe.argtypes = []
    check(parse(describe().decode()))


# ---- the one place a weight's kernel is chosen ----------------------------------------------------------------------
# Each weight layer says how the kernels read it (its `native()`: linear.py's Linear and KeptLinear, quant/'s
# BF16Linear, Int8Linear, Int4Linear, GGUFLinear; `native_table()`: the embeddings that read a table). A new weight
# format adds its kind to nt_abi.h and here, and a `native()` to its layer; nothing else chooses kinds.


def weight_rows(weight: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                kind: int | None = None) -> NtLinear | None:
    """An NtLinear of a layer's tensors: `kind` (by default the weight's dtype's: float32, bfloat16, int8 rows),
    or None where the kernels cannot read them (a dtype without a kind, non-contiguous rows, a bias that is not
    float32)."""
    if kind is None:
        kind = DTYPE_KIND.get(weight.dtype)
        if kind is None or not weight.is_contiguous():
            return None
    if bias is not None and bias.dtype != torch.float32:
        return None
    return NtLinear(weight.data_ptr(), int(kind), None if scale is None else scale.data_ptr(),
                    None if bias is None else bias.data_ptr())


def describe(module: torch.nn.Module) -> NtLinear | None:
    """How the kernels read this weight layer (its own `native()`), or None: a layer they do not compute."""
    native = getattr(type(module), "native", None)
    return None if native is None else native(module)


def describe_table(module: torch.nn.Module) -> NtLinear | None:
    """How the kernels read this embedding's token table (csrc/decode.cpp's embed): a float32 nn.Embedding's rows,
    or the table's own `native_table()` (bf16.BF16Embedding, int8.Int8Embedding), or None."""
    if type(module) is torch.nn.Embedding:
        return weight_rows(module.weight) if module.weight.dtype == torch.float32 else None
    native = getattr(type(module), "native_table", None)
    return None if native is None else native(module)
