"""The one adapter registry: LoRA adapter names -> the adapters read, and which of them sit in the model's slots.

vLLM keeps two limits apart, and so does this: `--max-loras` is the number of slots (adapters a batch can mix at
once: each slot is a preallocated stack in every wrapped matrix, layers.py), `--max-cpu-loras` the number of adapters
registered (held in memory, each a name requests may choose). More adapters may be registered than there are slots:
a sequence takes its adapter's slot when the scheduler admits it (`acquire`) and gives it back when it leaves the
running batch (`release`); an adapter that holds no slot is written into a free one, or into the slot of the least
recently used adapter that no running sequence holds, and when every slot is held the sequence waits in the
scheduler. Slots are written between engine steps only, and never one a running sequence uses, so a row's numbers
do not depend on which slot its adapter sits in.

Everything that names adapters asks this object: `LLM.generate(lora=...)`, the engine (`add_request`, the runner's
slots, the prefix cache's keys) and the server (the `model` field, /v1/models, load and unload). `resolve` maps a
name to an adapter, or to None for the base model's own names (the server's served names, a merged adapter's).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Iterable

import torch
from torch import nn

from ...errors import LoraError, UnknownLoraError
from ...families import family
from .adapter import LoraAdapter
from .layers import AdapterSet, wrap

NO_SLOTS = ("this model has no adapter slots: load it with lora={...} or max_loras=N, or serve with --enable-lora "
            "(or --lora-modules, --max-loras N)")


class AdapterRegistry:
    """Adapters by name over a model's slots (`slots`: None for a model that serves none); at most `max_adapters`
    registered (None: no limit). Thread-safe: the server reads names on its event loop while the engine's thread
    registers, acquires and releases."""

    def __init__(self, slots: AdapterSet | None, max_adapters: int | None = None) -> None:
        _check_limit(max_adapters, slots.max_loras if slots is not None else 1)
        self.slots, self.max_adapters = slots, max_adapters
        self._adapters: dict[str, LoraAdapter] = {}  # registered, in the order they came
        self._versions: dict[str, int] = {}  # name -> which load it is: a reloaded name never matches old prefixes
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> its slot, least recently used first
        self._users: dict[str, int] = {}  # name -> running sequences holding its slot
        self._loads = 0
        self._lock = threading.Lock()

    # ---- names -------------------------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """The registered adapters' names, in the order they were registered."""
        with self._lock:
            return list(self._adapters)

    @property
    def max_rank(self) -> int:
        """The largest rank a slot holds (LoraError when the model has no slots)."""
        if self.slots is None:
            raise LoraError(NO_SLOTS)
        return self.slots.max_rank

    def get(self, name: str) -> LoraAdapter | None:
        with self._lock:
            return self._adapters.get(name)

    def resolve(self, name: str | None, base: Iterable[str] = ()) -> str | None:
        """The adapter a request names: None for no name or one of `base` (the base model's own names); the name
        of a registered adapter; anything else raises UnknownLoraError naming what is registered."""
        if name is None or name in base:
            return None
        with self._lock:
            if name in self._adapters:
                return name
            loaded = ", ".join(repr(n) for n in self._adapters) or "none"
        if self.slots is None:
            raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded: this model serves no adapters (load it "
                                   "with lora={name: folder}, or serve with --lora-modules / --enable-lora)")
        raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")

    def key(self, name: str) -> str:
        """What the prefix cache keys a sequence's blocks by: the adapter's name and which load of it."""
        self.resolve(name)
        with self._lock:
            return f"{name}#{self._versions[name]}"

    # ---- registering -------------------------------------------------------------------------------------------
    def register(self, adapter: LoraAdapter, base: Iterable[str] = ()) -> None:
        """Serve `adapter` under its name (new, and none of `base`); it takes a free slot now if there is one, else
        one when a sequence needs it."""
        slots = self.slots
        if slots is None:
            raise LoraError(NO_SLOTS)
        slots.check(adapter)
        with self._lock:
            if adapter.name in self._adapters or adapter.name in base:
                raise LoraError(f"the name {adapter.name!r} is served already: unload it first, or choose another")
            if self.max_adapters is not None and len(self._adapters) >= self.max_adapters:
                raise LoraError(f"{len(self._adapters)} LoRA adapters are loaded, the limit (--max-cpu-loras, "
                                "max_cpu_loras; by default --max-loras when that is given): unload one first")
            self._adapters[adapter.name] = adapter
            self._loads += 1
            self._versions[adapter.name] = self._loads
            free = self._free_slot()
            if free is not None:
                slots.write(free, adapter)
                self._resident[adapter.name] = free

    def unregister(self, name: str) -> None:
        """Stop serving `name`; refused while a running sequence holds its slot."""
        self.resolve(name)
        with self._lock:
            users = self._users.get(name, 0)
            if users:
                raise LoraError(f"LoRA adapter {name!r} is in use by {users} running sequence(s): unload it when "
                                "they have finished")
            slot = self._resident.pop(name, None)
            if slot is not None:
                self.slots.write(slot, None)  # type: ignore[union-attr]
            del self._adapters[name], self._versions[name]

    # ---- slots -------------------------------------------------------------------------------------------------
    def acquire(self, name: str) -> bool:
        """Hold a slot for one more sequence of adapter `name` (the scheduler, admitting it): its slot, or a free
        one, or the least recently used idle adapter's. False when every slot is held by running sequences."""
        with self._lock:
            if name not in self._adapters:
                raise UnknownLoraError(f"LoRA adapter {name!r} is not loaded")
            if name not in self._resident:
                slot = self._free_slot()
                if slot is None:
                    idle = next((n for n in self._resident if not self._users.get(n)), None)
                    if idle is None:
                        return False
                    slot = self._resident.pop(idle)
                self.slots.write(slot, self._adapters[name])  # type: ignore[union-attr]
                self._resident[name] = slot
            self._resident.move_to_end(name)  # the most recently used
            self._users[name] = self._users.get(name, 0) + 1
            return True

    def release(self, name: str) -> None:
        """One sequence of `name` left the running batch: its slot stays written, evictable once none holds it."""
        with self._lock:
            users = self._users.get(name, 0) - 1
            if users > 0:
                self._users[name] = users
            else:
                self._users.pop(name, None)

    def slot(self, name: str) -> int:
        """The slot adapter `name` sits in (a running sequence's: acquire put it there)."""
        with self._lock:
            if name in self._resident:
                return self._resident[name]
        self.resolve(name)
        raise LoraError(f"LoRA adapter {name!r} holds no slot: a sequence acquires one when it is scheduled")

    @property
    def resident(self) -> dict[str, int]:
        """Adapters in slots -> their slot, least recently used first."""
        with self._lock:
            return dict(self._resident)

    @property
    def held(self) -> dict[str, int]:
        """Adapters held by running sequences -> how many hold each (their slots cannot be taken)."""
        with self._lock:
            return dict(self._users)

    def rows(self, slots: torch.Tensor | None) -> contextlib.AbstractContextManager:
        """The slots' rows context for one forward (AdapterSet.rows): what the Transformer enters."""
        assert self.slots is not None, "a forward names adapter slots, and this model has none"
        return self.slots.rows(slots)

    def _free_slot(self) -> int | None:
        taken = set(self._resident.values())
        return next((s for s in range(self.slots.max_loras) if s not in taken), None)  # type: ignore[union-attr]


