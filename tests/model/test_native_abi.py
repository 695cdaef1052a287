"""The native boundary is checked when the library loads (model/native_abi.py against csrc/nt_abi.h): the real
mirrors match the compiled library, and a field reordered or resized, a field missing or a kind code renumbered on
either side is refused with a message naming the struct and the field, never run."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nexttoken.errors import NextTokenError
from nexttoken.model import kernels, native_abi
from nexttoken.model.native_abi import CODES, STRUCTS, NativeABIError, NtExpert, NtLayer, NtLinear, NtLora, NtModel

ROOT = Path(__file__).resolve().parents[2]
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++")


def compile_layout(tmp_path: Path, header: str) -> Path:
    """abi.cpp compiled against `header` as nt_abi.h: a library whose nt_abi_layout() is that header's."""
    (tmp_path / "nt_abi.h").write_text(header)
    shutil.copy(kernels.CSRC / "abi.cpp", tmp_path / "abi.cpp")
    out = tmp_path / "libabi.so"
    subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-shared", "-fPIC", str(tmp_path / "abi.cpp"),
                    "-o", str(out)], check=True, capture_output=True, text=True)
    return out


def native_layout(path: Path) -> native_abi.Layout:
    lib = ctypes.CDLL(str(path))
    lib.nt_abi_layout.restype = ctypes.c_char_p
    return native_abi.parse(lib.nt_abi_layout().decode())


@pytest.fixture(scope="module")
def real_layout(tmp_path_factory: pytest.TempPathFactory) -> native_abi.Layout:
    """The layout of csrc/nt_abi.h as the compiler lays it out."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("needs g++")
    return native_layout(compile_layout(tmp_path_factory.mktemp("abi"), (kernels.CSRC / "nt_abi.h").read_text()))


def with_structs(**replaced: type[ctypes.Structure]) -> native_abi.Layout:
    """The Python mirrors with some structs replaced by variants (named as the C struct they stand for)."""
    return native_abi.mirror(tuple(replaced.get(s.__name__, s) for s in STRUCTS))


def variant(name: str, fields: list) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def test_the_real_mirrors_match_the_library(real_layout) -> None:
    native_abi.check(real_layout)  # no error
    assert set(real_layout.structs) == {s.__name__ for s in STRUCTS}
    assert real_layout.codes == dict(CODES)
    assert real_layout.structs["NtLinear"] == (32, (("weight", 0, 8), ("kind", 8, 8), ("scale", 16, 8),
                                                    ("bias", 24, 8)))
    assert real_layout.structs["NtModel"][0] == ctypes.sizeof(NtModel)


def test_two_swapped_fields_are_refused_naming_them(real_layout) -> None:
    fields = list(NtLinear._fields_)
    fields[1], fields[2] = fields[2], fields[1]  # kind <-> scale: both 8 bytes, so only the order tells
    with pytest.raises(NativeABIError) as e:
        native_abi.check(real_layout, with_structs(NtLinear=variant("NtLinear", fields)))
    message = str(e.value)
    assert "struct NtLinear" in message and "'kind' (offset 8" in message and "'scale' (offset 8" in message
    assert "kind@8:8" in message and "scale@8:8" in message  # both layouts, in full
    assert isinstance(e.value, NextTokenError)


def test_a_resized_field_is_refused_naming_it(real_layout) -> None:
    fields = [(n, ctypes.c_int32) if n == "sliding" else (n, t) for n, t in NtLayer._fields_]
    with pytest.raises(NativeABIError, match=r"struct NtLayer differs at field \d+: 'sliding' \(offset \d+, 8 bytes\)"
                                             r" in the native library, 'sliding' \(offset \d+, 4 bytes\)"):
        native_abi.check(real_layout, with_structs(NtLayer=variant("NtLayer", fields)))


def test_a_missing_field_and_a_renumbered_code_are_refused(real_layout) -> None:
    short = variant("NtModel", NtModel._fields_[:-1])  # no last field (swiglu_alpha)
    last = NtModel._fields_[-1][0]
    with pytest.raises(NativeABIError, match=f"'{last}' .* in the native library, nothing in Python"):
        native_abi.check(real_layout, with_structs(NtModel=short))
    codes = dict(CODES, W_I4=4)
    with pytest.raises(NativeABIError, match="code W_I4: 4 in Python .* but 3 in the native library"):
        native_abi.check(real_layout, native_abi.mirror(codes=codes))


# The C side drifting: nt_abi.h edited, the library rebuilt, the Python mirrors untouched.


def drifted_header() -> str:
    """nt_abi.h with NtLinear's kind and scale swapped."""
    text = (kernels.CSRC / "nt_abi.h").read_text()
    kind = re.search(r"^  int64_t kind;.*$", text, re.M).group(0)
    scale = re.search(r"^  const float\* scale;.*$", text, re.M).group(0)
    return text.replace(kind, "@KIND@").replace(scale, kind).replace("@KIND@", scale)


