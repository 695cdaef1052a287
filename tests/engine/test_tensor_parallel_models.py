"""Tensor parallelism on random models of every architecture, in bfloat16 and int8: 2 gloo ranks, each model
its own pair (this process is rank 0). The reference is the same folder loaded in one process: greedy tokens
equal, log-probs within float tolerance, seeded samples equal.
"""

from __future__ import annotations

import pytest
import torch

import nexttoken
from support.tensor_parallel import GREEDY, SAMPLED, assert_same
from support.tiny_models import (NO_TENSOR_PARALLEL, PROMPTS, RECURRENT, VARIANTS, build_hf_model, declared,
                                 save_variant)


@pytest.mark.parametrize("name", sorted(n for n in VARIANTS if declared(n).tensor_parallel
                                        and n not in NO_TENSOR_PARALLEL | RECURRENT))  # refused: their own tests
def test_tiny_architectures_equal_one_process(name, tmp_path) -> None:
    save_variant(name, tmp_path)
    one, tp = nexttoken.load(tmp_path), nexttoken.load(tmp_path, tensor_parallel_size=2)
    try:
        assert_same(tp, one, PROMPTS, **GREEDY)
        assert_same(tp, one, PROMPTS[:2], **SAMPLED)
    finally:
        tp.close()


def test_one_kv_head_replicated_and_vocab_not_divisible(tmp_path) -> None:
    """num_key_value_heads=1 < 2 ranks: each rank keeps a copy of the KV head; vocab 95 splits 48 + 47 (+1 pad)."""
    build_hf_model("llama", num_key_value_heads=1, vocab_size=95).save_pretrained(tmp_path)
    one, tp = nexttoken.load(tmp_path), nexttoken.load(tmp_path, tensor_parallel_size=2)
    try:
        assert tp.model.config.num_key_value_heads == 1 and tp.model.embed.weight.shape[0] == 48
        assert_same(tp, one, PROMPTS, **GREEDY)
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
        assert_same(tp, one, PROMPTS, tol=tol, **GREEDY)
    finally:
        tp.close()


def test_int8_stories260k(shared_dir) -> None:
    stories = shared_dir / "models" / "stories260k"
    one = nexttoken.load(stories, quantize="int8")
    tp = nexttoken.load(stories, quantize="int8", tensor_parallel_size=2)
    try:
        assert_same(tp, one, ["Once upon a time", "Tom had a dog"], tol=1e-3, **GREEDY)  # int8 kernels' order
    finally:
        tp.close()


def test_rank_reads_its_slices_of_fused_and_expert_matrices(tmp_path) -> None:
    """Rank 0's weights against the checkpoint's own tensors (read with safetensors): Phi-3's fused qkv_proj and
    gate_up_proj give rank 0 the first half of q, of k, of v (of gate, of up); every MoE expert and the shared expert
    give it the first half of their width (down: the first half of its columns); the router and the shared
    expert's gate are whole."""
    from safetensors.torch import load_file

    phi, moe = tmp_path / "phi3", tmp_path / "moe"
    save_variant("phi3-sliding-tied", phi)
    save_variant("qwen2-moe-shared", moe)
    tp = nexttoken.load(phi, tensor_parallel_size=2)
    try:
        t = load_file(phi / "model.safetensors")
        qkv, gate_up = t["model.layers.0.self_attn.qkv_proj.weight"], t["model.layers.0.mlp.gate_up_proj.weight"]
        q, kv, inter = 4 * 16, 4 * 16, 112  # 4 heads of 64 / 4 = 16, MHA
        want = torch.cat([qkv[: q // 2], qkv[q : q + kv // 2], qkv[q + kv : q + kv + kv // 2]])
        assert torch.equal(tp.model.layers[0].attention.wqkv.weight, want)
        assert torch.equal(tp.model.layers[0].mlp.w13.weight, torch.cat([gate_up[: inter // 2],
                                                                          gate_up[inter : inter + inter // 2]]))
    finally:
        tp.close()
    tp = nexttoken.load(moe, tensor_parallel_size=2)
    try:
        t = load_file(moe / "model.safetensors")
        mlp, p = tp.model.layers[0].mlp, "model.layers.0.mlp."
        for e in range(4):
            x = f"{p}experts.{e}."
            assert torch.equal(mlp.experts[e].w13.weight, torch.cat([t[x + "gate_proj.weight"][:24],
                                                                     t[x + "up_proj.weight"][:24]]))
            assert torch.equal(mlp.experts[e].w2.weight, t[x + "down_proj.weight"][:, :24])
        assert torch.equal(mlp.shared.w13.weight, torch.cat([t[p + "shared_expert.gate_proj.weight"][:40],
                                                             t[p + "shared_expert.up_proj.weight"][:40]]))
        assert torch.equal(mlp.shared.w2.weight, t[p + "shared_expert.down_proj.weight"][:, :40])
        assert torch.equal(mlp.gate.weight, t[p + "gate.weight"])
        assert torch.equal(mlp.shared_gate.weight, t[p + "shared_expert_gate.weight"])
        # layer 1 is dense (mlp_only_layers): split like any MLP, its down projection all-reduced on its own
        assert tp.model.layers[1].mlp.w13.weight.shape == (112, 64)
    finally:
        tp.close()


def test_int8_moe_experts_quantized_as_one_process(tmp_path) -> None:
    """Every expert's row-split down projection takes its row scales from whole rows (all-reduced maximum)."""
    save_variant("qwen2-moe-shared", tmp_path)
    one = nexttoken.load(tmp_path, dtype="float32", quantize="int8")
    tp = nexttoken.load(tmp_path, dtype="float32", quantize="int8", tensor_parallel_size=2)
    try:
        for mine, full in [(tp.model.layers[0].mlp.experts[2].w2, one.model.layers[0].mlp.experts[2].w2),
                           (tp.model.layers[0].mlp.shared.w2, one.model.layers[0].mlp.shared.w2)]:
            assert mine.weight.dtype == torch.int8
            assert torch.equal(mine.scale, full.scale)
            assert torch.equal(mine.weight, full.weight[:, : mine.weight.shape[1]])
        assert_same(tp, one, PROMPTS, tol=1e-3, **GREEDY)
    finally:
        tp.close()


def test_expert_widths_must_divide(tmp_path) -> None:
    import dataclasses

    from nexttoken.config import ModelConfig
    from nexttoken.errors import ModelLoadError
    from nexttoken.model.parallel import check_divisible

    save_variant("qwen2-moe-shared", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    check_divisible(cfg, 4)  # 4 heads, 2 KV heads copied, widths 112, 48 and 80 all divide by 4
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=50, shared_intermediate_size=90))
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=4 does not divide the experts' intermediate size "
                                             r"50, shared_expert_intermediate_size=90 .*\(e\.g\. 1, 2\)"):
        check_divisible(odd, 4)
