"""The served models and their state: the one place the server asks for a model's engine.

Each model is unloaded, loading, loaded, or failed (with the reason). A request naming a model `acquire`s it: a
loaded model at once, an unloaded one after its load (the first request waits; requests to other models keep
running, the load runs on a thread), a failed one never (its requests get the reason). Loads run one at a time,
under a memory budget (bytes; --memory-budget): before a model loads, the least recently used idle models are
unloaded until its estimated size fits (never one with requests running or waiting: the load waits for one to
become idle instead), and the model is then fitted into the room left (engine/fit.py). Idle models unload after
`idle_unload_s` (--idle-unload-seconds). llama.cpp's router mode and Ollama's scheduler work this way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.llm_engine import EngineStats
from ..errors import NextTokenError
from .catalog import TAG, ModelChoice

log = logging.getLogger("nexttoken.server.models")  # loads (with their memory), unloads, failures

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"
STATES = (UNLOADED, LOADING, LOADED, FAILED)


class UnknownModelError(NextTokenError, LookupError):
    """A request named a model this server does not serve."""


class ModelUnavailableError(NextTokenError, RuntimeError):
    """The model failed to load (the reason says why), or the server is shutting down."""


class Service(Protocol):
    """A loaded model as the registry needs it (server/service.py's ModelService)."""

    memory: Any  # engine/fit.py's Fit: its bytes of the budget (total_bytes) and the context it got

    def start(self) -> None: ...
    def close(self, reason: str) -> None: ...
    def shutdown(self) -> None: ...
    def stats(self) -> EngineStats: ...
    def adapters(self) -> list[str]: ...


@dataclass(eq=False)
class Entry:
    """One served model. `choice` None: a model handed over loaded (build_app's engine), which cannot be reloaded."""

    name: str
    aliases: tuple[str, ...] = ()
    choice: ModelChoice | None = None
    state: str = UNLOADED
    reason: str | None = None  # why it failed to load
    service: Any = None  # the loaded model (Service)
    active: int = 0  # requests holding it (acquired, not yet released)
    waiting: int = 0  # requests waiting for its load
    last_used: float = field(default_factory=time.monotonic)
    loads: int = 0
    unloads: int = 0
    idle_unload_s: float | None = None  # its own idle time before unloading (None: the registry's)
    size: int = 0  # bytes it held of the budget when last loaded (0: never loaded: its files' size is the estimate)
    draining: bool = False  # its room is promised to a waiting load: new requests wait, it unloads once idle
    task: asyncio.Task | None = None  # its load in progress

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def idle(self) -> bool:
        return self.state == LOADED and not self.active and not self.waiting

    @property
    def path(self) -> str | None:
        return None if self.choice is None or self.choice.spec.model is None else str(self.choice.spec.model)

    def describe(self) -> dict[str, Any]:
        """What listings show of it (/v1/models' status, Ollama's /api/tags and /api/ps): its names, state, the
        reason it failed, and once loaded its memory (bytes) and context."""
        info: dict[str, Any] = {"name": self.name, "aliases": list(self.aliases), "state": self.state,
                                "path": self.path, "active_requests": self.active}
        if self.reason is not None:
            info["reason"] = self.reason
        memory = getattr(self.service, "memory", None)
        if memory is not None:
            info |= {"weights_bytes": memory.weights_bytes, "kv_cache_bytes": memory.kv_cache_bytes,
                     "runtime_bytes": memory.runtime_bytes, "total_bytes": memory.total_bytes,
                     "max_model_len": memory.max_model_len, "kv_tokens": memory.kv_tokens}
        return info


Loader = Callable[[ModelChoice, "int | None"], Any]  # (choice, bytes of room or None) -> Service, on a thread


class ModelRegistry:
    """The entries, their loads and unloads. Every method runs on the server's event loop (loads and unloads go to
    a thread). `budget`: bytes the loaded models may hold together (None: no limit); `max_loaded`: models loaded
    at once (None: no limit)."""

    def __init__(self, entries: list[Entry], loader: Loader | None = None, budget: int | None = None,
                 idle_unload_s: float | None = None, max_loaded: int | None = None) -> None:
        if not entries:
            raise ValueError("a registry serves at least one model")
        self.entries, self.loader, self.budget = entries, loader, budget
        self.idle_unload_s, self.max_loaded = idle_unload_s, max_loaded
        self._lock = asyncio.Lock()  # one load or unload at a time: the budget's account stays true
        self._changed = asyncio.Event()  # set when a request releases a model (a waiting load may find room)
        self._retired = _zero_stats()  # the counters of engines unloaded since start (totals stay monotonic)
        self._closed: str | None = None
        self._idle_task: asyncio.Task | None = None

    # ---- lookups -----------------------------------------------------------------------------------------------
    @property
    def single(self) -> bool:
        """One model: it answers every request, whatever `model` names (its own API checks the name, as before)."""
        return len(self.entries) == 1

    def names(self) -> list[str]:
        """Every served name, each model's reported one first."""
        return [n for e in self.entries for n in e.names]

    def find(self, name: str | None) -> Entry | None:
        """The entry a request's `model` names: by a name or alias, or a LoRA adapter it serves (a loaded model's,
        or one its spec lists); None (no `model`): the first model; an unknown name: None."""
        if self.single or name is None:
            return self.entries[0]
        for e in self.entries:
            if name in e.names or name.removesuffix(f":{TAG}") in e.names:  # Ollama's `name:latest` is `name`
                return e
        for e in self.entries:
            adapters = e.service.adapters() if e.state == LOADED else list((e.choice.spec.lora or {}) if e.choice
                                                                           else ())
            if name in adapters:
                return e
        return None

    def unknown(self, name: str | None) -> UnknownModelError:
        served = ", ".join(repr(n) for n in self.names())
        return UnknownModelError(f"the model {name!r} does not exist; this server serves {served}")

    def loaded(self) -> Iterator[Entry]:
        return (e for e in self.entries if e.state == LOADED)

    # ---- requests ----------------------------------------------------------------------------------------------
    async def acquire(self, name: str | None) -> Entry:
        """The loaded entry `name` names, held for one request until `release`: loaded first when it is not (the
        caller waits). Raises UnknownModelError, or ModelUnavailableError with the reason it failed to load."""
        entry = self.find(name)
        if entry is None:
            raise self.unknown(name)
        while entry.state == LOADED and entry.draining:  # a load waits for its room: new requests wait too
            self._changed.clear()
            await self._changed.wait()
        while entry.state != LOADED:  # a request that waited for the load takes the model, draining or not
            self._check_open()
            if entry.state == FAILED:
                raise ModelUnavailableError(f"the model {entry.name!r} failed to load: {entry.reason}")
            entry.waiting += 1
            try:
                await asyncio.shield(self._start_load(entry))
            finally:
                entry.waiting -= 1
        entry.active += 1
        entry.last_used = time.monotonic()
        return entry

    def release(self, entry: Entry) -> None:
        """A request that held `entry` is done with it (its idle time starts now)."""
        entry.active -= 1
        entry.last_used = time.monotonic()
        self._changed.set()

    # ---- loading and unloading ---------------------------------------------------------------------------------
    async def load(self, name: str) -> Entry:
        """Load `name` now (a failed model is tried again): the admin route's."""
        entry = self.find(name) if name in self.names() else None
        if entry is None:
            raise self.unknown(name)
        if entry.state == FAILED:
            entry.state, entry.reason = UNLOADED, None
        if entry.state != LOADED:
            entry.waiting += 1
            try:
                await asyncio.shield(self._start_load(entry))
            finally:
                entry.waiting -= 1
        if entry.state == FAILED:
            raise ModelUnavailableError(f"the model {entry.name!r} failed to load: {entry.reason}")
        entry.last_used = time.monotonic()
        return entry

    async def unload(self, name: str) -> Entry:
        """Unload `name` now: the admin route's. Raises ModelUnavailableError while it has requests running, or
        when it was handed over loaded (it could not be loaded again)."""
        entry = self.find(name) if name in self.names() else None
        if entry is None:
            raise self.unknown(name)
        async with self._lock:
            if entry.state != LOADED:
                return entry
            if entry.active or entry.waiting:
                raise ModelUnavailableError(f"the model {entry.name!r} has {entry.active + entry.waiting} requests "
                                            "running or waiting: unload it when they are done")
            if entry.choice is None:
                raise ModelUnavailableError(f"the model {entry.name!r} was handed to the server loaded and could not "
                                            "be loaded again")
            await self._unload(entry, "asked to")
        return entry

    def _start_load(self, entry: Entry) -> asyncio.Task:
        if entry.task is None or entry.task.done():
            entry.task = asyncio.ensure_future(self._load(entry))
        return entry.task

    async def _load(self, entry: Entry) -> None:
        async with self._lock:
            if entry.state in (LOADED, FAILED):
                return
            if entry.choice is None or self.loader is None:
                entry.state, entry.reason = FAILED, "it was handed to the server loaded and cannot be loaded again"
                return
            entry.state, entry.reason = LOADING, None
            started = time.monotonic()
            try:
                await self._make_room(entry)
                self._check_open()
                room = None if self.budget is None else self.budget - self.held(entry)
                service = await asyncio.to_thread(self.loader, entry.choice, room)
            except Exception as e:  # noqa: BLE001 - whatever stopped the load is the model's reason, not the server's
                entry.state, entry.reason = FAILED, _reason(e)
                log.error("model %r failed to load: %s", entry.name, entry.reason)
                return
            service.start()
            entry.service, entry.state = service, LOADED
            await self._make_room(entry, service.memory.total_bytes, wait=False)  # its size was an estimate
            entry.loads += 1
            entry.size = service.memory.total_bytes
            entry.last_used = time.monotonic()
            log.info("model %r loaded in %.1f s: %s", entry.name, time.monotonic() - started,
                     service.memory.describe())

    async def _make_room(self, entry: Entry, need: int | None = None, wait: bool = True) -> None:
        """Unload the least recently used idle models until `entry` (`need` bytes; default: its size when last
        loaded, else its files') fits the budget and the count; wait for one to become idle when none is (`wait`;
        else leave it: a loaded model whose estimate fell short may hold more until the others are idle)."""
        need = need or entry.size or entry.choice.weight_bytes()  # type: ignore[union-attr]
        if wait and self.budget is not None and need > self.budget:
            raise ModelUnavailableError(f"it needs about {need} bytes ({need / 2**20:.1f} MiB), over the memory "
                                        f"budget of {self.budget} bytes: raise --memory-budget")
        try:
            await self._evict_for(entry, need, wait)
        finally:
            for e in self.entries:  # room found (or the load failed): promised models serve again
                e.draining = False
            self._changed.set()

    async def _evict_for(self, entry: Entry, need: int, wait: bool) -> None:
        while True:
            others = [e for e in self.loaded() if e is not entry]
            over = (self.max_loaded is not None and len(others) >= self.max_loaded) or (
                self.budget is not None and self.held(entry) + need > self.budget)
            if not over or not others:
                return
            idle = [e for e in others if e.idle and e.choice is not None]
            if not idle and not wait:
                return
            if idle:
                victim = min(idle, key=lambda e: e.last_used)
                await self._unload(victim, f"to make room for {entry.name!r}")
                continue
            # Every loaded model is busy: the least recently used one drains (its new requests wait, so a model
            # in steady use cannot starve this load), and the load waits for a request to finish.
            victims = [e for e in others if e.choice is not None]
            if victims:
                min(victims, key=lambda e: e.last_used).draining = True
            self._changed.clear()
            await self._changed.wait()

    async def _unload(self, entry: Entry, why: str) -> None:
        """Unload an idle loaded entry (the lock held)."""
        service, entry.service, entry.state, entry.draining = entry.service, None, UNLOADED, False
        entry.unloads += 1
        self._changed.set()  # its drained requests load it again
        self._retired = _summed([self._retired, service.stats()])
        await asyncio.to_thread(service.shutdown)
        log.info("model %r unloaded (%s)", entry.name, why)

    def held(self, exclude: Entry | None = None) -> int:
        """Bytes the loaded models hold of the budget (but `exclude`)."""
        return sum(e.service.memory.total_bytes for e in self.loaded() if e is not exclude)

    # ---- the server's life -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engines of the models loaded already, and the idle unloader (from the app's lifespan)."""
        for e in self.loaded():
            e.service.start()
        if self._idle_task is None:  # always: an entry's idle_unload_s may be set later (Ollama's keep_alive)
            self._idle_task = asyncio.ensure_future(self._unload_idle())

    async def _unload_idle(self) -> None:
        while True:
            times = [t for t in [self.idle_unload_s, *(e.idle_unload_s for e in self.entries)] if t is not None]
            await asyncio.sleep(min(1.0, max(0.05, min(times, default=4.0) / 4)))
            now = time.monotonic()
            for e in self.entries:
                limit = e.idle_unload_s if e.idle_unload_s is not None else self.idle_unload_s
                if limit is not None and e.idle and e.choice is not None and now - e.last_used >= limit:
                    async with self._lock:
                        if e.idle and time.monotonic() - e.last_used >= limit:
                            await self._unload(e, f"idle for {limit:g} s")

    def close(self, reason: str) -> None:
        """Refuse new loads and abort what the loaded engines run (the end of a graceful shutdown)."""
        self._closed = reason
        self._changed.set()  # requests waiting for a drained model go on, to be refused
        for e in self.loaded():
            e.service.close(reason)

    def shutdown(self) -> None:
        """Stop every engine thread (the app's lifespan's end)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
        for e in self.loaded():
            e.service.shutdown()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ModelUnavailableError(self._closed)

    # ---- numbers -----------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """The loaded engines' numbers added up (with the unloaded ones' totals): the server's /metrics gauges."""
        services = [e.service for e in self.entries]  # read once: an unload (on the loop) may clear one meanwhile
        return _summed([self._retired, *(s.stats() for s in services if s is not None)])


