"""Per-step hooks: give the model an extra input at every step, updated from each step's output.

The model here is a Llama-family Transformer plus a per-row "memory" vector added to every input embedding
(a stand-in for a recurrent state, a steering vector or a speaker embedding). The memory is an exponential
average of the embeddings of the tokens generated so far. A StepHook hands it to the model before each
forward pass (`model_inputs`) and updates it once each step's tokens are chosen (`after_step`); the decode
loop itself is not copied or changed. The same hook works per request on the engine that serves `LLM.generate`
(a hook object per request, batch of one). See docs/hooks.md.

Run:  python examples/per_step_hook.py                  (a tiny random model, no download)
      python examples/per_step_hook.py --model DIR      (any supported model folder)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from nexttoken import LLM, GenerationConfig
from nexttoken.config import ModelConfig
from nexttoken.generation import generate
from nexttoken.generation.decode import DecodeState, StepOutput
from nexttoken.model import Transformer, load_model


class MemoryLM(nn.Module):
    """`base` whose input embeddings get `memory` (B, C) added: forward(ids, batch, cache, memory=...)."""

    def __init__(self, base: Transformer) -> None:
        super().__init__()
        self.base, self.config = base, base.config

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def new_cache(self, batch_size: int, max_len: int):  # noqa: ANN201
        return self.base.new_cache(batch_size, max_len)

    def forward(self, input_ids: torch.Tensor, batch: Any, cache: Any, memory: torch.Tensor) -> torch.Tensor:
        # Add the memory to the embedding output of this call only.
        add = self.base.embed.register_forward_hook(lambda mod, args, out: out + memory[:, None, :].to(out.dtype))
        try:
            return self.base(input_ids, batch, cache)
        finally:
            add.remove()


class MemoryHook:
    """The StepHook: memory <- decay * memory + (1 - decay) * embedding(chosen token), once per step."""

    def __init__(self, model: MemoryLM, batch_size: int, decay: float = 0.8, scale: float = 4.0) -> None:
        self.embed, self.decay, self.scale = model.base.embed, decay, scale
        self.memory = torch.zeros(batch_size, model.config.hidden_size, device=model.device)  # (B, C)

    def model_inputs(self, state: DecodeState) -> dict[str, Any]:
        return {"memory": self.memory}

    def after_step(self, state: DecodeState, step: StepOutput) -> None:
        new = self.embed(step.tokens).float() * self.scale  # (B, C)
        self.memory = self.decay * self.memory + (1 - self.decay) * new


def tiny_random_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig.from_dict(dict(
        architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=112,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ))
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: a tiny random model)")
    parser.add_argument("--new-tokens", type=int, default=12)
    args = parser.parse_args()
    base = load_model(args.model) if args.model else tiny_random_model()
    model = MemoryLM(base)
    prompts = torch.tensor([[1, 5, 17, 33], [1, 40, 41, 42]])
    hook = MemoryHook(model, batch_size=2)
    with_memory = generate(model, prompts, hooks=[hook], max_new_tokens=args.new_tokens, eos_token_id=None)
    plain = generate(base, prompts, max_new_tokens=args.new_tokens, eos_token_id=None)
    print("with memory:", with_memory[:, 4:].tolist())
    print("plain      :", plain[:, 4:].tolist())
    print("final memory norm per row:", [round(float(n), 3) for n in hook.memory.norm(dim=-1)])
    # The same requests on the engine behind LLM.generate: each sequence gets a fresh hook (batch of one).
    llm = LLM(model, tokenizer=None, generation_config=GenerationConfig(eos_token_id=None), path=None)  # type: ignore[arg-type]
    rows = llm.generate(prompts.tolist(), hooks=lambda i: [MemoryHook(model, batch_size=1)],
                        max_new_tokens=args.new_tokens)
    print("engine     :", [r.token_ids for r in rows])


if __name__ == "__main__":
    main()
