"""A model folder with a real tokenizer whose greedy output is a chosen token sequence, over and over.

Every layer's output projection (attention `o_proj`, MLP `down_proj`) is zero, so the last hidden state is the
embedding of the last token; embeddings of the chain's tokens are one-hot (token i of the chain -> unit vector
i), every other token shares unit vector n, and the LM head maps unit vector i to the next token of the chain
(and n to the first) with a large logit. So whatever the prompt (a chat template's too), greedy decoding walks the
chain from its start unless the prompt ends inside it: c0, c1, ..., c(n-1), c0, ... A chain cut
from a non-ASCII text makes the output non-ASCII, with characters split across byte tokens, for any entry point
(library, CLI, server), and transformers loads the same folder for reference runs. Nothing is trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from nexttoken.text.tokenizer import Tokenizer

HIDDEN = 32
LOGIT = 10.0  # (before the final norm's sqrt(HIDDEN) gain): the chain's next token wins by ~56 nats


def chain_ids(tokenizer_dir: Path, text: str) -> list[int]:
    ids = Tokenizer.from_dir(tokenizer_dir).encode(text, add_special_tokens=False)
    assert len(set(ids)) == len(ids) < HIDDEN, f"{text!r}: the chain's ids must be distinct ({ids})"
    return ids


def build_chain_model(folder: Path, tokenizer_dir: Path, chain: list[int], eos: int) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer files into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    vocab = Tokenizer.from_dir(folder).vocab_size
    heads, inter = 4, 32
    g = torch.Generator().manual_seed(0)
    n = len(chain)
    embed = torch.zeros(vocab, HIDDEN)  # (V, C)
    embed[:, n] = 1.0  # every token outside the chain ...
    head = torch.zeros(vocab, HIDDEN)  # (V, C)
    head[chain[0], n] = LOGIT  # ... is followed by the chain's first token
    for i, token in enumerate(chain):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[chain[(i + 1) % len(chain)], i] = LOGIT
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": torch.ones(HIDDEN),
        p + "input_layernorm.weight": torch.ones(HIDDEN),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        p + "self_attn.q_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1,
        p + "self_attn.k_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1,
        p + "self_attn.v_proj.weight": torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1,
        p + "self_attn.o_proj.weight": torch.zeros(HIDDEN, HIDDEN),
        p + "mlp.gate_proj.weight": torch.randn(inter, HIDDEN, generator=g) * 0.1,
        p + "mlp.up_proj.weight": torch.randn(inter, HIDDEN, generator=g) * 0.1,
        p + "mlp.down_proj.weight": torch.zeros(HIDDEN, inter),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=HIDDEN,
        intermediate_size=inter, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, hidden_act="silu", torch_dtype="float32",
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder
