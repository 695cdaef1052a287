"""Run-time LoRA loading at default settings, over HTTP (docs/lora.md): `nexttoken serve --lora-modules a=...` has
one adapter slot; three more adapters loaded with POST /v1/load_lora_adapter are served at once, more adapters than
slots, concurrent requests of all four and the base each getting their own adapter's tokens (PEFT's
`PeftModel.generate`, decoded by the server's tokenizer). And a request racing its adapter's unload is OpenAI's 404
model_not_found, not a 400. Model: stories260K with adapters made by `peft`."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from nexttoken.text.tokenizer import Tokenizer
from support.lora import all_linear_adapter
from support.server import free_port, start_server, stop_server, stories_with_chat_template

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

KEY = "sesame"
NAMES = ("a", "b", "c", "d")
PROMPTS = ["Once upon a time", "The dog ran", "Lily saw a big"]
N = 16


@pytest.fixture(scope="module")
def folders(shared_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-slots")
    base = stories_with_chat_template(shared_dir, root / "stories")
    return {"base": base, **{name: all_linear_adapter(base, root / name, 20 + i, 4) for i, name in enumerate(NAMES)}}


@pytest.fixture(scope="module")
def reference(folders) -> dict[tuple[str, str | None], str]:
    """(prompt, adapter or None) -> the text of PEFT's greedy N tokens (transformers' alone for None)."""
    tok = Tokenizer.from_dir(folders["base"])
    out = {}
    for name in (*NAMES, None):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folders["base"]).eval()
        model = peft.PeftModel.from_pretrained(hf, folders[name]).eval() if name else hf
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            with torch.no_grad():
                new = model.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                                     pad_token_id=0)[0, len(ids):].tolist()
            out[(prompt, name)] = tok.decode(ids + new, skip_special_tokens=True)[len(prompt):]
    assert len({out[(PROMPTS[0], n)] for n in (*NAMES, None)}) == 5, "each adapter should change the text"
    return out


def test_more_adapters_than_slots_at_default_settings(folders, reference) -> None:
    proc, url = start_server(folders["base"], "--api-key", KEY, "--lora-modules", f"a={folders['a']}",
                             "--served-model-name", "stories")
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for name in NAMES[1:]:  # no --max-loras: one slot, and the loads still succeed
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folders[name])},
                           headers=auth)
            assert r.status_code == 200, r.text
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["stories", *NAMES]

        async def together() -> list[str]:
            aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
            jobs = [aclient.completions.create(model=m or "stories", prompt=p, max_tokens=N, temperature=0,
                                               extra_body={"ignore_eos": True})
                    for p in PROMPTS for m in (*NAMES, None)]
            return [r.choices[0].text for r in await asyncio.gather(*jobs)]

        assert asyncio.run(together()) == [reference[(p, m)] for p in PROMPTS for m in (*NAMES, None)]
        for name in ("d", "a", "c"):  # one at a time, each taking the slot from the one before
            r = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=N, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == reference[(PROMPTS[1], name)] and r.model == name
    finally:
        stop_server(proc)


def test_a_request_racing_its_adapters_unload_is_a_404(folders) -> None:
    """The engine thread is held busy (an engine call that sleeps); the unload is queued, then a request naming the
    adapter passes the server's check and queues behind it: the unload runs first, and the request's adapter is
    gone when the engine adds it. Its answer is OpenAI's 404 model_not_found, streamed or not."""
    import uvicorn

    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.model.lora import attach, read_adapter
    from nexttoken.pretrained import load_pretrained
    from nexttoken.server import ServerSettings, build_app

    loaded = load_pretrained(folders["base"])
    registry = attach(loaded.model, 1, 8)
    for name in ("a", "b"):
        registry.register(read_adapter(name, folders[name], loaded.model.config))
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4), loaded.generation_config)
    app = build_app(engine, ServerSettings("stories"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def busy(seconds: float) -> threading.Thread:  # the engine thread sleeps inside an engine call
        def run() -> None:
            asyncio.run(app.state.engine.call(lambda _: time.sleep(seconds)))

        holder = threading.Thread(target=run, daemon=True)
        holder.start()
        return holder

    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        for name, stream in (("a", False), ("b", True)):
            holder = busy(2.0)
            time.sleep(0.3)

            async def race() -> tuple[httpx.Response, httpx.Response]:
                async with httpx.AsyncClient(timeout=60) as c:
                    gone = {"lora_name": name}  # noqa: B023
                    unload = asyncio.create_task(c.post(url + "/v1/unload_lora_adapter", json=gone))
                    await asyncio.sleep(0.3)  # the unload waits on the engine thread first
                    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 4, "stream": stream}  # noqa: B023
                    request = await c.post(url + "/v1/completions", json=body)
                    return await unload, request

            unloaded, r = asyncio.run(race())
            holder.join()
            assert unloaded.status_code == 200, unloaded.text
            if stream:
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                error = json.loads(events[0])["error"]
            else:
                assert r.status_code == 404, r.text
                error = r.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model" and f"'{name}'" in error["message"]
        ok = httpx.post(url + "/v1/completions", json={"model": "stories", "prompt": PROMPTS[0], "max_tokens": 4})
        assert ok.status_code == 200
    finally:
        server.should_exit = True
        thread.join(30)
