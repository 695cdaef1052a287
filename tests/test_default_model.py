"""The model packaged in nexttoken/default_model: transformers loads it and agrees with nexttoken token for token,
the tokenizers agree, greedy text is English, and the README's command prints a story without `--model`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch

import nexttoken
from nexttoken.llm import DEFAULT_MODEL_DIR
from nexttoken.text.tokenizer import Tokenizer

PROMPTS = ["Once upon a time", "Lily went to the park", "The little dog"]
WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")


@pytest.fixture(scope="module")
def llm():
    return nexttoken.load()  # no path: the packaged default model


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def words() -> set[str]:
    return set((DEFAULT_MODEL_DIR / "words.txt").read_text().split())


def english_share(text: str, words: set[str]) -> tuple[float, int]:
    found = [w.lower() for w in WORD.findall(text)]
    return sum(w in words for w in found) / max(1, len(found)), len(found)


def test_folder_is_a_small_llama_with_sampling_defaults() -> None:
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    gen = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    assert gen["do_sample"] is True and 0.5 <= gen["temperature"] <= 1.0 and gen["eos_token_id"] == [2]
    size = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.iterdir() if f.is_file())
    assert size <= 10_000_000, f"the packaged model is {size / 1e6:.1f} MB, over the 10 MB budget"


def test_transformers_greedy_tokens_equal_nexttoken(llm, hf) -> None:
    model, tok = hf
    ours = llm.generate(PROMPTS, do_sample=False, max_new_tokens=40)  # a list: batched together
    for prompt, got in zip(PROMPTS, ours):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert got.prompt_token_ids == ids[0].tolist()
        out = model.generate(ids, do_sample=False, max_new_tokens=40, top_p=None, temperature=None, top_k=None)
        expected = out[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in expected:  # transformers pads finished rows; nexttoken stops at the EOS
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        assert got.token_ids == expected, prompt
        single = llm.generate(prompt, do_sample=False, max_new_tokens=40)  # one prompt: the padded-batch loop
        assert single.token_ids == expected, prompt


@pytest.mark.parametrize(
    "text",
    ["Once upon a time, there was a little girl named Lily.", "  two  spaces\nand a newline\n\n\"Hi!\" said Tom.",
     "café, naïve, 日本語 and 🙂", "<s>user: Tell me a story.\nassistant:", ""],
)
def test_tokenizer_ids_equal_tokenizers_library_and_transformers(text: str, hf) -> None:
    ours = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    lib = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    _, auto = hf
    expected = lib.encode(text).ids
    assert expected[0] == 1  # BOS
    assert ours.encode(text) == expected == auto(text).input_ids
    plain = lib.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, add_special_tokens=False) == plain
    if "<s>" not in text:  # byte fallback: every character survives the round trip, spaces included
        assert ours.decode(plain) == auto.decode(plain) == text


def test_chat_template_renders_like_transformers(llm, hf) -> None:
    _, auto = hf
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a story."}]
    ours = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == "<s>system: Be kind.\nuser: Tell me a story.\nassistant:"


def test_greedy_once_upon_a_time_is_english(llm, words) -> None:
    text = llm.generate("Once upon a time", do_sample=False, max_new_tokens=80).text
    share, n = english_share(text, words)
    assert n >= 20 and share >= 0.9, f"{share:.0%} of {n} words are known words: {text!r}"


def test_chat_answers_with_a_story(llm, words) -> None:
    reply = llm.chat([{"role": "user", "content": "Tell me a story."}], do_sample=False, max_new_tokens=40).text
    share, n = english_share(reply, words)
    assert n >= 10 and share >= 0.9, reply


def test_readme_command_prints_a_story_without_model_flag(words) -> None:
    # `make demo` runs `nexttoken generate "Once upon a time" --max-new-tokens 120` with the packaged model.
    run = subprocess.run(
        [sys.executable, "-m", "nexttoken.cli", "generate", "Once upon a time", "--max-new-tokens", "40"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Once upon a time")
    generated = run.stdout[len("Once upon a time"):]
    share, n = english_share(generated, words)
    assert n >= 10 and share >= 0.8, run.stdout  # sampled (the model's defaults): a looser bar than greedy
