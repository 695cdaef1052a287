"""llama.cpp's mmproj GGUF (nexttoken/model/weights/mmproj.py, LoadSpec.mmproj): a tiny SmolVLM and a tiny Gemma 3
converted by llama.cpp's own converter into their text GGUF and projector file (--mmproj); each pair loads, its tower
is the folder's (to the bit; Gemma 3's soft_emb_norm within the one rounding of the stored 1 + w), and it answers
with the folder's tokens and transformers' on the same image."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from support import idefics3 as tiny
from support.llama_cpp import convert
from support.vision import gemma3_vlm

import nexttoken
from nexttoken.errors import ModelLoadError
from nexttoken.model.weights.mmproj import read_mmproj

PROMPT = "User:<image>Once upon a time<end_of_utterance>\nAssistant:"
GEMMA3_PROMPT = "<start_of_turn>user\n<start_of_image>Once upon a time<end_of_turn>\n<start_of_turn>model\n"


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


@pytest.fixture(scope="module")
def gemma3(shared_dir, tmp_path_factory):  # noqa: ANN201
    """(folder, transformers' model, processor, text GGUF, mmproj GGUF) of a tiny Gemma 3 (4 tokens an image).
    Its three text layers all slide, as llama.cpp's Gemma 3 has them (a global layer every sixth; its GGUF records
    no layer types). The converter writes the projection in float16 whatever --outtype says, so the folder's is
    rounded to float16 first (the tower is then compared exactly, and the tokens too). It converts a copy laid out
    as the released checkpoints are (vision_tower.vision_model.*, the names it maps) with a SentencePiece model
    beside it (its Gemma 3 vocabulary reader needs one; the tiny model's BPE vocabulary is not one it recognises),
    so the pair is loaded with the folder's tokenizer."""
    root = tmp_path_factory.mktemp("gemma3")
    folder, released = root / "folder", root / "released"
    _, processor = gemma3_vlm(folder, seed=5)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["layer_types"] = ["sliding_attention"] * 3  # llama.cpp's Gemma 3: 5 sliding, then global
    (folder / "config.json").write_text(json.dumps(config))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        proj = hf.model.multi_modal_projector.mm_input_projection_weight
        proj.copy_(proj.half().float())
    hf.save_pretrained(folder)
    shutil.copytree(folder, released)
    tensors = load_file(folder / "model.safetensors")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()},
              released / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(shared_dir / "tokenizers" / "llama-2-chat" / "tokenizer.model", released / "tokenizer.model")
    with ThreadPoolExecutor(2) as pool:
        text = pool.submit(convert, released, root / "text.gguf", "f32")
        mmproj = pool.submit(convert, released, root / "mmproj.gguf", "f32", ("--mmproj",))
        return folder, hf, processor, text.result(), mmproj.result()


def test_gemma3_pair_gives_the_folders_tokens(gemma3) -> None:
    folder, hf, processor, text, mmproj = gemma3
    photo = Image.fromarray(np.random.default_rng(1).integers(0, 256, (41, 29, 3), dtype=np.uint8))
    pair = nexttoken.load(text, mmproj=mmproj, tokenizer=folder)
    got = pair.generate(GEMMA3_PROMPT, images=[photo], max_new_tokens=8).token_ids
    assert got == nexttoken.load(folder).generate(GEMMA3_PROMPT, images=[photo], max_new_tokens=8).token_ids
    inputs = processor(text=GEMMA3_PROMPT, images=[photo], return_tensors="pt")
    assert got == hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    assert pair.model.vision.image_token_id == hf.config.image_token_index
    assert pair.model.vision.mm_tokens == 4 and pair.images.size == (56, 56)


def test_gemma3_projector_is_the_folders_tower(gemma3) -> None:
    folder, hf, _, _, mmproj = gemma3
    mm = read_mmproj(mmproj)
    assert mm.kind == "gemma3" and mm.config["mm_tokens_per_image"] == 4
    theirs = {k: v for k, v in hf.state_dict().items()
              if k.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    assert set(mm.tensors) == set(theirs)
    norm = "model.multi_modal_projector.mm_soft_emb_norm.weight"
    for name, t in theirs.items():  # (1 + w) - 1: w within one float32 rounding at 1
        torch.testing.assert_close(mm.tensors[name], t, rtol=0, atol=2**-23 if name == norm else 0, msg=name)
    torch.testing.assert_close(1 + mm.tensors[norm], 1 + theirs[norm], rtol=0, atol=0)  # the scale the tower uses
