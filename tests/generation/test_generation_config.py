"""GenerationConfig: transformers' names and defaults, files, overrides, and errors that name the problem."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest
import torch

from nexttoken import GenerationConfig, GenerationConfigError, PromptTooLongError, generate
from nexttoken.model import load_model
from support.tiny_models import save_variant


def test_defaults_follow_transformers() -> None:
    from transformers import GenerationConfig as HFConfig

    hf_defaults = HFConfig._get_default_generation_params()
    ours = GenerationConfig()
    for name in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty"):
        assert getattr(ours, name) == hf_defaults[name], name


@pytest.mark.parametrize(
    "option,value,fragment",
    [
        ("temperature", -1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, r"top_p: must be a number in \(0.0, 1.0\]"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -3, "top_k: must be an integer >= 0"),
        ("top_k", 2.5, "top_k"),
        ("min_p", 1.2, "min_p"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("max_new_tokens", -1, "max_new_tokens"),
        ("max_new_tokens", True, "max_new_tokens"),
        ("do_sample", "yes", "do_sample: must be true or false"),
        ("eos_token_id", [1, -2], "eos_token_id"),
        ("stop_strings", ["ok", ""], "stop_strings"),
        ("seed", -5, "seed"),
    ],
)
def test_bad_values_are_named(option: str, value, fragment: str) -> None:
    with pytest.raises(GenerationConfigError, match=fragment):
        GenerationConfig().updated(**{option: value})


def test_unknown_option_is_named_with_the_known_ones() -> None:
    with pytest.raises(GenerationConfigError, match=r"unknown generation option 'max_tokens'.*max_new_tokens"):
        GenerationConfig().updated(max_tokens=5)


def test_values_that_are_fine() -> None:
    cfg = GenerationConfig().updated(temperature=0, top_p=1, top_k=0, eos_token_id=[2, 1], stop_strings="\n", seed=3)
    assert cfg.greedy and cfg.eos_ids == [2, 1] and cfg.stop_string_list == ["\n"]


def test_from_file_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [7, 9],
                             "transformers_version": "4.45.0", "output_attentions": False}))
    cfg = GenerationConfig.from_file(f)
    assert (cfg.do_sample, cfg.temperature, cfg.top_p, cfg.eos_ids) == (True, 0.6, 0.9, [7, 9])
    assert cfg.updated(temperature=1.2).temperature == 1.2


def test_file_with_unsupported_option_raises(tmp_path: Path) -> None:
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"output_attentions": True}))
    with pytest.raises(GenerationConfigError, match="output_attentions.*generation_config.json"):
        GenerationConfig.from_file(f)


def test_config_is_immutable() -> None:
    cfg = GenerationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError, match="temperature"):
        cfg.temperature = 2.0  # type: ignore[misc]
    assert cfg.updated(temperature=2.0).temperature == 2.0 and cfg.temperature == 1.0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    save_variant("llama-gqa", d)
    return load_model(d)


def test_prompt_longer_than_context(model) -> None:
    ctx = model.config.max_position_embeddings
    with pytest.raises(PromptTooLongError, match=f"{ctx} tokens.*context is {ctx}"):
        generate(model, torch.ones(1, ctx, dtype=torch.long), max_new_tokens=1)


def test_generation_is_capped_at_the_context(model) -> None:
    ctx = model.config.max_position_embeddings
    out = generate(model, torch.ones(1, ctx - 3, dtype=torch.long), max_new_tokens=50, eos_token_id=None)
    assert out.shape == (1, ctx)


def test_default_is_twenty_new_tokens_and_max_length_counts_the_prompt(model) -> None:
    ids = torch.tensor([[1, 5, 6, 7]])
    assert generate(model, ids, eos_token_id=None).shape == (1, 24)
    assert generate(model, ids, max_length=10, eos_token_id=None).shape == (1, 10)
    with pytest.raises(GenerationConfigError, match="max_length=3 is shorter than the prompt"):
        generate(model, ids, max_length=3)


def test_bad_input_ids(model) -> None:
    with pytest.raises(GenerationConfigError, match="outside the vocabulary"):
        generate(model, torch.tensor([[1, 5000]]))
    with pytest.raises(GenerationConfigError, match="int64"):
        generate(model, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(GenerationConfigError, match="unknown generation option 'temprature'"):
        generate(model, torch.tensor([[1, 2]]), temprature=0.5)


def test_stop_strings_need_a_tokenizer(model) -> None:
    with pytest.raises(GenerationConfigError, match="tokenizer"):
        generate(model, torch.tensor([[1, 2]]), stop_strings=["x"])
