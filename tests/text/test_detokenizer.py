"""Streaming detokenization: the deltas add up to the full decode, exactly, and never split a character."""

from __future__ import annotations

import json
import random

import pytest
from conftest import requires_shared

from nexttoken.text.detokenizer import IncrementalDetokenizer, detokenize_stream
from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared

BYTE_LEVEL = ["llama-3.2-instruct", "qwen2.5-instruct"]
BYTE_FALLBACK = ["llama-2-chat", "phi-3-mini-instruct", "stories260k"]  # SentencePiece style, with Strip decoder
ALL = BYTE_LEVEL + BYTE_FALLBACK

TEXTS = [
    "Hello world",
    " leading space, then  two spaces and a trailing one ",
    "Emoji: 🦙🔥 and a family 👨‍👩‍👧 in a row",
    "日本語のテキストと中文字符, 한국어도",
    "Accents: naïve café, Zürich, ñandú, Ελληνικά, кириллица",
    "Lines\n\nwith\ttabs\n  and indents\n",
    "Rare characters fall back to bytes: ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⅷ ﷺ 𓀀",
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
]


@pytest.fixture(scope="module")
def load(shared_dir):
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            path = shared_dir / ("models" if name == "stories260k" else "tokenizers") / name
            cache[name] = Tokenizer.from_dir(path)
        return cache[name]

    return get


def stream(tok: Tokenizer, ids: list[int], skip: bool, prompt_ids: list[int] | None = None) -> list[str]:
    """The deltas of `ids` pushed one by one, the flush last; checks every partial output is final text."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_ids=prompt_ids)
    deltas = []
    for k, token_id in enumerate(ids):
        deltas.append(detok.push(token_id))
        if prompt_ids is None:
            # What was emitted is never taken back: it is a prefix of the decode of the ids so far.
            assert tok.decode(ids[: k + 1], skip_special_tokens=skip).startswith("".join(deltas))
    deltas.append(detok.flush())
    return deltas


def with_specials(tok: Tokenizer, ids: list[int], rng: random.Random) -> list[int]:
    """`ids` with special tokens (named ones and e.g. <|eot_id|>) inserted at random places, BOS first."""
    specials = sorted(set(tok.all_special_ids) | set(sorted(tok.skipped_special_ids)[:4]))
    out = list(ids)
    for special in specials:
        out.insert(rng.randrange(len(out) + 1), special)
    return out


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode(load, name, skip):
    tok = load(name)
    rng = random.Random(0)
    for text in TEXTS:
        plain = tok.encode(text)
        for ids in (plain, with_specials(tok, plain, rng)):
            deltas = stream(tok, ids, skip)
            full = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == full, (text, ids)
            if "\ufffd" not in full:
                assert not any("\ufffd" in d for d in deltas), deltas
            if ids == plain and ids[-1] not in tok.byte_fallback_ids:
                # Valid text is held back only inside a run of byte tokens (Llama 2 spells "\n" as <0x0A>):
                # one more byte could still turn the whole run into U+FFFDs.
                assert deltas[-1] == ""


def test_byte_fallback_is_exercised(load):
    """stories260k's 512-token vocabulary spells every non-ASCII character in <0xNN> byte tokens; a run of them
    is one unit for the decoder, so its text comes out whole when the run ends."""
    tok = load("stories260k")
    ids = tok.encode("日本 🦙 x", add_special_tokens=False)
    assert sum(i in tok.byte_fallback_ids for i in ids) == 3 + 3 + 4
    deltas = stream(tok, ids, skip=True)
    assert [d for d in deltas if d] == ["日本 ", "🦙 ", "x"]


@pytest.mark.parametrize("name", ALL)
def test_prompt_context_keeps_leading_space(load, name):
    """With the prompt given, the first delta reads as a continuation (SentencePiece keeps its "▁" as a space)."""
    tok = load(name)
    prompt = tok.encode("The weather today")
    completion = tok.encode("The weather today is sunny, 晴れ 🌞!")[len(prompt) :]
    assert tok.decode(prompt + completion).startswith(tok.decode(prompt))
    head = tok.decode(prompt, skip_special_tokens=True)
    expected = tok.decode(prompt + completion, skip_special_tokens=True)[len(head) :]
    assert "".join(stream(tok, completion, skip=True, prompt_ids=prompt)) == expected
    assert expected.startswith(" is")
    # Without the prompt the stream is a text of its own: SentencePiece strips the first space, like decode().
    assert "".join(stream(tok, completion, skip=True)) == tok.decode(completion, skip_special_tokens=True)


def test_llama2c_reference_texts_stream(load, shared_dir):
    tok = load("stories260k")
    runs = json.loads((shared_dir / "reference" / "stories260k_llama2c_greedy.json").read_text())["runs"]
    for run in runs:
        assert "".join(detokenize_stream(tok, run["ids"])) == run["text"]
        generated = run["ids"][len(run["prompt_ids"]) :]
        continuation = "".join(stream(tok, generated, skip=True, prompt_ids=run["prompt_ids"]))
        assert run["prompt"] + continuation == run["text"]


@pytest.mark.parametrize("name", ALL)
def test_random_ids(load, name):
    """Random ids, biased to pieces of characters, make invalid UTF-8: the full decode then holds U+FFFD, and
    the concatenation must still equal it exactly, with and without a prompt before them."""
    tok = load(name)
    rng = random.Random(1234)
    partial = [i for i in range(min(tok.vocab_size, 20_000)) if "\ufffd" in tok.decode([i])]
    pools = [list(range(tok.vocab_size)), partial, sorted(tok.skipped_special_ids)]
    if tok.byte_fallback_ids:
        pools.append(sorted(tok.byte_fallback_ids))
    for trial in range(300):
        skip = trial % 2 == 0
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randrange(1, 40))]
        assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip), ids
        prompt, rest = ids[: len(ids) // 3], ids[len(ids) // 3 :]
        head = tok.decode(prompt, skip_special_tokens=skip)
        whole = tok.decode(prompt + rest, skip_special_tokens=skip)
        if prompt and not head.endswith("\ufffd") and whole.startswith(head):
            got = "".join(stream(tok, rest, skip, prompt_ids=prompt))
            assert got == whole[len(head) :], (prompt, rest)


@pytest.mark.parametrize("name", ["llama-2-chat", "qwen2.5-instruct", "stories260k"])
def test_work_per_token_is_bounded(load, name, monkeypatch):
    """Decoding work per token does not grow with the text, even through long byte-fallback runs."""
    tok = load(name)
    ids = tok.encode(" ".join(TEXTS) * 20)
    decoded = []
    real_decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or real_decode(ids, **kw))
    text = "".join(detokenize_stream(tok, ids))
    monkeypatch.undo()
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert sum(decoded) < 6 * len(ids), (sum(decoded), len(ids))


@pytest.mark.parametrize("name", ["llama-2-chat", "qwen2.5-instruct"])
def test_without_anchor_token(load, name, monkeypatch):
    """A vocabulary with no usable anchor falls back to decoding all final ids as context: still exact."""
    monkeypatch.setattr("nexttoken.text.detokenizer._find_anchor", lambda tok, byte_ids: [])
    tok = load(name)
    rng = random.Random(7)
    for text in TEXTS[:4]:
        ids = with_specials(tok, tok.encode(text), rng)
        for skip in (True, False):
            assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)
            prompt, rest = ids[:5], ids[5:]
            expected = tok.decode(ids, skip_special_tokens=skip)[len(tok.decode(prompt, skip_special_tokens=skip)) :]
            assert "".join(stream(tok, rest, skip, prompt_ids=prompt)) == expected
