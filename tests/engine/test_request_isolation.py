"""One request's failure is its own: whatever a request's own work raises inside an engine step (its grammar mask,
its processors, its sampler, its detokenizer, its hooks, its speculation, its tool-call parsing) ends that request
with finish_reason "error", and the requests batched with it finish with exactly their solo output. Failures are
injected into real requests of the real engine (stories260k), in greedy and sampled rows; the server tests send
the issue's repros (grammars past the grammar engine's limits) to a real server on loopback."""

from __future__ import annotations

import httpx
import pytest
import nexttoken
from nexttoken.engine import LLMEngine
from nexttoken.generation.config import GenerationConfig

from support.server import start_server, stop_server

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Once upon a time", "The dog ran", "Lily saw a bird", "Tom had a red ball"]
GREEDY = dict(max_new_tokens=10, ignore_eos=True, do_sample=False)
SAMPLED = dict(max_new_tokens=10, ignore_eos=True, do_sample=True, top_k=None, temperature=0.9)


class Injected(RuntimeError):
    """The failure a test plants in one request."""


class RaiseAt:
    """A callable that raises Injected from its `at`-th call on and before that calls `inner` (None: returns its
    second argument, as a logits processor returns its scores)."""

    def __init__(self, at: int, inner=None) -> None:  # noqa: ANN001
        self.at, self.inner, self.calls = at, inner, 0

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls += 1
        if self.calls >= self.at:
            raise Injected(f"injected failure at call {self.at}")
        return self.inner(*args, **kwargs) if self.inner is not None else args[1]


class FailingDetokenizer:
    def __init__(self, inner, at: int) -> None:  # noqa: ANN001
        self.inner, self.push = inner, RaiseAt(at, inner.push)

    def flush(self) -> str:
        return self.inner.flush()


@pytest.fixture(scope="module")
def llm(shared_dir):
    return nexttoken.load(shared_dir / "models" / "stories260k")


def _cfg(kind: str, seed: int, **extra) -> GenerationConfig:  # noqa: ANN003
    return GenerationConfig(**{**(GREEDY if kind == "greedy" else SAMPLED), "seed": seed, **extra})


def _solo(llm, prompt: str, cfg: GenerationConfig) -> list[int]:  # noqa: ANN001
    engine = LLMEngine(llm.model, llm.tokenizer)
    seq = engine.add_request(llm.tokenizer.encode(prompt), cfg)
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "length"
    return list(seq.output_ids)


def _plant(engine: LLMEngine, seq, place: str, kind: str) -> None:  # noqa: ANN001
    """Make seq's own work at `place` raise on its third token (after two went out)."""
    if place == "mask":
        if kind == "greedy":  # the all-greedy path computes its masks in the batch
            seq.grammar.mask_for = RaiseAt(3, seq.grammar.mask_for)
        else:  # the processor chain computes it
            seq.grammar.prepare = RaiseAt(3, seq.grammar.prepare)
    elif place == "sampler":
        seq.sampler = RaiseAt(3, seq.sampler)
    elif place == "detokenizer":
        seq.out.detokenizer = FailingDetokenizer(seq.out.detokenizer, 3)
    elif place == "hook":
        class Hook:
            calls = RaiseAt(3, lambda state: {})

            def model_inputs(self, state):  # noqa: ANN001, ANN201
                return self.calls(state)

            def after_step(self, state, step) -> None:  # noqa: ANN001
                pass

        seq.hooks.append(Hook())


PLACES = [("mask", "greedy"), ("mask", "sampled"), ("processor", "greedy"), ("processor", "sampled"),
          ("sampler", "greedy"), ("sampler", "sampled"), ("detokenizer", "greedy"), ("detokenizer", "sampled"),
          ("hook", "greedy"), ("hook", "sampled"), ("speculation", "greedy"), ("speculation", "sampled"),
          ("draft", "greedy"), ("draft", "sampled")]


