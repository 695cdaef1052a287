"""LFM2-VL (Liquid AI): LFM2's hybrid text model (`text_config`, tensors under `model.language_model.*`) with a
SigLIP2 NaFlex vision tower (`model.vision_tower.*`: each image at its own patch grid) and a pixel-unshuffle
projector (`model.multi_modal_projector.*`); large images split into tiles plus a thumbnail
(model/vision/lfm2_vl.py, images/lfm2_vl.py). transformers' modeling_lfm2_vl.py."""

from __future__ import annotations

from .base import Family
from .lfm2 import LFM2

LFM2_VL = Family(
    "Lfm2VlForConditionalGeneration", ("lfm2_vl",), "LFM2-VL 450M / 1.6B / 3B (images in)",
    "LFM2's text model (`text_config`) with a SigLIP2 NaFlex tower (position embeddings resized to each image's patch "
    "grid) and a pixel-unshuffle projector (`downsample_factor`, LayerNorm, GELU MLP); an image larger than "
    "`max_image_tokens` split into `min_tiles`..`max_tiles` tiles of `tile_size` plus a thumbnail",
    read=LFM2.read, tensor_parallel=False, lora=False, state=LFM2.state, vision="lfm2_vl",
    # the text model's tensors under LFM2's names, then Llama's; the tower's and projector's dropped from the decoder's
    renames=((r"^model\.language_model\.", "model."), (r"^model\.(vision_tower|multi_modal_projector)\..*$", ""),
             *LFM2.renames),
)
