"""Stopping: transformers' own cases (huggingface/transformers tests/generation/test_stopping_criteria.py) ported,
max_time in generate, and how min_new_tokens interacts with EOS and stop strings."""

from __future__ import annotations


import pytest
import torch

from nexttoken.errors import GenerationConfigError
from nexttoken.generation import generate
from nexttoken.generation.stopping import EosToken, MaxLength, MaxTime, StoppingChain, StopStrings
from support.decoding import PROMPTS, left_padded, model_pair


def tensors(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 250, (3, length), generator=torch.Generator().manual_seed(length))
    return ids, torch.ones((3, length)) / length


class FakeClock:
    """A clock the test moves by hand: no test depends on how fast the machine runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_list_criteria() -> None:
    criteria = StoppingChain([MaxLength(10), MaxTime(0.1, clock=FakeClock())])
    assert not all(criteria(*tensors(5)))
    assert not all(criteria(*tensors(9)))
    assert all(criteria(*tensors(10)))


def test_max_length_criteria() -> None:
    criteria = MaxLength(10)
    assert not all(criteria(*tensors(5)))
    assert not all(criteria(*tensors(9)))
    assert all(criteria(*tensors(10)))


def test_max_time_criteria() -> None:
    ids, scores = tensors(5)
    clock = FakeClock()
    criterion = MaxTime(0.125, clock=clock)  # binary fractions: the sums below are exact
    assert not any(criterion(ids, scores))
    clock.now += 0.125  # exactly max_time: not yet past it
    assert not any(criterion(ids, scores))
    clock.now += 0.0625
    assert all(criterion(ids, scores))
    assert all(MaxTime(0.1, start=clock.now - 0.2, clock=clock)(ids, scores))


def test_eos_token_criteria() -> None:
    criteria = EosToken([0])
    ids, scores = tensors(5)
    ids[:, -1] = 0
    assert all(criteria(ids, scores))
    ids, scores = tensors(5)
    ids[:2, -1] = 0
    ids[2, -1] = 1
    assert criteria(ids, scores).tolist() == [True, True, False]
    ids[:, -1] = 1
    assert criteria(ids, scores).tolist() == [False, False, False]


class Letters:
    """A character tokenizer: id i is one character (what transformers' stop-string tests get from gpt2)."""

    ALPHABET = "<|im_start|>end stop"

    def __init__(self) -> None:
        self.chars = sorted(set(self.ALPHABET + "abcdefghijklmnopqrstuvwxyzN"))

    def encode(self, text: str) -> list[int]:
        return [self.chars.index(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.chars[i % len(self.chars)] for i in ids)


def test_stop_string_cases() -> None:
    tok = Letters()
    stops = ["<|im_end|>", "stop", "e nd"]
    true_strings = ["<|im_start|><|im_end|>", "<|im_start|><|im_end|<|im_end|>", ">><|im_start|>>stop", "stop", "e nd"]
    # transformers' false cases that contain no stop string (its criterion only looks at the end of the text;
    # ours, checked every step, looks at a recent window, so a stop string earlier in it also counts)
    false_strings = ["<|im_start|><|im_end|", "<|im_start|><|im_end|<|im_end|", "end", "en d", "eNd", "<|im_end|",
                     "|im_end|>", "s"]
    criterion = StopStrings(tok, stops, prompt_length=0)
    for text in true_strings:
        assert criterion(torch.tensor([tok.encode(text)]), None).tolist() == [True], text
    for text in false_strings:
        assert criterion(torch.tensor([tok.encode(text)]), None).tolist() == [False], text


def test_max_time_stops_generate() -> None:
    _, ours = model_pair()
    out = generate(ours, torch.tensor([[1, 5, 6]]), max_new_tokens=50, max_time=1e-9, eos_token_id=None,
                   return_dict_in_generate=True)
    assert out.sequences.shape[1] == 4 and bool(out.finished[0])  # the first check already stops it
    with pytest.raises(GenerationConfigError):
        generate(ours, torch.tensor([[1, 5, 6]]), max_time=0)


def test_min_new_tokens_holds_back_eos_like_transformers() -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    first = generate(ours, ids, attention_mask=mask, max_new_tokens=1, eos_token_id=None)[:, -1].tolist()
    kw = dict(max_new_tokens=8, eos_token_id=first, pad_token_id=0)
    assert generate(ours, ids, attention_mask=mask, **kw).shape[1] == ids.shape[1] + 1  # EOS right away
    got = generate(ours, ids, attention_mask=mask, min_new_tokens=3, **kw)
    want = hf.generate(input_ids=ids, attention_mask=mask, min_new_tokens=3, **kw)
    assert torch.equal(got, want) and got.shape[1] >= ids.shape[1] + 4


def test_min_new_tokens_does_not_hold_back_stop_strings() -> None:
    # transformers' semantics: min_new_tokens only bans EOS; a stop string may still end the text earlier.
    _, ours = model_pair()
    tok = Letters()
    prompt = torch.tensor([[1, 5, 17, 33]])
    first = int(generate(ours, prompt, max_new_tokens=1, eos_token_id=None)[0, -1])
    stop = tok.decode([first])
    out = generate(ours, prompt, max_new_tokens=6, min_new_tokens=4, eos_token_id=[2], stop_strings=stop,
                   tokenizer=tok, return_dict_in_generate=True)
    assert out.sequences.shape[1] == 5 and bool(out.finished[0])
