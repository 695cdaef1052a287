"""Ollama's wire format: its request bodies and their translation, the model cards of /api/tags, /api/ps, /api/show."""
