"""LFM2-VL test inputs and the recorded outputs of transformers' own processor on them.

transformers' Lfm2VlImageProcessor has only a torchvision backend, and torchvision is not a test dependency: its
outputs on IMAGES (tiny processor settings, SETTINGS) are recorded in tests/data/lfm2_vl_processor.npz by running
this module with torchvision importable (`python tests/support/lfm2_vl.py`), and the tests compare against them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "lfm2_vl_processor.npz"
# 4-pixel patches, 32-pixel tiles, 4..16 tokens per image: at most 64 patches a tile, grids of 2..10 tiles
SETTINGS = dict(encoder_patch_size=4, tile_size=32, max_image_tokens=16, min_image_tokens=4, downsample_factor=2)
TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)]


def photo(h: int, w: int, mode: str = "RGB"):  # noqa: ANN201 - a PIL image
    """A photo-like picture (gradients and a disc), deterministic, in `mode` (RGB, L or RGBA)."""
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 100 * np.sin((x + y) / 7)], axis=-1)
    rgb[(y - h / 2) ** 2 + (x - w / 3) ** 2 < (min(h, w) / 4) ** 2] = (250, 30, 60)
    image = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
    if mode == "RGBA":
        alpha = (255 * (x / max(w - 1, 1))).astype(np.uint8)
        image = Image.fromarray(np.dstack([np.asarray(image), alpha]))
    return image.convert("L") if mode == "L" else image


IMAGES = {"tiny": (1, 1, "RGB"), "one-tile": (40, 17, "RGB"), "photo": (240, 320, "RGB"), "tall": (333, 40, "RGB"),
          "huge": (1500, 2100, "RGB"), "grayscale": (100, 30, "L"), "rgba": (64, 65, "RGBA")}


def record() -> None:
    """Write transformers' pixel values, masks, spatial shapes and placeholder text for each of IMAGES."""
    from transformers.image_transforms import convert_to_rgb
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    processor = Lfm2VlImageProcessor(**SETTINGS)
    text = Lfm2VlProcessor.__new__(Lfm2VlProcessor)  # its placeholder strings need no tokenizer
    text.image_processor = processor
    text.image_token, text.image_start_token = "<image>", "<|image_start|>"
    text.image_end_token, text.image_thumbnail_token = "<|image_end|>", "<|img_thumbnail|>"
    out = {}
    for name, (h, w, mode) in IMAGES.items():
        # its processor does not convert to RGB by default: transformers' convert_to_rgb first, as load_image does
        got = processor(images=[convert_to_rgb(photo(h, w, mode))], return_tensors="np", return_row_col_info=True)
        for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
            out[f"{name}/{key}"] = got[key]
        out[f"{name}/text"] = np.array(text.replace_image_token(got, 0, use_image_special_tokens=True))
    DATA.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(DATA, **out)


if __name__ == "__main__":
    record()


def build(folder: Path, stories: Path, seed: int = 0):  # noqa: ANN201 - the transformers model
    """A tiny Lfm2VlForConditionalGeneration in `folder`: stories260K's tokenizer with LFM2-VL's image tokens added
    (no BOS, as the chat template writes the whole prompt), its processor settings (SETTINGS), a SigLIP2 tower of
    hidden 32 (2 layers, 4-pixel patches, an 8 x 8 position grid) and LFM2's hybrid text model (convolution and
    attention layers)."""
    import json

    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(stories / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in TOKENS])
    tok.post_processor = None
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((stories / "tokenizer_config.json").read_text())
    config.update(model_max_length=4096, add_bos_token=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    image_token = tok.token_to_id("<image>")
    vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, patch_size=4, num_patches=64, vision_use_head=False)
    text = dict(model_type="lfm2", vocab_size=-(-tok.get_vocab_size() // 64) * 64, hidden_size=64,
                intermediate_size=112, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                layer_types=["conv", "full_attention", "conv"], block_ff_dim=112, block_multiple_of=16,
                max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3)
    cfg = transformers.Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=image_token,
                                    projector_hidden_size=40, downsample_factor=SETTINGS["downsample_factor"])
    torch.manual_seed(seed)
    model = transformers.Lfm2VlForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms at ones and biases at zeros: make every one matter
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.3)
            elif ("vision_tower" in name or "projector" in name) and name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    settings = {"image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor", **SETTINGS}
    (folder / "preprocessor_config.json").write_text(json.dumps(settings))
    return model
