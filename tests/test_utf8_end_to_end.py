"""UTF-8 safety end to end: output forced to be non-ASCII, with characters split over byte tokens (SentencePiece
byte fallback, byte-level BPE pieces), through `LLM.stream`, the CLI and the server's SSE streams. No delta holds
U+FFFD or half a character, and the deltas join to the full text, which equals the tokenizer's decode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import nexttoken
from support.chain_model import build_chain_model, chain_ids
from support.server import start_server, stop_server

# (tokenizer family, the chain's text, a prompt that ends with the chain's last token, its EOS id)
CASES = {
    "llama-2-chat": (" 🦙 Grüße 日本", "Hello 日本", 2),  # 🦙 as four <0x..> byte-fallback tokens
    "llama-3.2-instruct": (" 🦙 Grüße 𝄞 日本", " 日本", 128009),  # 🦙 and 𝄞 split across byte-level pieces
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, shared_dir, tmp_path_factory):
    text, prompt, eos = CASES[request.param]
    tokenizers = shared_dir / "tokenizers" / request.param
    chain = chain_ids(tokenizers, text)
    folder = build_chain_model(tmp_path_factory.mktemp(request.param), tokenizers, chain, eos)
    llm = nexttoken.load(folder)
    assert llm.encode(prompt)[-1] == chain[-1]  # so the output walks the chain from its first token
    return folder, llm, prompt, chain


def _new(case) -> int:  # noqa: ANN001
    """Two whole turns of the chain: the output ends on a character boundary (a cut inside a character would
    rightly end the text with U+FFFD, as the tokenizer's own decode does)."""
    return 2 * len(case[3])


def _whole_characters(deltas: list[str]) -> None:
    assert deltas and all(isinstance(d, str) and "\ufffd" not in d for d in deltas), deltas
    for d in deltas:
        d.encode("utf-8", errors="strict")  # no lone surrogate: half a character cannot hide in a delta


def test_library_stream_never_splits_a_character(case) -> None:
    _, llm, prompt, chain = case
    NEW = _new(case)
    result = llm.generate(prompt, max_new_tokens=NEW)
    assert result.token_ids[: len(chain)] == chain  # the forced output
    deltas = list(llm.stream(prompt, max_new_tokens=NEW))
    _whole_characters(deltas)
    assert "".join(deltas) == result.text
    head = llm.tokenizer.decode(result.prompt_token_ids, skip_special_tokens=True)
    assert head + result.text == llm.tokenizer.decode(result.prompt_token_ids + result.token_ids,
                                                      skip_special_tokens=True)
    assert any(ord(c) > 0xFFFF for c in result.text) and "日本" in result.text  # 4-byte and CJK characters
    # Pieces that are not whole characters on their own really are in the output.
    assert any("\ufffd" in llm.tokenizer.decode([t]) for t in result.token_ids)


def test_cli_prints_whole_characters(case) -> None:
    folder, llm, prompt, _ = case
    NEW = _new(case)
    out = subprocess.run([sys.executable, "-m", "nexttoken.cli", "generate", prompt, "--model", str(folder),
                          "--max-new-tokens", str(NEW)], capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    printed = out.stdout.decode("utf-8", errors="strict")
    assert "\ufffd" not in printed
    assert printed == prompt + llm.generate(prompt, max_new_tokens=NEW).text + "\n"


def _sse_texts(url: str, path: str, body: dict, field) -> list[str]:  # noqa: ANN001
    texts = []
    with httpx.Client(timeout=120) as h, h.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                texts += [t for t in (field(c) for c in chunk["choices"]) if t]
    return texts


def test_sse_streams_whole_characters(case) -> None:
    folder, llm, prompt, _ = case
    NEW = _new(case)
    proc, url = start_server(Path(folder))
    try:
        completion = _sse_texts(url, "/v1/completions",
                                {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "stream": True},
                                lambda c: c["text"])
        _whole_characters(completion)
        assert "".join(completion) == llm.generate(prompt, max_new_tokens=NEW).text
        messages = [{"role": "user", "content": prompt}]
        chat = _sse_texts(url, "/v1/chat/completions",
                          {"messages": messages, "max_tokens": NEW, "temperature": 0, "stream": True},
                          lambda c: c["delta"].get("content"))
        _whole_characters(chat)
        assert "".join(chat) == llm.chat(messages, max_new_tokens=NEW).text
    finally:
        stop_server(proc)
