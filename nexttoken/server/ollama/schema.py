"""Ollama's routes in /openapi.json: their request bodies, their answers (a JSON body, or NDJSON lines when
streamed) and every error status in Ollama's `{"error": "..."}` body, so a fuzzer driven by the document reaches
them and checks their answers (openai/schema.py does the same for OpenAI's)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..openai.schema import API_ERRORS, ERRORS, GET_ERRORS, operation
from .protocol import (OllamaChatRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest, OllamaGenerateRequest,
                       OllamaShowRequest)

ERROR = {"type": "object", "required": ["error"], "additionalProperties": False,
         "properties": {"error": {"type": "string"}}}
_FINAL = {"done": {"type": "boolean"}, "done_reason": {"enum": ["stop", "length", "load", "unload"]},
          "total_duration": {"type": "integer", "minimum": 0}, "eval_count": {"type": "integer", "minimum": 0},
          "prompt_eval_count": {"type": "integer", "minimum": 0}}
CHAT = {"type": "object", "required": ["model", "created_at", "message", "done"],
        "properties": {"model": {"type": "string"}, "message": {"type": "object", "required": ["role", "content"]},
                       **_FINAL}}
GENERATE = {"type": "object", "required": ["model", "created_at", "response", "done"],
            "properties": {"model": {"type": "string"}, "response": {"type": "string"},
                           "context": {"type": "array", "items": {"type": "integer"}}, **_FINAL}}
EMBED = {"type": "object", "required": ["model", "embeddings"],
         "properties": {"embeddings": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}}
EMBEDDING = {"type": "object", "required": ["embedding"],
             "properties": {"embedding": {"type": "array", "items": {"type": "number"}}}}
MODELS = {"type": "object", "required": ["models"],
          "properties": {"models": {"type": "array", "items": {"type": "object", "required": ["name", "model"]}}}}
SHOW = {"type": "object", "required": ["template", "details", "model_info", "capabilities"]}
VERSION = {"type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}
BODIES = (OllamaChatRequest, OllamaGenerateRequest, OllamaEmbedRequest, OllamaEmbeddingsRequest, OllamaShowRequest)


def ollama_operation(model: type[BaseModel] | None, ok: dict[str, Any], *errors: str,
                     stream: bool = False) -> dict[str, Any]:
    """A route's `openapi_extra` and `responses`: its body, its 200 (NDJSON lines too, with `stream`), its errors
    in Ollama's body."""
    op = operation(model, ok)
    if stream:
        op["responses"][200]["content"]["application/x-ndjson"] = {"schema": {"type": "string"}}
    op["responses"].update({s: {"description": ERRORS[s], "content": {"application/json": {"schema": ERROR}}}
                            for s in errors})
    return {**op, "tags": ["ollama"]}


ROUTES: dict[str, dict[str, Any]] = {
    "chat": ollama_operation(OllamaChatRequest, CHAT, *API_ERRORS, stream=True),
    "generate": ollama_operation(OllamaGenerateRequest, GENERATE, *API_ERRORS, stream=True),
    "embed": ollama_operation(OllamaEmbedRequest, EMBED, *API_ERRORS),
    "embeddings": ollama_operation(OllamaEmbeddingsRequest, EMBEDDING, *API_ERRORS),
    "show": ollama_operation(OllamaShowRequest, SHOW, *API_ERRORS),
    "tags": ollama_operation(None, MODELS, *GET_ERRORS),
    "ps": ollama_operation(None, MODELS, *GET_ERRORS),
    "version": ollama_operation(None, VERSION, *GET_ERRORS),
}
