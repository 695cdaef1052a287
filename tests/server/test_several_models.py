"""Several models in one server (`--model NAME=PATH` more than once, docs/serving.md#several-models): each request
goes to the model it names, loaded on its first request; /v1/models lists every model with its state; idle models
unload and load again; a memory budget that holds one model at a time swaps them without a failed request; a
damaged model file fails its own requests only, with the reason; the admin routes load and unload, behind the key.

Models: stories260K (a real tokenizer), a tiny random Llama (no tokenizer) and a tiny random Qwen2 written as a
GGUF file as llama.cpp's converter writes it (no tokenizer); the reference for each is transformers' greedy
decoding on the same weights."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import requires_shared
from prometheus_client.parser import text_string_to_metric_families
from support.gguf_writer import reference_tokens, write_model
from support.server import start_server, stop_server
from support.tiny_models import build_hf_model

pytestmark = requires_shared

KEY = "sk-admin"
NEW = 8
IDS = {"stories": [1, 403, 407, 261, 300], "llama": [1, 5, 17, 33, 40], "gguf": [1, 40, 41, 42, 43, 44]}


@pytest.fixture(scope="module")
def models(model_dir, tmp_path_factory):
    """{name: (path, reference greedy tokens)}: the three models on disk, and a truncated GGUF file."""
    import transformers

    root = tmp_path_factory.mktemp("several")
    stories = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llama = build_hf_model("llama", seed=1)
    llama.save_pretrained(root / "llama")
    qwen = build_hf_model("qwen2", seed=2)
    held = write_model(root / "gguf" / "tiny-qwen.gguf", "qwen2", qwen)
    data = (root / "gguf" / "tiny-qwen.gguf").read_bytes()
    (root / "broken.gguf").write_bytes(data[: len(data) * 2 // 3])  # cut off in the middle of its tensors
    refs = {name: _greedy(model, IDS[name]) for name, model in (("stories", stories), ("llama", llama))}
    refs["gguf"] = reference_tokens(qwen, held, IDS["gguf"], NEW)
    return {"stories": (model_dir, refs["stories"]), "llama": (root / "llama", refs["llama"]),
            "gguf": (root / "gguf" / "tiny-qwen.gguf", refs["gguf"]), "broken": (root / "broken.gguf", None)}


def _greedy(model, ids: list[int]) -> list[int]:  # noqa: ANN001
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _flags(models: dict, *names: str) -> list[str]:
    return [arg for name in names for arg in ("--model", f"{name}={models[name][0]}")]


PRESETS = """
[models.llama]
max_model_len = 64
aliases = ["tiny"]

[models.stories]
chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
"""


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    presets = tmp_path_factory.mktemp("presets") / "presets.toml"
    presets.write_text(PRESETS)
    proc, url = start_server(f"stories={models['stories'][0]}", *_flags(models, "llama", "gguf", "broken"),
                             "--api-key", KEY, "--idle-unload-seconds", "5", "--presets", str(presets))
    yield url
    stop_server(proc)


def _tokens(url: str, name: str, key: str | None = KEY) -> list[int]:
    """The model's greedy tokens for IDS[name], read off the logprobs (the tokenizer-less models' text is empty)."""
    body = {"model": name, "prompt": IDS[name], "max_tokens": NEW, "temperature": 0, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=_auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return [int(t.rsplit(":", 1)[1]) if t.startswith("token_id:") else t
            for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _expected(models: dict, name: str) -> list:
    """The reference tokens as the server shows them: ids, or stories260K's token texts."""
    ref = models[name][1]
    if name != "stories":
        return ref
    from nexttoken.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(models["stories"][0])
    return [tok.token_text(i) for i in ref]


def _states(url: str) -> dict[str, str]:
    cards = httpx.get(url + "/v1/models", headers=_auth(KEY), timeout=30).json()["data"]
    return {c["id"]: c["status"]["value"] for c in cards}


def _metrics(url: str, key: str | None = KEY) -> dict:
    text = httpx.get(url + "/metrics", headers=_auth(key), timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_models_are_listed_unloaded_until_asked_for(served) -> None:
    states = _states(served)
    assert states == {"stories": "unloaded", "llama": "unloaded", "tiny": "unloaded", "gguf": "unloaded",
                      "broken": "unloaded"}


def test_each_model_answers_as_alone_interleaved_and_concurrent(served, models) -> None:
    names = ["stories", "llama", "gguf"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: _tokens(served, n), names))
    for name, tokens in zip(names, got):
        assert tokens == _expected(models, name), name
    for name in ("llama", "stories", "gguf"):  # and one after another
        assert _tokens(served, name) == _expected(models, name)
    card = next(c for c in httpx.get(served + "/v1/models", headers=_auth(KEY)).json()["data"] if c["id"] == "llama")
    assert card["status"]["value"] == "loaded" and card["max_model_len"] == 64  # its preset's, not the file's 128
    assert card["status"]["weights_bytes"] > 0 and card["status"]["kv_cache_bytes"] > 0