@needs_compiler
def test_a_library_built_from_a_drifted_header_is_refused(tmp_path) -> None:
    path = compile_layout(tmp_path, drifted_header())
    with pytest.raises(NativeABIError, match="struct NtLinear differs at field 1: 'scale' .* 'kind'"):
        kernels.load(path)


@needs_compiler
def test_the_library_refuses_to_start_on_a_drifted_header(tmp_path) -> None:
    """The whole start: a process whose kernel cache holds a library of a drifted nt_abi.h (at the path of these
    sources) runs without it (torch), saying why; with NEXTTOKEN_REQUIRE_NATIVE=1 it stops with that message."""
    cache = tmp_path / "cache"
    env = dict(os.environ, NEXTTOKEN_CACHE=str(cache), NEXTTOKEN_NATIVE="1")
    where = "from nexttoken.model import kernels; print(kernels.library_path())"
    target = subprocess.run([sys.executable, "-c", where], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=True).stdout.strip()
    Path(target).parent.mkdir(parents=True)
    shutil.copy(compile_layout(tmp_path, drifted_header()), target)
    script = ("from nexttoken.model import kernels, linear; import torch\n"
              "print(kernels.library() is None, linear.Linear(8, 4)(torch.ones(1, 8)).shape)\n"
              "print(kernels.why_unavailable())")
    env.pop("NEXTTOKEN_REQUIRE_NATIVE", None)
    fallback = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert fallback.returncode == 0, fallback.stderr
    assert fallback.stdout.startswith("True torch.Size([1, 4])")
    assert "struct NtLinear differs at field 1: 'scale'" in fallback.stdout
    strict = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(env, NEXTTOKEN_REQUIRE_NATIVE="1"),
                            capture_output=True, text=True)
    assert strict.returncode != 0
    assert "NativeKernelError" in strict.stderr and "struct NtLinear differs at field 1" in strict.stderr
    assert "kind@16:8" in strict.stderr and "kind@8:8" in strict.stderr  # the library's layout and Python's


def test_the_nested_structs_are_the_mirrors_own() -> None:
    """NtLayer and NtModel hold the very NtLinear / NtLora / NtExpert that are checked, so a drift in one shows."""
    assert NtLayer.qkv.size == ctypes.sizeof(NtLinear) and NtLayer.lora_o.size == ctypes.sizeof(NtLora)
    assert NtLayer.shared.size == ctypes.sizeof(NtExpert)
    assert dict(NtLayer._fields_)["experts"]._type_ is NtExpert


# ---- the one chooser of a weight's kernel ---------------------------------------------------------------------------

