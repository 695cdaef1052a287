"""nexttoken: text generation with decoder-only language models, token-identical to transformers.

    llm = nexttoken.load("path/to/hf-model")          # or nexttoken.load() for the packaged model
    llm.generate("Once upon a time", max_new_tokens=50).text
    nexttoken.generate(llm.model, input_ids, do_sample=True, top_p=0.9, seed=0)   # transformers-shaped

The names below are imported on first use (PEP 562), so that `import nexttoken` and the command line's `--help`
do not pay for torch; `from nexttoken import load` imports what `load` needs, as before.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from .collector import paused
from .errors import (
    ChatTemplateError,
    GenerationConfigError,
    MissingFileError,
    ModelLoadError,
    NextTokenError,
    PromptTooLongError,
    TokenizerError,
)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and IDEs
    from .generation import GenerateOutput, GenerationConfig, generate
    from .llm import LLM, Completion, load
    from .loadspec import LoadSpec
    from .text.tokenizer import Tokenizer

__version__ = "0.1.0"

# public name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "GenerateOutput": ".generation", "GenerationConfig": ".generation.config", "generate": ".generation",
    "LLM": ".llm", "Completion": ".llm", "load": ".llm", "LoadSpec": ".loadspec", "Tokenizer": ".text.tokenizer",
}

__all__ = [
    "LLM",
    "ChatTemplateError",
    "Completion",
    "GenerateOutput",
    "GenerationConfig",
    "GenerationConfigError",
    "LoadSpec",
    "MissingFileError",
    "ModelLoadError",
    "NextTokenError",
    "PromptTooLongError",
    "Tokenizer",
    "TokenizerError",
    "generate",
    "load",
]


def __getattr__(name: str) -> Any:
    """A public name, or a subpackage (`nexttoken.engine`), imported on first use."""
    # The imports run with the garbage collector paused (collector.py): torch's objects make each full collection
    # ~60-90 ms, and importing nexttoken's loading modules would trigger one or two that find no garbage.
    with paused():
        if name in _LAZY:
            return getattr(importlib.import_module(_LAZY[name], __name__), name)
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
