"""The output pipeline (generation/output_pipeline.py) on its own: one sequence's tokens pushed one at a time, as
the engine pushes them, with stories260K's real tokenizer where text matters. Every expected value is worked out
by hand in the test from the tokenizer's pieces:

    "Once upon a time" = [1 <s>, 403 Once, 403 upon, 261 a, 378 time]
    ", there was a little girl." = [432 ",", 383 " there", 286 " was", 261 " a", 376 " little", 298 " g",
                                    315 "ir", 421 "l", 426 "."]
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nexttoken.text.detokenizer import IncrementalDetokenizer
from nexttoken.generation.config import GenerationConfig
from nexttoken.generation.output_pipeline import OutputPipeline, replay, token_logprobs
from nexttoken.text.tokenizer import Tokenizer

PROMPT = [1, 403, 407, 261, 378]
STORY = [432, 383, 286, 261, 376, 298, 315, 421, 426]
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(shared_dir: Path) -> Tokenizer:
    tok = Tokenizer.from_dir(shared_dir / "models" / "stories260k")
    assert tok.encode("Once upon a time, there was a little girl.") == PROMPT + STORY  # the pieces above
    return tok


def pipeline(tokenizer: Tokenizer, max_tokens: int = 20, **options) -> OutputPipeline:
    cfg = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=EOS, **options)
    return OutputPipeline(cfg, max_tokens, IncrementalDetokenizer(tokenizer, True, prompt_ids=PROMPT))


def push_all(out: OutputPipeline, tokens: list[int]) -> list:
    """Push until the sequence finishes; the deltas."""
    deltas = []
    for token in tokens:
        if out.finished:
            break
        deltas.append(out.push(token, -1.0))
    return deltas


def test_text_streams_token_by_token_and_ends_by_length(tokenizer) -> None:
    out = pipeline(tokenizer, max_tokens=4)
    deltas = push_all(out, STORY)
    assert [d.text for d in deltas] == [",", " there", " was", " a"]
    assert [d.finish_reason for d in deltas] == [None, None, None, "length"]
    assert out.token_ids == STORY[:4] and out.text == ", there was a" and out.stop_reason is None
    assert out.completion(PROMPT).finish_reason == "length"


def test_a_stop_string_across_tokens_is_held_back_then_cut(tokenizer) -> None:
    """'girl' arrives as ' g' + 'ir' + 'l': the 'g' and 'gir' tails are held back (they may become the stop
    string), never shown, and the text ends before the stop string."""
    out = pipeline(tokenizer, stop_strings=["girl"])
    deltas = push_all(out, STORY)
    assert [d.text for d in deltas] == [",", " there", " was", " a", " little", " ", "", ""]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "girl"
    assert out.token_ids == STORY[:8]  # the "." after it is never pushed
    assert out.text == "".join(d.text for d in deltas) == ", there was a little "
    c = out.completion(PROMPT)
    assert (c.text, c.finish_reason, c.stop_reason) == (", there was a little ", "stop", "girl")


def test_include_stop_str_in_output_keeps_it(tokenizer) -> None:
    out = pipeline(tokenizer, stop_strings=["girl"], include_stop_str_in_output=True)
    deltas = push_all(out, STORY)
    assert deltas[-1].text == "girl" and out.text == ", there was a little girl"


def test_a_held_back_tail_is_released_when_the_length_ends_it(tokenizer) -> None:
    """The length budget ends the sequence on ' g': the held 'g' is final text after all."""
    out = pipeline(tokenizer, max_tokens=6, stop_strings=["girl"])
    deltas = push_all(out, STORY)
    assert [d.text for d in deltas[-2:]] == [" little", " g"] and deltas[-1].finish_reason == "length"


def test_a_stop_string_inside_a_token_cuts_mid_token(tokenizer) -> None:
    """' little' holds 'itt': the text is cut inside the token's text."""
    out = pipeline(tokenizer, stop_strings=["itt"])
    push_all(out, STORY)
    assert out.token_ids == STORY[:5] and out.stop_reason == "itt" and out.text == ", there was a l"


def test_the_earliest_stop_string_in_the_text_wins(tokenizer) -> None:
    """After ' little' both match in ', there was a little': 'a l' at 12 comes before 'little' at 14."""
    out = pipeline(tokenizer, stop_strings=["little", "a l"])
    push_all(out, STORY)
    assert out.token_ids == STORY[:5] and out.stop_reason == "a l" and out.text == ", there was "


def test_eos_ends_with_its_id_kept_and_no_text(tokenizer) -> None:
    out = pipeline(tokenizer)
    deltas = push_all(out, STORY[:2] + [EOS] + STORY[2:])
    assert out.token_ids == STORY[:2] + [EOS] and out.text == ", there"
    assert (deltas[-1].text, deltas[-1].finish_reason, deltas[-1].stop_reason) == ("", "stop", None)


def test_ignore_eos_goes_on_to_the_length(tokenizer) -> None:
    out = pipeline(tokenizer, max_tokens=4, ignore_eos=True)
    push_all(out, [432, EOS, 383, 286, 261])
    assert out.token_ids == [432, EOS, 383, 286] and out.finish_reason == "length"
    assert out.text == ", there was"  # </s> is a special token: skipped in the text


