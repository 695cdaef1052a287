"""Fill-in-the-middle: the prompt in each family's documented layout, token for token (Qwen2.5-Coder's and
StarCoder2's and DeepSeek-Coder's documented strings through transformers' tokenizer; CodeLlama against
transformers' CodeLlamaTokenizer, which implements Meta's layout), llama.cpp's context files; then `suffix` on
/v1/completions (the `openai` client) and llama.cpp's /infill over the same request path, and a clear 400 for a
model without FIM tokens, after which the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from conftest import requires_shared
from support.server import start_server, stop_server
from support.tiny_models import build_chat_model

import nexttoken
from nexttoken.text.infill import fim_format, fim_prompt
from nexttoken.text.tokenizer import Tokenizer

pytestmark = requires_shared
transformers = pytest.importorskip("transformers")

PREFIX, SUFFIX = "def area(r):\n    ", "\n    return a\n"


def _with_tokens(folder: Path, src: Path, tokens: list[str], special: bool = True, **config) -> Path:
    """A tokenizer folder: `src`'s tokenizer plus `tokens` added (new ids after the vocabulary)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = json.loads((src / "tokenizer.json").read_text())
    first = max(t["id"] for t in tok["added_tokens"]) + 1
    tok["added_tokens"] += [{"id": first + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": special} for i, t in enumerate(tokens)]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    cfg.pop("added_tokens_decoder", None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _theirs(folder: Path, text: str) -> list[int]:
    """The documented prompt string through transformers' tokenizer (special tokens read as tokens)."""
    return transformers.AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]


def test_qwen25_coder_layout_with_context_files(shared_dir) -> None:
    folder = shared_dir / "tokenizers" / "qwen2.5-instruct"  # Qwen2.5-Coder's vocabulary: the same FIM tokens
    tok = Tokenizer.from_dir(folder)
    assert fim_format(tok).name == "qwen2.5-coder"
    assert fim_prompt(tok, PREFIX, SUFFIX) == _theirs(
        folder, f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")
    extra = [("util.py", "PI = 3.14\n"), ("b.py", "x = 1\n")]
    assert fim_prompt(tok, PREFIX, SUFFIX, extra, after="a =") == _theirs(folder, (
        "<|repo_name|>myproject\n<|file_sep|>util.py\nPI = 3.14\n<|file_sep|>b.py\nx = 1\n<|file_sep|>filename\n"
        f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>a ="))


def _byte_level(folder: Path, shared_dir: Path, tokens: list[str], **config) -> Path:
    """Qwen2.5's byte-level BPE (as StarCoder2's and DeepSeek-Coder's are) without its own FIM tokens, plus
    `tokens`: a tokenizer that spells FIM another family's way."""
    _with_tokens(folder, shared_dir / "tokenizers" / "qwen2.5-instruct", tokens, **config)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if not t["content"].startswith(("<|fim", "<|repo", "<|file"))]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


def test_starcoder2_and_deepseek_coder_layouts(shared_dir, tmp_path) -> None:
    star = _byte_level(tmp_path / "star", shared_dir,
                       ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>"])
    t = Tokenizer.from_dir(star)
    assert fim_format(t).name == "starcoder"
    assert fim_prompt(t, PREFIX, SUFFIX, [("a.py", "x")]) == _theirs(
        star, f"<repo_name>myproject\n<file_sep>a.py\nx<file_sep>filename\n<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}"
              "<fim_middle>")
    bos = "<｜begin▁of▁sentence｜>"
    deep = _byte_level(tmp_path / "deep", shared_dir, [bos, "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
                       bos_token=bos)
    t = Tokenizer.from_dir(deep)
    assert fim_format(t).name == "deepseek-coder" and t.bos_token_id is not None
    assert fim_prompt(t, PREFIX, SUFFIX) == _theirs(deep, f"{bos}<｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>")


def test_codellama_layout_equals_transformers(shared_dir, tmp_path) -> None:
    folder = _with_tokens(tmp_path, shared_dir / "tokenizers" / "llama-2-chat", ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
                          tokenizer_class="CodeLlamaTokenizer")
    theirs = transformers.CodeLlamaTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tok = Tokenizer.from_dir(folder)
    assert fim_format(tok).name == "codellama"
    for pre, suf in ((PREFIX, SUFFIX), ("x", "y"), ("  indented", " spaced")):
        assert fim_prompt(tok, pre, suf) == theirs(pre, suffix=suf)["input_ids"]  # <s>▁<PRE> {pre}▁<SUF>{suf}▁<MID>


@pytest.fixture(scope="module")
def coder(shared_dir, tmp_path_factory):
    folder = build_chat_model(tmp_path_factory.mktemp("coder"), shared_dir / "tokenizers" / "qwen2.5-instruct",
                              "qwen2")
    proc, url = start_server(folder)
    yield url, folder
    stop_server(proc)


def test_suffix_and_infill_over_the_request_path(coder) -> None:
    url, folder = coder
    llm = nexttoken.load(folder)
    ids = fim_prompt(llm.tokenizer, PREFIX, SUFFIX)
    want = llm.generate(ids, max_new_tokens=8, do_sample=False, top_k=None).text
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    body = httpx.post(url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8,
                                             "temperature": 0}, timeout=60).json()
    assert body["content"] == want and body["stop"] is True
    assert (body["tokens_evaluated"], body["tokens_predicted"], body["stop_type"]) == (len(ids), 8, "limit")
    extra = [{"filename": "util.py", "text": "PI = 3.14\n"}]
    with httpx.stream("POST", url + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8,
                                                     "temperature": 0, "input_extra": extra, "stream": True},
                      timeout=60) as s:
        chunks = [json.loads(line.removeprefix("data: ")) for line in s.iter_lines() if line]
    ids = fim_prompt(llm.tokenizer, PREFIX, SUFFIX, [("util.py", "PI = 3.14\n")])
    assert "".join(c["content"] for c in chunks) == llm.generate(ids, max_new_tokens=8, do_sample=False,
                                                                 top_k=None).text
    assert chunks[-1]["stop"] is True and not any(c["stop"] for c in chunks[:-1])


def test_a_model_without_fim_tokens_gets_a_400_and_the_server_serves(server) -> None:
    url = server  # stories260K has no fill-in-the-middle tokens
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle tokens" in r.json()["error"]["message"]
    r = httpx.post(url + "/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "suffix": "b"})
    assert r.status_code == 400 and "as text" in r.json()["error"]["message"]
    r = httpx.post(url + "/infill", json={"input_prefix": "a", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
    ok = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "suffix": ""})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
