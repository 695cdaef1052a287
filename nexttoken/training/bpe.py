"""Stage 2: a SentencePiece-style byte-fallback BPE tokenizer trained with the `tokenizers` library.

Layout of the vocabulary: 0 `<unk>`, 1 `<s>` (BOS), 2 `</s>` (EOS), 3..258 the byte pieces `<0x00>`..`<0xFF>`
(what a character outside the learned alphabet falls back to), then the learned pieces. Words carry their
leading space as `▁`, as in Llama 2. The byte pieces are ordinary vocabulary entries, not special tokens,
so `decode(..., skip_special_tokens=True)` still turns them back into text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
SPECIALS = (UNK, BOS, EOS)
BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))


def train_bpe(texts: Iterable[str], vocab_size: int, max_alphabet: int = 120) -> Tokenizer:
    """Train on `texts`; the result has exactly `vocab_size` entries (3 special + 256 bytes + learned)."""
    learned = vocab_size - len(SPECIALS) - len(BYTE_PIECES)
    if learned < max_alphabet:
        raise ValueError(f"vocab_size {vocab_size} leaves too few learned pieces; use at least {259 + max_alphabet}")
    tok = _pipeline(Tokenizer(models.BPE(unk_token=UNK)))
    trainer = trainers.BpeTrainer(
        vocab_size=learned + len(SPECIALS), special_tokens=list(SPECIALS), limit_alphabet=max_alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _with_byte_fallback(tok)


def _pipeline(tok: Tokenizer) -> Tokenizer:
    # Llama 2's text handling: spaces become "▁" and one is prepended, so "time" and " time" are one piece.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # Splitting before each "▁" keeps merges inside words (the normalizer already prepended the first one).
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    return tok


def _with_byte_fallback(trained: Tokenizer) -> Tokenizer:
    """Rebuild the trained BPE with the byte pieces at ids 3..258 and `byte_fallback` on."""
    spec = json.loads(trained.to_str())
    learned = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *BYTE_PIECES, *learned])}
    spec["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True, unk_token=UNK)
    for added in spec["added_tokens"]:  # the specials keep ids 0..2, as trained
        assert vocab[added["content"]] == added["id"], added
    return Tokenizer.from_str(json.dumps(spec))
