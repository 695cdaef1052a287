"""LFM2-VL end to end (issue 43): images through LLM.generate and the engine on a tiny Lfm2VlForConditionalGeneration
(its hybrid text model: convolution and attention layers), greedy and seeded tokens equal to transformers' generate
given the same model inputs (transformers' LFM2-VL processor needs torchvision:
tests/images/test_lfm2_vl_preprocessing.py checks our preprocessing against its recorded outputs)."""

from __future__ import annotations

import pytest
import torch
from support import lfm2_vl as ref

import nexttoken


@pytest.fixture(scope="module")
def vlm(shared_dir, tmp_path_factory):  # noqa: ANN201
    folder = tmp_path_factory.mktemp("lfm2vl")
    hf = ref.build(folder, shared_dir / "models" / "stories260k", seed=1)
    return hf, nexttoken.load(str(folder))


def _transformers(hf, llm, text: str, images: list, **options) -> list[int]:  # noqa: ANN001, ANN003
    """transformers' generate on the prompt ids and pixel inputs our preprocessing makes."""
    inputs = llm._read_images(images)
    ids = llm.encode(inputs.expand(text))
    pixels = torch.cat([torch.from_numpy(p.pixel_values) for p in inputs.parts])  # every image's tiles, in order
    mask = torch.cat([torch.from_numpy(p.extra["pixel_attention_mask"]) for p in inputs.parts])
    shapes = torch.cat([torch.from_numpy(p.extra["spatial_shapes"]) for p in inputs.parts])
    if options.get("do_sample"):
        torch.manual_seed(options.pop("seed"))
    out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, pixel_attention_mask=mask,
                      spatial_shapes=shapes, max_new_tokens=8, **options)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("text, images, options", [
    ("User: <image> Once upon a time", [(240, 320)], {}),  # 6 tiles and a thumbnail
    ("<image> and <image>: which?", [(40, 17), (333, 40)], {}),  # one tile, then 8 and a thumbnail
    ("A story about <image>", [(64, 65)], {"do_sample": True, "top_k": 20, "temperature": 0.8, "seed": 7}),
])
def test_generate_equals_transformers(vlm, text, images, options) -> None:
    hf, llm = vlm
    pictures = [ref.photo(h, w) for h, w in images]
    got = llm.generate(text, images=pictures, max_new_tokens=8, **options).token_ids
    assert got == _transformers(hf, llm, text, pictures, **options)