def test_presets_give_each_model_its_settings(served, models) -> None:
    body = {"model": "tiny", "prompt": IDS["llama"], "max_tokens": NEW, "temperature": 0, "logprobs": 0}
    r = httpx.post(served + "/v1/completions", json=body, headers=_auth(KEY), timeout=120)
    assert r.json()["model"] == "tiny" and len(r.json()["choices"][0]["logprobs"]["tokens"]) == NEW  # an alias
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{i}" for i in models["llama"][1]]
    chat = httpx.post(served + "/tokenize", headers=_auth(KEY), timeout=60,
                      json={"model": "stories", "messages": [{"role": "user", "content": "Once upon a time"}]})
    from nexttoken.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(models["stories"][0])  # the preset's template, not the folder's (support/server.py)
    assert chat.json()["tokens"] == tok.encode("<Once upon a time>", add_special_tokens=False)


def test_unknown_model_is_a_404_naming_the_served_ones(served) -> None:
    r = httpx.post(served + "/v1/chat/completions", headers=_auth(KEY), timeout=30,
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(repr(n) in r.json()["error"]["message"] for n in ("stories", "llama", "gguf", "broken"))
    r = httpx.post(served + "/v1/messages", headers=_auth(KEY), timeout=30,
                   json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["type"] == "error" and "'stories'" in r.json()["error"]["message"]


def test_a_damaged_file_fails_its_own_requests_with_the_reason(served, models) -> None:
    r = httpx.post(served + "/v1/completions", headers=_auth(KEY), timeout=120,
                   json={"model": "broken", "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "model_unavailable" and "'broken' failed to load" in error["message"]
    assert "truncated GGUF file" in error["message"]  # the loader's own reason
    assert _states(served)["broken"] == "failed"
    card = next(c for c in httpx.get(served + "/v1/models", headers=_auth(KEY)).json()["data"] if c["id"] == "broken")
    assert card["status"]["reason"] and card["status"]["reason"] in error["message"]
    assert _tokens(served, "llama") == _expected(models, "llama")  # the others keep serving


def test_admin_load_and_unload_behind_the_key(served, models) -> None:
    assert httpx.post(served + "/admin/models/llama/unload", timeout=30).status_code == 401
    r = httpx.post(served + "/admin/models/llama/unload", headers=_auth(KEY), timeout=60)
    assert r.status_code == 200 and r.json()["status"]["value"] == "unloaded"
    assert _states(served)["llama"] == "unloaded"
    r = httpx.post(served + "/admin/models/llama/load", headers=_auth(KEY), timeout=120)
    assert r.status_code == 200 and r.json()["status"]["value"] == "loaded"
    assert httpx.post(served + "/admin/models/nope/load", headers=_auth(KEY), timeout=30).status_code == 404
    assert _tokens(served, "llama") == _expected(models, "llama")


def test_idle_models_unload_and_load_again(served, models) -> None:
    body = {"model": "gguf", "prompt": IDS["gguf"], "max_tokens": NEW, "temperature": 0, "stream": True}
    with httpx.stream("POST", served + "/v1/completions", json=body, headers=_auth(KEY), timeout=120) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"  # a streamed answer holds the model until its end
    before = _metrics(served)
    assert before[("nexttoken_model_active_requests", (("model", "gguf"),))] == 0
    assert before[("nexttoken_model_state", (("model", "gguf"), ("state", "loaded")))] == 1
    assert before[("nexttoken_model_kv_cache_bytes", (("model", "gguf"),))] > 0
    deadline = time.monotonic() + 30
    while _states(served)["gguf"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _states(served)["gguf"] == "unloaded"
    after = _metrics(served)
    assert after[("nexttoken_model_unloads_total", (("model", "gguf"),))] > before.get(
        ("nexttoken_model_unloads_total", (("model", "gguf"),)), 0)
    assert after[("nexttoken_model_kv_cache_bytes", (("model", "gguf"),))] == 0
    assert _tokens(served, "gguf") == _expected(models, "gguf")  # loaded again by its request
    assert _states(served)["gguf"] == "loaded"


def test_ollama_lists_every_model_and_routes_to_the_named_one(served, models) -> None:
    """/api/tags lists every model under each name with its state, /api/ps the loaded ones with their expiry;
    /api/chat answers from the model it names (as /v1/chat/completions does), keep_alive sets its idle time, and
    /metrics labels the vllm:* samples with each model's name."""
    messages = [{"role": "user", "content": "Once upon a time"}]
    r = httpx.post(served + "/api/chat", headers=_auth(KEY), timeout=120, json={
        "model": "stories:latest", "messages": messages, "stream": False, "keep_alive": -1,
        "options": {"temperature": 0, "num_predict": NEW}})
    assert r.status_code == 200, r.text
    openai = httpx.post(served + "/v1/chat/completions", headers=_auth(KEY), timeout=120, json={
        "model": "stories", "messages": messages, "temperature": 0, "max_tokens": NEW}).json()
    assert r.json()["message"]["content"] == openai["choices"][0]["message"]["content"] != ""
    for name, family in (("gguf:latest", "qwen2"), ("tiny", "llama")):  # not the first model: routed by name
        shown = httpx.post(served + "/api/show", headers=_auth(KEY), timeout=120, json={"name": name}).json()
        assert shown["model_info"]["general.architecture"] == family, shown
    assert _tokens(served, "llama") == _expected(models, "llama")
    listed = httpx.get(served + "/api/tags", headers=_auth(KEY)).json()["models"]
    tags = {m["name"]: m["status"]["value"] for m in listed}
    states = _states(served)  # /v1/models' (gguf's may have gone idle since)
    assert {k: v for k, v in tags.items() if k != "gguf:latest"} == {f"{n}:latest": v for n, v in states.items()
                                                                     if n != "gguf"}
    assert set(tags) == {"stories:latest", "llama:latest", "tiny:latest", "gguf:latest", "broken:latest"}
    assert tags["stories:latest"] == tags["llama:latest"] == "loaded"
    running = {m["name"]: m for m in httpx.get(served + "/api/ps", headers=_auth(KEY)).json()["models"]}
    assert {"stories:latest", "llama:latest"} <= set(running) and "broken:latest" not in running
    assert running["stories:latest"]["expires_at"].startswith("9999")  # keep_alive -1: for good
    assert not running["llama:latest"]["expires_at"].startswith("9999")  # --idle-unload-seconds 5
    metrics = _metrics(served)
    for name in ("stories", "llama"):
        assert metrics[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", name)))] >= 1
    assert ("vllm:generation_tokens_total", (("model_name", "llama"),)) in metrics
    missing = httpx.post(served + "/api/chat", headers=_auth(KEY), timeout=30,
                         json={"model": "nope", "messages": messages})
    assert missing.status_code == 404 and list(missing.json()) == ["error"]  # Ollama's body
    error = missing.json()["error"]
    assert error.startswith("model 'nope' not found") and "'stories:latest'" in error
    r = httpx.post(served + "/api/chat", headers=_auth(KEY), timeout=30,
                   json={"model": "stories", "messages": [], "keep_alive": 0})  # Ollama's unload
    assert r.json()["done_reason"] == "unload"
    deadline = time.monotonic() + 30
    while _states(served)["stories"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _states(served)["stories"] == "unloaded"


# ---- a memory budget that holds one model at a time -------------------------------------------------------------

@pytest.fixture(scope="module")
def budgeted(models):
    """stories260K and the tiny Llama under a budget of 12 MB: either model's pool for 256 sequences of its whole
    context (167 MB, 16 MB) would take more, so each fitted pool takes the room left and either model's load unloads
    the other."""
    proc, url = start_server(f"stories={models['stories'][0]}", *_flags(models, "llama"), "--memory-budget", "12MB",
                             "--max-num-seqs", "256")
    yield proc, url
    stop_server(proc)


def test_a_budget_for_one_model_swaps_them_without_a_failed_request(budgeted, models) -> None:
    proc, budgeted = budgeted
    names = ["stories", "llama"] * 4
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda n: _tokens(budgeted, n, None), names))
    for name, tokens in zip(names, got):
        assert tokens == _expected(models, name), name
    metrics = _metrics(budgeted, None)
    assert metrics[("nexttoken_memory_budget_bytes", ())] == 12_000_000
    assert metrics[("nexttoken_memory_held_bytes", ())] <= 12_000_000
    loaded = [n for n in ("stories", "llama")
              if metrics[("nexttoken_model_state", (("model", n), ("state", "loaded")))] == 1]
    assert len(loaded) == 1  # never both
    assert sum(metrics[("nexttoken_model_unloads_total", (("model", n),))] for n in ("stories", "llama")) >= 1
    card = next(c for c in httpx.get(budgeted + "/v1/models").json()["data"] if c["id"] == loaded[0])
    status = card["status"]
    assert status["weights_bytes"] + status["kv_cache_bytes"] + status["runtime_bytes"] <= 12_000_000
    context = {"stories": 512, "llama": 128}[loaded[0]]
    assert card["max_model_len"] == context and context <= status["kv_tokens"] < 256 * context  # fitted to the room
    log = proc.stdout.read().decode()
    assert "model 'stories' loaded in" in log and "model 'llama' loaded in" in log and "KV pool" in log
    assert "unloaded (to make room for" in log


def test_admin_routes_are_refused_without_a_key(budgeted) -> None:
    r = httpx.post(budgeted[1] + "/admin/models/llama/load", timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"

