"""GGUF files loaded packed (the default for a quantized file): the blocks stay as the file stores them and are
multiplied natively (csrc/ggml.cpp). References: the same file loaded with dequantize=True (the float32 model of
gguf's dequantized values, which test_gguf_files.py / test_gguf_smollm2.py hold to transformers), the PyTorch
modules path for the fused decode step, and the file's own bytes for the zero-copy views."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHARED_DIR, SMOLLM2_GGUF, requires_shared
from support.tiny_models import build_hf_model

import nexttoken
from nexttoken.model import ForwardBatch, fused, kernels
from nexttoken.model.quant.bf16 import BF16Linear
from nexttoken.model.quant import tiles
from nexttoken.model.quant.ggml import GGUFEmbedding, GGUFLinear
from nexttoken.model.weights.gguf import load_gguf_model

gguf = pytest.importorskip("gguf")
from support.gguf_writer import FAMILIES, write_model

pytestmark = pytest.mark.skipif(not kernels.ggml_available(), reason="needs the native kernels with AVX-512 VNNI")


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """(T, V) logits of one forward over the whole sequence (M > 16 rows: the dequantized-tiles path)."""
    from nexttoken.bench.accuracy import all_logits

    return all_logits(model, ids, chunk=len(ids))


def _fused_equals_modules(llm, prompts: list, n: int) -> list[list[int]]:  # noqa: ANN001
    calls: list[bool] = []
    real = fused.decode_rows

    def counted(*a):  # noqa: ANN002, ANN202
        calls.append(True)
        return real(*a)

    fused.decode_rows = counted
    try:
        fast = [c.token_ids for c in llm.generate(prompts, max_new_tokens=n, do_sample=False, ignore_eos=True)]
    finally:
        fused.decode_rows = real
    assert calls, "the packed model did not take the native decode step"
    with fused.disabled():
        slow = [c.token_ids for c in llm.generate(prompts, max_new_tokens=n, do_sample=False, ignore_eos=True)]
    assert fast == slow
    return fast


# ---- tiny files the test writes ------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_tiny_packed_model_keeps_the_blocks_and_its_steps_agree(quant: str, tmp_path: Path) -> None:
    hf = build_hf_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2)
    path = tmp_path / "m.gguf"
    write_model(path, FAMILIES["llama-gqa"], hf, quant)
    llm = nexttoken.load(path)
    model = llm.model
    assert isinstance(model.layers[0].attention.wqkv, GGUFLinear) and isinstance(model.embed, GGUFEmbedding)
    assert model.layers[0].mlp.w13.type_name == quant
    ref = nexttoken.load(path, dequantize=True).model
    ids = [5, 17, 33, 8, 61, 2, 40, 12, 9, 30, 3, 7, 1, 19, 22, 50, 11, 4]
    # prefill multiplies exactly dequantized tiles: in float32, the float model's logits up to summation order;
    # by default on bf16 GEMMs (quant/tiles.py): within bf16 rounding of them
    want = _prefill_logits(ref, ids)
    with tiles.precision("float32"):
        assert torch.allclose(_prefill_logits(model, ids), want, atol=1e-4, rtol=1e-4)
    assert (_prefill_logits(model, ids) - want).norm() < 0.03 * want.norm()
    # decode: the native step and the modules give the same tokens, alone and in a batch of rows
    prompts = [ids[:8], ids[3:9], ids[:5]]
    batched = _fused_equals_modules(llm, prompts, 12)
    assert [llm.generate(p, max_new_tokens=12, do_sample=False, ignore_eos=True).token_ids for p in prompts] == batched


def test_mixed_types_in_one_fused_matrix(tmp_path: Path) -> None:
    """Q4_K_M files keep some v / down rows at Q6_K: q, k (Q4_0) and v (Q8_0) make one matrix of three parts, each
    multiplied as its own type."""
    hf = build_hf_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2)
    src, dst = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_model(src, FAMILIES["llama-gqa"], hf, "Q4_0")
    from support.gguf_writer import rewrite

    def v_q8(name, data, kind):  # noqa: ANN001, ANN202
        if name.endswith("attn_v.weight"):
            values = gguf.quants.dequantize(data, kind)
            return gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return data, kind

    rewrite(src, dst, change=v_q8)
    llm = nexttoken.load(dst)
    wqkv = llm.model.layers[0].attention.wqkv
    assert isinstance(wqkv, GGUFLinear) and wqkv.type_name == "Q4_0+Q8_0" and len(wqkv.parts) == 3
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = wqkv(x)  # the native product of the three parts
    w, lo = wqkv.dequantized(), 0
    for rows, _ in wqkv.parts:
        hi = lo + rows.shape[0]
        assert torch.allclose(whole[:, lo:hi], x @ w[lo:hi].T, atol=1e-5, rtol=1e-5)  # float32 activations
        lo = hi
    _fused_equals_modules(llm, [[5, 17, 33, 8], [9, 30]], 10)


def test_bf16_matrices_stay_bf16(tmp_path: Path) -> None:
    hf = build_hf_model("llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2)
    src, dst = tmp_path / "f.gguf", tmp_path / "bf.gguf"
    write_model(src, FAMILIES["llama-gqa"], hf, None)
    from support.gguf_writer import rewrite

    def bf16(name, data, kind):  # noqa: ANN001, ANN202
        if data.ndim == 2 and "norm" not in name:
            return gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.BF16), \
                gguf.GGMLQuantizationType.BF16
        return data, kind

    rewrite(src, dst, change=bf16)
    llm = nexttoken.load(dst)
    assert isinstance(llm.model.layers[0].mlp.w2, BF16Linear) and llm.model.layers[0].mlp.w2.weight.dtype == torch.bfloat16
    ref = nexttoken.load(dst, dequantize=True)
    ids = [5, 17, 33, 8, 61, 2]
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == \
        ref.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids


# ---- the real SmolLM2 Q4_1 file ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    if not SMOLLM2_GGUF.is_file():
        pytest.skip("needs ../shared/models/smollm2-135m-instruct")
    return nexttoken.load(SMOLLM2_GGUF)


@pytest.fixture(scope="module")
def smollm2_int8():
    """The same file with llama.cpp's arithmetic on its blocks: 8-bit activations (gguf_activations="int8")."""
    if not SMOLLM2_GGUF.is_file():
        pytest.skip("needs ../shared/models/smollm2-135m-instruct")
    return nexttoken.load(SMOLLM2_GGUF, gguf_activations="int8")


