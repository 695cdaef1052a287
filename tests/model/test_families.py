"""The family registry (nexttoken/families/): each declaration agrees with transformers' and llama.cpp's own tables,
the docs' family table is the registry's, and no other module keeps a list of architectures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nexttoken.config import ARCHITECTURE_OF_MODEL_TYPE, SUPPORTED_ARCHITECTURES
from nexttoken.families import BY_ARCHITECTURE, BY_GGUF, FAMILIES, docs_table
from support.tiny_models import VARIANTS

ROOT = Path(__file__).resolve().parents[2]


def test_model_types_are_transformers_causal_lm_mapping() -> None:
    """Each declared model_type -> architecture is what transformers' AutoModelForCausalLM maps it to (a
    vision-language family's: AutoModelForImageTextToText's, where the causal-LM mapping has no such type)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    for family in FAMILIES:
        mapping = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if family.vision is not None:
            mapping = {**MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, **mapping}
        for model_type in family.model_types:
            assert mapping[model_type] == family.architecture, model_type


def test_gguf_names_are_llama_cpps() -> None:
    gguf = pytest.importorskip("gguf")
    assert set(BY_GGUF) <= set(gguf.MODEL_ARCH_NAMES.values())


def test_the_public_views_are_the_registry() -> None:
    assert SUPPORTED_ARCHITECTURES == tuple(f.architecture for f in FAMILIES) == tuple(BY_ARCHITECTURE)
    assert dict(ARCHITECTURE_OF_MODEL_TYPE) == {t: f.architecture for f in FAMILIES for t in f.model_types}


def test_every_family_has_a_tiny_variant() -> None:
    """Every declared family runs in the parity, fused, engine and tensor-parallel suites (tests/support/tiny_models.py
    names its models by model_type, Gemma 3's without the `_text`)."""
    # (a vision-language family's own tiny checkpoints are built in tests/support/: vision.py, qwen_vl.py)
    declared = {t.removesuffix("_text") for f in FAMILIES if f.vision is None for t in f.model_types}
    assert declared <= {arch for arch, _ in VARIANTS.values()}


def test_docs_family_table_is_the_registrys() -> None:
    docs = (ROOT / "docs" / "models.md").read_text()
    assert docs_table() in docs, "docs/models.md's family table differs from nexttoken.families.docs_table()"


# Shells on top that name transformers' classes for their own reasons (training a Llama, benchmark shapes).
_SHELLS = ("training", "bench")


def test_no_module_outside_the_declarations_names_an_architecture() -> None:
    """The declarations are the one list: no other library module spells a `...ForCausalLM` name or keeps a
    table keyed by llama.cpp architecture names."""
    pattern = re.compile(r"[\"'][A-Za-z0-9]+ForCausalLM[\"']")
    offenders = []
    for path in (ROOT / "nexttoken").rglob("*.py"):
        rel = path.relative_to(ROOT / "nexttoken")
        if rel.parts[0] in ("families", *_SHELLS):
            continue
        if pattern.search(path.read_text()):
            offenders.append(str(rel))
    assert not offenders
