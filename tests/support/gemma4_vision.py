"""A tiny random-weight Gemma4ForConditionalGeneration (issue 43) built with transformers 5.24: Gemma 4's text model
with per-layer inputs and a one-layer vision tower (hidden 32, patch 4, 2 x 2 pooling, 70 soft tokens at most), over
the packaged default model's BPE tokenizer with Gemma 4's image tokens added, saved with its image processor's
files as a released checkpoint is."""

from __future__ import annotations

import json
from pathlib import Path

from support.vision import tokenizer_with

# Gemma 4's special tokens the processor reads (the audio pair only because Gemma4Processor checks they exist).
TOKENS = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>", "boa_token": "<|audio>",
          "eoa_token": "<audio|>"}
# The part of Gemma 4's chat template (llama.cpp's google-gemma-4-31B-it.jinja) a user turn with images takes.
TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<|image|>' }}{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def gemma4_vlm(folder: Path, seed: int = 0, two_way: bool = False):  # noqa: ANN201
    """Save the tiny checkpoint to `folder` (two_way: text_config.use_bidirectional_attention "vision", an image's
    tokens attending each other on the sliding layers); returns (hf model, hf image processor, hf tokenizer)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_with(folder, TOKENS, TEMPLATE)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
    V = -(-vocab // 64) * 64
    text = transformers.Gemma4TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=16, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "full_attention"], hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=V, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
        use_bidirectional_attention="vision" if two_way else None)
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=160)
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None, boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"], image_token_id=ids["image_token"], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at one, tables at one: make every one matter
        for name, p in model.named_parameters():
            if "norm" in name or "position_embedding_table" in name or "layer_scalar" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
    model.save_pretrained(folder)
    images = transformers.Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    images.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return model, images, tok


def hf_inputs(folder: Path, text: str, images: list) -> dict:  # noqa: ANN001
    """transformers' inputs for `text` with `images`: its image processor's pixel values and positions, and the
    prompt expanded by Gemma4Processor.replace_image_token (the processor itself cannot be built here: its video
    processor needs torchvision) and tokenised by its tokenizer."""
    from types import SimpleNamespace

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pixels = transformers.Gemma4ImageProcessorPil.from_pretrained(folder)(images, return_tensors="pt") if images else {}
    processor = SimpleNamespace(**{k: TOKENS[k] for k in ("boi_token", "image_token", "eoi_token")})
    pieces = text.split(TOKENS["image_token"])
    expanded = pieces[0] + "".join(transformers.Gemma4Processor.replace_image_token(processor, pixels, i) + rest
                                   for i, rest in enumerate(pieces[1:]))
    out = dict(tok(expanded, return_tensors="pt"))
    image_id = tok.convert_tokens_to_ids(TOKENS["image_token"])
    out["mm_token_type_ids"] = (out["input_ids"] == image_id).long()  # Gemma4Processor's: 1 on image tokens
    if images:
        out |= {"pixel_values": pixels["pixel_values"], "image_position_ids": pixels["image_position_ids"]}
    return out
