"""A GGUF file's MoE experts kept in their ggml blocks (gguf_packed.keepable_experts): a Q8_0 Qwen3-MoE file loads
each expert projection as a GGUFLinear (views of the stacked rows), with int16 activations within their rounding of the
same file dequantized, and with its greedy tokens. (gpt-oss's MXFP4 experts:
tests/model/test_gpt_oss.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.model.quant import tiles
from nexttoken.model.quant.ggml import GGUFLinear, native_blocks
from nexttoken.model.weights.gguf import load_gguf_model
from support.tiny_models import VARIANTS, build_hf_model

pytest.importorskip("gguf")
pytestmark = [pytest.mark.skipif(not native_blocks(), reason="needs the ggml kernels (AVX-512 VNNI)"),
              pytest.mark.usefixtures("one_thread")]


def test_q8_0_experts_stay_packed_and_agree_with_the_dequantized_file(tmp_path: Path) -> None:
    from nexttoken.bench.accuracy import all_logits
    from support.gguf_writer import write_model

    arch, overrides = VARIANTS["qwen3-moe-norm-topk"]
    path = tmp_path / "moe.gguf"
    write_model(path, "qwen3moe", build_hf_model(arch, **overrides), "Q8_0")
    packed, _ = load_gguf_model(path, activations="int16")  # int16 activations: close to the float products
    exact, _ = load_gguf_model(path, dequantize=True)
    expert = packed.layers[1].mlp.experts[5]
    assert isinstance(expert.w13, GGUFLinear) and isinstance(expert.w2, GGUFLinear)
    assert not isinstance(exact.layers[1].mlp.experts[5].w13, GGUFLinear)
    ids = [5, 17, 33, 8, 61, 2, 40, 12, 9, 30, 3, 7, 1, 19, 22, 50, 11, 4]
    with tiles.precision("float32"):
        # the experts take a few rows each: the native product, its activations quantized per block of 32
        want = all_logits(exact, ids, chunk=len(ids))
        assert (all_logits(packed, ids, chunk=len(ids)) - want).abs().max() <= 0.02 * want.abs().max()
        prompt = torch.tensor([ids[:8]])
        greedy = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert torch.equal(nexttoken.generate(packed, prompt, **greedy), nexttoken.generate(exact, prompt, **greedy))
