"""Stop strings against transformers' `generate(stop_strings=..., tokenizer=...)` on real tokenizers, and the
cases where nexttoken's semantics deliberately differ (docs/decoding.md, "Stopping").

Where they agree (most cases): a stop string that a token completes, whether it spans several tokens, byte
pieces of one character, or ends inside the completing token; both stop after that token. Where they differ:
transformers also matches a stop string that begins in the prompt, nexttoken (OpenAI's and vLLM's semantics) looks
in the generated text only; and a stop string that ends in a SentencePiece byte-fallback run is seen when the
run ends (the tokenizer decodes a run as a unit, so its text is final only then), one token after transformers.
The chain models of chain_model.py make the output known in advance.
"""

from __future__ import annotations

import pytest
import torch

import nexttoken
from support.chain_model import build_chain_model, chain_ids

CHAINS = {
    "llama-2-chat": (" 🦙 Grüße 日本", "Hello 日本", 2),
    "llama-3.2-instruct": (" 🦙 Grüße 𝄞 日本", " 日本", 128009),
    "qwen2.5-instruct": (" 🦙 Grüße 𝄞 日本", " 日本", 151645),
}
# (family, stop string): each ends exactly where a token of that family's chain ends.
AGREE = [
    ("llama-2-chat", "Grü"),  # spans "▁Gr" + "ü"
    ("llama-2-chat", "🦙 Gr"),  # four byte-fallback tokens, then "▁Gr"
    ("llama-2-chat", "ß"),  # ends inside the completing token "ße"
    ("llama-2-chat", "ße 日"),
    ("llama-3.2-instruct", "🦙"),  # byte-level pieces of one character
    ("llama-3.2-instruct", "Grüße"),
    ("llama-3.2-instruct", "Gr"),  # inside the token " Grü"
    ("llama-3.2-instruct", "𝄞 日本"),
    ("qwen2.5-instruct", "Grüße 𝄞"),
    ("qwen2.5-instruct", "ße 𝄞 日"),  # ends inside " 日"
]
NEW = 24


@pytest.fixture(scope="module")
def models(shared_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = {}
    for family, (text, prompt, eos) in CHAINS.items():
        tokenizers = shared_dir / "tokenizers" / family
        folder = build_chain_model(tmp_path_factory.mktemp(family), tokenizers, chain_ids(tokenizers, text), eos)
        # The tokenizers library on tokenizer.json is the reference (transformers 5's LlamaTokenizer rebuilds
        # the Llama 2 pipeline and gets some ids wrong, see shared/README.md).
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        hf = AutoModelForCausalLM.from_pretrained(folder).eval()
        out[family] = (nexttoken.load(folder), hf, hf_tok, prompt)
    return out


def _transformers(hf, tok, ids: list[int], stop: str) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, stop_strings=[stop],
                          tokenizer=tok, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family, stop", AGREE, ids=[f"{f}:{s}" for f, s in AGREE])
def test_stop_strings_equal_transformers_where_the_semantics_agree(models, family, stop) -> None:
    llm, hf, tok, prompt = models[family]
    ours = llm.generate(prompt, max_new_tokens=NEW, stop_strings=[stop])
    theirs = _transformers(hf, tok, ours.prompt_token_ids, stop)
    assert ours.token_ids == theirs  # the same tokens, up to and including the one that completes the stop string
    assert ours.finish_reason == "stop" and ours.stop_reason == stop
    full = llm.generate(prompt, max_new_tokens=NEW).text
    assert ours.text == full[: full.index(stop)]  # the text is cut before the stop string
    assert "".join(llm.stream(prompt, max_new_tokens=NEW, stop_strings=[stop])) == ours.text


def test_a_stop_string_that_begins_in_the_prompt_stops_transformers_only(models) -> None:
    """The prompt " 日本" and the first generated token " 🦙" read " 日本 🦙": transformers' criterion scans the
    sequence's tail, prompt included, and stops there; nexttoken looks at the generated text alone and stops only
    at the stop string's first occurrence inside it (after one turn of the chain)."""
    llm, hf, tok, prompt = models["qwen2.5-instruct"]
    ours = llm.generate(prompt, max_new_tokens=NEW, stop_strings=["日本 🦙"])
    theirs = _transformers(hf, tok, ours.prompt_token_ids, "日本 🦙")
    assert len(theirs) == 3  # " 🦙" is three byte-level pieces
    assert len(ours.token_ids) == 10 + 3 and ours.token_ids[:3] == theirs  # one whole turn, then " 🦙" again
    full = llm.generate(prompt, max_new_tokens=NEW).text
    assert ours.text == full[: full.index("日本 🦙")] and ours.finish_reason == "stop"


def test_a_stop_string_ending_in_a_byte_fallback_run_is_seen_when_the_run_ends(models) -> None:
    """"🦙" is four <0x..> byte tokens in Llama 2's vocabulary. The tokenizer decodes a run of byte tokens as a
    unit (one invalid byte turns all of it into U+FFFD), so the run's text is final only when a non-byte token
    follows: nexttoken stops one token after transformers, with the same text (cut before the stop string)."""
    llm, hf, tok, prompt = models["llama-2-chat"]
    ours = llm.generate(prompt, max_new_tokens=NEW, stop_strings=["🦙"])
    theirs = _transformers(hf, tok, ours.prompt_token_ids, "🦙")
    assert ours.token_ids[:-1] == theirs and len(theirs) == 5  # "▁▁" and the four bytes
    assert ours.text == "  " and ours.finish_reason == "stop"
