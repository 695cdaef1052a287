"""Quantized weights: int8 (per-row scales), int4 (groups of 32) and bf16, each a module the native kernels read,
and `apply_quantization`, which replaces a float model's layers with them (quantize.py)."""

from .quantize import QUANTIZATIONS, apply_quantization, quantize_bf16, quantize_int4, quantize_int8

__all__ = ["QUANTIZATIONS", "apply_quantization", "quantize_bf16", "quantize_int4", "quantize_int8"]
