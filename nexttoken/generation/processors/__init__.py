"""Logits processors: pure transforms (input_ids, scores) -> scores, validated when built, and the chain that
runs them in transformers' order (chain.py). One module per kind: penalties, warpers (sampling truncation),
constraints (forced and suppressed tokens, lengths), llama.cpp's samplers, watermark, guidance, and structured
output's grammar mask."""

from .chain import WARPERS, ChainInputs, LogitsProcessor, ProcessorChain, build_processors
from .penalties import RepetitionPenalty
from .warpers import MinP, Temperature, TopK, TopP

__all__ = [
    "LogitsProcessor", "ProcessorChain", "ChainInputs", "build_processors", "WARPERS",
    "RepetitionPenalty", "Temperature", "TopK", "TopP", "MinP",
]
