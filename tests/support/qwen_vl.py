"""A tiny random-weight Qwen2.5-VL checkpoint (transformers' Qwen2_5_VLConfig: a 2-block vision tower of width 32
with 56-pixel windows, one full-attention block, a 2-layer text model) and test images of awkward sizes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# Small pixel bounds keep every image at 4..64 tokens (28 x 28 pixels per token).
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 28 * 28 * 4,
                "max_pixels": 28 * 28 * 64, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
# Without a tokenizer: a small vocabulary whose last ids are Qwen's vision tokens.
SMALL_IDS = {"vocab_size": 256, "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 248,
             "vision_end_token_id": 249}


# Qwen2.5-VL's chat template (its chat_template.json): an image part becomes <|vision_start|><|image_pad|><|vision_end|>
TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
          "vision_end_token": "<|vision_end|>", "im_start_token": "<|im_start|>", "im_end_token": "<|im_end|>"}


# Qwen3-VL: 16-pixel patches, mean / std 0.5
PREPROCESSOR_3 = {**PREPROCESSOR, "patch_size": 16, "min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 64,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def build_qwen2_5_vl(folder: Path, tokenizer: bool = False, seed: int = 0, qwen3: bool = False):  # noqa: ANN201
    """Save the tiny model to `folder` (with `tokenizer`: the default model's small BPE tokenizer with Qwen's
    vision and chat tokens added, and Qwen2.5-VL's chat template); returns the transformers model. `qwen3`: a
    Qwen3-VL instead (3 vision blocks, learned positions over a 6 x 6 table, DeepStack after blocks 0 and 1; a
    3-layer Qwen3 text model with interleaved M-RoPE)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    ids = dict(SMALL_IDS)
    if tokenizer:
        from support.vision import tokenizer_with

        from nexttoken.text.tokenizer import Tokenizer

        vocab = tokenizer_with(folder, TOKENS, TEMPLATE)
        tok = Tokenizer.from_dir(folder)
        ids = {"vocab_size": -(-vocab // 64) * 64, **{k.replace("_token", "_token_id"): tok.token_to_id(v)
                                                       for k, v in TOKENS.items() if "im_" not in k}}
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=ids.pop("vocab_size"), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_parameters=rope,
                initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, initializer_range=0.3)
    if qwen3:
        text |= dict(num_hidden_layers=3, head_dim=16, rope_parameters={**rope, "mrope_interleaved": True})
        vision |= dict(depth=3, patch_size=16, num_position_embeddings=36, deepstack_visual_indexes=[0, 1])
        cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text, **ids)
        model_class = transformers.Qwen3VLForConditionalGeneration
    else:
        vision |= dict(window_size=56, fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, **ids)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(cfg).eval()
    with torch.no_grad():  # biases start at zero and norms at one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_3 if qwen3 else PREPROCESSOR))
    return model


def odd_images(seed: int = 0) -> list:
    """PIL images of awkward sizes and modes: tiny, huge, non-square both ways, grayscale, RGBA, palette, and one
    already on the patch grid."""
    from PIL import Image

    rng = np.random.default_rng(seed)

    def noise(w: int, h: int, c: int = 3) -> np.ndarray:
        # smooth gradients plus noise, so the bicubic resize has structure to keep
        y, x = np.mgrid[0:h, 0:w]
        base = (x * 255 // max(w - 1, 1) + y * 128 // max(h - 1, 1))[..., None] % 256
        return np.clip(base + rng.integers(-40, 40, (h, w, c)), 0, 255).astype(np.uint8)

    return [
        Image.fromarray(noise(3, 5)),  # tiny: scaled up to min_pixels
        Image.fromarray(noise(2400, 1800)),  # huge: scaled down to max_pixels
        Image.fromarray(noise(500, 90)),  # wide
        Image.fromarray(noise(70, 333)),  # tall
        Image.fromarray(noise(97, 61, 1)[..., 0], "L"),  # grayscale
        Image.fromarray(noise(120, 80, 4), "RGBA"),  # alpha onto white
        Image.fromarray(noise(64, 64)).convert("P"),  # palette
        Image.fromarray(noise(112, 56)),  # already on the 28-pixel grid
    ]


def reference_processor(tokenizer_dir: Path, qwen3: bool = False):  # noqa: ANN201
    """transformers' Qwen2_5_VLProcessor (`qwen3`: Qwen3VLProcessor) over the slow image processor and the folder's
    tokenizer. Its __init__ checks a video processor class that needs torchvision (not installed), so the instance
    is assembled without it; its __call__ (placeholder expansion, tokenizing, mm_token_type_ids) is transformers'
    own."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    processor = object.__new__(Qwen3VLProcessor if qwen3 else Qwen2_5_VLProcessor)
    settings = {k: v for k, v in (PREPROCESSOR_3 if qwen3 else PREPROCESSOR).items() if k != "image_processor_type"}
    processor.image_processor = Qwen2VLImageProcessorPil(**settings)
    processor.tokenizer, processor.video_processor, processor.chat_template = tokenizer, None, None
    for name in ("image", "video", "vision_start", "vision_end"):
        token = TOKENS[f"{name}_token"]
        setattr(processor, f"{name}_token", token)
        setattr(processor, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    return processor


def build_qwen3_5(folder: Path, seed: int = 0, moe: bool = False):  # noqa: ANN201
    """A tiny Qwen3_5ForConditionalGeneration saved to `folder` with the default model's BPE tokenizer (Qwen's
    vision and chat tokens added, Qwen2.5-VL's chat template) and Qwen3-VL's preprocessing (16-pixel patches); its
    text model is the hybrid of tests/support/tiny_models.py's "qwen3_5-delta" cut to 4 layers (gated-DeltaNet and
    gated attention alternating) with half of each head rotated by interleaved M-RoPE [2, 3, 3]; its tower 2
    blocks of width 32 with learned positions over a 6 x 6 table. `moe`: a Qwen3_5MoeForConditionalGeneration
    instead (the text model "qwen3_5-moe"'s sparse MLPs on the same 4 layers; the same tower). Returns the
    transformers model."""
    import transformers
    from support.tiny_models import BASE, VARIANTS
    from support.vision import tokenizer_with

    from nexttoken.text.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer_with(folder, TOKENS, TEMPLATE)
    tok = Tokenizer.from_dir(folder)
    ids = {k.replace("_token", "_token_id"): tok.token_to_id(v) for k, v in TOKENS.items() if "im_" not in k}
    rope = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 3, 3],
            "mrope_interleaved": True}  # a small theta: every rotated pair turns visibly between an image's rows
    layers = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    text = {**BASE, **VARIANTS["qwen3_5-moe" if moe else "qwen3_5-delta"][1], "num_hidden_layers": 4,
            "layer_types": layers,
            "vocab_size": -(-vocab // 64) * 64,
            "rope_parameters": rope, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                  num_position_embeddings=36, initializer_range=0.3)
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    cfg = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():  # biases start at zero and norms at one: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") and "visual" in name:
                p.normal_(0, 0.3)
            elif "visual" in name and "norm" in name:
                p.normal_(1.0, 0.3)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_3))
    return model
