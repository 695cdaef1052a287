"""nexttoken: text generation with decoder-only language models, token-identical to transformers.

    llm = nexttoken.load("path/to/hf-model")          # or nexttoken.load() for the packaged model
    llm.generate("Once upon a time", max_new_tokens=50).text
    nexttoken.generate(llm.model, input_ids, do_sample=True, top_p=0.9, seed=0)   # transformers-shaped
"""

from .errors import (
    ChatTemplateError,
    GenerationConfigError,
    MissingFileError,
    ModelLoadError,
    NextTokenError,
    PromptTooLongError,
    TokenizerError,
)
from .generation import GenerateOutput, GenerationConfig, generate
from .llm import LLM, Completion, load
from .text.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "ChatTemplateError",
    "Completion",
    "GenerateOutput",
    "GenerationConfig",
    "GenerationConfigError",
    "MissingFileError",
    "ModelLoadError",
    "NextTokenError",
    "PromptTooLongError",
    "Tokenizer",
    "TokenizerError",
    "generate",
    "load",
]
