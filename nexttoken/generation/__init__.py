"""Decoding: options, processors, token choice, stopping criteria, the loop that runs them, and the search
strategies (beam, group beam, contrastive) chosen by `modes.generation_mode`.

The names below are imported on first use (PEP 562): `generation.config` (the options, no torch) can be read by
the command line's parser without importing the decoding loop and torch."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import GenerationConfig
    from .decode import GenerationCache, StepHook
    from .generate import GenerateOutput, generate
    from .logprobs import compute_transition_scores
    from .modes import GenerationMode, generation_mode
    from .processors.watermark import WatermarkDetector, WatermarkingConfig

# public name -> the submodule that defines it
_LAZY = {
    "GenerationConfig": ".config", "GenerationCache": ".decode", "StepHook": ".decode", "GenerateOutput": ".generate",
    "generate": ".generate", "compute_transition_scores": ".logprobs", "GenerationMode": ".modes",
    "generation_mode": ".modes", "WatermarkDetector": ".processors.watermark",
    "WatermarkingConfig": ".processors.watermark",
}

__all__ = [
    "GenerateOutput", "GenerationCache", "GenerationConfig", "GenerationMode", "StepHook", "WatermarkDetector",
    "WatermarkingConfig", "compute_transition_scores", "generate", "generation_mode",
]


class _Package(types.ModuleType):
    """This package, where importing the submodule generate.py does not hide the function `generate`: the import
    system sets a package attribute per submodule it loads, which the eager `from .generate import generate`
    used to overwrite; the lazy function is read through __getattr__ instead."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # nexttoken.generation.generate stays the function; the module is sys.modules' entry
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
