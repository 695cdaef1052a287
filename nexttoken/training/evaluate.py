"""Held-out loss in bits per byte: comparable across models whose tokenizers differ.

Nats per token depend on how many tokens a tokenizer cuts the text into, so the teacher (512 pieces) and the
student (2048 pieces) are scored on the same texts and their summed loss is divided by the texts' UTF-8
bytes. Each story is scored as a whole document: BOS, the story, then the model's own end-of-story token
(BOS for the teacher, which is how llama2.c ends a story; EOS for the student), so both pay for knowing when
the story ends. Scoring uses transformers, an implementation independent of nexttoken's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class HeldOutScore:
    bits_per_byte: float
    nats_per_token: float
    stories: int
    bytes: int
    tokens: int


@torch.no_grad()
def score(model_dir: Path, texts: list[str], end_id: int, max_len: int = 512) -> HeldOutScore:
    """Total next-token loss of `<bos> text <end_id>` for every text, per UTF-8 byte and per token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nats, n_bytes, n_tokens = 0.0, 0, 0
    for text in texts:
        ids = tok(text).input_ids + [end_id]  # starts with BOS (the tokenizer's post-processor adds it)
        assert len(ids) <= max_len, f"a held-out story is {len(ids)} tokens, longer than the context {max_len}"
        x = torch.tensor([ids])  # (1, T)
        logits = model(x[:, :-1]).logits[0]  # (T-1, V)
        nats += torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(ids) - 1
    return HeldOutScore(nats / n_bytes / math.log(2), nats / n_tokens, len(texts), n_bytes, n_tokens)


def held_out_texts(teacher_dir: Path, n: int, seed: int, teacher_context: int = 512) -> list[str]:
    """`n`-ish fresh stories sampled from the teacher at temperature 1 (its own distribution), finished ones only,
    with a seed range the training corpus never uses."""
    from transformers import AutoTokenizer

    from .corpus import sample_batch

    stories = sample_batch(teacher_dir, seed=seed, temperature=1.0, batch=n, max_new_tokens=teacher_context - 1)
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    # Re-encoding text can take a few more tokens than were sampled; keep what fits the teacher's context.
    return [s.text for s in stories if s.finished and len(tok(s.text).input_ids) < teacher_context]
