"""Idefics3 and SmolVLM (Hugging Face): a Llama text model (`text_config`, tensors under `model.text_model.*`)
with a SigLIP tower whose positions follow each tile's patches (`model.vision_model.*`) and a pixel-shuffle
connector (`model.connector.*`); images split into tiles plus a global image, each tile's rows in place of its
`<image>` tokens (model/vision/idefics3.py, images/idefics3.py). transformers' modeling_idefics3.py /
modeling_smolvlm.py (the same network)."""

from __future__ import annotations

from .base import Family

# the text model's tensors under the Llama names; the tower's and connector's dropped from the decoder's
RENAMES = ((r"^model\.text_model\.", "model."), (r"^model\.(vision_model|connector)\..*$", ""))
# model_types: transformers maps `idefics3` / `smolvlm` to image-text-to-text models (not causal LMs); the
# checkpoints name their architecture, and a config without one loads by these.

IDEFICS3 = Family(
    "Idefics3ForConditionalGeneration", ("idefics3",), "Idefics3-8B-Llama3 (images in)",
    "a Llama text model (`text_config`) with a SigLIP tower over image tiles (patch positions bucketed per tile) "
    "and a pixel-shuffle connector (`scale_factor`); an image is split into up to `size / max_image_size` rows and "
    "columns of tiles plus the whole image, each tile `image_seq_len` `<image>` tokens",
    vision="idefics3", renames=RENAMES,
)
SMOLVLM = Family(
    "SmolVLMForConditionalGeneration", ("smolvlm",), "SmolVLM 256M / 500M / 2.2B, SmolVLM2 (images in)",
    "Idefics3's network (a Llama text model, the tiled SigLIP tower, the pixel-shuffle connector) and processor",
    vision="idefics3", renames=RENAMES,
)
