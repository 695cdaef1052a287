"""A thinking model's tokenizer (the real Qwen2.5 one with Qwen3's thinking tokens) and a thinking answer (no
tests here)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
QWEN3_TOKENS = {"<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}
ANSWER = "<think>Let me see</think>Hello there"
QUESTION = [{"role": "user", "content": "Hi"}]


def thinking_tokenizer(folder: Path, shared_dir: Path, template: str) -> Path:
    """The Qwen2.5 tokenizer with Qwen3's added tokens, and `template` (a file in tests/data) as its template."""
    folder.mkdir(parents=True, exist_ok=True)
    src = shared_dir / "tokenizers" / "qwen2.5-instruct"
    tok = json.loads((src / "tokenizer.json").read_text())
    tok["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": False} for t, i in QWEN3_TOKENS.items()]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"].update({str(i): {"content": t, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": False}
                                           for t, i in QWEN3_TOKENS.items()})
    config["chat_template"] = (DATA / template).read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
