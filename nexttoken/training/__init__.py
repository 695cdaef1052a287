"""Reproducible training of nexttoken's packaged default model (`python -m nexttoken.training`).

The pipeline, one module per stage:
  corpus.py  sample stories from a teacher model (llama2.c stories260K) with nexttoken itself
  bpe.py     train a byte-fallback BPE tokenizer on those stories with the `tokenizers` library
  train.py   train a small Llama on the tokenized stories (AdamW, cosine schedule, CPU)
  export.py  write a Hugging Face folder (config, safetensors, tokenizer, generation config, model card)
  evaluate.py  held-out loss in bits per byte, so models with different tokenizers are comparable
"""
