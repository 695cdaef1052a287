"""The high-level API on a real model: Completion fields, stop strings, streaming, chat, user hooks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken import ChatTemplateError, Completion, generate

PROMPT = "Once upon a time"
# llama2.c's greedy continuation (../shared/reference): "Once upon a time, there was a little girl named Lily. ..."


@pytest.fixture(scope="module")
def stories_dir(shared_dir) -> Path:
    return shared_dir / "models" / "stories260k"


@pytest.fixture(scope="module")
def stories(stories_dir):
    return nexttoken.load(stories_dir)


@pytest.fixture(scope="module")
def hf_stories(stories_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(stories_dir).eval()


def test_completion_fields(stories) -> None:
    result = stories.generate(PROMPT, max_new_tokens=20)
    assert isinstance(result, Completion)
    assert result.prompt_token_ids == stories.tokenizer.encode(PROMPT)
    assert result.prompt_token_ids[0] == 1  # add_bos_token
    assert len(result.token_ids) == 20 and len(result.logprobs) == 20
    assert result.finish_reason == "length"
    assert result.text == stories.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.text.startswith(", there was a little girl named Lily.")


def test_logprobs_equal_transformers_log_softmax(stories, hf_stories) -> None:
    result = stories.generate(PROMPT, max_new_tokens=12)
    ids = torch.tensor([result.prompt_token_ids])
    out = hf_stories.generate(ids, max_new_tokens=12, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    assert out.sequences[0, ids.shape[1]:].tolist() == result.token_ids
    expected = [torch.log_softmax(l[0].float(), -1)[t].item() for l, t in zip(out.logits, result.token_ids)]
    assert result.logprobs == pytest.approx(expected, abs=1e-4)
    assert all(lp <= 0 for lp in result.logprobs)


def test_eos_from_generation_config_stops_with_stop_reason(stories) -> None:
    assert stories.generation_config.eos_ids == [2, 1]
    result = stories.generate("The little dog", max_new_tokens=300)
    assert result.finish_reason == "stop" and result.token_ids[-1] == 1
    assert 1 not in result.token_ids[:-1]


@pytest.mark.parametrize(
    "stop,expected_text",
    [
        ([" Lily"], ", there was a little girl named"),
        (" girl named", ", there was a little"),  # spans token boundaries
        (["zzz", "was a"], ", there "),  # the earliest match wins
    ],
)
def test_stop_strings_end_the_text_before_the_match(stories, stop, expected_text) -> None:
    result = stories.generate(PROMPT, max_new_tokens=60, stop_strings=stop)
    assert result.text == expected_text
    assert result.finish_reason == "stop"
    full = stories.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert full.startswith(expected_text) and full != expected_text  # the completing token is kept in the ids
    streamed = "".join(stories.stream(PROMPT, max_new_tokens=60, stop_strings=stop))
    assert streamed == expected_text


def test_stream_equals_generate_with_sampling(stories) -> None:
    options = dict(do_sample=True, temperature=1.2, top_p=0.95, seed=11, max_new_tokens=80)
    assert "".join(stories.stream(PROMPT, **options)) == stories.generate(PROMPT, **options).text


def test_batch_equals_one_by_one(stories) -> None:
    prompts = ["Tom and his dog", "Lily", "Sam had a red ball and a big"]
    batched = stories.generate(prompts, max_new_tokens=40, repetition_penalty=1.2)
    for prompt, result in zip(prompts, batched):
        alone = stories.generate(prompt, max_new_tokens=40, repetition_penalty=1.2)
        assert result.token_ids == alone.token_ids and result.text == alone.text
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_transformers_processor_objects_work_unchanged(stories, hf_stories) -> None:
    from transformers import NoRepeatNGramLogitsProcessor

    ids = torch.tensor([stories.tokenizer.encode(PROMPT)])
    expected = hf_stories.generate(ids, max_new_tokens=40, do_sample=False,
                                   logits_processor=[NoRepeatNGramLogitsProcessor(1)])
    got = generate(stories.model, ids, max_new_tokens=40, logits_processor=[NoRepeatNGramLogitsProcessor(1)])
    assert torch.equal(got, expected)
    plain = generate(stories.model, ids, max_new_tokens=40)
    assert not torch.equal(got, plain)  # the processor really acted


def test_user_processor_callable_sees_ids_and_scores(stories) -> None:
    seen = []

    def ban_the(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen.append(input_ids.shape)
        the = stories.tokenizer.encode(" the", add_special_tokens=False)[0]
        return scores.index_fill(1, torch.tensor([the]), float("-inf"))

    ids = torch.tensor([stories.tokenizer.encode(PROMPT)])
    out = generate(stories.model, ids, max_new_tokens=30, logits_processor=ban_the)
    the = stories.tokenizer.encode(" the", add_special_tokens=False)[0]
    assert the not in out[0, ids.shape[1]:].tolist()
    assert the in generate(stories.model, ids, max_new_tokens=30)[0, ids.shape[1]:].tolist()
    assert seen[0] == ids.shape and seen[1] == (1, ids.shape[1] + 1)
    # The same callable through the high-level API.
    result = stories.generate(PROMPT, max_new_tokens=30, logits_processor=[ban_the])
    assert result.token_ids == out[0, ids.shape[1]:].tolist()


def test_user_stopping_criteria_one_bool_per_row(stories) -> None:
    from transformers import EosTokenCriteria

    period = stories.tokenizer.encode(".", add_special_tokens=False)[-1]
    prompts = ["Once upon a time", "Tom and his dog went"]
    ids = [stories.tokenizer.encode(p) for p in prompts]
    width = max(map(len, ids))
    batch = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = (torch.arange(width) >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
    out = generate(stories.model, batch, attention_mask=mask, max_new_tokens=60, pad_token_id=0,
                   stopping_criteria=[EosTokenCriteria(eos_token_id=period)], return_dict_in_generate=True)
    for row in out.sequences[:, width:].tolist():
        assert period in row
        after = row[row.index(period) + 1 :]
        assert all(t == 0 for t in after)  # finished rows are padded
    assert out.finished.all()


def test_transformers_style_streamer(stories) -> None:
    class Collect:
        def __init__(self) -> None:
            self.chunks: list[torch.Tensor] = []
            self.ended = False

        def put(self, value: torch.Tensor) -> None:
            self.chunks.append(value)

        def end(self) -> None:
            self.ended = True

    ids = torch.tensor([stories.tokenizer.encode(PROMPT)])
    streamer = Collect()
    out = generate(stories.model, ids, max_new_tokens=10, streamer=streamer)
    assert streamer.ended and torch.equal(streamer.chunks[0], ids)
    assert torch.cat([c.view(-1) for c in streamer.chunks[1:]]).tolist() == out[0, ids.shape[1]:].tolist()


def test_return_dict_scores_and_logits(stories) -> None:
    ids = torch.tensor([stories.tokenizer.encode(PROMPT)])
    out = generate(stories.model, ids, max_new_tokens=5, return_dict_in_generate=True, output_scores=True,
                   output_logits=True, repetition_penalty=1.5)
    assert len(out.scores) == 5 and len(out.logits) == 5
    assert out.scores[0].shape == (1, 512)
    assert not torch.equal(out.scores[0], out.logits[0])  # processed vs raw
    assert out.sequences.shape == (1, ids.shape[1] + 5)


def test_chat_without_template_says_so(stories) -> None:
    with pytest.raises(ChatTemplateError, match="chat_template"):
        stories.chat([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def stories_with_template(stories_dir, tmp_path_factory) -> nexttoken.LLM:
    d = tmp_path_factory.mktemp("chat")
    for f in stories_dir.iterdir():
        os.symlink(f, d / f.name)
    cfg = json.loads((stories_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ bos_token if loop.first }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (d / "tokenizer_config.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return nexttoken.load(d)


def test_chat_renders_the_template_and_generates(stories_with_template) -> None:
    llm = stories_with_template
    messages = [{"role": "user", "content": "Tell me a story"}]
    result = llm.chat(messages, max_new_tokens=20)
    rendered = "<s>user: Tell me a story\nassistant:"
    assert result.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert result.prompt_token_ids.count(1) == 1  # BOS written once, by the template
    assert result.text == llm.generate(result.prompt_token_ids, max_new_tokens=20).text
    assert "".join(llm.stream_chat(messages, max_new_tokens=20)) == result.text


def test_text_continues_the_prompt_keeping_its_leading_space(stories) -> None:
    """SentencePiece decoders strip a text's first space; the completion must still read on from the prompt."""
    prompt = "Once upon a time, there was a little girl"
    result = stories.generate(prompt, max_new_tokens=6)
    assert result.text.startswith(" named Lily")
    full = stories.tokenizer.decode(result.prompt_token_ids + result.token_ids, skip_special_tokens=True)
    assert prompt + result.text == full
    assert "".join(stories.stream(prompt, max_new_tokens=6)) == result.text
    assert stories.generate([prompt, "Tom"], max_new_tokens=6)[0].text == result.text  # the engine path too


def test_seeded_batch_of_identical_prompts_samples_different_rows(stories) -> None:
    options = dict(do_sample=True, temperature=1.0, seed=5, max_new_tokens=30)
    rows = stories.generate(["Once upon a time"] * 4, **options)
    assert len({tuple(r.token_ids) for r in rows}) == 4
    assert rows[0].token_ids == stories.generate("Once upon a time", **options).token_ids  # row 0 draws from seed
    again = stories.generate(["Once upon a time"] * 4, **options)
    assert [r.token_ids for r in again] == [r.token_ids for r in rows]
