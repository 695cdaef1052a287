"""llama.cpp's multimodal projector file (`mmproj-*.gguf`, written by convert_hf_to_gguf.py --mmproj): the vision
encoder and projector of a vision-language model, beside the text model's own GGUF. Its `clip.*` keys and `v.*` /
`mm.*` tensors are read back into the checkpoint's config and tensor names, so the same tower (model/vision/) runs
them, and its preprocessing settings into the Hugging Face processor's.

Projector types read (`clip.projector_type`): idefics3 (SmolVLM, Idefics3), gemma3 (Gemma 3 4B / 12B / 27B: the
converter stores the projector's soft_emb_norm as 1 + w, read back as w, and its input projection in float16)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelLoadError
from .gguf import GGUFFile, _tensor, open_gguf


def _siglip_names(root: str) -> tuple[tuple[str, str], ...]:
    """llama.cpp's tensor names of a SigLIP encoder (gguf-py's MODEL_TENSOR map for MMPROJ) -> a checkpoint's, the
    encoder under `root` (Idefics3: model.vision_model.; Gemma 3, as transformers 5 names it: model.vision_tower.)."""
    return (
        (r"^v\.patch_embd\.", f"{root}embeddings.patch_embedding."),
        (r"^v\.position_embd\.", f"{root}embeddings.position_embedding."),
        (r"^v\.post_ln\.", f"{root}post_layernorm."),
        (r"^v\.blk\.(\d+)\.ln([12])\.", root + r"encoder.layers.\1.layer_norm\2."),
        (r"^v\.blk\.(\d+)\.ffn_up\.", root + r"encoder.layers.\1.mlp.fc1."),
        (r"^v\.blk\.(\d+)\.ffn_down\.", root + r"encoder.layers.\1.mlp.fc2."),
        (r"^v\.blk\.(\d+)\.attn_([qkv])\.", root + r"encoder.layers.\1.self_attn.\2_proj."),
        (r"^v\.blk\.(\d+)\.attn_out\.", root + r"encoder.layers.\1.self_attn.out_proj."),
    )


# -> Idefics3's checkpoint names (and its connector's projection)
IDEFICS3_NAMES = _siglip_names("model.vision_model.") + (
    (r"^mm\.model\.fc\.", "model.connector.modality_projection.proj."),
)
# -> Gemma 3's (and the projector's two tensors)
GEMMA3_NAMES = _siglip_names("model.vision_tower.") + (
    (r"^mm\.input_projection\.weight$", "model.multi_modal_projector.mm_input_projection_weight"),
    (r"^mm\.soft_emb_norm\.", "model.multi_modal_projector.mm_soft_emb_norm."),
)
GEMMA3_NORM = "model.multi_modal_projector.mm_soft_emb_norm.weight"


@dataclass(frozen=True)
class Mmproj:
    """An mmproj file read back: the vision kind, a config.json-shaped dict of the tower, its tensors under the
    checkpoint's names (float32), and the image processor's settings (preprocessor_config.json's keys)."""

    path: Path
    kind: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    image_settings: dict[str, Any]


def read_mmproj(path: str | Path) -> Mmproj:
    """Open an mmproj GGUF; a text model's GGUF, or a projector type nexttoken does not run, raises by name."""
    g = open_gguf(path)
    m = g.metadata
    if g.arch != "clip" or m.get("general.type", "mmproj") != "mmproj":
        raise ModelLoadError(f"{g.path} is not a multimodal projector file (general.architecture {g.arch!r}, "
                             "not 'clip'): pass the mmproj-*.gguf that llama.cpp's converter writes with --mmproj")
    if not m.get("clip.has_vision_encoder", False):
        raise ModelLoadError(f"{g.path} holds no vision encoder (an audio projector?); nexttoken reads images")
    projector = str(m.get("clip.projector_type", ""))
    if projector not in PROJECTORS:
        raise ModelLoadError(f"{g.path}: projector type {projector!r} is not supported; nexttoken reads mmproj files "
                             f"of {', '.join(PROJECTORS)}")
    return PROJECTORS[projector](g)


def _idefics3(g: GGUFFile) -> Mmproj:
    return Mmproj(g.path, "idefics3", _idefics3_config(g, "Idefics3ForConditionalGeneration"),
                  _tensors(g, IDEFICS3_NAMES), _idefics3_image_settings(g))


def _gemma3(g: GGUFFile) -> Mmproj:
    """Gemma 3: SigLIP's clip.vision.* as vision_config; the pooling (clip.vision.projector.scale_factor, 4 when
    absent, as clip.cpp reads it) gives mm_tokens_per_image; images resized to the encoder's square."""
    size, patch = int(_need(g, "clip.vision.image_size")), int(_need(g, "clip.vision.patch_size"))
    per_side = size // patch // int(g.metadata.get("clip.vision.projector.scale_factor", 4))
    vision = {"hidden_size": int(_need(g, "clip.vision.embedding_length")),
              "intermediate_size": int(_need(g, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(_need(g, "clip.vision.block_count")),
              "num_attention_heads": int(_need(g, "clip.vision.attention.head_count")),
              "image_size": size, "patch_size": patch,
              "layer_norm_eps": float(g.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))}
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": vision,
              "text_config": {"hidden_size": int(_need(g, "clip.vision.projection_dim"))},
              "mm_tokens_per_image": per_side * per_side}
    tensors = _tensors(g, GEMMA3_NAMES)
    if GEMMA3_NORM in tensors:  # the converter wrote 1 + w (Gemma3RMSNorm's scale); the tower adds the 1 itself
        tensors[GEMMA3_NORM] = tensors[GEMMA3_NORM] - 1.0
    settings: dict[str, Any] = {"size": {"height": size, "width": size}, "image_seq_length": per_side * per_side}
    for key, name in (("clip.vision.image_mean", "image_mean"), ("clip.vision.image_std", "image_std")):
        if g.metadata.get(key) is not None:
            settings[name] = [float(v) for v in g.metadata[key]]
    return Mmproj(g.path, "gemma3", config, tensors, settings)


# clip.projector_type -> its reader (the vision kind, config, tensors and image settings)
PROJECTORS = {"idefics3": _idefics3, "gemma3": _gemma3}


def _need(g: GGUFFile, key: str) -> Any:
    value = g.metadata.get(key)
    if value is None:
        raise ModelLoadError(f"{g.path}: the mmproj file lacks {key}; write it again with llama.cpp's converter")
    return value


def _idefics3_config(g: GGUFFile, architecture: str) -> dict[str, Any]:
    """The tower's config.json as Idefics3's: clip.vision.* are its vision_config, projection_dim the text width.
    (llama.cpp's idefics3 graph runs the tanh GELU; image_token_id comes from the text model's vocabulary.)"""
    vision = {"hidden_size": int(_need(g, "clip.vision.embedding_length")),
              "intermediate_size": int(_need(g, "clip.vision.feed_forward_length")),
              "num_hidden_layers": int(_need(g, "clip.vision.block_count")),
              "num_attention_heads": int(_need(g, "clip.vision.attention.head_count")),
              "image_size": int(_need(g, "clip.vision.image_size")),
              "patch_size": int(_need(g, "clip.vision.patch_size")),
              "layer_norm_eps": float(g.metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
              "hidden_act": "gelu_pytorch_tanh" if g.metadata.get("clip.use_gelu", True) else "gelu"}
    return {"architectures": [architecture], "vision_config": vision,
            "text_config": {"hidden_size": int(_need(g, "clip.vision.projection_dim"))},
            "scale_factor": int(g.metadata.get("clip.vision.projector.scale_factor", 2))}


def _idefics3_image_settings(g: GGUFFile) -> dict[str, Any]:
    """preprocessor_config.json's keys as the converter recorded them: the first resize's longest edge
    (preproc_image_size), the tile (the encoder's image_size), the mean and std."""
    tile = int(_need(g, "clip.vision.image_size"))
    settings: dict[str, Any] = {"size": {"longest_edge": int(g.metadata.get("clip.vision.preproc_image_size", tile))},
                                "max_image_size": {"longest_edge": tile}}
    for key, name in (("clip.vision.image_mean", "image_mean"), ("clip.vision.image_std", "image_std")):
        if g.metadata.get(key) is not None:
            settings[name] = [float(v) for v in g.metadata[key]]
    return settings


def _tensors(g: GGUFFile, names: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its checkpoint name, dequantized to float32; an unknown name raises."""
    out = {}
    for gname in g.tensors:
        name = gname
        for pattern, replacement in names:
            name = re.sub(pattern, replacement, name)
        if name == gname:
            raise ModelLoadError(f"{g.path}: tensor {gname!r} is not one of the projector's; is the file complete "
                                 "and of a supported model?")
        out[name] = _tensor(g, gname, torch.float32)
    return out