def _reason(e: BaseException) -> str:
    """A failed load's reason for clients: nexttoken's own errors say what and how to fix it; others get their type."""
    return str(e) if isinstance(e, NextTokenError) else f"{type(e).__name__}: {e}"


def _zero_stats() -> EngineStats:
    return EngineStats(**{f.name: 0 for f in dataclasses.fields(EngineStats)})


def _summed(stats: list[EngineStats]) -> EngineStats:
    """Engines' stats field by field (the block size: the largest)."""
    values = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)}
    values["kv_block_size"] = max(s.kv_block_size for s in stats)
    return EngineStats(**values)


class ModelCollector:
    """Per-model gauges at scrape time (a `model` label): its state, its memory (weights, KV pool, runtime), its
    context and pool in tokens, its loads and unloads; and the budget with what the loaded models hold of it."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def collect(self):  # noqa: ANN201
        r = self.registry
        state = GaugeMetricFamily("nexttoken_model_state", "1 for the model's state (unloaded, loading, loaded, "
                                  "failed)", labels=["model", "state"])
        sizes = {key: GaugeMetricFamily(f"nexttoken_model_{key}", doc, labels=["model"]) for key, doc in (
            ("weights_bytes", "The model's weights in bytes (0 unloaded)"),
            ("kv_cache_bytes", "The model's KV pool in bytes (0 unloaded)"),
            ("runtime_bytes", "The model's working memory in bytes, estimated (0 unloaded)"),
            ("max_model_len", "Tokens per request the model got (0 unloaded)"),
            ("kv_tokens", "Tokens the model's KV pool holds (0 unloaded)"),
            ("active_requests", "Requests holding the model"))}
        loads = CounterMetricFamily("nexttoken_model_loads", "Times the model was loaded", labels=["model"])
        unloads = CounterMetricFamily("nexttoken_model_unloads", "Times the model was unloaded", labels=["model"])
        for e in r.entries:
            for s in STATES:
                state.add_metric([e.name, s], 1.0 if e.state == s else 0.0)
            info = e.describe()
            for key, family in sizes.items():
                family.add_metric([e.name], float(info.get(key, 0)))
            loads.add_metric([e.name], e.loads)
            unloads.add_metric([e.name], e.unloads)
        yield state
        yield from sizes.values()
        yield loads
        yield unloads
        if r.budget is not None:
            yield GaugeMetricFamily("nexttoken_memory_budget_bytes", "The loaded models' memory budget "
                                    "(--memory-budget)", value=r.budget)
        yield GaugeMetricFamily("nexttoken_memory_held_bytes", "Bytes the loaded models hold of the budget",
                                value=r.held())
