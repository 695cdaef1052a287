"""A config.json without `architectures` (older exports, some fine-tunes) loads by its `model_type`, as transformers'
AutoModelForCausalLM does: the same table, and the same logits as transformers on the same folder."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import requires_shared
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import nexttoken
from nexttoken.config import ARCHITECTURE_OF_MODEL_TYPE, SUPPORTED_ARCHITECTURES, ModelConfig
from nexttoken.errors import ModelLoadError


def test_model_types_name_the_architectures_transformers_names() -> None:
    assert set(ARCHITECTURE_OF_MODEL_TYPE.values()) == set(SUPPORTED_ARCHITECTURES)
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    for model_type, arch in ARCHITECTURE_OF_MODEL_TYPE.items():  # vision-language types: image-text-to-text's
        assert {**MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}[model_type] == arch


def test_an_unknown_model_type_without_architectures_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' \\(no architectures\\).*LlamaForCausalLM"):
        ModelConfig.from_dict({"model_type": "gpt2", "hidden_size": 8})


@requires_shared
def test_a_folder_without_architectures_loads_by_model_type(shared_dir, tmp_path) -> None:
    src = shared_dir / "models" / "stories260k"
    for name in ("generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).symlink_to(src / name)
    config = json.loads((src / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = nexttoken.load(tmp_path)
    assert llm.model.config.architecture == "LlamaForCausalLM"
    ids = torch.tensor([[1, 300, 42, 7, 99]])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = reference.generate(ids, max_new_tokens=12, do_sample=False)
    got = nexttoken.generate(llm.model, ids, max_new_tokens=12, do_sample=False)
    assert got.tolist() == expected.tolist()