@requires_shared
def test_real_file_is_multiplied_from_its_mapped_blocks(smollm2) -> None:
    model = smollm2.model
    g = gguf.GGUFReader(SMOLLM2_GGUF)
    layer = model.layers[3]
    assert isinstance(layer.mlp.w2, GGUFLinear) and layer.mlp.w2.type_name == "Q4_1"
    assert model.lm_head is model.embed.table and model.lm_head.type_name == "Q8_0"  # tied: one table
    # o / down / the token table are the file's own bytes (equal), and no float copy of any matrix exists
    for gname, module in (("blk.3.ffn_down.weight", layer.mlp.w2), ("blk.3.attn_output.weight", layer.attention.wo),
                          ("token_embd.weight", model.lm_head)):
        assert np.array_equal(module.weight.numpy(), np.asarray(next(t for t in g.tensors if t.name == gname).data))
    # so are the parts of the fused gate/up and v (no copy at load); q and k rows are reordered (llama.cpp's
    # permutation undone), so those alone are copies
    file_data = {t.name: np.asarray(t.data) for t in g.tensors if t.name.startswith("blk.3.")}
    (gate, _), (up, _) = layer.mlp.w13.parts
    assert np.array_equal(gate.numpy(), file_data["blk.3.ffn_gate.weight"])
    assert np.array_equal(up.numpy(), file_data["blk.3.ffn_up.weight"])
    assert [rows.shape[0] for rows, _ in layer.attention.wqkv.parts] == [576, 192, 192]
    assert np.array_equal(layer.attention.wqkv.parts[2][0].numpy(), file_data["blk.3.attn_v.weight"])
    floats = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.is_floating_point())
    assert floats < 1 << 20  # norms only: ~70 KB
    packed = sum(t.numel() for n, t in model.state_dict().items() if t.dtype == torch.uint8 and "lm_head" not in n)
    assert packed <= SMOLLM2_GGUF.stat().st_size


