"""One arithmetic policy (model/arithmetic.py), held by the model: its defaults and environment, the fused decode
step and the prefill precision it chooses for a real model, and the scoped conveniences (fused.disabled,
tiles.precision) that change it inside a block only."""

from __future__ import annotations

import threading

import pytest
import torch

from nexttoken.errors import NextTokenError
from nexttoken.model import fused, kernels, load_model
from nexttoken.model.arithmetic import Arithmetic, ArithmeticPolicyError, changed, in_force
from nexttoken.model.quant import tiles
from nexttoken.model.quant.quantize import quantize_int8
from support.tiny_models import save_variant

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44]])


def test_defaults_environment_and_validation() -> None:
    # exact by default: float32 prompts and float32 activations on GGUF blocks; llama.cpp's arithmetic an opt-in
    assert Arithmetic() == Arithmetic(fused_step=True, prefill="float32", gguf_activations="float32")
    assert Arithmetic.llama_cpp() == Arithmetic(prefill="bfloat16", gguf_activations="int8",
                                                quantized_activations="integer")
    with pytest.raises(ArithmeticPolicyError, match="quantized_activations='int4'"):
        Arithmetic(quantized_activations="int4")
    assert Arithmetic.from_env({}) == Arithmetic()
    assert Arithmetic.from_env({"NEXTTOKEN_FUSED": "0", "NEXTTOKEN_PREFILL": "bfloat16"}) == Arithmetic(
        fused_step=False, prefill="bfloat16")
    with pytest.raises(ArithmeticPolicyError, match="NEXTTOKEN_PREFILL='fp8': use one of float32, bfloat16"):
        Arithmetic.from_env({"NEXTTOKEN_PREFILL": "fp8"})
    with pytest.raises(ArithmeticPolicyError, match="gguf_activations='int4'"):
        Arithmetic(gguf_activations="int4")
    with pytest.raises(ArithmeticPolicyError, match=r"unknown arithmetic choice\(s\) \['prefil'\]"):
        Arithmetic().replace(prefil="float32")
    with pytest.raises(NextTokenError):
        tiles.precision("float16")
    with pytest.raises(ArithmeticPolicyError, match="set model.arithmetic"):
        with changed(gguf_activations="int16"):
            pass


def test_a_model_is_built_with_the_environments_policy(tmp_path, monkeypatch) -> None:
    save_variant("llama-gqa", tmp_path)
    assert load_model(tmp_path).arithmetic == Arithmetic.from_env()
    monkeypatch.setenv("NEXTTOKEN_FUSED", "0")
    monkeypatch.setenv("NEXTTOKEN_PREFILL", "bfloat16")
    assert load_model(tmp_path).arithmetic == Arithmetic(fused_step=False, prefill="bfloat16")


def count_native(monkeypatch) -> list[bool]:  # noqa: ANN001
    calls: list[bool] = []
    real = fused.decode_step
    monkeypatch.setattr(fused, "decode_step", lambda *a: calls.append(real(*a) is not None) or real(*a))
    return calls


@needs_kernel
def test_the_models_policy_chooses_the_fused_step(tmp_path, monkeypatch) -> None:
    """fused_step=False on one model: its decode steps run the modules (no native call) and give the same greedy
    tokens; another model built beside it keeps its own policy."""
    from nexttoken.generation import generate

    save_variant("llama-gqa", tmp_path)
    model, other = load_model(tmp_path), load_model(tmp_path)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    calls = count_native(monkeypatch)
    fast = generate(model, PROMPTS, **kwargs)
    assert calls and all(calls)
    calls.clear()
    model.arithmetic = model.arithmetic.replace(fused_step=False)
    assert torch.equal(generate(model, PROMPTS, **kwargs), fast) and not calls
    assert torch.equal(generate(other, PROMPTS, **kwargs), fast) and calls  # not a process-wide switch
    calls.clear()
    model.arithmetic = model.arithmetic.replace(fused_step=True)
    with fused.disabled(other):  # the convenience, for one model
        assert torch.equal(generate(other, PROMPTS, **kwargs), fast) and not calls
        generate(model, PROMPTS, max_new_tokens=4, do_sample=False, eos_token_id=None)
        assert calls
    assert other.arithmetic.fused_step


def prompt_logits(model: torch.nn.Module) -> torch.Tensor:
    """(2, V) last logits of two 40-token prompts: 80 rows, past the few-row kernels, on the prefill tiles."""
    from nexttoken.model import ForwardBatch

    T = 40
    ids = torch.randint(5, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    cols, valid = torch.arange(T).expand(2, T), torch.ones(2, T, dtype=torch.bool)
    with torch.no_grad():
        return model(ids, ForwardBatch.build(cols, cols, valid, T, write_start=0), model.new_cache(2, T))


@needs_kernel
def test_the_models_policy_chooses_the_prefill_precision(tmp_path) -> None:
    """An int8 model's prompt: float32 by its policy is the float32 product of its dequantized weights up to
    summation order (the reference: the same model with every Int8Linear replaced by torch's nn.Linear of
    q * scale); bfloat16 (the opt-in) is within bf16 rounding of it but not float32's."""
    save_variant("llama-gqa", tmp_path)
    model = quantize_int8(load_model(tmp_path))
    assert model.arithmetic.prefill == "float32"  # the default
    reference = quantize_int8(load_model(tmp_path))
    for parent in list(reference.modules()):
        if type(parent).__name__ == "Int8Embedding":
            continue  # its rows are looked up, dequantized exactly, in both models
        for name, child in list(parent.named_children()):
            if type(child).__name__ == "Int8Linear":
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = child.weight.float() * child.scale[:, None]
                if child.bias is not None:
                    dense.bias.data = child.bias.clone()
                setattr(parent, name, dense)
    want = prompt_logits(reference)
    model.arithmetic = model.arithmetic.replace(prefill="float32")
    exact = prompt_logits(model)
    assert (exact - want).norm() < 1e-4 * want.norm()  # float32 up to summation order (2e-5 measured)
    model.arithmetic = model.arithmetic.replace(prefill="bfloat16")
    fast = prompt_logits(model)
    assert (fast - want).norm() > 1e-3 * want.norm()  # bf16 GEMMs for real (1.2e-2 measured)
    with tiles.precision("float32"):  # the scoped convenience wins inside its block
        assert torch.equal(prompt_logits(model), exact)
    assert torch.equal(prompt_logits(model), fast)


def test_changes_are_scoped_to_their_block_and_thread() -> None:
    base = in_force()
    seen: list[Arithmetic] = []
    with changed(prefill="bfloat16", fused_step=False):
        assert in_force() == base.replace(prefill="bfloat16", fused_step=False)
        assert in_force(Arithmetic()) == Arithmetic(fused_step=False, prefill="bfloat16")
        worker = threading.Thread(target=lambda: seen.append(in_force()))
        worker.start()
        worker.join()
    assert in_force() == base and seen == [base]
