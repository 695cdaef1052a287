"""GGUF files the tests write themselves with the `gguf` package (GGUFWriter): every weight type dequantized as
ggml defines it (gguf.quants is the reference), tokenizers from the real tokenizer.json files of ../shared against
those files, tiny random models of every family against transformers, and damaged files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import requires_shared
from support.tiny_models import VARIANTS, build_hf_model

import nexttoken
from nexttoken.errors import ModelLoadError, NextTokenError
from nexttoken.model import kernels
from nexttoken.model.weights.gguf import SUPPORTED_TYPES, dequantize_tensor

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from support.gguf_writer import FAMILIES, reference_tokens, rewrite, write_model

# Offsets of the float16 scale fields in each K-quant block (ggml-common.h): random bytes elsewhere are valid.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _packed(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A (rows, cols) tensor of `kind`: quantized by gguf.quants where it can, else random blocks with finite scales."""
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "F32":
        return w
    if kind not in _K_SCALES:
        return quantize(w, T[kind])
    block, size = GGML_QUANT_SIZES[T[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _K_SCALES[kind]:
        raw[..., at: at + 2] = rng.uniform(0.001, 0.05, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_each_weight_type_dequantizes_as_ggml(kind: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    packed = _packed(kind, 6, 512, rng)
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    w.add_tensor("x", packed, raw_dtype=None if kind == "F32" else T[kind])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ref = dequantize(packed, T[kind] if kind != "F32" else T.F32)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_tensor(tmp_path / "t.gguf", "x", dtype)
        assert got.shape == (6, 512)
        assert torch.equal(got, torch.from_numpy(ref).to(dtype))  # bit for bit


# ---- tokenizers -----------------------------------------------------------------------------------------------

TOKENIZERS = {"llama-3.2-instruct": "llama-bpe", "qwen2.5-instruct": "qwen2", "llama-2-chat": None,
              "phi-3-mini-instruct": None}


def _write_tokenizer(w, folder: Path, pre: str | None) -> None:  # noqa: ANN001
    """tokenizer.json -> tokenizer.ggml.* as llama.cpp's converter writes it (SentencePiece scores: -merge rank)."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab, added = tj["model"]["vocab"], tj["added_tokens"]
    n = max(max(vocab.values()), max(a["id"] for a in added)) + 1
    tokens, types = [f"[PAD{i}]" for i in range(n)], [5] * n
    for t, i in vocab.items():
        tokens[i], types[i] = t, 6 if pre is None and t.startswith("<0x") and len(t) == 6 else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    for a in added:
        tokens[a["id"]], types[a["id"]] = a["content"], 3 if a["special"] else 4
    if pre is None:  # SentencePiece: the score ranks the merge that makes the token
        scores = [0.0] * n
        rank = {}
        for r, m in enumerate(merges):
            rank.setdefault(m.replace(" ", ""), r)
        for t, i in vocab.items():
            scores[i] = -float(rank.get(t, 0 if types[i] != 1 else len(merges)))
        unk = vocab.get("<unk>")
        if unk is not None:
            types[unk] = 2
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_add_space_prefix(True)
        if unk is not None:
            w.add_unk_token_id(unk)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
    w.add_token_list(tokens)
    w.add_token_types(types)


@requires_shared
@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_tokenizer_from_gguf_matches_the_original(name: str, shared_dir: Path, tmp_path: Path) -> None:
    import tokenizers

    from nexttoken.text.gguf_vocab import tokenizer_from_gguf
    from nexttoken.model.weights.gguf import open_gguf

    folder = shared_dir / "tokenizers" / name
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    _write_tokenizer(w, folder, TOKENIZERS[name])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ours = tokenizer_from_gguf(open_gguf(tmp_path / "t.gguf").metadata, name)
    original = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    cases = json.loads((shared_dir / "tokenizers" / "conformance_cases.json").read_text())
    texts = [c["text"] for c in cases[name]["cases"]] if name in cases else []
    texts += [c["text"] for v in cases.values() if isinstance(v, dict) for c in v.get("cases", [])]
    for text in dict.fromkeys(texts):
        assert ours.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == original.decode(
            original.encode(text, add_special_tokens=False).ids), text


def test_a_repeated_token_text_keeps_its_first_id() -> None:
    """Vocabularies repeat a text now and then (unused or byte-fallback slots): the text -> id map the tokenizer is
    built from gives it its first id (the lower ids are written last)."""
    from nexttoken.text.gguf_vocab import _ids

    assert _ids(["a", "b", "a", "c", "b"]) == {"a": 0, "b": 1, "c": 3}
    assert _ids([]) == {}


# ---- tiny models of every family -------------------------------------------------------------------------------

EXTRA = {
    "gemma3": ("gemma3", dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=16, num_hidden_layers=6,
                              sliding_window_pattern=6, rope_parameters={
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                  "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})),
    # llama.cpp's llama architecture has no sliding window (nor have Mixtral's released configs)
    "mixtral-moe": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80, norm_topk_prob=False)),
}








@pytest.mark.parametrize("variant", list(FAMILIES))
def test_tiny_models_of_every_family_give_transformers_tokens(variant: str, tmp_path: Path) -> None:
    hf_arch, overrides = EXTRA[variant] if variant in EXTRA else VARIANTS[variant]
    hf = build_hf_model(hf_arch, **overrides)
    quant = "Q8_0" if variant in ("llama-gqa", "qwen3-moe-norm-topk") else ("Q4_1" if variant == "qwen2-bias" else None)
    held = write_model(tmp_path / f"{variant}.gguf", FAMILIES[variant], hf, quant)
    llm = nexttoken.load(tmp_path / f"{variant}.gguf", dequantize=True)  # exact: transformers on the same values
    assert llm.tokenizer is None and llm.name == variant
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    got = llm.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids
    assert got == reference_tokens(hf, held, ids, 8)


@pytest.mark.skipif(not kernels.ggml_available(), reason="needs the native kernels with AVX-512 VNNI")
@pytest.mark.parametrize("variant,quant", [(v, "Q8_0") for v in FAMILIES] + [("llama-gqa", "Q4_1")])
def test_a_quantized_file_decodes_greedily_in_native_chains(variant: str, quant: str, tmp_path: Path,
                                                           monkeypatch) -> None:
    """A GGUF file's blocks as they are (no dequantize): the native step looks its tokens up in the quantized table
    itself (GGUFEmbedding.native_table), so a plain greedy call runs its steps in chains (fused.greedy_chain, 16 per
    call), and the tokens are those of the modules' steps, which embed in Python (GGUFEmbedding.forward)."""
    from nexttoken.generation import generate
    from nexttoken.loading import load
    from nexttoken.loadspec import LoadSpec
    from nexttoken.model import fused

    hf_arch, overrides = EXTRA[variant] if variant in EXTRA else VARIANTS[variant]
    write_model(tmp_path / "m.gguf", FAMILIES[variant], build_hf_model(hf_arch, **overrides), quant)
    model = load(LoadSpec(model=tmp_path / "m.gguf")).main.model
    assert type(model.embed).__name__ == "GGUFEmbedding" and model.embed.native_table() is not None
    calls = []
    chain = fused.greedy_chain
    monkeypatch.setattr(fused, "greedy_chain", lambda *a: calls.append(a[5]) or chain(*a))
    prompt = torch.tensor([[5, 17, 33, 8, 61, 2, 40, 12]])
    kwargs = dict(max_new_tokens=21, do_sample=False, pad_token_id=0, eos_token_id=None)
    chained = generate(model, prompt, **kwargs)
    assert calls == [16, 4]  # the 20 steps after the first
    with fused.disabled(model):
        modules = generate(model, prompt, **kwargs)
    assert len(calls) == 2 and torch.equal(chained, modules)


# ---- damaged files -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_model(path, "llama", build_hf_model("llama"))
    return path


def test_a_truncated_file_names_the_file(tiny_file: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_file.read_bytes()[: tiny_file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf.*(truncated|damaged)"):
        nexttoken.load(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(tiny_file.read_bytes()[:40])
    with pytest.raises(ModelLoadError, match="header.gguf"):
        nexttoken.load(header)
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a model")
    with pytest.raises(ModelLoadError, match="fake.gguf is not a GGUF file"):
        nexttoken.load(fake)
    with pytest.raises(NextTokenError, match="missing.gguf does not exist"):
        nexttoken.load(tmp_path / "missing.gguf")




def test_unsupported_architecture_type_and_shape_are_named(tiny_file: Path, tmp_path: Path) -> None:
    rewrite(tiny_file, tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match="mamba.gguf: GGUF architecture 'mamba' is not supported"):
        nexttoken.load(tmp_path / "mamba.gguf")

    def iq(name, data, kind):  # noqa: ANN001, ANN202 - a type nexttoken does not read (same bytes per row)
        if name == "blk.0.ffn_up.weight":
            return quantize(data.astype(np.float32), T.Q8_0), T.Q8_0
        return data, kind

    rewrite(tiny_file, tmp_path / "q.gguf", change=iq)
    assert nexttoken.load(tmp_path / "q.gguf")  # Q8_0 reads
    raw = bytearray((tmp_path / "q.gguf").read_bytes())
    r = gguf.GGUFReader(tmp_path / "q.gguf")
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    # the tensor-info type field sits just before its data offset: relabel Q8_0 as IQ4_NL (same 34-byte blocks)
    info = bytes(t.name, "utf-8")
    at = raw.index(info) + len(info) + 4 + 8 * len(t.shape)
    assert int.from_bytes(raw[at: at + 4], "little") == T.Q8_0
    raw[at: at + 4] = int(T.IQ4_NL).to_bytes(4, "little")
    (tmp_path / "iq.gguf").write_bytes(raw)
    with pytest.raises(ModelLoadError, match="iq.gguf: tensor blk.0.ffn_up.weight is of quantization type IQ4_NL"):
        nexttoken.load(tmp_path / "iq.gguf")

    def narrow(name, data, kind):  # noqa: ANN001, ANN202
        return (data[:, :32].copy(), kind) if name == "blk.1.attn_v.weight" else (data, kind)

    rewrite(tiny_file, tmp_path / "shape.gguf", change=narrow)
    with pytest.raises(ModelLoadError, match="shape.gguf: tensor model.layers.1.self_attn.v_proj.weight has shape"):
        nexttoken.load(tmp_path / "shape.gguf")
