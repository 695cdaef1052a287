"""Decode speed of random-weight Qwen3-0.6B- and Gemma-3-270M-shaped models (quantize="bf16"), the fused native
step against the PyTorch modules (fused.disabled()), interleaved round by round.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/family_decode_speed.py qwen3-0.6b --rounds 3 --clock cpu

--clock cpu times by this process's CPU time (1 thread), for a machine shared with other work; wall by the clock.
"""

from __future__ import annotations

import argparse
import time

import torch

from nexttoken.config import ModelConfig
from nexttoken.generation import generate
from nexttoken.model import fused
from nexttoken.model.llama import Transformer
from nexttoken.model.quant import quantize_bf16

GEMMA3_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3
SHAPES = {  # the Hugging Face configs' shapes
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "gemma3-270m": dict(architectures=["Gemma3ForCausalLM"], hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        vocab_size=262144, tie_word_embeddings=True, rope_theta=1e6, rope_local_base_freq=10000.0,
                        sliding_window=512, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
                        rms_norm_eps=1e-6, max_position_embeddings=32768, layer_types=GEMMA3_LAYERS),
}


def random_model(name: str) -> Transformer:
    """The shape with N(0, 0.02) weights, norms neutral, embeddings tied, weights bf16 (float32 activations)."""
    cfg = ModelConfig.from_dict(SHAPES[name])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu")  # _apply recomputes the RoPE frequencies on the CPU
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.fill_(0.0 if cfg.norm_plus_one else 1.0) if "norm" in pname else p.normal_(0, 0.02)
    model.lm_head.weight = model.embed.weight
    return quantize_bf16(model).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = random_model(args.shape)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    greedy = dict(do_sample=False, eos_token_id=None)
    for _ in range(args.rounds):
        for label in ("fused", "modules"):
            with fused.disabled() if label == "modules" else torch.no_grad():
                generate(model, prompt, max_new_tokens=2, **greedy)  # warm-up
                t0 = clock()
                generate(model, prompt, max_new_tokens=1, **greedy)  # the prefill alone
                t1 = clock()
                generate(model, prompt, max_new_tokens=args.new_tokens + 1, **greedy)
                t2 = clock()
            per_s = args.new_tokens / ((t2 - t1) - (t1 - t0))
            print(f"{args.shape} bf16 {label}: decode {per_s:.1f} tokens per {args.clock} second", flush=True)


if __name__ == "__main__":
    main()
