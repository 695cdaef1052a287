"""A system prompt and a question that calls both tools (support/tools.py), as Chat messages, and the logit bias that
ends a random model's answer after a complete call (no tests here)."""

from __future__ import annotations

import json

INSTRUCTIONS, QUESTION = "You are a helpful assistant.", "What is the weather in Zürich, and the time in CET?"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


def ending(folder) -> dict[str, float]:
    """A logit bias towards the end tokens, so a random model stops after a complete call."""
    config = json.loads((folder / "generation_config.json").read_text())
    eos = config["eos_token_id"]
    return {str(t): 8.0 for t in (eos if isinstance(eos, list) else [eos])}
