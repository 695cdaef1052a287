"""A real instruction model from its GGUF file: SmolLM2-135M-Instruct (Q4_1, ../shared/models/smollm2-135m-instruct).

References: llama.cpp's own tokenizer ids and chat rendering (llamacpp_reference.json), and transformers'
`from_pretrained(dir, gguf_file=...)` in float32 (the exact reference for a float run of the dequantized weights:
llama.cpp multiplies Q4_1 blocks with 8-bit activations, so its answers drift). One model of each per module."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import SMOLLM2_GGUF, requires_shared

import nexttoken

pytestmark = requires_shared

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "How many legs does a spider have?", "Translate 'good morning' into Spanish.", "What is 12 times 7?",
    "Give me a synonym for happy.", "Who wrote Romeo and Juliet?", "What is photosynthesis?",
    "Tell me a fun fact about cats.", "What does CPU stand for?", "Suggest a name for a pet goldfish.",
    "What is the boiling point of water?", "List two planets in our solar system.", "Why is the sky blue?",
    "What is the opposite of cold?", "Describe a rainbow in one sentence.", "How do I say thank you in French?",
    "What is the largest ocean on Earth?", "Recommend a book for a long flight.",
]
NEW = 10
REFERENCE = json.loads((SMOLLM2_GGUF.parent / "llamacpp_reference.json").read_text()) if SMOLLM2_GGUF.is_file() else {}


@pytest.fixture(scope="module")
def llm():
    """The float32 model of the file's dequantized weights: transformers' GGUF loader computes the same numbers.
    (The default, packed load is tested against this one in test_gguf_packed.py.)"""
    return nexttoken.load(SMOLLM2_GGUF, dequantize=True)


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    """transformers' `from_pretrained(dir, gguf_file=...)` in float32, as the session's smollm2_dir holds it (that
    folder is this very model, saved by the shared make_folder.py): read back from its float32 safetensors instead
    of dequantizing the file a second time (~15 s on 2 cores)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(llm, hf):
    """transformers' greedy tokens on each prompt's ids (stopping at the ids nexttoken stops at, as llama.cpp)."""
    eos = llm.generation_config.eos_token_id
    out = []
    for p in PROMPTS:
        ids = llm.chat_prompt([{"role": "user", "content": p}])
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                              pad_token_id=2)
        out.append(gen[0, len(ids):].tolist())
    return out


