"""Offline batches on the engine: what `LLM.generate([...])` uses for a list of prompts.

Each prompt becomes its own request (own generator, own stop checks), so a batch returns what each prompt would
alone. Options the engine cannot honour (beam search, contrastive search, guidance, scores output, user hooks)
make `plan_offline` return None, and the caller keeps its padded-batch decode loop for them.
"""

from __future__ import annotations

import torch

from ..errors import GenerationConfigError
from ..generation.config import GenerationConfig
from ..generation.generate import new_token_budget
from ..model import Transformer
from .llm_engine import EngineConfig, LLMEngine
from .params import SamplingParams
from .sequence import Sequence

MAX_SLOTS = 32  # prompts decoded at once; more wait for a free slot


def plan_offline(model: Transformer, prompts: list[list[int]], cfg: GenerationConfig) -> list[SamplingParams] | None:
    """One SamplingParams per prompt, or None when cfg needs the classic decode loop."""
    if cfg.output_scores or cfg.output_logits or getattr(cfg, "top_logprobs", 0) or getattr(cfg, "prompt_logprobs", False):
        return None
    context = model.config.max_position_embeddings
    generation = cfg.updated(stop_strings=None)  # the engine matches stop strings on its streamed text
    try:
        return [
            SamplingParams(
                # One seed for a batch must not make identical prompts sample identically: row i draws from
                # seed + i (as the server's choice i does), so row 0 equals the same prompt generated alone.
                generation=generation if cfg.seed is None else generation.updated(seed=(cfg.seed + i) % 2**63),
                max_tokens=new_token_budget(cfg, torch.ones(1, len(p), dtype=torch.long), context),
                stop=tuple(cfg.stop_string_list),
            )
            for i, p in enumerate(prompts)
        ]
    except GenerationConfigError:
        return None  # e.g. beams or max_new_tokens=0: the decode loop handles (or reports) them


def run_offline(model: Transformer, tokenizer, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:  # noqa: ANN001
    """Run the prompts to completion on a fresh engine sized for them; finished Sequences in prompt order."""
    needed = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    config = EngineConfig(
        max_num_seqs=min(len(prompts), MAX_SLOTS),
        max_model_len=min(needed, model.config.max_position_embeddings),
        prefix_cache_blocks=0,
        max_num_batched_tokens=512,
    )
    # Text continues the prompt's (prompt text + completion text == the whole decode), as in the server.
    return LLMEngine(model, tokenizer, config).generate(prompts, params)
