"""Every supported model family, declared once (base.Family), and the registry the rest of the tree reads: by
transformers architecture, by config.json `model_type`, by llama.cpp's GGUF `general.architecture`.

Adding a family is one module here (its Family) and one entry in FAMILIES below; docs/models.md's table is
rendered from this registry (`docs_table`, checked by tests/model/test_families.py).
"""

from __future__ import annotations

from types import MappingProxyType

from . import (exaone, gemma, gemma4, glm, gpt_oss, granite, granite_hybrid, lfm2, llama, mamba2, mixtral, olmo, olmo3,
               phi3, qwen, qwen35, smollm3)
from . import ernie
from .base import (CONVOLUTION, FULL, LINEAR_ATTENTION, LOCAL_SLIDING, MIXERS, NOPE, RECURRENT_FEATURES,
                   RECURRENT_REFUSED, SLIDING, STATE_SPACE, Family, GGUFMeta, LayerKind)

# In docs/models.md's order.
FAMILIES: tuple[Family, ...] = (
    llama.LLAMA, llama.MISTRAL, qwen.QWEN2, qwen.QWEN3, olmo.OLMO2, granite.GRANITE, gemma.GEMMA2, gemma.GEMMA3,
    mixtral.MIXTRAL, qwen.QWEN2_MOE, qwen.QWEN3_MOE, phi3.PHI3,
    smollm3.SMOLLM3, gemma4.GEMMA4, olmo3.OLMO3, exaone.EXAONE4, glm.GLM4_MOE,
    gpt_oss.GPT_OSS,
    ernie.ERNIE4_5, ernie.ERNIE4_5_MOE,
    lfm2.LFM2, qwen35.QWEN3_5, granite_hybrid.GRANITE_HYBRID, mamba2.MAMBA2,
)
BY_ARCHITECTURE = MappingProxyType({f.architecture: f for f in FAMILIES})
BY_MODEL_TYPE = MappingProxyType({t: f for f in FAMILIES for t in f.model_types})
BY_GGUF = MappingProxyType({f.gguf: f for f in FAMILIES if f.gguf})

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
    rows += [f"| `{f.architecture}` | {f.state} | {', '.join(RECURRENT_FEATURES)} | {', '.join(RECURRENT_REFUSED)} |"
             for f in FAMILIES if f.state]
    return "\n".join(rows)
