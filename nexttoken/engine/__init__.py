"""The serving engine: continuous batching over a paged KV pool (block_manager.py; see llm_engine.py)."""

from .llm_engine import EngineConfig, EngineStats, LLMEngine, expand
from .sequence import Sequence, SequenceStatus, TokenEvent
from .speculation import SpeculativeConfig

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "Sequence", "SequenceStatus", "SpeculativeConfig", "TokenEvent", "expand"]
