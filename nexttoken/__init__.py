"""nexttoken: text generation with decoder-only language models, token-identical to transformers."""

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

__version__ = "0.1.0"