def test_each_weight_layer_describes_its_own_kind() -> None:
    """native_abi.describe asks the layer: the kind code and the very tensors the kernels will read."""
    import torch

    from nexttoken.model.linear import KeptLinear, Linear
    from nexttoken.model.native_abi import Kind, describe, describe_table
    from nexttoken.model.quant.bf16 import BF16Embedding, BF16Linear
    from nexttoken.model.arithmetic import Arithmetic
    from nexttoken.model.quant.int8 import Int8Embedding, Int8Linear

    torch.manual_seed(0)
    lin = Linear(16, 8)
    d = describe(lin)
    assert (d.kind, d.weight, d.bias, d.scale) == (Kind.W_F32, lin.weight.data_ptr(), lin.bias.data_ptr(), None)
    bf = BF16Linear.from_linear(lin)
    assert describe(bf).kind == Kind.W_BF16 and describe(bf).weight == bf.weight.data_ptr()
    i8 = Int8Linear.from_linear(lin)
    assert (describe(i8).kind, describe(i8).scale) == (Kind.W_I8_F32, i8.scale.data_ptr())  # exact by default
    i8.use_arithmetic(Arithmetic(quantized_activations="integer"))
    assert describe(i8).kind == Kind.W_I8
    assert describe(torch.nn.Linear(16, 8)) is None  # not a layer the kernels know
    assert describe(Linear(16, 8).half()) is None  # float16 rows: no kind
    assert describe(Linear(16, 8).to(torch.bfloat16)) is None  # a bfloat16 bias: the kernels add float32 biases
    router = KeptLinear(16, 4, bias=False)
    assert describe(router).kind == Kind.W_F32 and describe(router).bias is None
    biased = KeptLinear(16, 4)  # gpt-oss's router: its float32 bias described with the rows
    assert (describe(biased).kind, describe(biased).bias) == (Kind.W_F32, biased.bias.data_ptr())
    assert describe(KeptLinear(16, 4).to(torch.bfloat16)) is None  # routers are read as float32 rows
    table = torch.nn.Embedding(10, 16)
    assert describe_table(table).kind == Kind.W_F32 and describe_table(table).weight == table.weight.data_ptr()
    assert describe_table(BF16Embedding(BF16Linear.from_linear(torch.nn.Linear(16, 10)))).kind == Kind.W_BF16
    q = Int8Linear.from_linear(torch.nn.Linear(16, 10))
    assert describe_table(Int8Embedding(q, torch.float32)).scale == q.scale.data_ptr()
    assert describe_table(Int8Embedding(q, torch.bfloat16)) is None  # a bf16 model's rows are rounded


@pytest.mark.skipif(not kernels.ggml_available() or not kernels.int4_available(), reason="needs AVX-512 VNNI kernels")
def test_packed_layers_describe_their_kernels_kind() -> None:
    import torch

    from nexttoken.model import arithmetic
    from nexttoken.model.native_abi import GGML_F32, GGML_Q16, Kind, describe
    from nexttoken.model.quant.ggml import GGML_TYPES, GGUFLinear
    from nexttoken.model.quant.int4 import Int4Linear

    i4 = Int4Linear.from_linear(torch.nn.Linear(64, 8))
    assert (describe(i4).kind, describe(i4).scale) == (Kind.W_I4_F32, i4.scale.data_ptr())  # exact by default
    i4.use_arithmetic(arithmetic.Arithmetic(quantized_activations="integer"))
    assert describe(i4).kind == Kind.W_I4
    rows = torch.zeros(4, 34, dtype=torch.uint8)  # 4 rows of one Q8_0 block (32 values)
    layer = GGUFLinear([(rows, GGML_TYPES["Q8_0"])], 32, None)
    # float32 activations by default (exact)
    assert describe(layer).kind == Kind.W_GGML + (GGML_TYPES["Q8_0"] | GGML_F32) and describe(layer).weight == rows.data_ptr()
    layer.use_arithmetic(arithmetic.Arithmetic(gguf_activations="int8"))
    assert describe(layer).kind == Kind.W_GGML + GGML_TYPES["Q8_0"] and layer.activations == "int8"
    layer.use_arithmetic(arithmetic.Arithmetic(gguf_activations="int16"))  # what a model's policy hands it
    assert describe(layer).kind == Kind.W_GGML + (GGML_TYPES["Q8_0"] | GGML_Q16) and layer.activations == "int16"
