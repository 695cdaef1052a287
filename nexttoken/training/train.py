"""Stage 3: train a small Llama (transformers' `LlamaForCausalLM`) on the tokenized stories, on CPU.

Stories are packed into one token stream, `<s> story </s> <s> story </s> ...`; each step reads `batch` random
windows of `seq_len + 1` tokens from it. AdamW with a linear warmup and a cosine decay to 10% of the peak.

The schedule runs over a wall-clock budget (`minutes`), not a step count: the machines are shared, so the
same number of steps can take 15 or 45 minutes. Progress is `elapsed / budget` (or `step / max_steps`,
whichever is further), the cosine follows it, and training stops when it reaches 1.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 320
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class TrainSettings:
    minutes: float = 25.0
    max_steps: int = 100_000
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30  # steps
    weight_decay: float = 0.1
    eval_seconds: float = 90.0  # validation loss every this much training time
    bf16: bool = False  # bfloat16 autocast for the forward pass (weights and optimizer stay float32)
    seed: int = 0


@dataclass
class TrainLog:
    """Per-step training loss and periodic validation loss (nats per token), for the plot and the model card."""

    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0


def llama_config(shape: ModelShape, vocab_size: int, bos: int, eos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    )


def pack(docs: list[list[int]]) -> torch.Tensor:
    """One (N,) int64 stream of all documents back to back (each already starts with BOS)."""
    return torch.tensor([t for d in docs for t in d], dtype=torch.long)


def lr_at(step: int, progress: float, s: TrainSettings) -> float:
    """Linear warmup over the first steps, then cosine from the peak to `min_lr_ratio` as progress goes 0 -> 1."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = min(1.0, progress)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T+1)


@torch.no_grad()
def stream_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, batch: int = 16) -> float:
    """Mean next-token loss (nats) over consecutive windows covering `stream`."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    x = stream[: n * seq_len + 1]
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = torch.stack([x[j * seq_len : (j + 1) * seq_len + 1] for j in range(i, min(n, i + batch))])  # (b, T+1)
        logits = model(rows[:, :-1]).logits  # (b, T, V)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    model.train()
    return total / count


def train(
    model: LlamaForCausalLM, train_stream: torch.Tensor, val_stream: torch.Tensor, s: TrainSettings
) -> TrainLog:
    """Train in place; prints progress (loss, lr, tokens/s, ETA) and returns the loss history."""
    gen = torch.Generator().manual_seed(s.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings; norms are not decayed
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    log = TrainLog()
    model.train()
    budget = s.minutes * 60
    start = last_eval = time.time()
    step, progress = 0, 0.0
    while progress < 1.0:
        lr = lr_at(step, progress, s)
        for group in opt.param_groups:
            group["lr"] = lr
        rows = random_windows(train_stream, s.batch, s.seq_len, gen)  # (B, T+1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.bf16):
            logits = model(rows[:, :-1]).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed = time.time() - start
        progress = max(elapsed / budget, step / s.max_steps)
        log.steps.append(step)
        log.train_loss.append(loss.item())
        val = ""
        if time.time() - last_eval >= s.eval_seconds or progress >= 1.0:
            log.val_steps.append(step)
            log.val_loss.append(stream_loss(model, val_stream, s.seq_len))
            last_eval = time.time()
            val = f"  val {log.val_loss[-1]:.4f}"
        if step % 10 == 0 or val or step <= 3:
            rate = step * s.batch * s.seq_len / elapsed
            print(f"train: step {step}  {progress:6.1%}  loss {loss.item():.4f}{val}  lr {lr:.2e}  "
                  f"{rate:,.0f} tok/s  elapsed {elapsed / 60:.1f} min  left {max(0.0, budget - elapsed) / 60:.1f} min",
                  flush=True)
    log.seconds = time.time() - start
    model.eval()
    return log


def plot_losses(log: TrainLog, file, title: str) -> None:  # noqa: ANN001
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(log.steps, log.train_loss, lw=0.8, alpha=0.6, label="train (batch)")
    ax.plot(log.val_steps, log.val_loss, "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.set_ylim(top=min(max(log.train_loss), log.train_loss[min(20, len(log.train_loss) - 1)] + 0.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)
