"""Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`), driven by the real `ollama` Python client, unchanged, against a real server on loopback. The
reference is the OpenAI API on the same server (the same request path): the same request gives the same tokens
and the same embeddings. Bad input gets Ollama's `{"error": "..."}` body and the server keeps serving.

Model: stories260K with a plain chat template (conftest's `server`)."""

from __future__ import annotations

import json
import math
from importlib.metadata import version

import httpx
import jsonschema
import ollama
import openai
import pytest
from safetensors import safe_open
from conftest import requires_shared
from support.server import CHAT_TEMPLATE

pytestmark = requires_shared

MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me about a girl"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
# (Ollama's options, the same request's OpenAI fields)
GRID = [
    pytest.param(dict(temperature=0, num_predict=12), dict(temperature=0, max_tokens=12), id="greedy"),
    pytest.param(dict(temperature=0.9, top_p=0.9, top_k=8, min_p=0.05, seed=3, repeat_penalty=1.3,
                      presence_penalty=0.2, frequency_penalty=0.1, stop=["."], num_predict=16),
                 dict(temperature=0.9, top_p=0.9, seed=3, presence_penalty=0.2, frequency_penalty=0.1, stop=["."],
                      max_tokens=16, extra_body=dict(top_k=8, min_p=0.05, repetition_penalty=1.3)), id="sampled"),
]


@pytest.fixture(scope="module")
def apis(server):
    chat = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = chat.models.list().data[0].id
    return server, ollama.Client(host=server, timeout=120), chat, model


@pytest.mark.parametrize("options, fields", GRID)
def test_chat_gives_the_openai_tokens_whole_and_streamed(apis, options, fields) -> None:
    url, client, chat, model = apis
    ref = chat.chat.completions.create(model=model, messages=MESSAGES, **fields)
    r = client.chat(model=model, messages=MESSAGES, options=options)
    choice = ref.choices[0]
    assert r.done and r.message.role == "assistant" and r.message.content == choice.message.content
    assert r.done_reason == choice.finish_reason
    assert (r.prompt_eval_count, r.eval_count) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration >= 0 and r.load_duration == 0

    parts = list(client.chat(model=model, messages=MESSAGES, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].message.content == ""
    assert "".join(p.message.content for p in parts) == r.message.content
    assert (parts[-1].done_reason, parts[-1].eval_count, parts[-1].prompt_eval_count) == (
        r.done_reason, r.eval_count, r.prompt_eval_count)


def test_generate_is_the_templated_chat_and_raw_is_the_completion(apis) -> None:
    url, client, chat, model = apis
    greedy = dict(temperature=0, num_predict=10)
    ref = chat.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=10)
    r = client.generate(model=model, system=MESSAGES[0]["content"], prompt=MESSAGES[1]["content"], options=greedy)
    assert r.response == ref.choices[0].message.content and r.done_reason == ref.choices[0].finish_reason
    assert r.eval_count == ref.usage.completion_tokens and len(r.context) == r.prompt_eval_count + r.eval_count
    parts = list(client.generate(model=model, system=MESSAGES[0]["content"], prompt=MESSAGES[1]["content"],
                                 options=greedy, stream=True))
    assert "".join(p.response for p in parts) == r.response and parts[-1].context == r.context

    raw = client.generate(model=model, prompt="Once upon a time", raw=True, options=greedy)
    done = chat.completions.create(model=model, prompt="Once upon a time", temperature=0, max_tokens=10)
    assert raw.response == done.choices[0].text and raw.prompt_eval_count == done.usage.prompt_tokens

    # a follow-up turn: the previous answer's context, then the new prompt through the template
    follow = client.generate(model=model, prompt="And then?", context=r.context, options=greedy)
    turn = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "And then?"}]}).json()
    ref = chat.completions.create(model=model, prompt=r.context + turn["tokens"], temperature=0, max_tokens=10)
    assert follow.response == ref.choices[0].text and follow.prompt_eval_count == len(r.context) + turn["count"]


def test_format_schema_and_json(apis) -> None:
    url, client, chat, model = apis
    for seed in range(2):
        r = client.chat(model=model, messages=MESSAGES, format=SCHEMA, options=dict(seed=seed, num_predict=60))
        assert r.done_reason == "stop", r
        jsonschema.validate(json.loads(r.message.content), SCHEMA)
        ref = chat.chat.completions.create(model=model, messages=MESSAGES, seed=seed, max_tokens=60,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "output", "schema": SCHEMA}})
        assert r.message.content == ref.choices[0].message.content
    g = client.generate(model=model, prompt="Tell me about a girl", format=SCHEMA, options=dict(seed=1, num_predict=60))
    jsonschema.validate(json.loads(g.response), SCHEMA)
    r = client.chat(model=model, messages=MESSAGES, format="json", options=dict(seed=0, num_predict=6))
    ref = chat.chat.completions.create(model=model, messages=MESSAGES, seed=0, max_tokens=6,
                                       response_format={"type": "json_object"})
    assert r.message.content == ref.choices[0].message.content and r.message.content.startswith("{")


