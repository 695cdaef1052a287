"""model/weights/gguf_reader.py against the `gguf` package's GGUFReader on the same files: the real SmolLM2 file
(a 49,152-token vocabulary) and tiny files of every kind of value and tensor GGUF holds. Same metadata values, same
tensors (names, types, shapes, offsets, and data: dtype, shape and bytes of the views)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from nexttoken.errors import ModelLoadError  # noqa: E402
from nexttoken.model.weights.gguf import open_gguf  # noqa: E402
from nexttoken.model.weights.gguf_reader import read_gguf  # noqa: E402


def _same_as_gguf(path: Path) -> None:
    metadata, tensors, mapped = read_gguf(path)
    assert mapped.shape[0] == path.stat().st_size
    reader = gguf.GGUFReader(str(path), mode="c")
    assert metadata == {key: field.contents() for key, field in reader.fields.items()}
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert (ours.tensor_type, ours.n_elements, ours.n_bytes, ours.data_offset) == \
            (theirs.tensor_type, theirs.n_elements, theirs.n_bytes, theirs.data_offset), ours.name
        assert np.array_equal(ours.shape, theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert ours.data.tobytes() == theirs.data.tobytes(), ours.name


def test_the_real_file_reads_as_the_gguf_package_reads_it(shared_dir: Path) -> None:
    _same_as_gguf(shared_dir / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_every_value_and_tensor_kind(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7), w.add_int8("t.i8", -7), w.add_uint16("t.u16", 700), w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000), w.add_int32("t.i32", -70000), w.add_float32("t.f32", 0.5)
    w.add_uint64("t.u64", 2**40), w.add_int64("t.i64", -(2**40)), w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True), w.add_string("t.str", "ünïcödé ✓")
    w.add_array("t.ints", [1, 2, 3]), w.add_array("t.floats", [0.25, -1.5]), w.add_array("t.strs", ["a", "", "b c"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    for kind in ("Q8_0", "Q4_0", "Q5_1", "BF16"):
        qtype = gguf.GGMLQuantizationType[kind]
        data = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
        w.add_tensor(kind.lower(), data, raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    _same_as_gguf(path)
    g = open_gguf(path)
    assert g.metadata["t.strs"] == ["a", "", "b c"] and g.metadata["t.str"] == "ünïcödé ✓"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])  # inside the metadata
    with pytest.raises(ModelLoadError, match="cut.gguf.*(truncated|damaged)"):
        open_gguf(cut)


@pytest.mark.parametrize("native", [True, False], ids=["native", "loop"])
def test_string_arrays_read_alike_natively_and_in_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           native: bool) -> None:
    """A vocabulary's string arrays go through csrc/ggml.cpp's nt_gguf_strings where the kernel library is here,
    through the Python loop where not: both give GGUFReader's values, a string with a NUL byte of its own included
    (the native join cannot be split there, so it falls back), and both refuse an array cut short."""
    from nexttoken.model import kernels
    from nexttoken.model.weights import gguf_reader

    if native and not kernels.available():
        pytest.skip(f"the native kernel library is unavailable here: {kernels.why_unavailable()}")
    calls = []
    real = kernels.library if native else (lambda: None)
    monkeypatch.setattr(gguf_reader, "_library", lambda: calls.append(1) or real())
    rng = np.random.default_rng(1)
    alphabet = list("abc xyzĠĊ▁ü✓\n\t") + ["<|im_end|>", "日本", "\U0001f600"]
    words = ["".join(rng.choice(alphabet, size=rng.integers(0, 12))) for _ in range(3000)]
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("t.words", words)
    w.add_array("t.nul", ["a", "b\x00c", "", "d"])
    w.add_string("t.after", "still in step")
    w.add_tensor("f32", np.ones((2, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    _same_as_gguf(path)
    metadata = read_gguf(path)[0]
    assert metadata["t.words"] == words and metadata["t.nul"] == ["a", "b\x00c", "", "d"]
    assert metadata["t.after"] == "still in step"
    assert gguf_reader.strings(b"\x00" * 16, 8, 0) == ([], 8)  # an empty array: nothing read, the offset kept
    assert calls, "the string arrays did not ask for the native library"
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index("<|im_end|>".encode()) + 3])  # inside the words array
    with pytest.raises(ModelLoadError, match="cut.gguf.*(truncated|damaged)"):
        open_gguf(cut)
