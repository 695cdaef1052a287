"""Decoding: options, processors, token choice, stopping criteria, the loop that runs them, and the search
strategies (beam, group beam, contrastive) chosen by `modes.generation_mode`."""

from .config import GenerationConfig
from .decode import GenerationCache, StepHook
from .generate import GenerateOutput, generate
from .logprobs import compute_transition_scores
from .modes import GenerationMode, generation_mode
from .processors.watermark import WatermarkDetector, WatermarkingConfig

__all__ = [
    "GenerateOutput", "GenerationCache", "GenerationConfig", "GenerationMode", "StepHook", "WatermarkDetector",
    "WatermarkingConfig", "compute_transition_scores", "generate", "generation_mode",
]
