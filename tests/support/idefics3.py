"""Tiny random-weight Idefics3 / SmolVLM checkpoints, written by transformers into a folder with a real tokenizer
(stories260K's, with the image tokens added as SmolVLM's tokenizer has them), the processor's settings and
SmolVLM's chat template: every file a real checkpoint has, at a size the tests run in seconds.

The tower: hidden 32, 2 layers of 2 heads, 4-pixel patches on 32-pixel tiles (8 x 8 patches), pixel shuffle 2, so
each tile takes 16 placeholder tokens; images are resized to a longest edge of 64 for the models (at most 2 x 2
tiles + the global image) and 128 for the preprocessing tests (4 x 4 tiles)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_TOKENS = (["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
                + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
IMAGE_TOKEN_ID = 513  # "<image>": stories260K has 512 tokens, "<fake_token_around_image>" is 512
# SmolVLM-256M-Instruct's chat template (its tokenizer_config.json)
CHAT_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
                 "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                 "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
                 "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=4, initializer_range=0.2)
TEXT = dict(model_type="llama", vocab_size=576, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, initializer_range=0.3, rms_norm_eps=1e-5)


def write_tokenizer(folder: Path, stories: Path) -> None:
    """stories260K's tokenizer.json with the image tokens added (ids 512-551), and its tokenizer_config.json with
    SmolVLM's chat template; like SmolVLM's tokenizer it adds no BOS (the template's text is the whole prompt, for
    transformers' processor called on it as for the chat renderer)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(stories / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in IMAGE_TOKENS])
    tok.post_processor = None
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((stories / "tokenizer_config.json").read_text())
    config.update(chat_template=CHAT_TEMPLATE, model_max_length=4096, add_bos_token=False)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def build(folder: Path, stories: Path, architecture: str = "SmolVLMForConditionalGeneration", seed: int = 0,
          splitting: bool = True, longest_edge: int = 64, **text: object):  # noqa: ANN201 - the transformers model
    """A tiny checkpoint of `architecture` (SmolVLM or Idefics3) in `folder`, its images resized to `longest_edge`
    (64: at most 2 x 2 tiles and the global image, 80 tokens); returns the transformers model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls, processor_cls = {
        "SmolVLMForConditionalGeneration": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration,
                                            transformers.SmolVLMImageProcessorPil),
        "Idefics3ForConditionalGeneration": (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration,
                                             transformers.Idefics3ImageProcessorPil),
    }[architecture]
    config = config_cls(vision_config=VISION, text_config={**TEXT, **text}, image_token_id=IMAGE_TOKEN_ID,
                        scale_factor=2, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # random LayerNorms and biases (ones and zeros at init) so that each one matters
        for name, p in model.named_parameters():
            if "vision_model" in name and ("norm" in name or name.endswith("bias")):
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
    model.save_pretrained(folder)
    write_processor(folder, stories, processor_cls(max_image_size={"longest_edge": 32},
                                                   size={"longest_edge": longest_edge}, do_image_splitting=splitting))
    return model


def write_processor(folder: Path, stories: Path, image_processor=None):  # noqa: ANN001, ANN201
    """The tokenizer and processor files alone (processor_config.json as transformers 5 writes it, the image
    processor's settings inside); returns transformers' processor. Idefics3Processor stands for SmolVLM's, whose
    prompt strings are the same (SmolVLMProcessor needs num2words, for videos)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, stories)
    image_processor = image_processor or transformers.SmolVLMImageProcessorPil(
        max_image_size={"longest_edge": 32}, size={"longest_edge": 128})
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=16,
                                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return processor


def hf_processor(folder: Path):  # noqa: ANN201
    """transformers' processor of the folder, its image processor the PIL one (torchvision is not installed)."""
    import transformers

    return transformers.AutoProcessor.from_pretrained(folder, use_fast=False)
