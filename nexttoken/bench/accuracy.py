"""How far weight-only quantization (int8, int4) moves the model: next-token top-1 agreement and KL vs float32."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import ForwardBatch, Transformer, load_model
from ..model.quant.quantize import apply_quantization
from ..text.tokenizer import Tokenizer

# Human-written text in the TinyStories register (what stories260k was trained on).
TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she saw a "
    "big red ball in the park. She ran to the ball and kicked it very high. Her friend Tom came to play with her.",
    "Tom had a small dog called Max. Max liked to run and bark at the birds. One morning, Max found a stick in the "
    "garden and brought it to Tom. Tom threw the stick and Max ran after it. They played all day and were very happy.",
    "The sun was shining and the sky was blue. A little bird sat on a tree and sang a song. A cat looked up at the "
    "bird and wanted to be friends. The bird was scared at first, but the cat was kind, so they became friends.",
    "Mom said, \"It is time for bed, Ben.\" Ben did not want to sleep. He wanted to play with his toy car. Mom gave "
    "him a hug and read him a story about a brave bear. Soon Ben closed his eyes and fell asleep.",
    "Sara and her brother went to the beach with their dad. They built a big sand castle with a tall tower. A wave "
    "came and took the tower away. Sara was sad, but her brother said, \"Let's build it again!\" They laughed and "
    "made an even bigger castle.",
    "There was a little frog who lived in a pond. Every day he jumped from leaf to leaf. One day he saw a shiny "
    "stone at the bottom of the water. He dived down and picked it up. He gave the stone to his mom, and she smiled.",
    "Anna wanted to bake a cake for her grandma. She took flour, eggs and milk from the kitchen. Her dad helped her "
    "mix everything in a bowl. When the cake was ready, it smelled very good. Grandma ate a big piece and said thank you.",
    "A boy named Jack found a lost kitten in the rain. The kitten was wet and cold. Jack took it home and gave it "
    "some warm milk. The next day, a girl came to look for her kitten. Jack gave it back, and the girl hugged him.",
]


@torch.inference_mode()
def all_logits(model: Transformer, ids: list[int], chunk: int = 8) -> torch.Tensor:
    """(T, V) float32 next-token logits at every position of one sequence.

    Fed `chunk` tokens per forward through the KV cache, so every product takes the decode path (the native
    kernel, which sees at most 16 rows) rather than the prefill GEMM: the report measures what decoding runs.
    """
    T = len(ids)
    x = torch.tensor([ids])  # (1, T)
    cache = model.new_cache(1, T)
    valid = torch.ones(1, T, dtype=torch.bool)
    out = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        cols = torch.arange(start, end)[None]  # (1, t)
        batch = ForwardBatch.build(cols, cols, valid, end, model.config.sliding_window, write_start=start,
                                   last_only=False)
        out.append(model(x[:, start:end], batch, cache)[0].float())
    return torch.cat(out)


def int8_accuracy(path: str | Path, texts: list[str] | None = None) -> dict:
    """Compare int8 weight-only against float32 on every next-token prediction of the texts."""
    return quantized_accuracy(path, "int8", texts)


def quantized_accuracy(path: str | Path, quantize: str, texts: list[str] | None = None) -> dict:
    """Compare `quantize` ("int8" or "int4") weight-only against float32 on every next-token prediction."""
    path = Path(path)
    tokenizer = Tokenizer.maybe_from_dir(path)
    if tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json: the accuracy report needs real text")
    ref = load_model(path, dtype="float32")
    quant = apply_quantization(load_model(path, dtype="float32"), quantize)
    agree = total = 0
    kl_sum = 0.0
    for text in texts or TEXTS:
        ids = tokenizer.encode(text)
        p = all_logits(ref, ids).log_softmax(-1)  # (T, V)
        q = all_logits(quant, ids).log_softmax(-1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        total += len(ids)
        kl_sum += float((p.exp() * (p - q)).sum(-1).sum())
    return {"model": str(path), "quantize": quantize, "tokens": total, "top1_agreement": agree / total, "kl_mean": kl_sum / total}


@torch.inference_mode()
def gguf_accuracy(path: str | Path, texts: list[str] | None = None, chunk: int = 16,
                  activations: str = "int8") -> dict:
    """A GGUF file's packed run (its blocks multiplied natively, 8-bit activations: the default) against its own
    dequantized float32 run (`dequantize=True`) on every next-token prediction of the texts: top-1 agreement and KL.
    The packed logits come from decode-sized steps of `chunk` tokens (the native kernels' path); the float ones
    from one prefill."""
    from ..model.weights.gguf import load_gguf_model
    from ..text.gguf_vocab import tokenizer_from_gguf

    packed, g = load_gguf_model(path, activations=activations)
    ref, _ = load_gguf_model(path, dequantize=True)
    tokenizer = tokenizer_from_gguf(g.metadata, str(path))
    agree = total = 0
    kl_sum = 0.0
    for text in texts or TEXTS:
        ids = tokenizer.encode(text)
        p = all_logits(ref, ids, chunk=len(ids)).log_softmax(-1)  # (T, V)
        q = all_logits(packed, ids, chunk=chunk).log_softmax(-1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        total += len(ids)
        kl_sum += float((p.exp() * (p - q)).sum(-1).sum())
    from ..model.quant.ggml import GGML_TYPES, GGUFLinear

    names = {v: k for k, v in GGML_TYPES.items()}
    kinds = sorted({names[t] for m in packed.modules() if isinstance(m, GGUFLinear) for t in m.types})
    return {"model": str(path), "blocks": "+".join(kinds), "activations": activations, "tokens": total, "top1_agreement": agree / total,
            "kl_mean": kl_sum / total}


@torch.inference_mode()
def gguf_agreement(path: str | Path, activations: str = "float32", prefill: str = "float32",
                   texts: list[str] | None = None, chunk: int = 16) -> dict:
    """How a GGUF file's packed run under one arithmetic agrees with the file's own weights computed in float32
    (dequantize=True, float32 prefill): top-1 agreement over every next-token prediction of the texts, and the
    largest and mean error of the actual next token's log-prob; measured in decode-sized steps of `chunk` tokens
    (the native kernels) and in one prefill per text (the prefill products), both counted."""
    from ..model import arithmetic
    from ..model.weights.gguf import load_gguf_model
    from ..text.gguf_vocab import tokenizer_from_gguf

    packed, g = load_gguf_model(path, activations=activations)
    packed.arithmetic = packed.arithmetic.replace(prefill=prefill)
    ref, _ = load_gguf_model(path, dequantize=True)
    ref.arithmetic = ref.arithmetic.replace(prefill="float32")
    tokenizer = tokenizer_from_gguf(g.metadata, str(path))
    agree = total = 0
    errors: list[torch.Tensor] = []
    with arithmetic.changed():  # no enclosing change applies: each model's own policy does
        for text in texts or TEXTS:
            ids = tokenizer.encode(text)
            nxt = torch.tensor(ids[1:])[:, None]
            p = all_logits(ref, ids, chunk=len(ids)).log_softmax(-1)  # (T, V)
            for step in (chunk, len(ids)):
                q = all_logits(packed, ids, chunk=step).log_softmax(-1)
                agree += int((p.argmax(-1) == q.argmax(-1)).sum())
                total += len(ids)
                errors.append((p[:-1].gather(1, nxt) - q[:-1].gather(1, nxt)).abs().reshape(-1))
    err = torch.cat(errors)
    return {"activations": activations, "prefill": prefill, "positions": total, "top1_agreement": agree / total,
            "max_logprob_error": float(err.max()), "mean_logprob_error": float(err.mean())}
