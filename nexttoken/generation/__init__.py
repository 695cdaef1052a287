"""Decoding: options, processors, token choice, stopping criteria and the loop that runs them."""

from .config import GenerationConfig
from .generate import GenerateOutput, generate

__all__ = ["GenerateOutput", "GenerationConfig", "generate"]
