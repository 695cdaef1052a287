"""The native decode kernels: weight-streaming x @ W^T for a few rows (nexttoken/csrc/gemv.cpp) and a whole fused
decode step (nexttoken/csrc/decode.cpp, driven by nexttoken/model/fused.py), built on first use. The sources are
package data, so a regular (non-editable) install carries them.

torch's F.linear with one input row streams weights at ~18-20 GB/s on a 2-core Zen 4, a third of what the
memory can deliver; the kernel streams them at the memory's speed. It is a plain C-ABI shared library compiled
with the system C++ compiler in about a second and cached (keyed by the source's hash) under
$NEXTTOKEN_CACHE or ~/.cache/nexttoken, then called through ctypes. Everything falls back to torch when it is
unavailable: no compiler, no AVX-512, a non-CPU tensor, or NEXTTOKEN_NATIVE=0 in the environment.
NEXTTOKEN_REQUIRE_NATIVE=1 (CI sets it where g++ and AVX-512 are present) turns "unavailable" into an error that
carries the compiler's message, so a kernel that stops compiling fails the run instead of skipping its tests.

Loading checks the boundary first (native_abi.py): the structs and codes the library was compiled with
(csrc/nt_abi.h) against their Python mirrors. A difference refuses the library with a message naming the struct,
the field and both layouts (`why_unavailable()`; an error under NEXTTOKEN_REQUIRE_NATIVE=1), never a misread struct.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..errors import NextTokenError
from . import native_abi
from .native_abi import DTYPE_KIND, OUT_KIND, Kind, NativeABIError

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = (CSRC / "gemv.cpp", CSRC / "decode.cpp", CSRC / "int4.cpp", CSRC / "ggml.cpp",
           CSRC / "abi.cpp", CSRC / "mxfp4.cpp", CSRC / "recurrent.cpp")  # one library
HEADERS = (CSRC / "rows.h", CSRC / "nt_abi.h")  # included by the sources: part of the cache key
MAX_ROWS = 16  # activation rows per call; beyond that torch's GEMM is the faster choice
_W_KIND = DTYPE_KIND  # nt_linear's kind of a float32 / bfloat16 / int8 weight (nt_abi.h's NtKind)
_OUT_KIND = OUT_KIND


def _cache_dir() -> Path:
    root = os.environ.get("NEXTTOKEN_CACHE") or Path.home() / ".cache" / "nexttoken"
    return Path(root) / "kernels"


class NativeKernelError(NextTokenError, RuntimeError):
    """NEXTTOKEN_REQUIRE_NATIVE=1 and the native kernel cannot be built or used here."""


def build(verbose: bool = False) -> Path | None:
    """Compile csrc/*.cpp into the cache (once per source version); the library's path, or None."""
    path, why = _build()
    if path is None and verbose:
        print(f"nexttoken: native kernel unavailable ({why}); using torch", file=sys.stderr)
    return path


def library_path() -> Path:
    """Where the library built from these sources lives in the cache (keyed by their hash)."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS)).hexdigest()[:16]
    return _cache_dir() / f"libnt_gemv_{digest}.so"


def _build() -> tuple[Path | None, str]:
    """(the library's path, "") or (None, why not)."""
    missing = [str(f) for f in SOURCES + HEADERS if not f.is_file()]
    if missing:
        return None, f"sources missing: {missing}"
    target = library_path()
    if target.is_file():
        return target, ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return None, f"no writable cache at {target.parent}: {e}"
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    # -ffp-contract=off: no multiply-add fused unless the source asks, so the fused step rounds as PyTorch does.
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off",
           *map(str, SOURCES), "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # ~1 min alone, more when busy
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"compiler not run: {e}"
    if done.returncode != 0:
        return None, f"build failed:\n{done.stderr.strip()}"
    os.replace(tmp, target)  # atomic: concurrent first uses never load a half-written file
    return target, ""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None when it cannot be used on this machine."""
    lib, why = _loaded()
    if lib is None and why and os.environ.get("NEXTTOKEN_REQUIRE_NATIVE") == "1":
        raise NativeKernelError(f"NEXTTOKEN_REQUIRE_NATIVE=1 but the native kernel is unavailable: {why}")
    return lib


def why_unavailable() -> str:
    """Why library() is None ("" when it is loaded, or switched off by NEXTTOKEN_NATIVE=0)."""
    return _loaded()[1]


class _Unsupported(NextTokenError):
    """The library loads, but this CPU cannot run it."""


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not): built, opened and checked once per process."""
    if os.environ.get("NEXTTOKEN_NATIVE", "1") == "0":
        return None, ""
    path, why = _build()
    if path is None:
        return None, why
    try:
        return load(path), ""
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    except NativeABIError as e:
        return None, f"{path} was refused: {e}"
    except _Unsupported as e:
        return None, str(e)


def load(path: Path) -> ctypes.CDLL:
    """Open the kernel library at `path`, check its boundary (native_abi.check_library: NativeABIError on a
    drift) and declare its functions' signatures. OSError when it cannot be opened."""
    lib = ctypes.CDLL(str(path))  # torch is loaded first, so its libgomp (same soname) is the one we use
    native_abi.check_library(lib)
    if not lib.nt_supported():
        raise _Unsupported("this CPU lacks AVX-512 F/BW/VL/DQ or FMA")
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.nt_linear.argtypes = [p, i, p, p, p, i64, i64, i64, p, i]
    lib.nt_linear.restype = i
    lib.nt_argmax_f32.argtypes = [p, i64, i64, p]
    lib.nt_argmax_f32.restype = i
    lib.nt_dequantize_i8.argtypes = [p, p, i64, i64, p, i]
    lib.nt_dequantize_i8.restype = i
    lib.nt_decode_step.argtypes = [p, p, i64, p, i64, i64, p]
    lib.nt_decode_step.restype = i
    lib.nt_decode_step_ids.argtypes = [p, p, i64, p, i64, i64, p]
    lib.nt_decode_step_ids.restype = i
    lib.nt_decode_greedy.argtypes = [p, i64, i64, i64, i64, p, i64, p, p]
    lib.nt_decode_greedy.restype = i64
    lib.nt_decode_rows.argtypes = [p, p, i64, p, p, i64, p, p]
    lib.nt_decode_rows.restype = i
    lib.nt_decode_rows_ids.argtypes = [p, p, i64, p, p, i64, p, p]
    lib.nt_decode_rows_ids.restype = i
    lib.nt_decode_part.argtypes = [p, i64, i64, p, i64, p, p, i64, p, p]
    lib.nt_decode_part.restype = i
    lib.nt_int4_supported.restype = i
    lib.nt_linear_i4.argtypes = [p, p, p, p, i64, i64, i64, p, i]
    lib.nt_linear_i4.restype = i
    lib.nt_linear_i4f.argtypes = [p, p, p, p, i64, i64, i64, p, i]
    lib.nt_linear_i4f.restype = i
    lib.nt_quantize_i4.argtypes = [p, i64, i64, p, i64, p, p]
    lib.nt_quantize_i4.restype = i
    lib.nt_dequantize_i4.argtypes = [p, p, i64, i64, p, i]
    lib.nt_dequantize_i4.restype = i
    lib.nt_ggml_supported.restype = i
    lib.nt_linear_ggml.argtypes = [i, p, p, p, i64, i64, i64, p, i]
    lib.nt_linear_ggml.restype = i
    lib.nt_dequantize_ggml.argtypes = [i, p, i64, i64, p, i]
    lib.nt_dequantize_ggml.restype = i
    lib.nt_ggml_row.argtypes = [i, p, i64, i64, p]
    lib.nt_ggml_row.restype = i
    lib.nt_gguf_strings.argtypes = [p, i64, i64, i64, p, p, p]
    lib.nt_gguf_strings.restype = i64
    lib.nt_mxfp4_supported.restype = i
    lib.nt_linear_mxfp4.argtypes = [p, p, p, i64, i64, i64, p]
    lib.nt_linear_mxfp4.restype = i
    lib.nt_dequantize_mxfp4.argtypes = [p, i64, i64, p]
    lib.nt_dequantize_mxfp4.restype = i
    return lib


def available() -> bool:
    return library() is not None


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel can take this call: CPU tensors, supported dtypes, a handful of rows."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dtype in _W_KIND
        and x.dtype in _OUT_KIND
        and x.numel() // x.shape[-1] <= MAX_ROWS
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
        and library() is not None
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    kind: int | None = None,
) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T * scale (N,) + bias (N,); bias/scale float32. Output in x's dtype. `kind`:
    nt_abi.h's NtKind where the weight's dtype does not say it (W_I8_F32: int8 rows, float32 activations)."""
    lib = library()
    assert lib is not None
    N, K = weight.shape
    # Decode calls are tiny, so every avoided dispatch counts: a contiguous float32 x is read as it is.
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()  # (..., K)
    M = xf.numel() // K
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype)  # (..., N)
    rc = lib.nt_linear(
        weight.data_ptr(),
        _W_KIND[weight.dtype] if kind is None else kind,
        xf.data_ptr(),
        None if bias is None else bias.data_ptr(),
        None if scale is None else scale.data_ptr(),
        M,
        N,
        K,
        y.data_ptr(),
        _OUT_KIND[x.dtype],
    )
    assert rc == 0
    return y


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """(B, V) scores -> (B,) int64 ids, exactly torch.argmax(scores, -1): native for contiguous float32 CPU
    scores (a vectorised two-pass scan), torch otherwise."""
    lib = library() if scores.device.type == "cpu" and scores.dtype == torch.float32 else None
    if lib is None or scores.dim() != 2 or not scores.is_contiguous() or scores.shape[1] == 0:
        return scores.argmax(dim=-1)
    out = torch.empty(scores.shape[0], dtype=torch.long)
    lib.nt_argmax_f32(scores.data_ptr(), scores.shape[0], scores.shape[1], out.data_ptr())
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 rows q (N, K) * scale (N,) as `dtype` (float32 or bfloat16), rounded once; into `out` when given."""
    lib = library()
    assert lib is not None and q.is_contiguous() and scale.dtype == torch.float32
    N, K = q.shape
    out = torch.empty((N, K), dtype=dtype) if out is None else out[: N * K].view(N, K)
    lib.nt_dequantize_i8(q.data_ptr(), scale.data_ptr(), N, K, out.data_ptr(), _OUT_KIND[dtype])
    return out


def int4_available() -> bool:
    """Whether the 4-bit kernels (int4.cpp: AVX-512 VNNI and F16C too) run here."""
    lib = library()
    return lib is not None and bool(lib.nt_int4_supported())


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, K: int,
                bias: torch.Tensor | None = None, exact: bool = True) -> torch.Tensor:
    """x (..., K) @ W^T (+ bias (N,) float32) for 4-bit W: packed (N, Kp/2) uint8 and scales (N, Kp/32) float16
    as nexttoken/model/quant/int4.py lays them out; at most MAX_ROWS rows of x. Output in x's dtype. exact: float32
    activations (nt_linear_i4f), else int8 per group of 32 (nt_linear_i4)."""
    lib = library()
    assert lib is not None and x.shape[-1] == K
    N = packed.shape[0]
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()  # (..., K)
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype)  # (..., N)
    rc = (lib.nt_linear_i4f if exact else lib.nt_linear_i4)(packed.data_ptr(), scales.data_ptr(), xf.data_ptr(),
                          None if bias is None else bias.data_ptr(), xf.numel() // K, N, K, y.data_ptr(),
                          _OUT_KIND[x.dtype])
    assert rc == 0
    return y


def quantize_int4(w: torch.Tensor, factors: tuple[float, ...], Kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (packed (N, Kp/2) uint8, scales (N, Kp/32) float16): int4.py's quantize_groups, natively."""
    lib = library()
    assert lib is not None
    wf = w.detach().to(torch.float32).contiguous()  # (N, K)
    N, K = wf.shape
    f = torch.tensor(factors, dtype=torch.float64)
    packed = torch.empty(N, Kp // 2, dtype=torch.uint8)
    scales = torch.empty(N, Kp // 32, dtype=torch.float16)
    lib.nt_quantize_i4(wf.data_ptr(), N, K, f.data_ptr(), len(factors), packed.data_ptr(), scales.data_ptr())
    return packed, scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, K: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit rows (packed (N, Kp/2), scales (N, Kp/32)) as (N, K) `dtype` (float32 or bfloat16), each value
    q * scale rounded once; into `out` when given."""
    lib = library()
    assert lib is not None and packed.is_contiguous() and scales.is_contiguous()
    N = packed.shape[0]
    out = torch.empty((N, K), dtype=dtype) if out is None else out[: N * K].view(N, K)
    lib.nt_dequantize_i4(packed.data_ptr(), scales.data_ptr(), N, K, out.data_ptr(), _OUT_KIND[dtype])
    return out


GGML_KIND = int(Kind.W_GGML)  # nt_linear's kind for GGUF blocks: GGML_KIND + the ggml type id (csrc/ggml.cpp)


def ggml_available() -> bool:
    """Whether the GGUF block kernels (ggml.cpp: AVX-512 VNNI and F16C) run here."""
    lib = library()
    return lib is not None and bool(lib.nt_ggml_supported())


def linear_ggml(x: torch.Tensor, packed: torch.Tensor, ggml_type: int, K: int,
                bias: torch.Tensor | None = None, N: int | None = None) -> torch.Tensor:
    """x (..., K) @ W^T (+ bias (N,) float32) for W stored as GGUF blocks: packed (N, row bytes) uint8 of ggml type
    `ggml_type` (csrc/ggml.cpp; type 255: packed is the int64 description of parts of several types, and N must be
    given); at most MAX_ROWS rows of x. Output in x's dtype."""
    lib = library()
    assert lib is not None and x.shape[-1] == K and packed.is_contiguous()
    N = packed.shape[0] if N is None else N
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()  # (..., K)
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype)  # (..., N)
    rc = lib.nt_linear_ggml(ggml_type, packed.data_ptr(), xf.data_ptr(), None if bias is None else bias.data_ptr(),
                            xf.numel() // K, N, K, y.data_ptr(), _OUT_KIND[x.dtype])
    assert rc == 0, f"nt_linear_ggml refused type {ggml_type}, K={K}"
    return y


def dequantize_ggml(packed: torch.Tensor, ggml_type: int, K: int, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF block rows packed (N, row bytes) as (N, K) `dtype` (float32: exactly gguf.quants.dequantize's values;
    bfloat16: those rounded once); into `out` when given."""
    lib = library()
    assert lib is not None and packed.is_contiguous()
    N = packed.shape[0]
    out = torch.empty((N, K), dtype=dtype) if out is None else out[: N * K].view(N, K)
    rc = lib.nt_dequantize_ggml(ggml_type, packed.data_ptr(), N, K, out.data_ptr(), _OUT_KIND[dtype])
    assert rc == 0, f"nt_dequantize_ggml refused type {ggml_type}, K={K}"
    return out


def mxfp4_available() -> bool:
    """Whether the MXFP4 kernels (csrc/mxfp4.cpp: AVX-512 F/BW/VL/DQ and FMA) run here."""
    lib = library()
    return lib is not None and bool(lib.nt_mxfp4_supported())


def linear_mxfp4(x: torch.Tensor, packed: torch.Tensor, K: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W^T (+ bias (N,) float32) for W as MXFP4 blocks: packed (N, K / 32 * 17) uint8 (csrc/mxfp4.cpp);
    at most MAX_ROWS rows of x, float32 activations. Output in x's dtype."""
    lib = library()
    assert lib is not None and x.shape[-1] == K and packed.is_contiguous()
    N = packed.shape[0]
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()  # (..., K)
    y = torch.empty((*x.shape[:-1], N), dtype=torch.float32)  # (..., N)
    rc = lib.nt_linear_mxfp4(packed.data_ptr(), xf.data_ptr(), None if bias is None else bias.data_ptr(),
                             xf.numel() // K, N, K, y.data_ptr())
    assert rc == 0, f"nt_linear_mxfp4 refused K={K}, {xf.numel() // K} rows"
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def dequantize_mxfp4(packed: torch.Tensor, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 rows packed (N, K / 32 * 17) as (N, K) float32, exactly gguf.quants.dequantize's values; into `out`
    (at least N * K float32) when given."""
    lib = library()
    assert lib is not None and packed.is_contiguous()
    N = packed.shape[0]
    out = torch.empty((N, K), dtype=torch.float32) if out is None else out[: N * K].view(N, K)
    rc = lib.nt_dequantize_mxfp4(packed.data_ptr(), N, K, out.data_ptr())
    assert rc == 0, f"nt_dequantize_mxfp4 refused K={K}"
    return out


if __name__ == "__main__":  # `python -m nexttoken.model.kernels`: build now (e.g. from scripts/setup.sh)
    built = build(verbose=True)
    status = built if built and available() else f"unavailable (torch fallback): {why_unavailable()}"
    print(f"nexttoken native kernel: {status}")
