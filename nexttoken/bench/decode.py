"""`nexttoken bench decode --families`: decode speed of random-weight family shapes (Qwen3-0.6B, Gemma-3-270M,
LFM2-350M's hybrid of short convolutions and attention; bf16 weights, float32 activations) at batch 1 (or
`--batch 1,8`), the fused native step against the PyTorch modules (`fused.disabled()`), interleaved round by round
so that a busy machine's noise falls on both alike.

    OMP_NUM_THREADS=1 nexttoken bench decode --families qwen3-0.6b,gemma3-270m --rounds 3 --clock cpu
    nexttoken bench decode --families lfm2-350m --batch 1,8 --rounds 1

Decode time is a run of N+1 new tokens minus a run of 1 (the prefill alone), so the prompt's cost cancels.
`--clock cpu` times by this process's CPU time (use it at 1 thread on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .output import BenchError, progress_printer, write_report

if TYPE_CHECKING:
    import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # runner.py's clocks (it imports torch)

GEMMA3_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3
LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)  # LiquidAI/LFM2-350M's full_attn_idxs: the other 10 layers are convolutions
FAMILY_SHAPES = {  # the Hugging Face configs' shapes; the micro ones for smoke tests
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "gemma3-270m": dict(architectures=["Gemma3ForCausalLM"], hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        vocab_size=262144, tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=10000.0,
                        sliding_window=512, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                        rms_norm_eps=1e-6, max_position_embeddings=32768, layer_types=GEMMA3_LAYERS),
    "lfm2-350m": dict(architectures=["Lfm2ForCausalLM"], hidden_size=1024, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, vocab_size=65536, block_ff_dim=6656,
                      block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
                      conv_L_cache=3, conv_bias=False, norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=True,
                      max_position_embeddings=128000,
                      layer_types=["full_attention" if i in LFM2_ATTENTION else "conv" for i in range(16)]),
    "lfm2-micro": dict(architectures=["Lfm2ForCausalLM"], hidden_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256, block_ff_dim=192,
                       block_multiple_of=16, conv_L_cache=3, norm_eps=1e-5, rope_theta=1e6,
                       tie_word_embeddings=True, max_position_embeddings=256,
                       layer_types=["conv", "full_attention", "conv"]),
    "qwen3-micro": dict(architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        vocab_size=256, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                        max_position_embeddings=256),
    "gemma3-micro": dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         vocab_size=256, tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=10000.0,
                         sliding_window=8, query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh",
                         rms_norm_eps=1e-6, max_position_embeddings=256,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
PATHS = ("fused", "modules")
DEFAULT_FAMILIES = "qwen3-0.6b,gemma3-270m"


def random_model(name: str) -> torch.nn.Module:
    """The shape with N(0, 0.02) weights, norms neutral, embeddings tied, weights bf16 (float32 activations)."""
    import torch  # here, not at the top: `nexttoken --help` must not import torch

    from ..config import ModelConfig
    from ..model.llama import Transformer
    from ..model.quant import quantize_bf16

    cfg = ModelConfig.from_dict(FAMILY_SHAPES[name])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")  # _apply recomputes the RoPE frequencies on the CPU
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.fill_(0.0 if cfg.norm_plus_one else 1.0) if "norm" in pname else p.normal_(0, 0.02)
    model.lm_head.weight = model.embed.weight
    return quantize_bf16(model).eval()


def decode_rate(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, path: str, clock: str) -> float:
    """Decode tokens per second (all rows' tokens) of one greedy run of `prompt` (B, P) on `path` ("fused" or
    "modules")."""
    from contextlib import nullcontext

    import torch  # here, not at the top: `nexttoken --help` must not import torch

    from ..generation import generate
    from ..model import fused

    now = CLOCKS[clock]
    greedy = dict(do_sample=False, eos_token_id=None)
    with fused.disabled() if path == "modules" else nullcontext(), torch.no_grad():
        generate(model, prompt, max_new_tokens=2, **greedy)  # warm-up
        t0 = now()
        generate(model, prompt, max_new_tokens=1, **greedy)  # the prefill alone
        t1 = now()
        generate(model, prompt, max_new_tokens=new_tokens + 1, **greedy)
        t2 = now()
    return prompt.shape[0] * new_tokens / max((t2 - t1) - (t1 - t0), 1e-9)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode speed of family shapes: the fused native step vs the PyTorch modules")
    p.add_argument("--families", nargs="?", const=DEFAULT_FAMILIES, default=DEFAULT_FAMILIES,
                   help=f"comma-separated family shapes (random bf16 weights), default {DEFAULT_FAMILIES}: "
                        f"{', '.join(FAMILY_SHAPES)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (rows decoded together), default 1")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: this process's CPU time (at 1 thread on a shared machine); wall: the clock")
    p.add_argument("--out", default="bench-decode", help="output prefix: writes OUT.json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `nexttoken --help` must not import torch
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if not families or any(f not in FAMILY_SHAPES for f in families):
        raise BenchError(f"--families {args.families!r}: use a comma-separated list of {', '.join(FAMILY_SHAPES)}")
    if min(args.rounds, args.prompt_len, args.new_tokens) < 1:
        raise BenchError("--rounds, --prompt-len and --new-tokens must be >= 1")
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise BenchError(f"--batch {args.batch!r}: use comma-separated sizes >= 1, like 1,8")
    progress = progress_printer()
    torch.set_num_threads(args.threads)
    rows = []
    for family in families:
        progress(f"{family}: random bf16 weights ...")
        model = random_model(family)
        for batch in batches:
            prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len),
                                   generator=torch.Generator().manual_seed(1))  # (batch, prompt_len)
            rates: dict[str, list[float]] = {path: [] for path in PATHS}
            for _ in range(args.rounds):
                for path in PATHS:
                    rates[path].append(decode_rate(model, prompt, args.new_tokens, path, args.clock))
                    progress(f"{family} bf16 batch {batch} {path}: decode {rates[path][-1]:.1f} tokens per "
                             f"{args.clock} second")
            medians = {path: statistics.median(v) for path, v in rates.items()}
            rows.append({"family": family, "batch": batch, "fused_tok_s": medians["fused"],
                         "modules_tok_s": medians["modules"], "fused_vs_modules": medians["fused"] / medians["modules"],
                         "rounds": rates})
    for r in rows:
        print(f"{r['family']} bf16, batch {r['batch']}: fused {r['fused_tok_s']:.1f} tok/s, modules {r['modules_tok_s']:.1f} "
              f"tok/s = {r['fused_vs_modules']:.2f}x ({args.clock} clock, {args.threads} threads, median of "
              f"{args.rounds})")
    report = {"threads": args.threads, "clock": args.clock, "prompt_len": args.prompt_len, "batches": batches,
              "new_tokens": args.new_tokens, "rows": rows}
    progress(f"wrote {write_report(report, Path(args.out).with_suffix('.json'))}")
    return 0
