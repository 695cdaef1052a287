"""The garbage collector around loading and serving (nexttoken/collector.py): `nexttoken.load`, its imports
included, runs no full collection (each full one walks torch's ~500k objects); the collector's state is restored after,
also when a load fails; the server freezes its startup heap, and a frozen object that becomes garbage is collected
once thawed (what a model's unload relies on)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import httpx
import pytest
from conftest import requires_shared
from support.server import start_server, stop_server

from nexttoken.collector import freeze_heap, paused, thaw_heap

# A fresh interpreter: torch imported first (as a user's script does), then every collection during
# `nexttoken.load` (lazy imports and the load) is counted by a gc callback.
PROBE = """
import gc, json, sys
import torch
import nexttoken
seen = []
gc.callbacks.append(lambda phase, info: seen.append(info["generation"]) if phase == "start" else None)
before = len(seen)
llm = nexttoken.load(sys.argv[1])
during = seen[before:]
print(json.dumps({"during": during, "enabled": gc.isenabled(), "text": llm.generate("Once", max_new_tokens=3).text}))
"""


@requires_shared
def test_load_and_its_imports_run_no_collection(shared_dir) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE, str(shared_dir / "models" / "stories260k")],
                         capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Without the pause: 36 collections here, one of them full. With it: none while the collector is off, and
    # the young-generation passes of the code around the load (the call's own objects, then the deferred ones).
    assert set(got["during"]) <= {0} and len(got["during"]) <= 4, got
    assert got["enabled"] and got["text"]


def test_paused_restores_the_collector_state() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with paused():
            assert not gc.isenabled()
            with paused():
                assert not gc.isenabled()
            assert not gc.isenabled()  # the inner block leaves the outer one's state
            raise RuntimeError("a failed load")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()


class _Node:
    pass


def test_a_frozen_cycle_is_collected_once_thawed() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a reference cycle: only the cyclic collector frees it
    alive = weakref.ref(a)
    try:
        assert freeze_heap() > 0
        del a, b
        gc.collect()
        assert alive() is not None  # frozen: collections skip it
        thaw_heap()
        gc.collect()
        assert alive() is None
    finally:
        thaw_heap()


@requires_shared
def test_the_server_freezes_its_startup_heap(shared_dir) -> None:
    proc, url = start_server(shared_dir / "models" / "stories260k")
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Once", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
    finally:
        stop_server(proc)
        log = proc.stdout.read().decode()
    line = next(x for x in log.splitlines() if x.startswith("gc: "))
    assert int(line.split()[1]) > 100_000, line  # torch's objects and the model's