@torch.inference_mode()
def _step_logits(model, seq: list[int], disabled: bool, scale: float = 1.0) -> torch.Tensor:  # noqa: ANN001
    """(V,) logits of one decode step for seq[-1] after a prefill of the rest; the embeddings times `scale`."""
    P = len(seq) - 1
    x, valid, cols = torch.tensor([seq]), torch.ones(1, P + 1, dtype=torch.bool), torch.arange(P)[None]
    cache = model.new_cache(1, P + 1)
    model(x[:, :P], ForwardBatch.build(cols, cols, valid[:, :P], P, write_start=0), cache)
    pos = torch.tensor([[P]])
    hook = model.embed.register_forward_hook(lambda m, i, o: o * scale) if scale != 1.0 else None
    try:
        if disabled:
            with fused.disabled():
                return model(x[:, P:], ForwardBatch.build(pos, pos, valid, P + 1, write_start=P), cache).reshape(-1)
        return model(x[:, P:], ForwardBatch.build(pos, pos, valid, P + 1, write_start=P), cache).reshape(-1)
    finally:
        if hook is not None:
            hook.remove()


@requires_shared
def test_real_file_int8_fused_step_is_the_modules_up_to_their_own_rounding(smollm2_int8) -> None:
    """The native step computes what the modules do; its float32 rounding differs from theirs by an ulp here and
    there, and 8-bit activations (a value rounds to the next integer step or not) amplify such an ulp on a
    30-layer model: scaling the embeddings by 1 + 2e-7 moves the modules' own logits by ~0.6. So with llama.cpp's
    arithmetic the fused step is held to that yardstick and the same top-1 (the tiny files above: the same
    tokens)."""
    seq = smollm2_int8.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    seq += smollm2_int8.generate(seq, max_new_tokens=8, do_sample=False, ignore_eos=True).token_ids
    model = smollm2_int8.model
    native, modules = _step_logits(model, seq, False), _step_logits(model, seq, True)
    nudged = _step_logits(model, seq, True, scale=1 + 2e-7)
    assert native.argmax() == modules.argmax() == nudged.argmax()
    assert (native - modules).abs().max() <= 2 * (nudged - modules).abs().max() + 1e-3


@requires_shared
def test_real_file_fused_step_gives_the_modules_tokens(smollm2) -> None:
    """With the default float32 activations an ulp of difference is not amplified: the native step and the
    modules give the same tokens on the real file, a batch of three chat prompts."""
    assert smollm2.model.layers[0].mlp.w13.activations == "float32"
    prompts = [smollm2.chat_prompt([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.")]
    _fused_equals_modules(smollm2, prompts, 24)


def _stories() -> list[str]:
    runs = json.loads((SHARED_DIR / "reference" / "stories260k_llama2c_greedy.json").read_text())["runs"]
    return sorted({r["text"] for r in runs})


@requires_shared
def test_real_file_default_is_its_dequantized_float32_run(smollm2, smollm2_int8) -> None:
    """Exact by default: the packed file (float32 activations on its blocks) gives the answers of its own weights
    computed in float32 (dequantize=True): top-1 equal on >= 99.9% of positions over real text and every next
    token's log-prob within 1e-3, in decode-sized steps (the native kernels) and in one prefill (the tiles).
    llama.cpp's arithmetic (int8 activations, bf16 prefill) stays an opt-in that misses both."""
    from nexttoken.bench.accuracy import all_logits
    from nexttoken.model import arithmetic

    ref, _ = load_gguf_model(SMOLLM2_GGUF, dequantize=True)
    agree = agree8 = total = 0
    worst = worst8 = 0.0
    for text in _stories():
        ids = smollm2.tokenizer.encode(text)
        nxt = torch.tensor(ids[1:])[:, None]
        p = all_logits(ref, ids, chunk=len(ids)).log_softmax(-1)  # (T, V)
        for q in (all_logits(smollm2.model, ids, chunk=16).log_softmax(-1),  # decode steps: the native kernels
                  all_logits(smollm2.model, ids, chunk=len(ids)).log_softmax(-1)):  # one prefill: the tiles
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            worst = max(worst, float((p[:-1].gather(1, nxt) - q[:-1].gather(1, nxt)).abs().max()))
            total += len(ids)
        with arithmetic.changed(prefill="bfloat16"):
            q8 = all_logits(smollm2_int8.model, ids, chunk=16).log_softmax(-1)
        agree8 += int((p.argmax(-1) == q8.argmax(-1)).sum())
        worst8 = max(worst8, float((p[:-1].gather(1, nxt) - q8[:-1].gather(1, nxt)).abs().max()))
    assert total >= 2000
    assert agree / total >= 0.999 and worst <= 1e-3, (agree / total, worst)  # measured: 100%, < 1e-4
    # llama.cpp's arithmetic: 96.6% on these ten stories (KL 0.0026), log-probs off by tenths
    assert agree8 / (total // 2) < 0.999 and worst8 > 1e-2, (agree8 / (total // 2), worst8)
