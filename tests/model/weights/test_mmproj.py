"""llama.cpp's mmproj GGUF (nexttoken/model/weights/mmproj.py, LoadSpec.mmproj): a tiny SmolVLM converted by
llama.cpp's own converter into its text GGUF and its projector file (--mmproj); the pair loads, its tower is the
folder's to the bit, and it answers with the folder's tokens and transformers' on the same image."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image
from support import idefics3 as tiny
from support.llama_cpp import convert

import nexttoken
from nexttoken.errors import ModelLoadError
from nexttoken.model.weights.mmproj import read_mmproj

PROMPT = "User:<image>Once upon a time<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def converted(shared_dir, tmp_path_factory):  # noqa: ANN201
    """(folder, transformers' model, text GGUF, mmproj GGUF)."""
    folder = tmp_path_factory.mktemp("smolvlm")
    hf = tiny.build(folder, shared_dir / "models" / "stories260k", seed=4)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]  # as SmolVLM2's config.json names its text model
    (folder / "config.json").write_text(json.dumps(config))
    with ThreadPoolExecutor(2) as pool:  # two converter processes at once
        text = pool.submit(convert, folder, folder.parent / "text.gguf", "f32")
        mmproj = pool.submit(convert, folder, folder.parent / "mmproj.gguf", "f32", ("--mmproj",))
        return folder, hf, text.result(), mmproj.result()


def test_the_pair_gives_the_folders_tokens(converted) -> None:
    folder, hf, text, mmproj = converted
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8))
    # the folder's tokenizer: the converter's vocabulary of this test tokenizer adds a BOS (llama.cpp's default for
    # a SentencePiece vocabulary) that SmolVLM's does not
    pair = nexttoken.load(text, mmproj=mmproj, tokenizer=folder)
    got = pair.generate(PROMPT, images=[photo], max_new_tokens=8).token_ids
    assert got == nexttoken.load(folder).generate(PROMPT, images=[photo], max_new_tokens=8).token_ids
    inputs = tiny.hf_processor(folder)(text=[PROMPT], images=[[photo]], return_tensors="pt")
    assert got == hf.generate(**inputs, max_new_tokens=8)[0, inputs["input_ids"].shape[1]:].tolist()
    assert pair.model.vision.image_token_id == tiny.IMAGE_TOKEN_ID


def test_the_projector_is_the_folders_tower(converted) -> None:
    folder, hf, _, mmproj = converted
    mm = read_mmproj(mmproj)
    assert mm.kind == "idefics3"
    assert mm.image_settings["size"] == {"longest_edge": 64}  # the folder's processor: size, max_image_size
    assert mm.image_settings["max_image_size"] == {"longest_edge": 32}
    theirs = {k: v for k, v in hf.state_dict().items() if k.startswith(("model.vision_model.", "model.connector."))}
    assert set(mm.tensors) == set(theirs)
    for name, t in theirs.items():
        torch.testing.assert_close(mm.tensors[name], t, rtol=0, atol=0, msg=name)


def test_wrong_files_are_refused_by_name(converted) -> None:
    folder, _, text, mmproj = converted
    with pytest.raises(ModelLoadError, match="not a multimodal projector file"):
        nexttoken.load(text, mmproj=text)
    with pytest.raises(ModelLoadError, match="goes beside a .gguf model"):
        nexttoken.load(folder, mmproj=mmproj)
