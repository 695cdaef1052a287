"""`nexttoken serve`, for real: a server subprocess on a free loopback port, driven by the `openai` client.

The reference for every result is the Python API (`nexttoken.load(...).generate`, its own decode loop) on the
same folder: stories260K with a small chat template added in a temporary copy.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch

from support.server import MAX_N, model_id, start_server, stop_server

openai = pytest.importorskip("openai")


# ---- endpoints -----------------------------------------------------------------------------------------------------

def test_models_health_tokenize_detokenize(server, client, llm) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("stories-chat")
    assert httpx.get(server + "/health").status_code == 200
    tok = httpx.post(server + "/tokenize", json={"prompt": "Once upon a time"}).json()
    assert tok["tokens"] == llm.tokenizer.encode("Once upon a time") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512
    chat = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == llm.chat_prompt([{"role": "user", "content": "hi"}])
    detok = httpx.post(server + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == llm.tokenizer.decode(tok["tokens"])


def test_metrics_names(server, client) -> None:
    client.completions.create(model=model_id(client), prompt="The dog", max_tokens=3, temperature=0)
    text = httpx.get(server + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds",
                 "num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio",
                 "generation_tokens_per_second", "prefix_cache_hit_rate", "kv_blocks_total", "kv_blocks_free",
                 "kv_blocks_cached", "kv_cache_bytes", "num_preemptions_total", "process_resident_memory_bytes"):
        assert f"nexttoken_{name}" in text, name
    assert _metric(text, "nexttoken_time_to_first_token_seconds_count") >= 1


def _metric(text: str, name: str, default: float | None = None) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    if match is None and default is not None:
        return default  # a labelled counter appears once it is first counted
    assert match, name
    return float(match.group(1))


# ---- results equal the Python API -----------------------------------------------------------------------------------

def test_greedy_completion_equals_python_api(client, llm) -> None:
    prompt = "Once upon a time"
    ref = llm.generate(prompt, max_new_tokens=30, do_sample=False)
    r = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=30, temperature=0, logprobs=3)
    choice = r.choices[0]
    # The server's text continues the prompt (keeps the leading space the Python API's fresh decode strips).
    assert llm.tokenizer.decode(llm.encode(prompt) + ref.token_ids, skip_special_tokens=True) == prompt + choice.text
    assert choice.finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids) == len(choice.logprobs.tokens)
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
    for token, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert max(top.values()) == pytest.approx(lp, abs=1e-5)  # greedy: the chosen token is the most likely
        assert token in top


def test_stream_concatenates_to_the_full_result(client, llm) -> None:
    model = model_id(client)
    prompt = "Lily went to the park"
    # The stop string occurs in the greedy output and spans tokens: the stream must cut it, never show part of it.
    whole = llm.generate(prompt, max_new_tokens=40, top_k=None).text
    assert " big box" in whole
    expected = whole[: whole.index(" big box")]
    kwargs = dict(model=model, prompt=prompt, max_tokens=40, temperature=0, stop=[" big box"])
    full = client.completions.create(**kwargs)
    assert full.choices[0].text == expected
    assert (full.choices[0].finish_reason, full.choices[0].model_extra["stop_reason"]) == ("stop", " big box")
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == expected
    assert all(expected.startswith("".join(deltas[: i + 1])) for i in range(len(deltas)))  # nothing retracted
    ends = [(c.choices[0].finish_reason, c.choices[0].model_extra["stop_reason"]) for c in chunks
            if c.choices and c.choices[0].finish_reason]
    assert ends == [("stop", " big box")]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0)
    stream = list(client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens == 30


def test_chat_equals_python_api_with_logprobs(client, llm) -> None:
    messages = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "A story about a cat"}]
    ref = llm.chat(messages, max_new_tokens=25, do_sample=False)
    r = client.chat.completions.create(model=model_id(client), messages=messages, max_completion_tokens=25,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(ref.logprobs, abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)


@pytest.mark.parametrize("options, server_options", [
    (dict(do_sample=True, temperature=0.8, top_p=0.9, seed=3), dict(temperature=0.8, top_p=0.9, seed=3)),
    (dict(do_sample=True, top_k=5, min_p=0.05, seed=11), dict(extra_body=dict(top_k=5, min_p=0.05), seed=11)),
    (dict(do_sample=False, repetition_penalty=1.3), dict(temperature=0, extra_body=dict(repetition_penalty=1.3))),
    (dict(do_sample=False, presence_penalty=1.5, frequency_penalty=0.5),
     dict(temperature=0, presence_penalty=1.5, frequency_penalty=0.5)),
])
def test_sampling_parameters_equal_python_api(client, llm, options, server_options) -> None:
    prompt = "The little bird"
    options = {"top_k": None, **options}  # OpenAI has no top_k by default (transformers' is 50)
    ref = llm.generate(prompt, max_new_tokens=25, **options)
    r = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=25, logprobs=0, **server_options)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_n_choices_and_prompt_forms(client, llm) -> None:
    model = model_id(client)
    kwargs = dict(model=model, prompt="The cat", max_tokens=12, n=3, seed=5, temperature=1.0, logprobs=0)
    r = client.completions.create(**kwargs)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) > 1  # different seeds per choice
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.prompt_tokens == len(llm.encode("The cat"))  # counted once, not per choice
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    ids = llm.encode("The cat")
    by_text = client.completions.create(model=model, prompt=["The cat", "A dog"], max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=[ids, llm.encode("A dog")], max_tokens=8, temperature=0)
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    single = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert single.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) + len(llm.encode("A dog"))


def test_echo_with_prompt_logprobs(client, llm) -> None:
    prompt = "Once upon a time there was"
    r = client.completions.create(model=model_id(client), prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                  logprobs=1)
    choice = r.choices[0]
    ids = llm.encode(prompt)
    assert choice.text.startswith(prompt)
    assert len(choice.logprobs.tokens) == len(ids) + 5
    assert choice.logprobs.token_logprobs[0] is None
    # Independent reference: one full forward pass of the prompt through the model.
    from nexttoken.model import ForwardBatch

    model = llm.model
    cache = model.new_cache(1, len(ids))
    cols = torch.arange(len(ids))[None]
    batch = ForwardBatch.build(cols, cols, torch.ones(1, len(ids), dtype=torch.bool), len(ids), None,
                               write_start=0, last_only=False)
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids]), batch, cache).float()[0], -1)
    expected = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert choice.logprobs.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)


def test_stop_conditions(client, llm) -> None:
    model = model_id(client)
    base = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0)
    text = base.choices[0].text
    word = text.split()[3]  # a word in the middle of the greedy text
    cut = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[word])
    assert cut.choices[0].text == text[: text.index(word)]
    assert cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                     stop=word, extra_body=dict(include_stop_str_in_output=True))
    assert kept.choices[0].text == text[: text.index(word) + len(word)]
    ids = llm.encode("Once upon a time")
    greedy_ids = llm.generate("Once upon a time", max_new_tokens=40, do_sample=False).token_ids
    stop_id = greedy_ids[5]
    by_id = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                      extra_body=dict(stop_token_ids=[stop_id]))
    assert by_id.usage.completion_tokens == greedy_ids.index(stop_id) + 1
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].stop_reason == stop_id
    # logit_bias +100 on EOS (id 2) ends at once; min_tokens holds it back; ignore_eos runs to max_tokens.
    eos = client.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0, logit_bias={"2": 100})
    assert eos.usage.completion_tokens == 1 and eos.choices[0].finish_reason == "stop"
    held = client.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0, logit_bias={"2": 100},
                                     extra_body=dict(min_tokens=6))
    assert held.usage.completion_tokens == 7 and held.choices[0].finish_reason == "stop"
    ignored = client.completions.create(model=model, prompt=ids, max_tokens=20, temperature=0, logit_bias={"2": 100},
                                        extra_body=dict(ignore_eos=True, skip_special_tokens=False))
    assert ignored.usage.completion_tokens == 20 and ignored.choices[0].finish_reason == "length"
    assert ignored.choices[0].text.count("</s>") == 20
    banned = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                       logit_bias={str(greedy_ids[0]): -100}, user="someone")
    assert not banned.choices[0].text.startswith(text[:3])


# ---- concurrency and disconnects -------------------------------------------------------------------------------------

CONCURRENT_PROMPTS = [f"{name} {verb} the {thing}" for name in ("Lily", "Tom", "The cat", "A bird")
                      for verb in ("saw", "liked", "wanted", "found") for thing in ("ball", "tree")]


def _request(i: int) -> dict:
    sampled = i % 3 == 2
    return dict(prompt=CONCURRENT_PROMPTS[i], max_tokens=8 + (i * 7) % 25,
                temperature=0.9 if sampled else 0, seed=100 + i if sampled else None)


def test_32_concurrent_streams_equal_alone(server, client) -> None:
    model = model_id(client)
    assert len(CONCURRENT_PROMPTS) == 32
    alone = [client.completions.create(model=model, **_request(i)).choices[0].text for i in range(32)]

    async def one(aclient, i: int) -> str:
        stream = await aclient.completions.create(model=model, stream=True, **_request(i))
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    together = asyncio.run(run_all())
    assert together == alone


def test_disconnect_frees_the_slot(model_dir) -> None:
    """A server with one slot: after a streaming client leaves, the next request can only be served if the abort
    freed that slot (no clock involved: the event is the next request completing), and the abort is counted once."""
    proc, url = start_server(model_dir, "--max-num-seqs", "1")
    try:
        abort = 'nexttoken_requests_finished_total{finish_reason="abort"}'
        before = _metric(httpx.get(url + "/metrics").text, abort, default=0.0)
        body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # it is decoding (400 tokens to go): now leave
        after = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120).completions.create(
            model=model_id(openai.OpenAI(base_url=url + "/v1", api_key="x")), prompt="The end", max_tokens=5,
            temperature=0)
        assert after.usage.completion_tokens == 5  # the only slot was free again
        text = httpx.get(url + "/metrics").text
        assert _metric(text, abort) == before + 1
        # vLLM's name counts it too, under the model's name
        assert _metric(text, f'vllm:request_success_total{{finished_reason="abort",model_name="{after.model}"}}') == 1
    finally:
        stop_server(proc)


# ---- bad input -------------------------------------------------------------------------------------------------------

def _body(**kw) -> dict:
    return {"prompt": "Hello", "max_tokens": 4, **kw}


BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/completions", _body(model="gpt-9"), 404, "model"),
    ("wrong type", "/v1/completions", _body(temperature="0.5"), 400, "temperature"),
    ("wrong prompt type", "/v1/completions", _body(prompt=[True]), 400, "prompt"),
    ("out of range", "/v1/completions", _body(top_p=1.5), 400, "top_p"),
    ("negative max_tokens", "/v1/completions", _body(max_tokens=-1), 400, "max_tokens"),
    ("prompt too long", "/v1/completions", _body(prompt=[1] * 600), 400, "prompt"),
    ("max_tokens past context", "/v1/completions", _body(max_tokens=600), 400, "max_tokens"),
    ("too many stops", "/v1/completions", _body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("bad logit_bias key", "/v1/completions", _body(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias id outside vocab", "/v1/completions", _body(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("logit_bias value", "/v1/completions", _body(logit_bias={"5": 500}), 400, "logit_bias"),
    ("n over limit", "/v1/completions", _body(n=MAX_N + 1), 400, "n"),
    ("unknown field", "/v1/completions", _body(temprature=0.5), 400, "temprature"),
    ("empty prompt", "/v1/completions", _body(prompt=[]), 400, "prompt"),
    ("min_tokens over max_tokens", "/v1/completions", _body(min_tokens=9), 400, None),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None),
    ("oversized body", "/v1/completions", _body(prompt="x" * 30000), 413, None),
    ("detokenize outside vocab", "/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
]


@pytest.mark.parametrize("name, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_then_server_serves(server, name, path, body, status, param) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(server + "/v1/completions", json=_body(temperature=0), timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_openai_client_sees_typed_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        # temperature has one bound everywhere, GenerationConfig's [0, inf) (transformers' and vLLM's, not OpenAI's 2)
        client.completions.create(model=model_id(client), prompt="x", max_tokens=2, temperature=-0.5)
    assert info.value.body["param"] == "temperature"


def test_api_key(model_dir) -> None:
    proc, url = start_server(model_dir, "--api-key", "sekret", "--max-num-seqs", "2")
    try:
        denied = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            denied.models.list()
        assert httpx.get(url + "/health").status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=2).usage
    finally:
        stop_server(proc)


def test_loadtest_runs_and_plots(server, tmp_path) -> None:
    from nexttoken.cli import main

    plot, report = tmp_path / "load.png", tmp_path / "load.json"
    code = main(["loadtest", "--url", server, "--concurrency", "4", "--num-requests", "8", "--max-tokens", "6",
                 "--compare", "--plot", str(plot), "--json", str(report)])
    assert code == 0
    runs = json.loads(report.read_text())
    assert [r["concurrency"] for r in runs] == [1, 4]
    assert all(r["completion_tokens"] == 48 and r["failed"] == 0 for r in runs)
    assert set(runs[1]["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and runs[1]["itl_ms"]["p50"] > 0
    assert plot.stat().st_size > 10_000
