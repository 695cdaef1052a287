"""Grammar compiles cannot stall the server (issue 39, item 9): they run on a pool of their own with a time budget
(a 400 naming it), a refused constraint is refused again at once, and the cache of compiled grammars is bounded in
bytes. Through a real server with the openai client, and on the cache itself with the real tokenizer."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from nexttoken.generation.processors.structured import (BYTES_PER_GRAMMAR_CHAR, ENTRY_BYTES, Constraint,
                                                        GrammarCache, StructuredOutputError)
from nexttoken.text.tokenizer import Tokenizer
from support.server import start_server, stop_server

openai = pytest.importorskip("openai")

# The soak's grammar: one GBNF rule of 60,000 alternatives (650 KB; ~30 s of llguidance here, then refused).
HUGE = "root ::= " + " | ".join(f'"w{i}"' for i in range(60000))
BUDGET_S = 3.0


@pytest.fixture(scope="module")
def client(model_dir):  # noqa: F811
    proc, url = start_server(model_dir, "--max-body-bytes", str(1 << 21), "--grammar-compile-timeout", str(BUDGET_S))
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop_server(proc)


def _chat(client, **extra):  # noqa: ANN001, ANN202
    start = time.monotonic()
    try:
        out = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4, temperature=0,
                                             messages=[{"role": "user", "content": "Tell me a story."}], **extra)
    except openai.APIStatusError as e:
        return e, time.monotonic() - start
    return out, time.monotonic() - start


def test_a_slow_compile_neither_stalls_a_plain_chat_nor_runs_past_its_budget(client) -> None:
    _chat(client)  # warm: the first request pays for loading what the engine loads lazily
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        huge = pool.submit(_chat, client, extra_body={"grammar": HUGE})
        time.sleep(0.5)  # the compile has begun
        plain, plain_s = _chat(client)
        refused, refused_s = huge.result()
    assert plain.choices[0].finish_reason == "length" and plain_s < 2.0, plain_s
    assert isinstance(refused, openai.BadRequestError), refused
    assert refused.body["param"] == "grammar" and "budget of 3 s" in refused.body["message"], refused.body
    assert BUDGET_S <= refused_s < BUDGET_S + 3, refused_s
    again, again_s = _chat(client, extra_body={"grammar": HUGE})  # the compile runs on; the constraint is refused
    assert isinstance(again, openai.BadRequestError) and again_s < 1.0, (again, again_s)
    assert _chat(client)[0].choices[0].finish_reason == "length"


def test_a_refused_grammar_is_refused_again_at_once(client) -> None:
    bad = {"grammar": 'root ::= "a" | missing_rule_' + "x" * 20}
    first, _ = _chat(client, extra_body=bad)
    again, again_s = _chat(client, extra_body=bad)
    assert isinstance(first, openai.BadRequestError) and isinstance(again, openai.BadRequestError)
    assert again.body["message"] == first.body["message"] and again_s < 0.5


def test_the_cache_is_bounded_in_bytes_and_keeps_refusals(shared_dir) -> None:
    tokenizer = Tokenizer.from_dir(shared_dir / "models" / "stories260k")
    schemas = [Constraint("json_schema", {"enum": [f"value {k} {i}" for i in range(2000)]}) for k in range(6)]
    size = ENTRY_BYTES + BYTES_PER_GRAMMAR_CHAR * len(schemas[0].grammar())  # one entry's estimate
    cache = GrammarCache(size=100, budget_bytes=int(3.5 * size))
    lltok = cache.tokenizer(tokenizer, 512, (2,))
    for schema in schemas:
        cache.compile(schema, lltok)
        assert cache.bytes <= cache.budget_bytes
    assert len(cache) == 3 and cache.stats.compiles == 6
    assert cache.lookup(schemas[0], lltok) is None and cache.lookup(schemas[-1], lltok).cached  # oldest dropped
    bad = Constraint("grammar", "start: nothing_here")
    with pytest.raises(StructuredOutputError, match="nothing_here"):
        cache.compile(bad, lltok)
    with pytest.raises(StructuredOutputError, match="nothing_here"):
        cache.lookup(bad, lltok)  # kept: refused again without compiling
    assert cache.stats.compiles == 6
    one = GrammarCache(size=100, budget_bytes=1)
    one.compile(schemas[0], one.tokenizer(tokenizer, 512, (2,)))
    assert len(one) == 1  # the newest is kept whatever its size
