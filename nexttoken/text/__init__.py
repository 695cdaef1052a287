"""Text in and out: `tokenizer.json` (tokenizer.py), sandboxed chat templates (chat_template.py), incremental
detokenizing that never splits a character (detokenizer.py), a GGUF file's vocabulary built as the same Tokenizer
(gguf_vocab.py) and fill-in-the-middle prompts in each code family's layout (infill.py)."""
