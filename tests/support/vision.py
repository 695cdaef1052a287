"""Tiny random-weight vision-language checkpoints built with transformers (issue 43), over a small real BPE
tokenizer (the packaged default model's) with the family's special tokens added, and its real chat template, saved
with the transformers processor's own files, as a released checkpoint is."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# Gemma 3's chat template, as google/gemma-3-4b-it's tokenizer_config.json has it.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def tokenizer_with(folder: Path, extra: dict[str, str], template: str) -> int:
    """Write the default model's BPE tokenizer into `folder` with `extra`'s tokens added as special tokens (named
    in tokenizer_config.json as transformers' multimodal tokenizers name them) and the chat template; returns
    the vocabulary's size."""
    from tokenizers import AddedToken, Tokenizer

    src = ROOT / "nexttoken" / "default_model"
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                            [*extra.values(), "<start_of_turn>", "<end_of_turn>"]])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config |= {"extra_special_tokens": extra, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def gemma3_vlm(folder: Path, seed: int = 0, image_size: int = 56, mm_tokens: int = 4, layers: int = 2):  # noqa: ANN201
    """A tiny Gemma3ForConditionalGeneration (SigLIP: hidden 32, `layers` layers, patch 14) saved to `folder` with
    its tokenizer and processor files; returns (hf model, hf processor)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_with(folder, GEMMA3_TOKENS, GEMMA3_TEMPLATE)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = {k: hf_tok.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    text = transformers.Gemma3TextConfig(
        vocab_size=-(-vocab // 64) * 64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=12, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=16,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, pad_token_id=0)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2, image_size=image_size,
        patch_size=14, vision_use_head=False)
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=mm_tokens,
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at zero (1 + w) or one, the projection at zero: make every one matter
        for name, p in model.named_parameters():
            if "norm" in name or "mm_input_projection" in name:
                p.normal_(0.0, 0.5 if "norm" in name else 0.2)
    model.save_pretrained(folder)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=hf_tok,
                                             image_seq_length=mm_tokens, chat_template=GEMMA3_TEMPLATE)
    processor.save_pretrained(folder)
    return model, processor


def odd_images(tmp: Path) -> dict:
    """Images a caller may send: tiny, huge, non-square, grayscale, RGBA, palette, EXIF-rotated (as PIL images
    decoded from their files)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    photo = Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = tmp / "rotated.jpg"
    photo.save(rotated, format="JPEG", exif=exif)
    rgba = Image.fromarray(rng.integers(0, 256, (20, 30, 4), dtype=np.uint8))
    buf = io.BytesIO()
    rgba.save(buf, format="PNG")
    return {
        "tiny": Image.fromarray(rng.integers(0, 256, (1, 2, 3), dtype=np.uint8)),
        "huge": Image.fromarray(rng.integers(0, 256, (1100, 1500, 3), dtype=np.uint8)),
        "non-square": photo,
        "grayscale": Image.fromarray(rng.integers(0, 256, (40, 17), dtype=np.uint8)),
        "rgba": buf.getvalue(),
        "exif-rotated": str(rotated),
    }


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst
