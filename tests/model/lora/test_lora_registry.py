"""The one adapter registry (model/lora/registry.py) and LoRA as vLLM users expect it: more adapters registered than
slots, a slot taken when a sequence runs and the least recently used idle adapter evicted (never one in use; a
sequence whose adapter finds every slot held waits in the scheduler), and `llm.generate(prompts, lora=[a, b, c,
None])` with one adapter per prompt. The reference is PEFT itself: adapters made by `peft` on a tiny random Llama,
each prompt's tokens equal to `PeftModel.generate` on its adapter (transformers alone for the base)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import GenerationConfigError, LoraError, UnknownLoraError
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import load_model
from nexttoken.model.lora import attach, read_adapter

from support.lora import FAMILIES, PROMPTS, make_adapter, peft_greedy, peft_model
from support.tiny_models import save_variant

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("a", "b", "c", "d")
N = 8  # new tokens per prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny random Llama and four PEFT adapters on it (random, non-zero B)."""
    root = tmp_path_factory.mktemp("lora-registry")
    base = root / "base"
    hf = save_variant("llama-gqa", base)
    return base, {name: make_adapter(hf, root / name, seed=10 + i, **FAMILIES["llama-gqa"])
                  for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def reference(tiny) -> dict[tuple[int, str | None], list[int]]:
    """(prompt index, adapter or None) -> PEFT's greedy tokens (transformers' alone for None)."""
    base, folders = tiny
    out = {}
    for name in (*NAMES, None):
        model = peft_model(base, folders[name]) if name else transformers.AutoModelForCausalLM.from_pretrained(
            base, attn_implementation="eager").eval()
        for i, prompt in enumerate(PROMPTS):
            out[(i, name)] = peft_greedy(model, prompt, N)
    assert len({tuple(out[(0, n)]) for n in (*NAMES, None)}) == 5, "each adapter should change the tokens"
    return out


def test_eviction_is_least_recently_used_and_never_an_adapter_in_use(tiny) -> None:
    base, folders = tiny
    model = load_model(base)
    registry = attach(model, max_loras=2, max_rank=8)
    adapters = {name: read_adapter(name, folders[name], model.config) for name in NAMES}
    for name in NAMES:
        registry.register(adapters[name])
    assert registry.names == list(NAMES)
    assert list(registry.resident.items()) == [("a", 0), ("b", 1)]  # registered while a slot was free: written at once

    def holds(slot: int, name: str) -> bool:  # the slot's matrices are that adapter's (one layer's wqkv)
        linear, w = registry.slots.layers[(0, "wqkv")], adapters[name].weights[(0, "wqkv")]
        return torch.equal(linear.lora_A[slot, : w.A.shape[0]], w.A)

    assert registry.acquire("a")  # a used last: b is the least recently used
    registry.release("a")
    assert registry.acquire("c") and list(registry.resident.items()) == [("a", 0), ("c", 1)] and holds(1, "c")
    assert registry.acquire("a")  # a and c are both held by running sequences now
    assert not registry.acquire("d"), "no slot may be taken from an adapter in use"
    assert registry.resident == {"a": 0, "c": 1} and holds(0, "a") and holds(1, "c")
    registry.release("c")  # c idle, a held: d takes c's slot
    assert registry.acquire("d") and list(registry.resident.items()) == [("a", 0), ("d", 1)] and holds(1, "d")
    with pytest.raises(LoraError, match="in use"):
        registry.unregister("a")
    registry.release("a")
    registry.release("d")
    assert registry.acquire("b") and list(registry.resident.items()) == [("d", 1), ("b", 0)]  # a was older
    assert holds(0, "b")
    registry.release("b")
    registry.unregister("b")  # its slot is zeroed and free again
    assert registry.resident == {"d": 1} and not registry.slots.layers[(0, "wqkv")].lora_A[0].any()
    with pytest.raises(UnknownLoraError, match="'b' is not loaded"):
        registry.acquire("b")
    assert registry.resolve("base-name", base=["base-name"]) is None and registry.resolve("d") == "d"


def test_a_per_prompt_adapter_list_gives_each_prompt_its_peft_tokens(tiny, reference) -> None:
    base, folders = tiny
    llm = nexttoken.load(base, lora={name: folders[name] for name in NAMES[:3]})
    lora = ["a", "b", "c", None]
    got = llm.generate(PROMPTS, lora=lora, max_new_tokens=N, min_new_tokens=N)
    assert [c.token_ids for c in got] == [reference[(i, name)] for i, name in enumerate(lora)]
    # n sampled choices per prompt: each choice of a prompt runs under that prompt's adapter (the i-th sequence of
    # a request draws from seed + i, so prompt 1's choices alone start at seed + 2)
    sampled = dict(max_new_tokens=N, min_new_tokens=N, do_sample=True, num_return_sequences=2)
    two = llm.generate(PROMPTS[:2], lora=["c", None], seed=7, **sampled)
    alone = [*llm.generate(PROMPTS[0], lora="c", seed=7, **sampled), *llm.generate(PROMPTS[1], seed=9, **sampled)]
    assert [c.token_ids for c in two] == [c.token_ids for c in alone]
    assert [c.token_ids for c in two[:2]] != [c.token_ids for c in llm.generate(PROMPTS[0], seed=7, **sampled)]
    assert llm.generate(PROMPTS[0], lora=["b"], max_new_tokens=N, min_new_tokens=N).token_ids == reference[(0, "b")]
    with pytest.raises(GenerationConfigError, match="lists 2 adapters for 4 prompt"):
        llm.generate(PROMPTS, lora=["a", "b"], max_new_tokens=2)
    with pytest.raises(UnknownLoraError, match="'zzz' is not loaded"):
        llm.generate(PROMPTS[:2], lora=["a", "zzz"], max_new_tokens=2)
    with pytest.raises(GenerationConfigError, match="got 3"):
        llm.generate(PROMPTS[:2], lora=["a", 3], max_new_tokens=2)


def test_more_adapters_than_slots_at_default_settings(tiny, reference) -> None:
    """One adapter given at load: one slot. Three more loaded at run time (no flag needed); a batch over all four
    and the base gives every prompt its own adapter's PEFT tokens, the adapters taking the slot in turns."""
    base, folders = tiny
    llm = nexttoken.load(base, lora={"a": folders["a"]})
    for name in NAMES[1:]:
        llm.load_lora(name, folders[name])
    assert llm.loras == list(NAMES) and llm.model.adapters.slots.max_loras == 1
    requests = [(i, name) for i in range(len(PROMPTS)) for name in (*NAMES, None)]
    got = llm.generate([PROMPTS[i] for i, _ in requests], lora=[name for _, name in requests], max_new_tokens=N,
                       min_new_tokens=N)
    assert [c.token_ids for c in got] == [reference[r] for r in requests]
    assert llm.loras == list(NAMES)


def test_a_sequence_whose_adapter_finds_every_slot_held_waits_in_the_scheduler(tiny, reference) -> None:
    base, folders = tiny
    llm = nexttoken.load(base, lora={name: folders[name] for name in NAMES}, max_loras=2, max_cpu_loras=4)
    engine = LLMEngine(llm.model, None, EngineConfig(max_num_seqs=8, max_model_len=128, chunk_size=4),
                       llm.generation_config)
    params = GenerationConfig(max_new_tokens=N, min_new_tokens=N, do_sample=False)
    seqs = {name: engine.add_request(PROMPTS[0], params, lora=name) for name in (*NAMES, None)}
    seen: list[set] = []
    while engine.has_unfinished():
        engine.step()
        running = {s.lora for s in engine.scheduler.running if s.lora is not None}
        assert len(running) <= 2, "at most two adapters run at once: two slots"
        seen.append(running)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert llm.model.adapters.held == {}  # every sequence handed its slot back
    assert any(len(r) == 2 for r in seen) and set().union(*seen) == set(NAMES)
    assert {name: s.output_ids for name, s in seqs.items()} == {name: reference[(0, name)] for name in seqs}


def test_max_cpu_loras_bounds_the_adapters_registered(tiny) -> None:
    base, folders = tiny
    llm = nexttoken.load(base, lora={"a": folders["a"]}, max_loras=1, max_cpu_loras=2)
    llm.load_lora("b", folders["b"])
    with pytest.raises(LoraError, match="2 LoRA adapters are loaded, the limit"):
        llm.load_lora("c", folders["c"])
    llm.unload_lora("a")
    llm.load_lora("c", folders["c"])
    assert llm.loras == ["b", "c"]
    with pytest.raises(LoraError, match="must be an integer >= max_loras"):
        nexttoken.load(base, lora={"a": folders["a"]}, max_loras=2, max_cpu_loras=1)


def test_an_adapter_unloaded_after_a_request_named_it_is_unknown_to_the_engine(tiny) -> None:
    base, folders = tiny
    llm = nexttoken.load(base, lora={"a": folders["a"], "b": folders["b"]})
    engine = LLMEngine(llm.model, None, EngineConfig(max_num_seqs=4, max_model_len=64, chunk_size=4),
                       llm.generation_config)
    params = GenerationConfig(max_new_tokens=2, do_sample=False)
    seq = engine.add_request(PROMPTS[0], params, lora="b")
    with pytest.raises(LoraError, match="in use"):
        engine.unload_lora("b")
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason is not None
    engine.unload_lora("b")
    with pytest.raises(UnknownLoraError, match="'b' is not loaded"):
        engine.add_request(PROMPTS[0], params, lora="b")