def test_embed_and_the_legacy_embeddings_equal_openai(apis) -> None:
    url, client, chat, model = apis
    texts = ["Once upon a time", "a girl named Lily"]
    r = client.embed(model=model, input=texts)
    ref = chat.embeddings.create(model=model, input=texts)
    assert r.embeddings == [d.embedding for d in ref.data]
    assert r.prompt_eval_count == ref.usage.prompt_tokens and r.model == model
    assert client.embed(model=model, input=texts[0], dimensions=8).embeddings == [
        chat.embeddings.create(model=model, input=texts[0], dimensions=8).data[0].embedding]
    legacy = client.embeddings(model=model, prompt=texts[0])
    raw = chat.embeddings.create(model=model, input=texts[0], extra_body={"normalize": False})
    assert legacy.embedding == raw.data[0].embedding  # the legacy route is not normalized, as Ollama's


def test_list_show_ps_version(apis, model_dir) -> None:
    url, client, chat, model = apis
    with safe_open(model_dir / "model.safetensors", "pt") as f:  # the checkpoint's own count
        parameters = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    card = chat.models.retrieve(model)
    listed = client.list().models
    assert [m.model for m in listed] == [f"{model}:latest"] and listed[0].size > 0
    assert listed[0].details.family == "llama" and listed[0].details.quantization_level == "F32"
    shown = client.show(f"{model}:latest")
    assert shown.template == CHAT_TEMPLATE and "completion" in shown.capabilities
    # no thinking format; tools through Hermes' preamble (the template renders none: docs/tool_calls.md)
    assert "thinking" not in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == card.max_model_len
    assert shown.modelinfo["general.parameter_count"] == parameters
    running = client.ps().models
    assert [m.model for m in running] == [f"{model}:latest"] and running[0].context_length == card.max_model_len
    assert running[0].size == listed[0].size and running[0].size_vram == 0  # on the CPU
    assert httpx.get(url + "/api/version").json() == {"version": version("nexttoken")}


def test_num_ctx_below_the_context_bounds_the_answer(apis) -> None:
    url, client, chat, model = apis
    r = client.chat(model=model, messages=MESSAGES, options=dict(temperature=0, num_predict=30))
    short = client.chat(model=model, messages=MESSAGES, options=dict(temperature=0, num_predict=30,
                                                                      num_ctx=r.prompt_eval_count + 5))
    assert (short.eval_count, short.done_reason) == (5, "length") and r.eval_count > 5
    assert r.message.content.startswith(short.message.content)


def test_streams_by_default_as_ndjson_and_loads_on_an_empty_request(apis) -> None:
    url, client, chat, model = apis
    body = {"model": model, "messages": MESSAGES[1:], "options": {"temperature": 0, "num_predict": 4.0}}  # integral
    with httpx.stream("POST", url + "/api/chat", json=body, timeout=60) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["eval_count"] == 4 and lines[-1]["done_reason"] == "length"
    r = client.chat(model=model, messages=[])
    assert (r.done, r.done_reason, r.message.content) == (True, "load", "")
    r = client.generate(model=model, prompt="", keep_alive=0)
    assert (r.done, r.done_reason, r.response) == (True, "unload", "")


