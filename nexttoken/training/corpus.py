"""Stage 1: a corpus of stories sampled from the teacher model with nexttoken's own `generate`.

Each batch uses its own seed and one temperature from a cycle, so the corpus is varied and reproducible.
Stories go to a JSONL file (one {"text", "finished", "temperature", "seed"} per line); batches run in
worker processes of one thread each, because tiny matmuls gain nothing from a second thread on a
shared machine and lose a lot to thread synchronisation.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Mostly the teacher's own distribution (T=1), with some sharper and flatter batches for variety.
TEMPERATURES = (1.0, 0.8, 1.0, 0.9, 1.0, 1.1)


@dataclass(frozen=True)
class Story:
    text: str
    finished: bool  # the teacher ended it (emitted BOS) rather than running out of context
    temperature: float
    seed: int


def sample_batch(teacher_dir: Path, seed: int, temperature: float, batch: int, max_new_tokens: int) -> list[Story]:
    """`batch` stories from an empty prompt (just BOS); the teacher ends a story by emitting BOS (id 1).

    Uses the low-level `generate` on one padded batch: its rows share one seeded generator, so they differ.
    (`LLM.generate` on a list runs each row as if alone, so identical prompts with one seed give identical rows.)
    """
    from ..generation import generate  # imported here so worker processes import torch after their thread setting
    from ..llm import load

    llm = load(teacher_dir)
    bos = llm.tokenizer.bos_token_id
    prompt = torch.full((batch, 1), bos, dtype=torch.long)  # (B, 1)
    out = generate(
        llm.model, prompt, do_sample=True, temperature=temperature, top_p=1.0, top_k=0, seed=seed,
        max_new_tokens=max_new_tokens, return_dict_in_generate=True,
    )
    stories = []
    for row, finished in zip(out.sequences[:, 1:].tolist(), out.finished.tolist()):  # (B, new)
        ends = [i for i, t in enumerate(row) if t in llm.generation_config.eos_ids]
        text = llm.tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True).strip()
        if text:
            stories.append(Story(text, bool(finished), temperature, seed))
    return stories


def _worker(job: tuple[str, int, float, int, int]) -> list[Story]:
    torch.set_num_threads(1)
    teacher, seed, temperature, batch, max_new = job
    return sample_batch(Path(teacher), seed, temperature, batch, max_new)


def write_corpus(
    teacher_dir: Path, out_file: Path, target_chars: int, batch: int = 384, max_new_tokens: int = 511,
    workers: int = 2, first_seed: int = 1000,
) -> list[Story]:
    """Sample batches until the corpus holds `target_chars` characters; write and return the stories."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    stories: list[Story] = []
    chars, start = 0, time.time()
    # A story is ~650 characters; ask for enough batches up front, workers stream results back in order.
    # Big batches: the teacher is so small that per-step overhead, not arithmetic, sets the pace.
    n_batches = max(1, -(-target_chars // (batch * 600)))
    jobs = [(str(teacher_dir), first_seed + i, TEMPERATURES[i % len(TEMPERATURES)], batch, max_new_tokens)
            for i in range(n_batches)]
    with out_file.open("w") as f, mp.get_context("spawn").Pool(workers) as pool:
        for i, got in enumerate(pool.imap(_worker, jobs)):
            for s in got:
                f.write(json.dumps(s.__dict__, ensure_ascii=False) + "\n")
            stories.extend(got)
            chars += sum(len(s.text) for s in got)
            rate = chars / (time.time() - start)
            print(f"corpus: batch {i + 1}/{n_batches}  {len(stories)} stories  {chars / 1e6:.2f}M chars  "
                  f"{rate:,.0f} chars/s", flush=True)
            if chars >= target_chars:
                pool.terminate()
                break
    return stories


def read_corpus(file: Path) -> list[Story]:
    with file.open() as f:
        return [Story(**json.loads(line)) for line in f if line.strip()]
