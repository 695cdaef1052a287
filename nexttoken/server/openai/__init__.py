"""OpenAI's wire format: request bodies (protocol.py), prompts and lengths from them (prompts.py), their options as
a GenerationConfig (options.py), and choices, log-probs and usage as OpenAI writes them (outputs.py)."""
