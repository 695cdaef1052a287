"""LoRA adapters over HTTP (docs/lora.md), for real: `nexttoken serve --lora-modules ... --max-loras ...` in a
subprocess, driven by the `openai` client. The request's `model` picks the adapter; /v1/models lists adapters with
their `parent`; POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time behind the API key.
The reference is the Python API (itself held to PEFT in test_lora.py) on the same folder and adapters: stories260K
with adapters made by `peft`."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
import torch

import nexttoken

from support.lora import all_linear_adapter
from support.server import start_server, stop_server, stories_with_chat_template

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

KEY = "sesame"
PROMPTS = ["Once upon a time", "The dog ran", "Lily saw a big"]




@pytest.fixture(scope="module")
def folders(shared_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    base = stories_with_chat_template(shared_dir, root / "stories")
    out = {"base": base, "a": all_linear_adapter(base, root / "a", 0, 4), "b": all_linear_adapter(base, root / "b", 1, 8),
           "c": all_linear_adapter(base, root / "c", 2, 2), "big": all_linear_adapter(base, root / "big", 3, 32)}
    damaged = root / "damaged"
    shutil.copytree(out["a"], damaged)
    data = (damaged / "adapter_model.safetensors").read_bytes()
    (damaged / "adapter_model.safetensors").write_bytes(data[:200])
    out["damaged"] = damaged
    return out


@pytest.fixture(scope="module")
def server(folders):
    proc, url = start_server(folders["base"], "--api-key", KEY, "--lora-modules", f"a={folders['a']}",
                             "--max-loras", "2", "--max-lora-rank", "16", "--served-model-name", "stories")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(folders):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield nexttoken.load(folders["base"], lora={"a": folders["a"], "b": folders["b"]})
    torch.set_num_threads(before)


def _text(llm, prompt: str, lora: str | None) -> str:  # noqa: ANN001
    """What the server's completion text is for this prompt: the continuation, as the server decodes it."""
    ids = llm.encode(prompt)
    out = llm.generate(prompt, max_new_tokens=20, do_sample=False, lora=lora)
    return llm.tokenizer.decode(ids + out.token_ids, skip_special_tokens=True)[len(prompt):]


def test_the_model_field_picks_the_adapter(client, llm) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"stories", "a"}
    assert models["a"].parent == "stories" and models["stories"].parent is None
    for prompt in PROMPTS:
        for model, lora in (("stories", None), ("a", "a")):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
            assert r.choices[0].text == _text(llm, prompt, lora), (model, prompt)
            assert r.model == model
    assert _text(llm, PROMPTS[0], "a") != _text(llm, PROMPTS[0], None)
    chat = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0)
    assert chat.model == "a" and chat.choices[0].message.content is not None


def test_concurrent_requests_of_two_models_each_get_their_solo_output(server, llm) -> None:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
        jobs = [client.completions.create(model=m, prompt=p, max_tokens=20, temperature=0)
                for p in PROMPTS for m in ("a", "stories")]
        return [r.choices[0].text for r in await asyncio.gather(*jobs)]

    want = [_text(llm, p, lora) for p in PROMPTS for lora in ("a", None)]
    assert asyncio.run(run()) == want


def test_an_unknown_adapter_is_openais_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    error = e.value.body
    assert error["code"] == "model_not_found" and "'nope'" in error["message"] and "'a'" in error["message"]


def test_load_and_unload_at_run_time(server, client, folders, llm) -> None:
    load, unload = server + "/v1/load_lora_adapter", server + "/v1/unload_lora_adapter"
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "b", "lora_path": str(folders["b"])}
    assert httpx.post(load, json=body).status_code == 401  # behind the API key
    r = httpx.post(load, json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert {m.id for m in client.models.list().data} == {"stories", "a", "b"}
    got = client.completions.create(model="b", prompt=PROMPTS[1], max_tokens=20, temperature=0).choices[0].text
    assert got == _text(llm, PROMPTS[1], "b")
    # refused clearly, the server serving on: a full set of slots, a rank above the limit, a damaged file, a name
    # served already, an unknown name to unload
    for name, folder, status, words in (("c", "c", 400, "limit"), ("big", "big", 400, "max-lora-rank"),
                                        ("bad", "damaged", 400, "damaged"), ("a", "c", 400, "served already")):
        if name != "c":
            httpx.post(unload, json={"lora_name": "b"}, headers=auth)
        r = httpx.post(load, json={"lora_name": name, "lora_path": str(folders[folder])}, headers=auth)
        assert r.status_code == status and words in r.json()["error"]["message"], (name, r.text)
        httpx.post(load, json=body, headers=auth)
    r = httpx.post(unload, json={"lora_name": "b"}, headers=auth)
    assert r.status_code == 200
    assert httpx.post(unload, json={"lora_name": "b"}, headers=auth).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt="hi", max_tokens=2)
    assert client.completions.create(model="a", prompt=PROMPTS[0], max_tokens=20,
                                     temperature=0).choices[0].text == _text(llm, PROMPTS[0], "a")


def test_a_bad_lora_module_stops_the_server_with_its_reason(folders, capsys) -> None:
    from nexttoken.cli import main

    before = torch.get_num_threads()
    try:  # refused after the model loads, before the server listens: the same code path, in this process
        assert main(["serve", "--model", str(folders["base"]), "--lora-modules", f"big={folders['big']}"]) != 0
        assert main(["serve", "--model", str(folders["base"]), "--lora-modules", "a=x", "a=y"]) != 0
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "rank 32, above the limit 16" in err and "--max-lora-rank" in err
    assert "'a' is given twice" in err


def test_the_command_line_generates_under_an_adapter(folders, llm, capsys) -> None:
    from nexttoken.cli import main

    prompt = PROMPTS[2]
    assert main(["generate", "--model", str(folders["base"]), "--lora", f"a={folders['a']}", "--greedy",
                 "--max-new-tokens", "20", prompt]) == 0
    assert capsys.readouterr().out == prompt + _text(llm, prompt, "a") + "\n"
