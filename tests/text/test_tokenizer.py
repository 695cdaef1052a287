"""Tokenizer conformance: ids against the shared reference ids, the `tokenizers` library and transformers."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import tokenizers
from conftest import requires_shared

from nexttoken.errors import MissingFileError, TokenizerError
from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared

FAMILIES = ["llama-3.2-instruct", "qwen2.5-instruct", "llama-2-chat", "phi-3-mini-instruct"]
ALL = FAMILIES + ["stories260k"]

# Extra texts beyond the reference cases: specials typed in text, leading spaces, byte fallback, empty.
EXTRA_TEXTS = [
    "",
    " Hello",
    "Hello world",
    "<s>hi</s> <|endoftext|>",
    "héllo 🦙 日本語\n\n  x\t¡ñ!",
    "Once upon a time, there was a little girl named Lily.",
]

# (bos, eos, pad, unk) ids as the official configs define them.
SPECIAL_IDS = {
    "llama-3.2-instruct": (128000, 128009, None, None),
    "qwen2.5-instruct": (None, 151645, 151643, None),
    "llama-2-chat": (1, 2, None, 0),
    "phi-3-mini-instruct": (1, 32000, 32000, 0),
    "stories260k": (1, 2, None, 0),
}


def folder(shared: Path, name: str) -> Path:
    return shared / "models" / name if name == "stories260k" else shared / "tokenizers" / name


@pytest.fixture(scope="module")
def load(shared_dir):
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_dir(folder(shared_dir, name))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def cases(shared_dir):
    return json.loads((shared_dir / "tokenizers" / "conformance_cases.json").read_text())


def hf_tokenizer(path: Path, cls_name: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls_name).from_pretrained(str(path))


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_ids(load, cases, name):
    tok = load(name)
    for case in cases[name]["cases"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]


@pytest.mark.parametrize("name", ALL)
def test_matches_tokenizers_library(load, cases, shared_dir, name):
    tok = load(name)
    ref = tokenizers.Tokenizer.from_file(str(folder(shared_dir, name) / "tokenizer.json"))
    texts = EXTRA_TEXTS + [c["text"] for c in cases.get(name, {}).get("cases", [])]
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special).ids, (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.batch_encode(texts) == [e.ids for e in ref.encode_batch(texts)]
    assert tok.vocab_size == len(tok) == ref.get_vocab_size(with_added_tokens=True)


# transformers 5's LlamaTokenizer (which AutoTokenizer picks for Llama 2 and Phi-3) rebuilds their pipeline and gets
# some ids wrong (" Hello" -> [15043], not [29871, 15043]); PreTrainedTokenizerFast reads tokenizer.json as we do.
HF_CLASS = {"llama-2-chat": "PreTrainedTokenizerFast", "phi-3-mini-instruct": "PreTrainedTokenizerFast"}


@pytest.mark.parametrize("name", ALL)
def test_matches_transformers(load, cases, shared_dir, name):
    """Same ids as transformers (BOS included), same decode, same special tokens and sizes."""
    tok = load(name)
    hf = hf_tokenizer(folder(shared_dir, name), HF_CLASS.get(name, "AutoTokenizer"))
    texts = EXTRA_TEXTS + [c["text"] for c in cases.get(name, {}).get("cases", [])]
    for text in texts:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), text
    ids = tok.encode(EXTRA_TEXTS[3] + EXTRA_TEXTS[4])
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert tok.all_special_ids == hf.all_special_ids
    assert len(tok) == len(hf)
    assert tok.special_tokens == hf.special_tokens_map
    assert tok.model_max_length == hf.model_max_length


@pytest.mark.parametrize("name", ALL)
def test_special_tokens(load, name):
    tok = load(name)
    bos, eos, pad, unk = SPECIAL_IDS[name]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (bos, eos, pad, unk)
    assert tok.add_bos_token == (name in ("llama-3.2-instruct", "llama-2-chat", "stories260k"))
    if tok.add_bos_token:
        assert tok.encode("Hello")[0] == bos
    assert tok.skipped_special_ids >= set(tok.all_special_ids)
    assert tok.convert_ids_to_tokens(eos) == tok.eos_token
    assert tok.token_to_id(tok.eos_token) == eos
    assert tok.token_to_id("no such token, surely") is None


def test_stories260k_matches_llama2c(load, shared_dir):
    """llama2.c's own encoder and run.c's printed text agree with our encode/decode."""
    tok = load("stories260k")
    runs = json.loads((shared_dir / "reference" / "stories260k_llama2c_greedy.json").read_text())["runs"]
    for run in runs:
        assert tok.encode(run["prompt"]) == run["prompt_ids"]
        assert tok.decode(run["ids"], skip_special_tokens=True) == run["text"]
    assert tok.model_max_length == 512
    assert len(tok.byte_fallback_ids) == 256


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MissingFileError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    assert Tokenizer.maybe_from_dir(tmp_path) is None


def test_corrupt_files(shared_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(folder(shared_dir, "stories260k") / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": 7}')
    with pytest.raises(TokenizerError, match="bos_token|special token"):
        Tokenizer.from_dir(tmp_path)


def test_config_fallbacks(shared_dir, tmp_path):
    """special_tokens_map.json fills in for a legacy config; a token only the config declares is added."""
    shutil.copy(folder(shared_dir, "stories260k") / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "pad_token": "<pad>"})
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 512)
    assert tok.chat_template is None and tok.model_max_length is None
    assert tok.encode("a<pad>", add_special_tokens=False)[-1] == 512


def test_encode_rejects_non_text(load):
    with pytest.raises(TokenizerError, match="str"):
        load("stories260k").encode([1, 2, 3])