def attach(model: nn.Module, max_loras: int, max_rank: int, max_adapters: int | None = None) -> AdapterRegistry:
    """The model's registry over `max_loras` slots of rank `max_rank` (its matrices wrapped once; a later call with
    the same sizes returns the same registry), at most `max_adapters` adapters registered (None: no limit)."""
    existing = getattr(model, "adapters", None)
    if existing is not None:
        slots = existing.slots
        if (slots.max_loras, slots.max_rank) != (max_loras, max_rank):
            raise LoraError(f"this model serves adapters with max_loras={slots.max_loras}, "
                            f"max_lora_rank={slots.max_rank} already")
        return existing
    _check_limit(max_adapters, max_loras)  # before the matrices are wrapped
    cfg = getattr(model, "config", None)
    if cfg is not None and not family(cfg.architecture).lora:  # issue 41's hybrids: their recurrent layers' matrices
        raise LoraError(f"LoRA adapters are not applied to {cfg.architecture} models yet; serve it without "
                        "--enable-lora")
    registry = AdapterRegistry(wrap(model, max_loras, max_rank), max_adapters)
    model.adapters = registry
    return registry


def registry_of(model: nn.Module) -> AdapterRegistry:
    """The model's registry; a model without slots gets an empty one (every adapter name is unknown to it)."""
    registry = getattr(model, "adapters", None)
    return registry if registry is not None else AdapterRegistry(None)


def _check_limit(max_adapters: int | None, max_loras: int) -> None:
    if max_adapters is not None and (isinstance(max_adapters, bool) or not isinstance(max_adapters, int)
                                     or max_adapters < max_loras):
        raise LoraError(f"max_cpu_loras (adapters registered) must be an integer >= max_loras (the slots, "
                        f"{max_loras}), got {max_adapters!r}")
