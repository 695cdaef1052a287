"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`), built as a `tokenizers` object that splits text as
llama.cpp does (src/llama-vocab.cpp is the reference).

* "gpt2" vocabularies (byte-level BPE: Llama 3, Qwen, SmolLM, OLMo, Granite): the vocabulary and merges as stored;
  the pre-tokenizer is the list of regexes llama.cpp applies for `tokenizer.ggml.pre`, each splitting the pieces the
  previous one left (a `Split(..., "isolated")` each), then the byte-level mapping. "llama3"-style names also
  take a word that is a whole token without merging (llama.cpp's `ignore_merges`).
* "llama" vocabularies (SentencePiece: Llama 2, Mistral, Phi-3, Gemma): llama.cpp merges the adjacent pair whose
  result has the highest score; as a `tokenizers` BPE that is one merge per way of splitting a token into two
  tokens, ranked by the merged token's score; unknown characters fall back to <0xXX> byte tokens.

Control and user-defined tokens become added tokens (control ones special); `add_bos_token` / `add_eos_token`
(llama.cpp's defaults per vocabulary when absent) become the post-processor; `tokenizer.chat_template` the template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from ..errors import TokenizerError
from .tokenizer import Tokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
           r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges, add_bos by default), as llama-vocab.cpp has them,
# for the names the supported families' converters write (and their close relatives).
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **{name: ((_LLAMA3,), True, True) for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{name: ((_LLAMA3,), False, False) for name in ("dbrx", "smaug-bpe")},
    **{name: ((_QWEN2,), False, False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
    **{name: ((r"\p{N}", _GPT2), False, False) for name in ("smollm", "refact", "starcoder", "command-r",
                                                             "codeshell", "exaone", "minerva-7b")},
    **{name: ((_GPT2,), False, False) for name in ("gpt-2", "phi-2", "olmo", "mpt", "jais", "exaone4", "trillion",
                                                   "granite-docling")},
    "tekken": ((_TEKKEN,), True, True),
    **{name: ((_GPT4O,), False, False) for name in ("gpt-4o", "llama4")},
}


def tokenizer_from_gguf(meta: Mapping[str, Any], source: str) -> Tokenizer:
    """A Tokenizer from a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise TokenizerError(f"{source} carries no tokenizer (tokenizer.ggml.model / tokens); pass --tokenizer "
                             "DIR_OR_ID with the model's tokenizer.json")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if kind == "gpt2":
        backend, add_bos = _bpe(meta, tokens, source)
    elif kind == "llama":
        backend, add_bos = _spm(meta, tokens, types), True
    elif kind == "gemma4":
        backend, add_bos = _spm_bpe(meta, tokens), True
    else:
        raise TokenizerError(f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2 = "
                             "byte-level BPE, llama = SentencePiece, gemma4 = SentencePiece-style BPE); pass "
                             "--tokenizer DIR_OR_ID")
    # Added tokens, in id order so every one keeps its id: control tokens are special, user-defined ones not.
    marked = [i for i, t in enumerate(types) if t == CONTROL or t == USER_DEFINED]  # one pass over the vocabulary
    added = [tokenizers.AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False) for i in marked]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    special = {name + "_token": token(key) for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"),
                                                               ("pad", "padding"))}
    special = {k: v for k, v in special.items() if v is not None}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) and "bos_token" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
    single = ([f"{special['bos_token']}:0"] if add_bos else []) + ["$A:0"] + (
        [f"{special['eos_token']}:0"] if add_eos else [])
    pair = single + [s.replace("$A", "$B").replace(":0", ":1") for s in single]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(special[n], backend.token_to_id(special[n])) for n in ("bos_token", "eos_token")
                        if (n == "bos_token" and add_bos) or (n == "eos_token" and add_eos)])
    templates = {"default": meta["tokenizer.chat_template"]} if meta.get("tokenizer.chat_template") else {}
    for key, value in meta.items():  # named templates: tokenizer.chat_template.<name> (e.g. tool_use)
        if key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    extra = [tokens[i] for i in marked if types[i] == CONTROL and tokens[i] not in special.values()]
    return Tokenizer(backend, special, extra, templates, None)


def _bpe(meta: Mapping[str, Any], tokens: list[str], source: str) -> tuple[tokenizers.Tokenizer, bool]:
    """A byte-level BPE vocabulary and the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise TokenizerError(f"{source}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
                             f"{', '.join(sorted(PRE_TOKENIZERS))}; pass --tokenizer DIR_OR_ID")
    regexes, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
    backend = tokenizers.Tokenizer(models.BPE(_ids(tokens), _pairs(meta), ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, add_bos


def _ids(tokens: list[str]) -> dict[str, int]:
    """Token text -> id; a repeated text keeps its first id (the lower ids are written last)."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))


def _pairs(meta: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """`tokenizer.ggml.merges` ("left right") as pairs, split at the first space."""
    return [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]


def _spm_bpe(meta: Mapping[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """Gemma 4's vocabulary as llama.cpp reads it (tokenizer model `gemma4`): spaces escaped as "▁" with no prefix,
    the text split only at runs of newlines, then the file's BPE merges, unknown bytes as <0xNN> tokens."""
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = tokenizers.Tokenizer(models.BPE(_ids(tokens), _pairs(meta), unk_token=unk_token, fuse_unk=True,
                                              byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _spm(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """A SentencePiece vocabulary as llama.cpp tokenizes it: merges ranked by the merged token's score."""
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    vocab = _ids(tokens)
    merges = []
    for i, t in enumerate(tokens):
        if types[i] not in (NORMAL, UNUSED) or len(t) < 2:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], i, vocab[left], (left, right)))
    merges.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = tokenizers.Tokenizer(models.BPE(vocab, [m[3] for m in merges], unk_token=unk_token, fuse_unk=True,
                                              byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


# Token texts llama.cpp treats as ending generation besides EOS (llama-vocab.cpp's end-of-generation set).
_END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                      "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>",
                      "<end_of_utterance>", "<|flush|>", "<|calls|>", "</s>", "[EOT]", "[EOS]", "<|end_of_text|>",
                      "<eos>", "<turn|>", "<|tool_response>", "[e~[")
# Its fill-in-the-middle pad, repository and file-separator tokens end generation too (by metadata id or by text).
_FIM_KEYS = ("fim_pad", "fim_rep", "fim_sep")
_FIM = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
        "<REPO>", "<reponame>", "<|file_sep|>")
_ENDS_BY_TEXT = frozenset(_END_OF_GENERATION + _FIM)  # one hash lookup a token (a 150k vocabulary: ~5 ms, not ~60)
# llama.cpp's exceptions: with harmony's <|return|> and <|call|> (gpt-oss; Solar Open's <|calls|> and <|flush|>),
# <|end|> closes a message, not the answer; beside Gemma 4's <|tool_response> (or PLaMo's eos), </s> is text.
_NOT_END = ((("<|return|>", "<|call|>"), "<|end|>"), (("<|calls|>", "<|flush|>"), "<|end|>"),
            (("<|tool_response>",), "</s>"), (("<|plamo:eos|>",), "</s>"))


def end_of_generation_ids(meta: Mapping[str, Any]) -> list[int]:
    """The ids llama.cpp stops generating at: EOS, the EOT / EOM ids, the fill-in-the-middle pad / repository /
    separator ids, and the end-of-turn tokens it recognises by text (e.g. <|im_end|> and <|endoftext|>), in that
    order without repeats; less its exceptions (_NOT_END: gpt-oss's <|end|>)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom", *_FIM_KEYS)]
    ids += [i for i, t in enumerate(tokens) if t in _ENDS_BY_TEXT]
    ids = [i for i in dict.fromkeys(ids) if isinstance(i, int) and 0 <= i < len(tokens)]
    texts = {tokens[i] for i in ids}
    dropped = {end for needs, end in _NOT_END if texts.issuperset(needs)}
    return [i for i in ids if tokens[i] not in dropped]