def test_a_stop_token_id_is_the_stop_reason_and_its_text_is_dropped(tokenizer) -> None:
    out = pipeline(tokenizer, stop_token_ids=[286])
    push_all(out, STORY)
    assert out.token_ids == STORY[:3] and out.text == ", there"
    assert (out.finish_reason, out.stop_reason) == ("stop", 286)
    kept = pipeline(tokenizer, stop_token_ids=[286], include_stop_str_in_output=True)
    push_all(kept, STORY)
    assert kept.text == ", there was"


def test_min_new_tokens_ignores_stops_before_it(tokenizer) -> None:
    """EOS at token 2 and the stop id 383 at token 3 come before min_new_tokens=4: both are ordinary tokens; the
    EOS at token 5 stops."""
    out = pipeline(tokenizer, min_new_tokens=4, stop_token_ids=[383])
    push_all(out, [432, EOS, 383, 286, EOS, 261])
    assert out.token_ids == [432, EOS, 383, 286, EOS] and out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == ", there was"


def test_a_callers_criterion_and_an_outside_finish(tokenizer) -> None:
    out = pipeline(tokenizer, stop_strings=["girl"])
    push_all(out, STORY[:5])
    assert out.push(298, -1.0, stop=True).finish_reason == "stop" and out.stop_reason is None
    assert out.text == ", there was a little g"  # the criterion ends it: the held 'g' is released
    aborted = pipeline(tokenizer, stop_strings=["girl"])
    push_all(aborted, STORY[:6])
    delta = aborted.finish("abort")
    assert (delta.text, delta.finish_reason) == ("g", "abort") and delta.token_ids == []
    with pytest.raises(AssertionError):
        aborted.push(315, -1.0)


def test_token_logprobs_by_hand() -> None:
    """log_softmax of log([0.1, 0.2, 0.3, 0.4]) is the same vector (it sums to one)."""
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    lp, top = token_logprobs(logits, 2, 2)
    assert lp == pytest.approx(math.log(0.3), abs=1e-6)
    assert [t for t, _ in top] == [3, 2] and [v for _, v in top] == pytest.approx([math.log(0.4), math.log(0.3)])
    assert token_logprobs(logits + 5.0, 0, 0) == (pytest.approx(math.log(0.1), abs=1e-6), [])  # shift-invariant


def test_logprobs_bookkeeping_raw_or_processed_and_echo(tokenizer) -> None:
    raw = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    processed = torch.tensor([0.5, 0.5, 0.0, 0.0]).log()  # what a top-k of 2 and renormalising could leave
    out = pipeline(tokenizer, max_tokens=2, top_logprobs=1)
    assert out.logprobs_of(raw, processed, 1) == (pytest.approx(math.log(0.2)), [(3, pytest.approx(math.log(0.4)))])
    proc = pipeline(tokenizer, max_tokens=2, top_logprobs=1, logprobs_mode="processed")
    lp, top = proc.logprobs_of(raw, processed, 1)
    assert lp == pytest.approx(math.log(0.5)) and top[0][1] == pytest.approx(math.log(0.5))
    out.push(432, -0.5, [(432, -0.5)])
    out.push(383, -1.5, [(7, -1.0)])
    c = out.completion(PROMPT)
    assert c.logprobs == [-0.5, -1.5] and c.top_logprobs == [{432: -0.5}, {7: -1.0}]
    assert (c.prompt_tokens, c.completion_tokens) == (5, 2)
    echo = pipeline(tokenizer, max_tokens=1, echo=True)
    echo.push(432, -0.5)
    prompt_lps = [None] + [(-float(i), []) for i in range(1, 5)]
    e = echo.completion(PROMPT, prompt_lps, prompt_text="Once upon a time")
    assert e.text == "Once upon a time," and e.token_ids == PROMPT + [432]
    assert math.isnan(e.logprobs[0]) and e.logprobs[1:] == [-1.0, -2.0, -3.0, -4.0, -0.5]
    assert e.prompt_logprobs == [None, -1.0, -2.0, -3.0, -4.0] and e.completion_tokens == 1


def test_replay_of_a_search_row(tokenizer) -> None:
    """A finished beam's tokens through the same stops: cut at the stop string; or ended by the search itself."""
    cfg = GenerationConfig(max_new_tokens=20, stop_strings=["girl"], eos_token_id=EOS)
    cut = replay(cfg, STORY, [-1.0] * len(STORY), IncrementalDetokenizer(tokenizer, True, prompt_ids=PROMPT), True)
    assert (cut.text, cut.finish_reason, cut.stop_reason, len(cut.token_ids)) == (", there was a little ", "stop",
                                                                                   "girl", 8)
    ended = replay(cfg, STORY[:3], [-1.0] * 3, IncrementalDetokenizer(tokenizer, True, prompt_ids=PROMPT), False)
    assert (ended.text, ended.finish_reason) == (", there was", "length")
