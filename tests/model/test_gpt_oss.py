"""gpt-oss (nexttoken/families/gpt_oss.py) against transformers' GptOssForCausalLM on tiny random weights
(tests/support/gpt_oss.py: 4 layers alternating sliding (window 4, shorter than every sequence here) and full,
attention sinks, 4 experts with top 2, biases everywhere, YaRN): the config and YaRN's frequencies read as
transformers reads them; greedy and seeded tokens identical through `nexttoken.generate`, the engine's rows
(chunked prefill, each row equal to transformers alone: batch invariance) and `nexttoken.load`; the released
checkpoints' MXFP4 experts (`*_blocks` / `*_scales`); GGUF files written by llama.cpp's converter (MXFP4 experts
kept packed, against the same file dequantized and the folder); the features that refuse it say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.config import ModelConfig, RopeConfig
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import ModelLoadError
from nexttoken.families import FULL, SLIDING
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import fused, load_model
from nexttoken.model.quant import tiles
from nexttoken.model.quant.mxfp4 import Mxfp4Linear
from nexttoken.model.rope import inverse_frequencies
from nexttoken.model.weights.gguf import load_gguf_model, open_gguf
from support import gpt_oss
from support.harmony import harmony_tokenizer, special_ids
from support.tiny_models import PROMPTS, left_padded

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    hf = gpt_oss.save(folder)
    return hf, load_model(folder), folder


def test_config_is_transformers_gpt_oss() -> None:
    """transformers' defaults (the 20B's shape): alternating layers with the first sliding, sinks, biases, the
    router's rules, the clamped SwiGLU, YaRN x32 untruncated; and YaRN's frequencies and cos/sin scale equal to
    transformers' bit for bit, truncated or not."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.GptOssConfig(num_hidden_layers=4)
    for raw in (hf.to_dict(), {k: v for k, v in hf.to_dict().items() if k != "architectures"}):
        cfg = ModelConfig.from_dict(raw)
        assert cfg.architecture == "GptOssForCausalLM" and cfg.layers == (SLIDING, FULL, SLIDING, FULL)
        assert cfg.sliding_window == 128 and cfg.attention_sinks and cfg.attention_bias and cfg.mlp_bias
        assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.router_bias, cfg.moe.softmax_after_topk) == (128, 4, True,
                                                                                                         True)
        assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
        assert (cfg.rope.type, cfg.rope.factor, cfg.rope.theta, cfg.rope.truncate) == ("yarn", 32.0, 150000.0, False)
    for truncate in (False, True):
        hf = transformers.GptOssConfig(**{**gpt_oss.CONFIG, "rope_parameters": {
            **gpt_oss.CONFIG["rope_parameters"], "truncate": truncate}})
        want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
        rope = ModelConfig.from_dict(hf.to_dict()).rope
        assert torch.equal(inverse_frequencies(rope, hf.head_dim), want) and rope.attention_factor == scale
        assert isinstance(rope, RopeConfig)


def test_greedy_and_seeded_tokens_equal_transformers(pair) -> None:
    """Left-padded batches and single rows, 24 steps past the window of 4; the fused native step takes this model
    (family.native_step: sinks, the window, the top-k-softmax router, the experts' biases and clamped SwiGLU)."""
    hf, model, _ = pair
    ids, mask = left_padded(PROMPTS)
    assert torch.equal(nexttoken.generate(model, ids, attention_mask=mask, **GREEDY),
                       hf.generate(input_ids=ids, attention_mask=mask, **GREEDY))
    sampled = dict(GREEDY, do_sample=True, temperature=0.9, top_k=20)
    for rows in (1, 3):
        prompt = torch.tensor([p[:4] for p in PROMPTS][:rows])
        torch.manual_seed(77)
        want = hf.generate(prompt, **sampled)
        assert torch.equal(nexttoken.generate(model, prompt, seed=77, **sampled), want)
    assert fused._plan(model, model.new_cache(1, 8)).ok is True


def test_the_sinks_change_the_tokens(pair, tmp_path: Path) -> None:
    """Without its sinks the same model picks other tokens, in transformers and here: the parity tests the sinks."""
    hf, _, _ = pair
    plain = gpt_oss.build()
    with torch.no_grad():
        for layer in plain.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no share of the softmax: plain attention
    prompt = torch.tensor([PROMPTS[1]])
    assert not torch.equal(plain.generate(prompt, **GREEDY), hf.generate(prompt, **GREEDY))
    plain.save_pretrained(tmp_path)
    assert torch.equal(nexttoken.generate(load_model(tmp_path), prompt, **GREEDY), plain.generate(prompt, **GREEDY))