@pytest.mark.parametrize("place,kind", PLACES)
def test_a_failure_in_one_request_ends_it_alone(llm, place, kind) -> None:  # noqa: ANN001
    healthy = [(PROMPTS[0], _cfg("greedy", 1)), (PROMPTS[1], _cfg("sampled", 7)),
               (PROMPTS[2], _cfg("greedy", 3, prompt_lookup_num_tokens=3))]
    solo = [_solo(llm, p, c) for p, c in healthy]
    engine = LLMEngine(llm.model, llm.tokenizer)
    seqs = [engine.add_request(llm.tokenizer.encode(p), c, f"healthy-{i}") for i, (p, c) in enumerate(healthy[:2])]
    extra: dict = {}
    if place == "mask":
        # a grammar whose end (EOS) is allowed only past 10 tokens
        extra.update(regex="[a-z ]{80,300}", eos_token_id=2, ignore_eos=False)
    if place in ("speculation", "draft"):  # a speculative request whose processor fails on a verified / draft position
        extra["repetition_penalty"] = 1.1
    if place == "speculation":
        extra["prompt_lookup_num_tokens"] = 3
    processors = [RaiseAt(3 if place != "draft" else 2)] if place in ("processor", "speculation", "draft") else []
    bad = engine.add_request(llm.tokenizer.encode(PROMPTS[3]), _cfg(kind, 11, **extra), "bad",
                             logits_processor=processors,
                             draft_model=llm.model if place == "draft" else None)
    _plant(engine, bad, place, kind)
    seqs.append(engine.add_request(llm.tokenizer.encode(healthy[2][0]), healthy[2][1], "healthy-2"))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert bad.finish_reason == "error", (place, kind, bad.finish_reason)
    assert "Injected: injected failure" in bad.out.stop_reason
    last = [e for e in events if e.request_id == "bad"][-1]
    assert last.finish_reason == "error" and "injected failure" in last.stop_reason
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert [list(s.output_ids) for s in seqs] == solo  # the batch-mates: exactly their solo output
    assert engine.scheduler.num_slots == len(engine.scheduler.free_slots)  # every slot came back
    again = engine.add_request(llm.tokenizer.encode(PROMPTS[0]), _cfg("greedy", 1))  # and the engine goes on
    while engine.has_unfinished():
        engine.step()
    assert list(again.output_ids) == solo[0]


# ---- through the server: the repros ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--tool-call-parser", "hermes")
    yield url
    stop_server(proc)


RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
             "$ref": "#/$defs/n"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hi", "guided_choice": [f"x{i}" for i in range(2001)]}, "guided_choice"),
    ("/v1/completions", {"prompt": "Hi", "guided_choice": [f"x{i}" for i in range(2001)], "stream": True},
     "guided_choice"),
    ("/v1/completions", {"prompt": "Hi", "n": 2, "guided_json": RECURSIVE}, "guided_json"),
    ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": RECURSIVE}}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                                         "schema": RECURSIVE}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL],
                              "tool_choice": "required"}, "tools"),
])
def test_grammars_past_the_engines_limits_are_a_400_and_the_server_goes_on(server, path, body, param) -> None:  # noqa: F811
    """The issue's critical repro: greedy, 4 tokens; before, the engine thread died and every later request (and
    /health) got 503 until a restart."""
    probe = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    before = httpx.post(server + "/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
    r = httpx.post(server + path, json={"max_tokens": 4, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "exceeds the grammar engine's limits" in error["message"], error
    assert "<grammar>" not in error["message"] and len(error["message"]) < 1000  # the first line, not the dump
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    after = httpx.post(server + "/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
    assert after == before


def test_a_tool_call_parser_failure_ends_its_request_alone(model_dir, monkeypatch) -> None:  # noqa: F811
    """The tool-call parser fails (injected) on a chat request with tools, streamed and not, while a plain request
    runs beside it (an in-process server on loopback, as the parser lives in the server): the tools request ends in
    OpenAI's error body, the plain one equals its solo output, and the server goes on."""
    import asyncio
    import json
    import threading
    import time

    import uvicorn

    from nexttoken.engine import EngineConfig
    from nexttoken.pretrained import load_pretrained
    from nexttoken.server import ServerSettings, build_app
    from nexttoken.chat.tools.parser import ToolCallParser
    from support.server import free_port

    loaded = load_pretrained(model_dir)
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4), loaded.generation_config)
    app = build_app(engine, ServerSettings("m", tool_call_parser="hermes"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    plain = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    tools = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0,
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        solo = httpx.post(url + "/v1/completions", json=plain, timeout=60).json()["choices"][0]["text"]

        def boom(self, *args):  # noqa: ANN001, ANN002, ANN202
            raise Injected("injected failure in the tool-call parser")

        for name in ("feed", "parse"):
            monkeypatch.setattr(ToolCallParser, name, boom)

        async def together() -> tuple:
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(
                    c.post(url + "/v1/chat/completions", json={**tools, "stream": True}),
                    c.post(url + "/v1/chat/completions", json=tools),
                    c.post(url + "/v1/completions", json=plain))

        streamed, whole, healthy = asyncio.run(together())
        assert healthy.status_code == 200 and healthy.json()["choices"][0]["text"] == solo
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "internal_server_error"
        assert "injected" not in whole.text  # the details go to the log
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "internal_server_error"
        assert httpx.get(url + "/health").status_code == 200
        again = httpx.post(url + "/v1/completions", json=plain, timeout=60).json()["choices"][0]["text"]
        assert again == solo
    finally:
        server.should_exit = True
        thread.join(30)
