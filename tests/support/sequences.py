"""Engine `Sequence`s built directly, for the scheduler's and the block manager's own tests (no model, no engine),
and what the model runner does to them after a step (engine/model_runner.py), so a test can run a plan."""

from __future__ import annotations

from nexttoken.engine.block_manager import BlockManager
from nexttoken.engine.scheduler import StepPlan
from nexttoken.engine.sequence import Sequence
from nexttoken.generation.config import GenerationConfig
from nexttoken.generation.output_pipeline import OutputPipeline
from nexttoken.generation.processors.chain import ProcessorChain


def make_seq(rid: str, prompt: list[int], max_tokens: int = 16, group: str | None = None, priority: int = 0,
             arrival: float = 0.0, lora_key: str | None = None, **options) -> Sequence:
    """A request as the engine's add_request builds it (greedy, no tokenizer: ids only)."""
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, **options)
    return Sequence(request_id=rid, prompt_ids=list(prompt), params=cfg, out=OutputPipeline(cfg, max_tokens),
                    processors=ProcessorChain([]), sampler=None, group=group or rid, priority=priority,
                    arrival_time=arrival, lora_key=lora_key)


def run_plan(plan: StepPlan, blocks: BlockManager, token: int = 7) -> None:
    """The model runner's bookkeeping for a planned step: each prefill chunk's columns cached (and hashed for the
    prefix cache), replayed columns cached, and a new token (`token`) for every row that samples."""
    for chunk in plan.prefill:
        chunk.seq.num_cached = chunk.end
        blocks.cache_chunk(chunk.seq, chunk.start, chunk.end)
        if chunk.samples:
            chunk.seq.out.push(token, 0.0)
    for r in plan.replay:
        r.seq.num_cached = r.end
    for seq in plan.decode:
        seq.num_cached = seq.num_tokens
        seq.out.push(token, 0.0)
