"""A real trained model: llama2.c's stories260K must give llama2.c's own greedy output, ids and text."""

from __future__ import annotations

import json

import pytest
import torch

import nexttoken
from nexttoken.generation import generate

BOS = 1  # these models end a story by emitting BOS; run.c stops there without printing it


@pytest.fixture(scope="module")
def stories(shared_dir):
    return nexttoken.load(shared_dir / "models" / "stories260k")


@pytest.fixture(scope="module")
def runs(shared_dir) -> list[dict]:
    return json.loads((shared_dir / "reference" / "stories260k_llama2c_greedy.json").read_text())["runs"]


def new_tokens(run: dict) -> int:
    return run["steps"] - len(run["prompt_ids"]) + 1  # run.c runs positions 0..steps-1


def expected_continuation(run: dict) -> list[int]:
    ids = run["ids"][len(run["prompt_ids"]) :]
    return ids + [BOS] if run["stopped_on_bos"] else ids


@pytest.mark.parametrize("steps", [100, 256])
def test_ids_equal_llama2c_in_a_left_padded_batch(stories, runs, steps) -> None:
    """Every prompt of one length budget in one batch: each row must equal its own llama2.c run."""
    batch = [r for r in runs if r["steps"] == steps]
    results = stories.generate([r["prompt"] for r in batch], max_new_tokens=max(map(new_tokens, batch)))
    for run, result in zip(batch, results):
        assert result.prompt_token_ids == run["prompt_ids"]
        want = expected_continuation(run)
        assert result.token_ids[: len(want)] == want, run["prompt"]
        if BOS in want:  # a row whose own budget ends earlier may run on and stop later; only this is certain
            assert result.finish_reason == "stop", run["prompt"]


def test_low_level_generate_single_prompts(stories, runs) -> None:
    for run in (r for r in runs if r["steps"] == 100):
        prompt = run["prompt_ids"]
        out = generate(stories.model, torch.tensor([prompt]), max_new_tokens=new_tokens(run))[0].tolist()
        assert out == prompt + expected_continuation(run), run["prompt"]


def test_text_and_finish_reason_equal_llama2c(stories, runs) -> None:
    for run in runs:
        if run["steps"] == 256 and not run["stopped_on_bos"] and run["prompt"] not in ("", "The little dog"):
            continue  # the full-length 256-step texts are covered by the batch test's ids; keep two
        result = stories.generate(run["prompt"], max_new_tokens=new_tokens(run))
        assert result.finish_reason == ("stop" if run["stopped_on_bos"] else "length"), run["prompt"]
        # run.c prints the prompt and the continuation (text field: leading space after BOS stripped).
        full = stories.tokenizer.decode(result.prompt_token_ids + result.token_ids, skip_special_tokens=True)
        assert full == run["text"], run["prompt"]


def test_stream_concatenates_to_the_text(stories) -> None:
    result = stories.generate("Lily went to the park", max_new_tokens=120)
    streamed = "".join(stories.stream("Lily went to the park", max_new_tokens=120))
    assert streamed == result.text and len(result.text) > 100
