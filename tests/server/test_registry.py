"""The registry's choices under a memory budget (server/registry.py), in-process with real models and real
services (service.py's Loader): the least recently used idle model is unloaded first, never one holding a
request, and a load that would exceed the budget waits for a busy model to finish rather than failing.

Models: stories260K, a tiny random Llama and a tiny random Qwen2, each with a fixed KV pool (2 blocks over
what one whole-context sequence needs), so that each model's bytes are known after one measuring load."""

from __future__ import annotations

import asyncio

import pytest
from conftest import requires_shared
from support.tiny_models import build_hf_model

from nexttoken.engine import EngineConfig
from nexttoken.server.api.responses import ResponseStore
from nexttoken.server.api.traces import TraceStore
from nexttoken.server.catalog import build_catalog
from nexttoken.server.metrics import ServerMetrics
from nexttoken.server.registry import LOADED, UNLOADED, Entry, ModelRegistry
from nexttoken.server.service import Loader
from nexttoken.server.settings import ServerSettings

pytestmark = [requires_shared, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def choices(shared_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    build_hf_model("llama", seed=1).save_pretrained(root / "llama")
    build_hf_model("qwen2", seed=2).save_pretrained(root / "qwen")
    flags = [f"stories={shared_dir / 'models' / 'stories260k'}", f"llama={root / 'llama'}", f"qwen={root / 'qwen'}"]
    return build_catalog(flags)


def _registry(choices, budget: int | None) -> ModelRegistry:
    registry: ModelRegistry | None = None
    metrics = ServerMetrics(lambda: registry.stats())
    config = EngineConfig(max_num_seqs=2, num_kv_blocks=40)  # 640 tokens: every model's whole context, and more
    loader = Loader(config, ServerSettings("stories"), metrics, TraceStore("stories"), ResponseStore(),
                    {"speculative_ngram": False, "num_speculative_tokens": 4})
    registry = ModelRegistry([Entry(c.name, c.aliases, c) for c in choices], loader, budget)
    return registry


def _loaded(registry: ModelRegistry) -> set[str]:
    return {e.name for e in registry.entries if e.state == LOADED}


async def _use(registry: ModelRegistry, name: str) -> None:
    entry = await registry.acquire(name)
    registry.release(entry)


def test_least_recently_used_idle_model_goes_first_and_never_a_busy_one(choices) -> None:
    async def measure() -> dict[str, int]:
        registry = _registry(choices, None)
        registry.start()
        for name in ("stories", "llama", "qwen"):
            await _use(registry, name)
        sizes = {e.name: e.size for e in registry.entries}
        registry.shutdown()
        return sizes

    sizes = asyncio.run(measure())
    assert all(size > 0 for size in sizes.values())
    budget = sum(sizes.values()) - min(sizes.values()) // 2  # any two fit, never all three

    async def scenario() -> None:
        registry = _registry(choices, budget)
        registry.start()
        await _use(registry, "stories")
        await _use(registry, "llama")
        await _use(registry, "stories")  # llama is now the least recently used
        await _use(registry, "qwen")
        assert _loaded(registry) == {"stories", "qwen"}
        held = await registry.acquire("stories")  # stories busy, qwen idle: loading llama unloads qwen
        await _use(registry, "llama")
        assert _loaded(registry) == {"stories", "llama"} and registry.held() <= budget
        busy = await registry.acquire("llama")  # both busy: loading qwen waits for one of them
        waiting = asyncio.ensure_future(_use(registry, "qwen"))
        await asyncio.sleep(0.5)
        assert not waiting.done() and _loaded(registry) == {"stories", "llama"}
        late = asyncio.ensure_future(registry.acquire("stories"))  # stories' room is promised to qwen: it waits
        await asyncio.sleep(0.2)
        assert not late.done()
        registry.release(held)  # stories idle now: it goes, qwen loads, nothing failed
        await asyncio.wait_for(waiting, 60)
        assert next(e for e in registry.entries if e.name == "stories").unloads == 1
        again = await asyncio.wait_for(late, 60)  # then stories loads again, for its waiting request: qwen (idle) goes
        assert _loaded(registry) == {"llama", "stories"} and registry.held() <= budget
        assert next(e for e in registry.entries if e.name == "qwen").state == UNLOADED
        registry.release(again)
        registry.release(busy)
        registry.shutdown()

    asyncio.run(scenario())


def test_a_model_over_the_whole_budget_fails_with_the_reason(choices) -> None:
    async def scenario() -> str:
        registry = _registry(choices[:1], 1000)
        registry.start()
        try:
            await registry.acquire("stories")
        except Exception as e:  # noqa: BLE001 - its type and text are what is checked
            return f"{type(e).__name__}: {e}"
        finally:
            registry.shutdown()
        return "loaded"

    reason = asyncio.run(scenario())
    assert reason.startswith("ModelUnavailableError: the model 'stories' failed to load: it needs about")
    assert "over the memory budget of 1000 bytes" in reason
