"""Every supported model family, declared once (base.Family), and the registry the rest of the tree reads: by
transformers architecture, by config.json `model_type`, by llama.cpp's GGUF `general.architecture`.

Adding a family is one module here (its Family) and one entry in FAMILIES below; docs/models.md's table is
rendered from this registry (`docs_table`, checked by tests/model/test_families.py).
"""

from __future__ import annotations

from types import MappingProxyType

from . import (ernie, exaone, falcon_h1, gemma, gemma4, glm, gpt_oss, granite, granite_hybrid, idefics3, lfm2,
               lfm2_moe, lfm2_vl, llama, mamba2, mixtral, nemotron_h, olmo, olmo3, phi3, qwen, qwen3_next, qwen35,
               qwen35_moe, smollm3)
from .base import (CONVOLUTION, FULL, LINEAR_ATTENTION, LOCAL_SLIDING, MIXERS, NOPE, RECURRENT_FEATURES,
                   RECURRENT_LORA, RECURRENT_NATIVE, RECURRENT_REFUSED, SLIDING, STATE_SPACE, Family, GGUFMeta, LayerKind)

# In docs/models.md's order.
FAMILIES: tuple[Family, ...] = (
    llama.LLAMA, llama.MISTRAL, qwen.QWEN2, qwen.QWEN3, olmo.OLMO2, granite.GRANITE, gemma.GEMMA2, gemma.GEMMA3,
    gemma.GEMMA3_VISION, mixtral.MIXTRAL, qwen.QWEN2_MOE, qwen.QWEN3_MOE, qwen.QWEN2_5_VL, qwen.QWEN3_VL, phi3.PHI3,
    smollm3.SMOLLM3, gemma4.GEMMA4, gemma4.GEMMA4_VISION, olmo3.OLMO3, exaone.EXAONE4, glm.GLM4_MOE,
    gpt_oss.GPT_OSS,
    ernie.ERNIE4_5, ernie.ERNIE4_5_MOE,
    lfm2.LFM2, qwen35.QWEN3_5, granite_hybrid.GRANITE_HYBRID, mamba2.MAMBA2, lfm2_moe.LFM2_MOE,
    qwen35_moe.QWEN3_5_MOE, qwen3_next.QWEN3_NEXT, falcon_h1.FALCON_H1, nemotron_h.NEMOTRON_H,
    idefics3.IDEFICS3, idefics3.SMOLVLM, lfm2_vl.LFM2_VL,
)
BY_ARCHITECTURE = MappingProxyType({f.architecture: f for f in FAMILIES})
BY_MODEL_TYPE = MappingProxyType({t: f for f in FAMILIES for t in f.model_types})
BY_GGUF = MappingProxyType({a: f for f in FAMILIES if f.gguf for a in (f.gguf, *f.gguf_also)})

__all__ = ["BY_ARCHITECTURE", "BY_GGUF", "BY_MODEL_TYPE", "CONVOLUTION", "FAMILIES", "FULL", "LINEAR_ATTENTION",
           "LOCAL_SLIDING", "MIXERS", "NOPE", "SLIDING", "STATE_SPACE", "Family", "GGUFMeta", "LayerKind", "docs_table",
           "family", "features_table"]


def family(architecture: str) -> Family:
    """The declaration of a validated ModelConfig's architecture."""
    return BY_ARCHITECTURE[architecture]


def docs_table() -> str:
    """docs/models.md's family table, from the declarations."""
    rows = ["| `architectures` in config.json | examples | what the config switches on |", "|---|---|---|"]
    rows += [f"| `{f.architecture}` | {f.examples} | {f.summary} |" for f in FAMILIES]
    return "\n".join(rows)


def features_table() -> str:
    """docs/models.md's table of the families whose layers keep a recurrent state, and what the engine does on them."""
    rows = ["| `architectures` | state per sequence and layer | engine features | refused or off |", "|---|---|---|---|"]
    for f in [f for f in FAMILIES if f.state]:
        works, refused = list(RECURRENT_FEATURES), list(RECURRENT_REFUSED)
        (works if f.lora else refused).append(RECURRENT_LORA[0 if f.lora else 1])
        (works if f.native_step else refused).append(RECURRENT_NATIVE[0 if f.native_step else 1])
        rows.append(f"| `{f.architecture}` | {f.state} | {', '.join(works)} | {', '.join(refused)} |")
    return "\n".join(rows)
