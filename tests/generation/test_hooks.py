"""Per-step hooks: the runnable example in examples/per_step_hook.py against a hand-written transformers loop
that feeds the same extra input through inputs_embeds and its own KV cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from nexttoken.generation import generate
from support.decoding import model_pair

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "per_step_hook.py"


def _example():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("per_step_hook", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@torch.no_grad()
def _reference(hf, prompts: torch.Tensor, steps: int, decay: float, scale: float) -> torch.Tensor:
    """The loop people fork transformers' _sample to write: embeddings + memory, memory updated per step."""
    from transformers import DynamicCache

    embed = hf.model.embed_tokens
    memory = torch.zeros(prompts.shape[0], embed.weight.shape[1])
    cache = DynamicCache()
    out = hf(inputs_embeds=embed(prompts) + memory[:, None], past_key_values=cache, use_cache=True)
    tokens = []
    for _ in range(steps):
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(tok)
        memory = decay * memory + (1 - decay) * embed(tok) * scale
        out = hf(inputs_embeds=(embed(tok) + memory)[:, None], past_key_values=out.past_key_values, use_cache=True)
    return torch.stack(tokens, dim=1)


def test_memory_hook_matches_a_hand_written_transformers_loop() -> None:
    example = _example()
    hf, ours = model_pair()
    prompts = torch.tensor([[1, 5, 17, 33], [1, 40, 41, 42]])
    model = example.MemoryLM(ours)
    hook = example.MemoryHook(model, batch_size=2, decay=0.8, scale=4.0)
    got = generate(model, prompts, hooks=[hook], max_new_tokens=10, eos_token_id=None)
    want = _reference(hf, prompts, 10, 0.8, 4.0)
    assert torch.equal(got[:, 4:], want)
    plain = generate(ours, prompts, max_new_tokens=10, eos_token_id=None)
    assert not torch.equal(plain, got)  # the extra input really reached the model


def test_hook_sees_every_step_in_order() -> None:
    _, ours = model_pair()
    seen: list[tuple[int, list[int]]] = []

    class Recorder:
        def model_inputs(self, state):  # noqa: ANN001, ANN202
            return {}

        def after_step(self, state, step):  # noqa: ANN001, ANN202
            seen.append((state.length, step.tokens.tolist()))

    out = generate(ours, torch.tensor([[1, 5, 17]]), hooks=[Recorder()], max_new_tokens=4, eos_token_id=None)
    assert [length for length, _ in seen] == [4, 5, 6, 7]
    assert [t[0] for _, t in seen] == out[0, 3:].tolist()


def test_example_script_runs(capsys) -> None:  # noqa: ANN001
    import sys

    argv = sys.argv
    sys.argv = ["per_step_hook.py", "--new-tokens", "3"]
    try:
        _example().main()
    finally:
        sys.argv = argv
    assert "with memory:" in capsys.readouterr().out


def test_memory_hook_on_the_engine_path_matches_the_transformers_loop() -> None:
    """The same hook per request on the engine behind LLM.generate (a batch of one each, run together)."""
    from nexttoken import LLM, GenerationConfig

    example = _example()
    hf, ours = model_pair()
    prompts = torch.tensor([[1, 5, 17, 33], [1, 40, 41, 42]])
    model = example.MemoryLM(ours)
    llm = LLM(model, None, GenerationConfig(eos_token_id=None), path=None)  # type: ignore[arg-type]
    rows = llm.generate(prompts.tolist(), hooks=lambda i: [example.MemoryHook(model, batch_size=1)],
                        max_new_tokens=10)
    want = _reference(hf, prompts, 10, 0.8, 4.0)
    assert [r.token_ids for r in rows] == want.tolist()
