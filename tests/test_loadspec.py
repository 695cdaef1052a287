"""One loading path (nexttoken/loadspec.py, nexttoken/loading.py): every loading option is a LoadSpec field,
checked once with an error that names it; the library, the commands and the server load through one `load`; the
commands' flags are the fields'."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import nexttoken
from nexttoken import LoadSpec
from nexttoken.errors import LoraError, ModelLoadError, NextTokenError
from nexttoken.loadspec import DTYPES, GGUF_ACTIVATIONS, QUANTIZATIONS


def test_the_allowed_values_are_the_loaders() -> None:
    from nexttoken.model.quant.ggml import ACTIVATIONS
    from nexttoken.model.quant.quantize import QUANTIZATIONS as QUANT
    from nexttoken.model.weights.loader import DTYPES as LOADER_DTYPES

    assert DTYPES == tuple(LOADER_DTYPES) and QUANTIZATIONS == QUANT and GGUF_ACTIVATIONS == tuple(ACTIVATIONS)


@pytest.mark.parametrize("options, words", [
    (dict(dtype="fp8"), ["dtype='fp8'", "float32, bfloat16, float16"]),
    (dict(quantize="int3"), ["quantize='int3'", "int8, int4, bf16"]),
    (dict(gguf_activations="int4"), ["gguf_activations='int4'", "float32, int16, int8"]),
    (dict(prefill="float16"), ["prefill='float16'", "float32, bfloat16"]),
    (dict(device="tpu"), ["device='tpu'", "cpu, cuda"]),
    (dict(tensor_parallel_size=0), ["tensor_parallel_size must be an integer >= 1"]),
    (dict(tensor_parallel_size=True), ["tensor_parallel_size must be an integer >= 1"]),
    (dict(tensor_parallel_timeout=0), ["tensor_parallel_timeout", "positive"]),
    (dict(threads=0), ["threads must be an integer >= 1"]),
    (dict(dequantize="yes"), ["dequantize is True or False"]),
    (dict(model=3), ["model must be a string or a path"]),
    (dict(tensor_parallel_size=2, quantize="int4"), ["quantize='int4' does not run with tensor parallelism"]),
    (dict(colour="red"), ["unknown load option(s) ['colour']", "tensor_parallel_size"]),
])
def test_a_bad_value_names_the_field_and_what_it_allows(options, words) -> None:
    with pytest.raises(ModelLoadError) as e:
        LoadSpec.of(**options)
    assert all(w in str(e.value) for w in words), str(e.value)
    keywords = {"path" if k == "model" else k: v for k, v in options.items()}
    if set(keywords) <= set(inspect.signature(nexttoken.load).parameters):
        with pytest.raises(ModelLoadError):  # the library's keywords are checked by the same spec
            nexttoken.load(**keywords)


@pytest.mark.parametrize("options, words", [
    (dict(lora={"a": "x", "b": "y"}, merge_lora=True), ["exactly one"]),
    (dict(lora={"a": "x"}, tensor_parallel_size=2), ["tensor-parallel"]),
    (dict(lora=["x"]), ["maps adapter names"]),
    (dict(max_loras=0), ["max_loras must be an integer >= 1"]),
])
def test_lora_fields_raise_lora_errors(options, words) -> None:
    with pytest.raises(LoraError) as e:
        LoadSpec.of(**options)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_torch_dtypes_and_paths_are_accepted_and_the_spec_is_frozen(tmp_path) -> None:
    import torch

    spec = LoadSpec(model=tmp_path, dtype=torch.bfloat16, lora={"a": tmp_path})
    assert spec.lora == {"a": str(tmp_path)} and spec.adapter_name == "a"
    with pytest.raises(TypeError):
        spec.lora["b"] = "x"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dtype = "float32"  # type: ignore[misc]
    assert spec == LoadSpec(model=tmp_path, dtype=torch.bfloat16, lora={"a": str(tmp_path)})
    assert hash(spec) == hash(LoadSpec(model=tmp_path, dtype=torch.bfloat16, lora={"a": str(tmp_path)}))
    with pytest.raises(ModelLoadError, match="torch.int8"):
        LoadSpec(dtype=torch.int8)
    assert issubclass(ModelLoadError, NextTokenError)


def test_tensor_parallelism_refuses_a_gguf_file_before_starting_ranks(shared_dir) -> None:
    gguf = shared_dir / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(ModelLoadError, match="tensor parallelism loads Hugging Face folders, not GGUF files"):
        nexttoken.load(gguf, tensor_parallel_size=2)


def test_a_spec_loads_what_the_keywords_load(shared_dir) -> None:
    stories = shared_dir / "models" / "stories260k"
    by_keywords = nexttoken.load(stories, quantize="int8")
    by_spec = nexttoken.load(LoadSpec(model=stories, quantize="int8"))
    assert by_spec.name == by_keywords.name == "stories260k"
    want = by_keywords.generate("Once upon a time", max_new_tokens=12).token_ids
    assert by_spec.generate("Once upon a time", max_new_tokens=12).token_ids == want


def test_the_commands_flags_are_the_specs_fields() -> None:
    from nexttoken.cli import build_parser

    parser = build_parser()
    chat = parser.parse_args(["chat", "--model", "m", "--dtype", "bfloat16", "--quantize", "int8", "--threads", "2",
                              "--lora", "a=path/a", "--gguf-activations", "int16", "--draft-model", "d"])
    serve = parser.parse_args(["serve", "--model", "m", "--dtype", "bfloat16", "--quantize", "int8", "--threads", "2",
                               "--lora-modules", "a=path/a", "--gguf-activations", "int16", "--speculative-model", "d",
                               "--max-lora-rank", "16"])
    want = LoadSpec(model="m", dtype="bfloat16", quantize="int8", threads=2, lora={"a": "path/a"},
                    gguf_activations="int16", draft_model="d")
    assert LoadSpec.from_args(chat) == want
    assert LoadSpec.from_args(serve) == want.replace(max_lora_rank=16)  # serve's slot rank defaults to vLLM's 16
    with pytest.raises(SystemExit):  # a value outside the field's choices is refused by the parser itself
        parser.parse_args(["generate", "--quantize", "int3"])