def test_engine_rows_equal_transformers_alone(pair) -> None:
    """The engine's paged pool, chunked prefill and batched decode (rows of other lengths beside each one): every
    row equals transformers' generate on that prompt alone, through the sliding layers' window and the sinks."""
    hf, model, folder = pair
    engine = LLMEngine(model, None, EngineConfig(chunk_size=8, max_num_seqs=4, max_num_batched_tokens=24))
    prompts = [[1, 5, 9, 22], [1] + list(range(10, 30)), [1, 7, 3], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
    seqs = engine.generate(prompts, GenerationConfig(eos_token_id=None, top_k=None, max_new_tokens=12))
    for prompt, seq in zip(prompts, seqs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_ids == want, prompt
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(ids):].tolist()
    traced = nexttoken.load(folder).generate(ids, max_new_tokens=10, ignore_eos=True, trace=True)
    assert traced.token_ids == want and len(traced.trace["steps"]) == 10


def test_speculative_decoding_is_lossless(pair, tmp_path: Path) -> None:
    """Prompt lookup and a draft gpt-oss (other weights) verified on the modules path: the plain engine's tokens
    and log-probs, batched."""
    _, target, _ = pair
    gpt_oss.save(tmp_path, seed=1)
    draft = load_model(tmp_path)
    prompts = [[1, 5, 9, 22] * 3, [1, 7, 8], [1] + list(range(40, 60))]
    cfg = GenerationConfig(max_new_tokens=16, top_k=None, top_logprobs=2, eos_token_id=None)

    def run(draft_model=None, **options):  # noqa: ANN001, ANN202
        engine = LLMEngine(target, None, EngineConfig(chunk_size=8, max_num_seqs=4, max_model_len=128))
        seqs = [engine.add_request(p, cfg.updated(**options), draft_model=draft_model) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [(s.out.token_ids, s.out.logprobs, s.out.top_logprobs) for s in seqs], engine.stats()

    plain, _ = run()
    lookup, stats = run(prompt_lookup_num_tokens=3)
    assert lookup == plain and stats.spec_steps_total > 0
    drafted, stats = run(draft, num_assistant_tokens=3)
    assert drafted == plain and stats.spec_draft_tokens_total > 0


def test_tensor_parallelism_is_refused_by_name(pair) -> None:
    _, _, folder = pair
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM"):
        nexttoken.load(folder, tensor_parallel_size=2)


def test_mxfp4_checkpoint_equals_transformers_on_its_values(tmp_path: Path) -> None:
    """The released checkpoints' experts (`*_blocks` / `*_scales`, quant_method mxfp4): kept packed by default
    (Mxfp4Linear), dequantized exactly for bfloat16 or int8; either way the tokens of transformers holding the same
    values (bfloat16: logits within bf16 rounding of the float model's)."""
    hf = gpt_oss.build(seed=1)
    gpt_oss.quantize_mxfp4(hf, tmp_path)
    ids, mask = left_padded(PROMPTS)
    want = hf.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    packed = load_model(tmp_path)
    assert isinstance(packed.layers[1].mlp.experts[2].w13, Mxfp4Linear) and packed.quantization == "mxfp4"
    with tiles.precision("float32"):  # prefill through exactly dequantized tiles in float32
        assert torch.equal(nexttoken.generate(packed, ids, attention_mask=mask, **GREEDY), want)
    # the fused native step reads the packed experts as stored (ggml's MXFP4 type through csrc/mxfp4.cpp), and a
    # plain batch's decode steps give the modules' tokens
    with torch.inference_mode():
        assert fused._plan(packed, packed.new_cache(1, 8)).ok is True
    rows = torch.tensor([[5, 17, 33, 8], [61, 2, 40, 12]])
    with tiles.precision("float32"):
        native = nexttoken.generate(packed, rows, **GREEDY)
        with fused.disabled():
            assert torch.equal(native, nexttoken.generate(packed, rows, **GREEDY))
    int8 = load_model(tmp_path, quantize="int8")
    assert not isinstance(int8.layers[1].mlp.experts[2].w13, Mxfp4Linear)
    bf16_weights = load_model(tmp_path, quantize="bf16")  # what a bf16 checkpoint (the released ones) loads as
    assert isinstance(bf16_weights.layers[1].mlp.experts[2].w13, Mxfp4Linear)
    assert bf16_weights.layers[1].attention.wqkv.weight.dtype == torch.bfloat16
    bf16 = load_model(tmp_path, dtype="bfloat16")
    assert bf16.layers[1].mlp.experts[2].w13.weight.dtype == torch.bfloat16
    first = dict(GREEDY, max_new_tokens=1, output_logits=True, return_dict_in_generate=True)
    exact_logits = nexttoken.generate(packed, ids, attention_mask=mask, **first).logits[0]
    bf16_logits = nexttoken.generate(bf16, ids, attention_mask=mask, **first).logits[0].float()
    theirs = hf.to(torch.bfloat16).generate(input_ids=ids, attention_mask=mask, **first).logits[0].float()
    hf.float()
    # bf16 rounding moves near-tied router choices, so no closer than transformers' own bf16 run is to float32
    assert (bf16_logits - theirs).abs().max() <= max(0.02 * exact_logits.abs().max(),
                                                     (theirs - exact_logits).abs().max())


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory, shared_dir):
    """An MXFP4 gpt-oss folder over Qwen2.5's tokenizer with harmony's special tokens (the converter's GptOss writes a
    GPT-2 vocabulary) and the GGUF llama.cpp's converter writes of it: experts MXFP4 as the checkpoint's, the rest
    float32."""
    llama_cpp = pytest.importorskip("support.llama_cpp")
    try:
        llama_cpp.converter()
    except llama_cpp.ConverterMissing as e:
        pytest.skip(str(e))
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf = gpt_oss.build(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    gpt_oss.quantize_mxfp4(hf, folder)
    harmony_tokenizer(folder, shared_dir)
    return hf, folder, llama_cpp.convert(folder, folder / "model.gguf", "f32")


def test_gguf_from_llama_cpps_converter(gguf_pair, monkeypatch) -> None:
    """The converter's file (gpt-oss's names, YaRN and window keys, sinks, expert biases): read with its experts
    dequantized it gives the folder's (= transformers') tokens; read as stored (the default) its experts are
    Mxfp4Linear, within float rounding of the dequantized model's logits (prefill and decode), the same tokens."""
    from nexttoken.bench.accuracy import all_logits

    hf, folder, path = gguf_pair
    types = {name: t.tensor_type.name for name, t in open_gguf(path).tensors.items()}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.3.ffn_down_exps.weight"] == "MXFP4"
    ids = torch.tensor([[5, 17, 33, 8, 61, 2, 40, 12]])
    want = hf.generate(ids, **GREEDY)
    exact, _ = load_gguf_model(path, dequantize=True)  # the model alone: a 151k-token GGUF vocabulary is slow to read
    assert exact.config.layers == (SLIDING, FULL, SLIDING, FULL)
    assert torch.equal(nexttoken.generate(exact, ids, **GREEDY), want)
    packed, _ = load_gguf_model(path)
    assert isinstance(packed.layers[2].mlp.experts[3].w2, Mxfp4Linear)
    assert torch.equal(nexttoken.generate(packed, ids, **GREEDY), want)
    long = ids[0].tolist() + [9, 30, 3, 7, 1, 19, 22, 50, 11, 4]
    with tiles.precision("float32"):
        for chunk in (len(long), 1):  # > 16 rows: dequantized tiles; 1 row: the native product
            assert torch.allclose(all_logits(packed, long, chunk=chunk), all_logits(exact, long, chunk=chunk),
                                  atol=1e-4, rtol=1e-4)


def test_gguf_stops_at_return_and_call_not_at_end(gguf_pair) -> None:
    """The file's stop ids are the folder's generation_config (gpt-oss stops at <|return|> and <|call|>), as
    llama.cpp reads its vocabulary: harmony's <|end|>, which closes the analysis message before the answer, is no
    stop (llama-vocab.cpp drops it beside <|return|> and <|call|>)."""
    from nexttoken.text.gguf_vocab import end_of_generation_ids

    _, folder, path = gguf_pair
    ids = special_ids(folder)
    stops = end_of_generation_ids(open_gguf(path).metadata)
    assert set(json.loads((folder / "generation_config.json").read_text())["eos_token_id"]) <= set(stops)
    assert {ids["<|return|>"], ids["<|call|>"]} <= set(stops) and ids["<|end|>"] not in stops


def test_lora_on_the_attention_equals_peft(pair, tmp_path: Path) -> None:
    """A PEFT adapter on q/k/v/o (gpt-oss's experts are stacked parameters, no LoRA target): per-row and merged,
    PEFT's tokens, which differ from the base model's."""
    from support.lora import make_adapter, peft_greedy, peft_model

    hf, _, folder = pair
    adapter = make_adapter(hf, tmp_path / "adapter", seed=3, r=4, lora_alpha=8,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    ref = peft_model(folder, adapter)
    llm = nexttoken.load(folder, lora={"a": adapter})
    merged = nexttoken.load(folder, lora={"a": adapter}, merge=True)
    prompt = PROMPTS[1]
    want = peft_greedy(ref, prompt, 10)
    assert llm.generate(prompt, lora="a", max_new_tokens=10, min_new_tokens=10).token_ids == want
    assert merged.generate(prompt, max_new_tokens=10, min_new_tokens=10).token_ids == want
    assert llm.generate(prompt, max_new_tokens=10, min_new_tokens=10).token_ids != want
