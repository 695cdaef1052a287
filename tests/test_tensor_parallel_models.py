"""Tensor parallelism on random models of every architecture, in bfloat16 and int8: 2 gloo ranks, each model
its own pair (this process is rank 0). The reference is the same folder loaded in one process: greedy tokens
equal, log-probs within float tolerance, seeded samples equal.
"""

from __future__ import annotations

import pytest
import torch

import nexttoken
from test_tensor_parallel import GREEDY, SAMPLED, _assert_same
from tiny_models import PROMPTS, VARIANTS, build_hf_model, save_variant


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tiny_architectures_equal_one_process(name, tmp_path) -> None:
    save_variant(name, tmp_path)
    one, tp = nexttoken.load(tmp_path), nexttoken.load(tmp_path, tensor_parallel_size=2)
    try:
        _assert_same(tp, one, PROMPTS, **GREEDY)
        _assert_same(tp, one, PROMPTS[:2], **SAMPLED)
    finally:
        tp.close()


def test_one_kv_head_replicated_and_vocab_not_divisible(tmp_path) -> None:
    """num_key_value_heads=1 < 2 ranks: each rank keeps a copy of the KV head; vocab 95 splits 48 + 47 (+1 pad)."""
    build_hf_model("llama", num_key_value_heads=1, vocab_size=95).save_pretrained(tmp_path)
    one, tp = nexttoken.load(tmp_path), nexttoken.load(tmp_path, tensor_parallel_size=2)
    try:
        assert tp.model.config.num_key_value_heads == 1 and tp.model.embed.weight.shape[0] == 48
        _assert_same(tp, one, PROMPTS, **GREEDY)
    finally:
        tp.close()
    with pytest.raises(nexttoken.errors.TensorParallelError, match="was closed"):
        tp.generate(PROMPTS[0], max_new_tokens=2)


# bfloat16: these random logits are tens in size, where bf16 steps by 0.125; one process rounds each product's
# output once, the ranks round their partial products and then their float32 sum.
@pytest.mark.parametrize("dtype,quantize,tol", [("bfloat16", None, 0.25), ("float32", "int8", 1e-3)])
def test_bfloat16_and_int8(tmp_path, dtype, quantize, tol) -> None:
    save_variant("qwen2-bias", tmp_path)
    one = nexttoken.load(tmp_path, dtype=dtype, quantize=quantize)
    tp = nexttoken.load(tmp_path, dtype=dtype, quantize=quantize, tensor_parallel_size=2)
    try:
        assert tp.model.dtype == getattr(torch, dtype)
        if quantize:  # the row-split matrices' scales come from whole rows: the same int8 weights as one process
            w = tp.model.layers[0].mlp.w2.inner.weight
            assert w.dtype == torch.int8
            full = one.model.layers[0].mlp.w2
            assert torch.equal(full.scale, tp.model.layers[0].mlp.w2.inner.scale)
            assert torch.equal(full.weight[:, : w.shape[1]], w)
        _assert_same(tp, one, PROMPTS, tol=tol, **GREEDY)
    finally:
        tp.close()


def test_int8_stories260k(shared_dir) -> None:
    stories = shared_dir / "models" / "stories260k"
    one = nexttoken.load(stories, quantize="int8")
    tp = nexttoken.load(stories, quantize="int8", tensor_parallel_size=2)
    try:
        _assert_same(tp, one, ["Once upon a time", "Tom had a dog"], tol=1e-3, **GREEDY)  # int8 kernels' order
    finally:
        tp.close()
