"""One request path: `LLM.generate` (one prompt or a list), `LLM.stream`, `LLM.chat` and the HTTP server give the
same tokens, text, finish reasons and log-probs for the same request, and every single-sequence option of the
library works over HTTP (the real `openai` client, `extra_body`) with the tokens the Python API gives."""

from __future__ import annotations

import openai
import pytest
import torch

import nexttoken
from nexttoken.errors import GenerationConfigError

from support.server import model_id

PROMPT, OTHER = "The little bird", "Tom saw a"
MESSAGES = [{"role": "user", "content": "Tell me about a cat"}]
NEW = 14

# (library options, the same request's OpenAI fields): each row a point of the grid.
GRID = [
    pytest.param(dict(do_sample=False), dict(temperature=0), id="greedy"),
    pytest.param(dict(do_sample=True, temperature=0.8, top_p=0.9, seed=3), dict(temperature=0.8, top_p=0.9, seed=3),
                 id="sampled"),
    pytest.param(dict(do_sample=False, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
                 dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
                      extra_body=dict(repetition_penalty=1.3)), id="penalties"),
    pytest.param(dict(do_sample=False, stop_strings=["."]), dict(temperature=0, stop=["."]), id="stop-string"),
    pytest.param(dict(do_sample=False, min_new_tokens=6, top_logprobs=3), dict(temperature=0, extra_body=dict(
        min_tokens=6)), id="min-tokens-top-logprobs"),
    pytest.param(dict(do_sample=True, top_k=4, min_p=0.05, seed=9, logprobs_mode="processed"),
                 dict(seed=9, extra_body=dict(top_k=4, min_p=0.05, logprobs_mode="processed")), id="processed-logprobs"),
]


def _pieces(llm, ids: list[int]) -> list[str]:  # noqa: ANN001
    return [llm.tokenizer.token_text(i) for i in ids]  # the text each token adds, as OpenAI reports it


@pytest.mark.parametrize("options, fields", GRID)
def test_every_entry_point_gives_the_same_sequence(llm, client, options, fields) -> None:
    options = {"top_k": None, "max_new_tokens": NEW, **options}  # OpenAI has no top_k by default
    alone = llm.generate(PROMPT, **options)
    first, second = llm.generate([PROMPT, OTHER], **options)
    assert (first.token_ids, first.text, first.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert first.logprobs == alone.logprobs  # the engine is batch-invariant: the very same numbers
    seed = {"seed": options["seed"] + 1} if "seed" in options else {}  # the i-th sequence draws from seed + i
    assert second.token_ids == llm.generate(OTHER, **{**options, **seed}).token_ids
    assert "".join(llm.stream(PROMPT, **options)) == alone.text

    r = client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=NEW, logprobs=3, **fields)
    choice = r.choices[0]
    assert choice.text == alone.text and choice.finish_reason == alone.finish_reason
    assert choice.logprobs.tokens == _pieces(llm, alone.token_ids)
    assert choice.logprobs.token_logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    if options.get("top_logprobs"):
        want = [{llm.tokenizer.token_text(i): v for i, v in top.items()} for top in alone.top_logprobs]
        assert [dict(t) for t in choice.logprobs.top_logprobs] == [pytest.approx(w, abs=1e-4) for w in want]

    said = llm.chat(MESSAGES, **options)
    chat = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=NEW, logprobs=True,
                                          **fields)
    c = chat.choices[0]
    assert c.message.content == said.text and c.finish_reason == said.finish_reason
    assert [t.token for t in c.logprobs.content] == _pieces(llm, said.token_ids)
    assert [t.logprob for t in c.logprobs.content] == pytest.approx(said.logprobs, abs=1e-4)
    streamed = client.chat.completions.create(model=model_id(client), messages=MESSAGES, max_tokens=NEW, stream=True,
                                              **fields)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == said.text


