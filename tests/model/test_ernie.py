"""ERNIE 4.5 and ERNIE 4.5 MoE (families/ernie.py): their configs read as transformers reads them; RoPE over
adjacent pairs (the loader's reordering of q / k rows into halves) and the MoE router's correction bias each change
the tokens, and the tokens are transformers'; both from the GGUF files llama.cpp's converter writes (which keep the
checkpoint's row order), over a real SentencePiece tokenizer. (Greedy and seeded tokens through generate and the
engine, batch invariance: tests/model/test_attention_families.py; the every-variant suites run both variants.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.config import ModelConfig
from nexttoken.model import load_model
from support.tiny_models import VARIANTS, build_hf_model

PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60, 7, 8], [1, 40, 41, 42, 43, 44, 45, 46]])
GREEDY = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_configs_are_transformers() -> None:
    import transformers

    hf = transformers.Ernie4_5_MoeConfig(num_hidden_layers=7, moe_layer_start_index=2, moe_layer_interval=2,
                                         moe_layer_end_index=5, moe_num_experts=16, moe_k=4, moe_num_shared_experts=2,
                                         moe_intermediate_size=48)
    ours = ModelConfig.from_dict(hf.to_dict())
    sparse = [(i + 1) % hf.moe_layer_interval == 0 and hf.moe_layer_start_index <= i <= hf.moe_layer_end_index
              for i in range(hf.num_hidden_layers)]  # transformers' Ernie4_5_MoeDecoderLayer's rule
    assert list(ours.moe.sparse_layers) == sparse == [False, False, False, True, False, True, False]
    assert (ours.moe.num_experts, ours.moe.top_k, ours.moe.shared_intermediate_size) == (16, 4, 96)
    assert ours.moe.correction_bias and ours.moe.norm_topk_prob and not ours.moe.shared_gate
    dense = ModelConfig.from_dict(transformers.Ernie4_5Config(use_bias=True).to_dict())
    assert dense.attention_bias and dense.mlp_bias and dense.tie_word_embeddings and dense.rope.theta == 500_000.0
    with pytest.raises(nexttoken.errors.ModelLoadError, match="use_bias"):
        ModelConfig.from_dict(transformers.Ernie4_5_MoeConfig(use_bias=True).to_dict())


def test_pairs_and_the_correction_bias_change_the_tokens(tmp_path: Path) -> None:
    """The same dense folder read as a Llama (the same block and biases, RoPE over halves: no reordering) gives
    other tokens than transformers' ERNIE; without its correction bias the MoE gives other tokens, in transformers
    and here alike: the parity holds each part, not luck."""
    _, overrides = VARIANTS["ernie4_5-pairs-bias"]
    hf = build_hf_model("ernie4_5", **overrides)
    hf.save_pretrained(tmp_path / "dense")
    long = dict(GREEDY, max_new_tokens=24)
    want = hf.generate(PROMPTS, **long)
    assert torch.equal(nexttoken.generate(load_model(tmp_path / "dense"), PROMPTS, **long), want)
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=True, mlp_bias=True)
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    assert not torch.equal(nexttoken.generate(load_model(tmp_path / "dense"), PROMPTS, **long), want)
    _, overrides = VARIANTS["ernie4_5-moe"]
    base = build_hf_model("ernie4_5_moe", **overrides)
    other = build_hf_model("ernie4_5_moe", **overrides)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.zero_()
    want = other.generate(PROMPTS, **long)
    assert not torch.equal(base.generate(PROMPTS, **long), want)
    other.save_pretrained(tmp_path / "moe")
    assert torch.equal(nexttoken.generate(load_model(tmp_path / "moe"), PROMPTS, **long), want)


@pytest.mark.parametrize("name", ["ernie4_5-pairs-bias", "ernie4_5-moe"])
def test_gguf_from_llama_cpps_converter_gives_the_folders_tokens(name, tmp_path: Path, shared_dir) -> None:
    """A folder over Llama 2's SentencePiece tokenizer (the converter's ERNIE vocabulary reader wants one) through
    convert_hf_to_gguf.py: llama.cpp rotates pairs too, so the file keeps the checkpoint's q / k rows and the reader
    reorders them as the folder's; the MoE keys (experts, shared experts, the first dense layer, the correction bias
    as exp_probs_b) read back to the folder's config, and the tokens are transformers'."""
    pytest.importorskip("gguf")
    from support.llama_cpp import convert, with_tokenizer

    arch, overrides = VARIANTS[name]
    hf = build_hf_model(arch, **{**overrides, "vocab_size": 32000})
    folder = tmp_path / "model"
    hf.save_pretrained(folder)
    with_tokenizer(folder, shared_dir / "tokenizers" / "llama-2-chat")
    llm = nexttoken.load(convert(folder, tmp_path / "model.gguf", "f32"))
    cfg, want_cfg = llm.model.config, load_model(folder).config
    assert (cfg.architecture, cfg.moe, cfg.rope, cfg.attention_bias, cfg.mlp_bias) == (
        want_cfg.architecture, want_cfg.moe, want_cfg.rope, want_cfg.attention_bias, want_cfg.mlp_bias)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = hf.generate(torch.tensor([ids]), **dict(GREEDY, max_new_tokens=10))[0, len(ids):].tolist()
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want