def _trim(ids: list[int], eos: list[int]) -> list[int]:
    """transformers pads a finished row after its EOS; nexttoken's token_ids end at the EOS."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def test_the_file_is_read_as_transformers_reads_it(llm, hf) -> None:
    assert llm.name == "SmolLM2-135M-Instruct.Q4_1"
    assert llm.model.config.architecture == "LlamaForCausalLM" and llm.model.config.tie_word_embeddings
    ours = {n: p for n, p in llm.model.named_parameters()}
    ref = dict(hf.named_parameters())
    assert torch.equal(ours["embed.weight"], ref["model.embed_tokens.weight"])
    # llama.cpp's q/k row permutation undone exactly as transformers undoes it
    for i in (0, 29):
        wqkv = ours[f"layers.{i}.attention.wqkv.weight"]
        q, k = ref[f"model.layers.{i}.self_attn.q_proj.weight"], ref[f"model.layers.{i}.self_attn.k_proj.weight"]
        assert torch.equal(wqkv[: q.shape[0]], q) and torch.equal(wqkv[q.shape[0]: q.shape[0] + k.shape[0]], k)


def test_first_step_logits_match_transformers(llm, hf) -> None:
    ids = llm.chat_prompt([{"role": "user", "content": PROMPTS[0]}])
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
    ours = llm.generate(ids, max_new_tokens=1, top_logprobs=20)  # the raw distribution's log-probs
    assert list(ours.top_logprobs[0]) == ref.topk(20).indices.tolist()
    for token, value in ours.top_logprobs[0].items():
        assert value == pytest.approx(ref[token].item(), abs=1e-4)
    assert ours.token_ids[0] == int(ref.argmax())


def test_tokenizer_ids_are_llamacpps(llm) -> None:
    for case in REFERENCE["cases"]:
        assert llm.tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
        assert llm.tokenizer.encode(case["text"]) == case["ids_with_special"], case["text"]
    # transformers' GGUF tokenizer drops the smollm pre-tokenizer's digit split; llama.cpp keeps it
    assert llm.tokenizer.encode("ied 4 ½ months", add_special_tokens=False) == [885, 216, 36, 216, 16738, 2704]


def test_chat_template_renders_as_llamacpp(llm) -> None:
    for chat in REFERENCE["chat"]:
        assert llm.tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["rendered_prompt"]
        assert llm.chat_prompt(chat["messages"]) == chat["prompt_ids"]
        assert llm.tokenizer.decode(chat["ids"], skip_special_tokens=True) == chat["content"]


def test_chat_and_engine_give_transformers_tokens(llm, expected) -> None:
    eos = llm.generation_config.eos_token_id
    for prompt, want in zip(PROMPTS, expected):
        got = llm.chat([{"role": "user", "content": prompt}], max_new_tokens=NEW)
        assert got.token_ids == _trim(want, eos), prompt
    batched = llm.generate([llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS], max_new_tokens=NEW)
    assert [c.token_ids for c in batched] == [_trim(w, eos) for w in expected]


def test_padded_generate_gives_transformers_tokens(llm, expected) -> None:
    for prompt, want in list(zip(PROMPTS, expected))[:5]:
        ids = torch.tensor([llm.chat_prompt([{"role": "user", "content": prompt}])])
        out = nexttoken.generate(llm.model, ids, max_new_tokens=NEW, do_sample=False)
        assert _trim(out[0, ids.shape[1]:].tolist(), llm.generation_config.eos_token_id) == \
            _trim(want, llm.generation_config.eos_token_id), prompt


def test_structured_output_on_the_real_model(llm) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    got = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                   json_schema=schema, max_new_tokens=40)
    jsonschema.validate(json.loads(got.text), schema)


@pytest.fixture(scope="module")
def served(expected):
    from support.server import start_server, stop_server

    proc, url = start_server(SMOLLM2_GGUF, "--dequantize")  # the exact float model, as `llm`
    yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stop_server(proc)


def test_serve_a_gguf_file_to_the_openai_client(served, llm, expected) -> None:
    url, client = served
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    eos = llm.generation_config.eos_token_id
    for prompt, want in list(zip(PROMPTS, expected))[:4]:
        messages = [{"role": "user", "content": prompt}]
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages,
                                           max_tokens=NEW, temperature=0)
        text = llm.tokenizer.decode([t for t in _trim(want, eos) if t not in eos], skip_special_tokens=True)
        assert r.choices[0].message.content == text
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages,
                                                max_tokens=NEW, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Capital of France, as JSON?"}],
        max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert httpx.get(url + "/health").status_code == 200


def test_a_tool_loop_on_the_real_model(llm) -> None:
    """SmolLM2's ChatML template has no tool syntax, so by default the calls are read in Hermes' format (the one
    ChatML models are served with), its preamble in the prompt: the call is decoded under its schema, its result
    goes back as a `tool` turn, and the model answers in text."""
    from support.tools import QUESTION, SCHEMAS, TOOLS

    assert llm.tool_call_parser is None and llm.chat_renderer.preamble_format == "hermes"
    c = llm.chat(QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_new_tokens=60)
    assert c.finish_reason == "tool_calls" and len(c.tool_calls) == 1
    call = c.tool_calls[0]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # the template renders neither tool_calls nor a None content: the turn carries the call as Hermes text
    said = f'<tool_call>\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n</tool_call>'
    history = QUESTION + [{"role": "assistant", "content": said, "tool_calls": [call.to_openai()]},
                          {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 21})}]
    prompt = llm.tokenizer.decode(llm.chat_prompt(history))
    assert said in prompt and '<|im_start|>tool\n{"result": 21}<|im_end|>' in prompt
    answer = llm.chat(history, tools=TOOLS, tool_choice="none", max_new_tokens=12)
    assert answer.tool_calls is None and answer.text