# Every option of the library's single-sequence set, by its HTTP name: (library options, request fields, visible).
# `visible`: the option changes this prompt's output, so a server that dropped it would differ from the library.
SAMPLED = dict(do_sample=True, temperature=1.0, seed=21)
REPEATED = "Once upon a time, there was a little girl. Once upon a time, there was a"  # DRY acts on repeats
OPTIONS = [
    ("typical_p", dict(SAMPLED, typical_p=0.5), dict(typical_p=0.5), True),
    ("epsilon_cutoff", dict(SAMPLED, epsilon_cutoff=0.05), dict(epsilon_cutoff=0.05), True),
    ("eta_cutoff", dict(SAMPLED, eta_cutoff=0.05), dict(eta_cutoff=0.05), True),
    ("top_h", dict(SAMPLED, top_h=0.3), dict(top_h=0.3), True),
    ("top_n_sigma", dict(SAMPLED, top_n_sigma=0.5), dict(top_n_sigma=0.5), True),
    ("xtc", dict(SAMPLED, xtc_threshold=0.05, xtc_probability=1.0), dict(xtc_threshold=0.05, xtc_probability=1.0), True),
    ("dry", dict(_prompt=REPEATED, do_sample=False, dry_multiplier=2.0, dry_base=2.0, dry_allowed_length=1, dry_penalty_last_n=0,
                 dry_sequence_breakers=[13]),
     dict(dry_multiplier=2.0, dry_base=2.0, dry_allowed_length=1, dry_penalty_last_n=0, dry_sequence_breakers=[13]),
     True),
    ("mirostat_tau", dict(SAMPLED, mirostat_tau=2.0, mirostat_eta=0.2), dict(mirostat_tau=2.0, mirostat_eta=0.2), True),
    ("mirostat (llama.cpp mode)", dict(SAMPLED, mirostat_tau=5.0), dict(mirostat=2), True),
    ("no_repeat_ngram_size", dict(do_sample=False, no_repeat_ngram_size=1), dict(no_repeat_ngram_size=1), True),
    ("bad_words_ids", dict(do_sample=False), dict(), False),  # filled in below from the plain output
    ("sequence_bias", dict(do_sample=False), dict(), False),
    ("suppress_tokens", dict(do_sample=False), dict(), False),
    ("begin_suppress_tokens", dict(do_sample=False), dict(), False),
    ("min_length", dict(do_sample=False, min_length=30, ignore_eos=False), dict(min_length=30), False),
    ("exponential_decay_length_penalty", dict(do_sample=False, exponential_decay_length_penalty=[1, 3.0]),
     dict(exponential_decay_length_penalty=[1, 3.0]), True),
    ("renormalize_logits", dict(SAMPLED, top_k=3, renormalize_logits=True, logprobs_mode="processed"),
     dict(top_k=3, renormalize_logits=True, logprobs_mode="processed"), False),
    ("remove_invalid_values", dict(do_sample=False, remove_invalid_values=True), dict(remove_invalid_values=True), False),
    ("forced_eos_token_id", dict(do_sample=False, forced_eos_token_id=2), dict(forced_eos_token_id=2), True),
    ("encoder_repetition_penalty", dict(do_sample=False, encoder_repetition_penalty=3.0),
     dict(encoder_repetition_penalty=3.0), True),
    ("encoder_no_repeat_ngram_size", dict(do_sample=False, encoder_no_repeat_ngram_size=1),
     dict(encoder_no_repeat_ngram_size=1), True),
    ("watermarking_config", dict(do_sample=False, watermarking_config={"bias": 8.0, "greenlist_ratio": 0.25}),
     dict(watermarking_config={"bias": 8.0, "greenlist_ratio": 0.25}), True),
    ("sampler_order", dict(SAMPLED, top_p=0.5, temperature=3.0, sampler_order=["top_p", "temperature"]),
     dict(top_p=0.5, temperature=3.0, sampler_order=["top_p", "temperature"]), True),
    ("guidance_scale", dict(do_sample=False, guidance_scale=3.0), dict(guidance_scale=3.0), True),
    ("max_time", dict(do_sample=False, max_time=600.0), dict(max_time=600.0), False),
    ("min_tokens", dict(do_sample=False, min_new_tokens=NEW), dict(min_tokens=NEW), False),
    ("stop_token_ids", dict(do_sample=False), dict(), True),
    ("ignore_eos", dict(do_sample=False, ignore_eos=True), dict(ignore_eos=True), False),
    ("include_stop_str_in_output", dict(do_sample=False, stop_strings=[" big"], include_stop_str_in_output=True),
     dict(stop=[" big"], include_stop_str_in_output=True), True),
    ("skip_special_tokens", dict(do_sample=False, skip_special_tokens=False), dict(skip_special_tokens=False), False),
]


def _with_plain_ids(name: str, options: dict, fields: dict, plain: list[int]) -> tuple[dict, dict]:
    """Options that name token ids: take them from the plain output, so they are sure to matter."""
    first, third = plain[0], plain[2]
    values = {
        "bad_words_ids": [[third]],
        "sequence_bias": [[[first], -50.0]],
        "suppress_tokens": [third],
        "begin_suppress_tokens": [first],
        "stop_token_ids": [third],
    }
    if name not in values:
        return options, fields
    return {**options, name: values[name]}, {**fields, name: values[name]}