@pytest.mark.parametrize("call, status, words", [
    (lambda c, m: c.chat(model="nope", messages=MESSAGES), 404, "'nope' not found"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_predictt": 3}), 400, "options.num_predictt"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_ctx": 1 << 20}), 400, "num_ctx"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_predict": 0}), 400, "num_predict"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"num_ctx": 4}), 400, "num_ctx"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"repeat_penalty": 1.2, "repeat_last_n": 64}), 400,
     "repeat_last_n"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"temperature": -1}), 400, "options.temperature"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, options={"stop": list("abcde")}), 400, "options.stop"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, think=True), 400, "does not support thinking"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, keep_alive="5 minutes"), 400, "keep_alive"),
    (lambda c, m: c.chat(model=m, messages=[{"role": "user", "content": "Hi", "images": ["aGk="]}]), 400, "images"),
    (lambda c, m: c.generate(model=m, prompt="Hi", template="{{ .Prompt }}"), 400, "template"),
    (lambda c, m: c.generate(model=m, prompt="def f(", suffix="return 1"), 400, "fill-in-the-middle"),
    (lambda c, m: c.generate(model=m, prompt="Hi", context=[1, 10 ** 6]), 400, "context"),
    (lambda c, m: c.embed(model=m, input=["a" * 4000], truncate=False), 400, "context length"),
    (lambda c, m: c.embed(model=m, input=["a"] * 2049), 400, "2049 texts"),
    (lambda c, m: c.show("nope"), 404, "not found"),
    (lambda c, m: c.chat(model=m, messages=MESSAGES, format={"type": "object", "minProperties": "x"}), 400, "format:"),
])
def test_bad_requests_get_ollamas_error_and_the_server_keeps_serving(apis, call, status, words) -> None:
    url, client, chat, model = apis
    with pytest.raises(ollama.ResponseError) as e:
        call(client, model)
    assert e.value.status_code == status and words in e.value.error, e.value.error
    assert client.chat(model=model, messages=MESSAGES, options=dict(num_predict=2)).eval_count == 2


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/api/chat", b"{not json", 400),
    ("POST", "/api/chat", b"[]", 400),
    ("POST", "/api/generate", b'{"prompt": "Hi"}', 400),
    ("GET", "/api/nothing", None, 404),
    ("GET", "/api/chat", None, 405),
])
def test_malformed_requests_get_ollamas_error_body(apis, method, path, body, status) -> None:
    url = apis[0]
    r = httpx.request(method, url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and set(r.json()) == {"error"} and r.json()["error"], r.text


def test_keep_alive_durations() -> None:
    from nexttoken.server.ollama.protocol import keep_alive_s

    assert [keep_alive_s(v) for v in ("5m", "1h30m", "300ms", "10", 0, 90, "0")] == [300, 5400, 0.3, 10, 0, 90, 0]
    assert keep_alive_s(-1) == keep_alive_s("-1m") == float("inf")


def test_the_routes_are_in_the_openapi_document(apis) -> None:
    """/openapi.json carries Ollama's routes with their bodies and Ollama's error body: test_server_fuzz.py's
    fuzzer reaches them from there."""
    doc = httpx.get(apis[0] + "/openapi.json").json()
    routes = {"/api/chat": "post", "/api/generate": "post", "/api/embed": "post", "/api/embeddings": "post",
              "/api/show": "post", "/api/tags": "get", "/api/ps": "get", "/api/version": "get"}
    assert {path: next(iter(doc["paths"][path])) for path in routes} == routes
    chat = doc["paths"]["/api/chat"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/OllamaChatRequest")
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["properties"] == {
        "error": {"type": "string"}}


def test_clients_that_send_no_json_media_type(apis) -> None:
    """Ollama takes any media type, and `curl -d` sends a form's: so do its routes here, but not from a web page
    (a browser sends Origin with every cross-origin POST)."""
    url, client, chat, model = apis
    body = json.dumps({"model": model, "prompt": "Once", "raw": True, "stream": False, "options": {"num_predict": 2}})
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(url + "/api/generate", content=body, headers=form, timeout=60)
    assert r.status_code == 200 and r.json()["eval_count"] == 2
    r = httpx.post(url + "/api/generate", content=body, headers={**form, "origin": "https://page.example"})
    assert r.status_code == 415 and set(r.json()) == {"error"}
    r = httpx.post(url + "/v1/completions", content=body, headers=form)  # the other APIs keep asking for JSON
    assert r.status_code == 415


def test_litellm_ollama_chat_route(apis, monkeypatch) -> None:
    litellm = pytest.importorskip("litellm")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its price list off the net otherwise
    url, client, chat, model = apis
    ref = chat.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=8)
    r = litellm.completion(model=f"ollama_chat/{model}", api_base=url, messages=MESSAGES, temperature=0, max_tokens=8)
    assert r.choices[0].message.content == ref.choices[0].message.content
    assert r.usage.completion_tokens == ref.usage.completion_tokens
    e = litellm.embedding(model=f"ollama/{model}", api_base=url, input=["Once upon a time"])
    assert e.data[0]["embedding"] == chat.embeddings.create(model=model, input="Once upon a time").data[0].embedding


def test_a_name_from_the_listing_works_on_the_openai_api_too(apis) -> None:
    """What a user copies from `ollama list` (`name:latest`) names the model on the OpenAI routes as well, as on
    Ollama's own OpenAI-compatible endpoint; another tag is still a 404."""
    url, client, chat, model = apis
    listed = client.list().models[0].model
    assert listed == f"{model}:latest"
    want = chat.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=8)
    got = chat.chat.completions.create(model=listed, messages=MESSAGES, temperature=0, max_tokens=8)
    assert got.choices[0].message.content == want.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        chat.chat.completions.create(model=f"{model}:other", messages=MESSAGES, max_tokens=2)
