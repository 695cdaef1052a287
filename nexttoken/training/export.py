"""Stage 4: write the trained model as a Hugging Face folder that transformers and nexttoken both load."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from .bpe import BOS, EOS, SPECIALS, UNK

# A plain-text chat format the model is trained on (some corpus stories are wrapped in it): one "role: text" line
# per message, then "assistant:" for the model to continue. BOS is written as text; the tokenizer maps it to id 1.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Sampling defaults for `nexttoken generate` / `load().generate` without options: a whole story, lightly sharpened.
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0, "max_new_tokens": 256}

WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


def chat_text(request: str, story: str) -> str:
    """The text a chat-formatted training example has after BOS (what CHAT_TEMPLATE renders, plus the answer)."""
    return f"user: {request}\nassistant: {story}"


def tokenizer_config(model_max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for i, t in enumerate(SPECIALS)
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def word_list(texts: list[str], min_count: int = 3) -> list[str]:
    """Lower-case words seen at least `min_count` times: the reference vocabulary tests check generations against."""
    counts = Counter(w.lower() for t in texts for w in WORD.findall(t))
    return sorted(w for w, c in counts.items() if c >= min_count)


def export(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path, words: list[str]) -> None:
    """Write the folder; the model card (README.md) is written after the held-out evaluation."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # a re-run replaces the folder's files rather than mixing two models
        if stale.is_file():
            stale.unlink()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(model.config.max_position_embeddings))
    bos, eos = model.config.bos_token_id, model.config.eos_token_id
    _write_json(out / "generation_config.json",
                {"bos_token_id": bos, "eos_token_id": [eos], "pad_token_id": eos, **GENERATION_DEFAULTS})
    (out / "words.txt").write_text("\n".join(words) + "\n")
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; package data should be world-readable


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