@pytest.mark.parametrize("name, options, fields, visible", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_every_library_option_works_over_http(llm, client, name, options, fields, visible) -> None:
    base = {"top_k": None, "max_new_tokens": NEW}
    options = dict(options)
    prompt = options.pop("_prompt", PROMPT)
    plain = llm.generate(prompt, **base, **{k: v for k, v in options.items() if k in ("do_sample", "temperature",
                                                                                           "seed")})
    options, fields = _with_plain_ids(name, options, fields, plain.token_ids)
    ours = llm.generate(prompt, **{**base, **options})
    if visible or name in ("bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens"):
        assert (ours.token_ids, ours.text) != (plain.token_ids, plain.text), f"{name} changed nothing: pick a value"
    sampled = options.get("do_sample", False)
    top = dict(temperature=options.get("temperature", 1.0), seed=options["seed"]) if sampled else dict(temperature=0)
    r = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=NEW, logprobs=0, **top,
                                  extra_body=fields)
    choice = r.choices[0]
    shown = len(ours.token_ids) - _hidden_stop(ours, options)  # the server's log-probs leave out a hidden stop
    assert choice.logprobs.tokens == _pieces(llm, ours.token_ids[:shown]), name
    assert choice.text == ours.text and choice.finish_reason == ours.finish_reason
    assert choice.logprobs.token_logprobs == pytest.approx(ours.logprobs[:shown], abs=1e-4)


def _hidden_stop(out, options: dict) -> int:  # noqa: ANN001
    """1 when the output ended on a stop token its text leaves out (EOS or a stop token id, without
    include_stop_str_in_output), which the server's log-probs leave out too (OpenAI's and vLLM's rule), else 0."""
    by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and out.token_ids
    return int(bool(by_token) and not options.get("include_stop_str_in_output", False))


def test_options_are_checked_once_with_one_set_of_bounds(llm, client) -> None:
    """The same bad value is refused with the same GenerationConfig message by the library and the server."""
    for lib, field, value in [("top_p", "top_p", 0.0), ("temperature", "temperature", -1.0),
                              ("typical_p", "typical_p", 1.5), ("min_new_tokens", "min_tokens", -2),
                              ("dry_base", "dry_base", 0.5)]:
        with pytest.raises(GenerationConfigError) as lib_error:
            llm.generate(PROMPT, **{lib: value})
        with pytest.raises(openai.BadRequestError) as http_error:
            client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=4, extra_body={field: value})
        assert http_error.value.body["param"] == field
        assert str(lib_error.value) in http_error.value.body["message"]


def test_hooks_are_per_sequence(llm) -> None:
    class Count:
        def __init__(self) -> None:
            self.steps = 0

        def model_inputs(self, state):  # noqa: ANN001, ANN202
            return {}

        def after_step(self, state, step):  # noqa: ANN001, ANN202
            self.steps += 1

    one = Count()
    llm.generate(PROMPT, hooks=[one], max_new_tokens=5, eos_token_id=None)
    assert one.steps == 5
    with pytest.raises(GenerationConfigError, match="lambda i"):
        llm.generate([PROMPT, OTHER], hooks=[Count()], max_new_tokens=5)
    made: list[Count] = []
    llm.generate([PROMPT, OTHER], hooks=lambda i: made.append(Count()) or [made[-1]], max_new_tokens=5,
                 eos_token_id=None)
    assert [h.steps for h in made] == [5, 5]


def test_search_strategies_are_chosen_by_their_options(llm) -> None:
    """Beams go to the padded-batch search (never a fallback), and their rows through the same output pipeline."""
    ids = llm.encode(PROMPT)
    beams = llm.generate(PROMPT, num_beams=3, num_return_sequences=2, max_new_tokens=8, eos_token_id=None,
                         stop_strings=["."])
    low = nexttoken.generate(llm.model, torch.tensor([ids]), num_beams=3, num_return_sequences=2, max_new_tokens=8,
                             eos_token_id=None)
    for row, c in zip(low[:, len(ids):].tolist(), beams):
        assert row[: len(c.token_ids)] == c.token_ids
        text = llm.tokenizer.decode(ids + row, skip_special_tokens=True)[len(llm.tokenizer.decode(ids, skip_special_tokens=True)):]
        assert c.text == text.split(".")[0]
    with pytest.raises(GenerationConfigError, match="stream"):
        list(llm.stream(PROMPT, num_beams=2))
