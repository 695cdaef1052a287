"""A checkpoint stored in bfloat16 loads at the file's size: bf16 weights with float32 activations by default
(resolve_precision), its tokens those of transformers in float32 on the same file; explicit dtypes keep their
meaning. And the reader: every tensor read into place, a truncated file named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.errors import ModelLoadError
from nexttoken.generation import generate
from nexttoken.model import load_model
from nexttoken.model.quant import apply_quantization, quantize_bf16
from nexttoken.model.weights.loader import read_tensors, resolve_precision
from support.tiny_models import save_variant

PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44]])
GREEDY = dict(max_new_tokens=16, do_sample=False, eos_token_id=None)


def save_bf16(variant: str, folder: Path) -> Path:
    """A random-weight `variant` saved by transformers in bfloat16 (config dtype bfloat16, BF16 tensors)."""
    save_variant(variant, folder).to(torch.bfloat16).save_pretrained(folder)
    return folder


def tensor_bytes(model: torch.nn.Module) -> int:
    unique = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.numel()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def transformers_tokens(folder: Path, dtype: torch.dtype, prompts: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return hf.generate(prompts, attention_mask=torch.ones_like(prompts), min_new_tokens=16, pad_token_id=0,
                           **GREEDY)


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied-mha", "qwen2-bias", "qwen3-qk-norm", "phi3-plain",
                                     "mixtral-moe"])
def test_default_is_bf16_weights_exact_against_transformers_float32(variant: str, tmp_path: Path) -> None:
    folder = save_bf16(variant, tmp_path)
    model = load_model(folder)
    file_bytes = (folder / "model.safetensors").stat().st_size
    assert model.quantization == "bf16" and model.dtype == torch.float32
    assert model.layers[0].attention.wo.weight.dtype == torch.bfloat16
    # The file's size: bf16 matrices as stored, only the norms (and biases) widened to float32.
    assert tensor_bytes(model) <= 1.1 * file_bytes
    tokens = generate(model, PROMPTS, **GREEDY)
    assert torch.equal(tokens, transformers_tokens(folder, torch.float32, PROMPTS))


def test_explicit_dtypes_keep_their_meaning(tmp_path: Path) -> None:
    folder = save_bf16("llama-gqa", tmp_path)
    wide = load_model(folder, dtype="float32")
    assert getattr(wide, "quantization", None) is None
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    default_tokens = generate(load_model(folder), PROMPTS, **GREEDY)
    assert torch.equal(generate(wide, PROMPTS, **GREEDY), default_tokens)  # widening bf16 is exact
    narrow = load_model(folder, dtype="bfloat16")
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    assert torch.equal(generate(narrow, PROMPTS[:1], **GREEDY), transformers_tokens(folder, torch.bfloat16, PROMPTS[:1]))


def test_float32_checkpoint_stays_float32_and_quantize_reads_bf16_from_it(tmp_path: Path) -> None:
    save_variant("llama-tied-mha", tmp_path)  # float32 tensors
    model = load_model(tmp_path)
    assert getattr(model, "quantization", None) is None and model.dtype == torch.float32
    direct = load_model(tmp_path, quantize="bf16")  # read from the file as bf16, no float32 model first
    via_float = quantize_bf16(load_model(tmp_path))
    assert direct.quantization == "bf16"
    for (name, a), (_, b) in zip(direct.state_dict().items(), via_float.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_quantizing_a_bf16_checkpoint(tmp_path: Path) -> None:
    folder = save_bf16("llama-gqa", tmp_path)
    int8 = load_model(folder, quantize="int8")
    assert int8.quantization == "int8" and int8.dtype == torch.float32
    bf16 = load_model(folder)
    assert apply_quantization(bf16, "bf16") is bf16
    with pytest.raises(ModelLoadError, match="bf16 already.*quantize='int8'"):
        apply_quantization(bf16, "int8")


def test_llm_load_uses_the_same_rule(tmp_path: Path) -> None:
    folder = save_bf16("llama-tied-mha", tmp_path)
    assert nexttoken.load(folder).model.quantization == "bf16"
    assert getattr(nexttoken.load(folder, dtype="float32").model, "quantization", None) is None


def test_resolve_precision_rule() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision(None, cpu, torch.bfloat16).bf16_weights
    assert resolve_precision("auto", cpu, torch.bfloat16).bf16_weights
    assert not resolve_precision(None, cpu, torch.float32).bf16_weights
    assert resolve_precision(None, cuda, torch.bfloat16).dtype == torch.bfloat16
    assert not resolve_precision(None, cuda, torch.bfloat16).bf16_weights
    assert not resolve_precision("float32", cpu, torch.bfloat16).bf16_weights
    assert not resolve_precision(None, cpu, torch.bfloat16, quantize="int4").bf16_weights
    assert resolve_precision("bfloat16", cpu, torch.float32, quantize="bf16").bf16_weights


def test_reader_matches_safetensors_and_names_a_truncated_file(tmp_path: Path) -> None:
    folder = save_bf16("qwen2-bias", tmp_path)
    model = load_model(folder, dtype="bfloat16")
    stored = read_tensors([folder / "model.safetensors"])  # safetensors' own reader
    assert torch.equal(model.layers[1].attention.wqkv.bias, torch.cat(
        [stored[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv"]))
    assert torch.equal(model.layers[1].mlp.w2.weight, stored["model.layers.1.mlp.down_proj.weight"])
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(folder)
