"""Loading Hugging Face folders: sharded files, dtypes, tied weights, and every failure with its message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nexttoken
from nexttoken.errors import MissingFileError, ModelLoadError
from nexttoken.generation import generate
from nexttoken.model import load_model
from support.tiny_models import save_variant


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("llama")
    save_variant("llama-gqa", d)
    return d


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def greedy(model, n: int = 12) -> torch.Tensor:
    return generate(model, torch.tensor([[1, 5, 9, 12]]), max_new_tokens=n, eos_token_id=None)


def test_sharded_checkpoint_loads_identically(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file, metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(greedy(load_model(d)), greedy(load_model(model_dir)))


def test_missing_shard_is_named(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}})
    )
    with pytest.raises(MissingFileError, match="model-00001-of-00001.safetensors"):
        load_model(d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16", "float16", "float32"])
def test_dtypes(model_dir: Path, dtype) -> None:
    model = load_model(model_dir, dtype=dtype)
    expected = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    assert model.dtype == expected
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies are never rounded to the weights' dtype
    out = greedy(model)
    assert out.shape == (1, 16)


def test_bfloat16_logits_close_to_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ours = nexttoken.load(model_dir, dtype="bfloat16")
    ids = torch.tensor([[1, 5, 9, 12, 40, 41]])
    expected = hf.generate(ids, max_new_tokens=1, output_logits=True, return_dict_in_generate=True,
                           do_sample=False, pad_token_id=0).logits[0]
    got = generate(ours.model, ids, max_new_tokens=1, output_logits=True, return_dict_in_generate=True).logits[0]
    torch.testing.assert_close(got, expected.float(), rtol=0.02, atol=0.1)


def test_unknown_dtype(model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="int4"):
        load_model(model_dir, dtype="int4")


def test_tied_embeddings_share_storage(tmp_path: Path) -> None:
    save_variant("llama-tied-mha", tmp_path)
    model = load_model(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


def test_folder_without_tokenizer_loads_for_token_ids(model_dir: Path) -> None:
    llm = nexttoken.load(model_dir)
    assert llm.tokenizer is None
    result = llm.generate([1, 5, 9], max_new_tokens=5, eos_token_id=None)
    assert len(result.token_ids) == 5 and result.text == ""
    with pytest.raises(nexttoken.TokenizerError, match="token ids"):
        llm.generate("hello")


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(MissingFileError, match="config.json"):
        load_model(d)


def test_missing_weights(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(MissingFileError, match="model.safetensors"):
        load_model(d)


def test_pickle_only_checkpoint_is_refused(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(MissingFileError, match="safetensors only"):
        load_model(d)


def test_unknown_architecture(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(d)


def test_unsupported_rope_type(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="yarn"):
        load_model(d)


def test_invalid_config_json(model_dir: Path, tmp_path: Path) -> None:
    d = copy_of(model_dir, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(d)


def _drop_up_proj(t: dict) -> None:
    del t["model.layers.1.mlp.up_proj.weight"]


def _reshape_k_proj(t: dict) -> None:
    t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)


def _add_layer_5(t: dict) -> None:
    t["model.layers.5.self_attn.q_proj.weight"] = torch.zeros(4, 4)


@pytest.mark.parametrize(
    "change,message",
    [
        (_drop_up_proj, r"model\.layers\.1\.mlp\.up_proj\.weight missing"),  # a missing tensor is named
        (_reshape_k_proj, r"k_proj\.weight has shape \(8, 64\).*\(32, 64\)"),  # a wrong shape is named
        (_add_layer_5, r"unexpected tensors model\.layers\.5"),  # an unexpected tensor is named
    ],
)
def test_checkpoint_mismatch_is_named(model_dir: Path, tmp_path: Path, change, message: str) -> None:  # noqa: ANN001
    d = copy_of(model_dir, tmp_path)
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        load_model(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(model_dir: Path, tmp_path: Path, damage: str) -> None:
    d = copy_of(model_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model(d)
