"""The contract in /openapi.json: each route's real request body (the pydantic models the handlers parse with) and
every answer it can give (its 200 body, OpenAI's error body for each error status), so that a client generator or
a fuzzer driven by the document reaches the endpoints with bodies and can check the answers.

The handlers read their bodies themselves (guards.BodyLimit reads it first, with its size and time limits), so
FastAPI sees no body parameter: `operation()` gives each route's `openapi_extra` and `responses`, and
`components()` the request models' schemas they refer to.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest

REF = "#/components/schemas/{model}"

ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}

# Why each error status is answered (the guards' and the handlers').
ERRORS = {
    "400": "the request is invalid: the message names the field (param) and the fix",
    "401": "the API key is missing or wrong (--api-key)",
    "403": "the admin routes answer only with an API key set (--api-key) or --admin-without-key",
    "404": "no such model or route",
    "409": "the model has requests running (an admin unload waits for none)",
    "408": "the request body did not arrive within --body-timeout",
    "413": "the request body is over --max-body-bytes",
    "415": "the body is not sent as Content-Type: application/json",
    "421": "the Host header names another server (--allowed-hosts)",
    "429": "the waiting queue is full (--max-waiting-seqs): retry after Retry-After seconds",
    "500": "an internal error for this request alone (the server log has it)",
    "503": "the server is shutting down, at --max-connections, or its engine stopped",
}

_LOGPROBS = {"type": ["object", "null"]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": {"type": "integer", "minimum": 0},
                         "completion_tokens": {"type": "integer", "minimum": 0},
                         "total_tokens": {"type": "integer", "minimum": 0}}}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", "abort", "error", None]}


def _body(required: list[str], choice: dict[str, Any], obj: str) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "usage": _USAGE,
                           "choices": {"type": "array", "items": {"type": "object", "required": required,
                                                                  "properties": choice}}}}


COMPLETION = _body(["index", "text", "finish_reason"], {
    "index": {"type": "integer", "minimum": 0}, "text": {"type": "string"}, "logprobs": _LOGPROBS,
    "finish_reason": _FINISH}, "text_completion")
CHAT_COMPLETION = _body(["index", "message", "finish_reason"], {
    "index": {"type": "integer", "minimum": 0}, "logprobs": _LOGPROBS, "finish_reason": _FINISH,
    "message": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": {"type": "object"}}}}}, "chat.completion")
TOKENIZE = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
    "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
MODEL = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"},
    "generation_defaults": {"type": "object"}}}
MODELS = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}}

# With stream=true: server-sent events, each a data: line with a chunk (or an error body), then data: [DONE].
_STREAM = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                            "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: {"description": ERRORS[s], "content": {"application/json": {"schema": ERROR}}} for s in statuses}


def operation(model: type[BaseModel] | None, ok: dict[str, Any] | None, *errors: str, stream: bool = False,
              ok_type: str = "application/json") -> dict[str, Any]:
    """A route's `openapi_extra` and `responses`: its request body (`model`), its 200 body (None: empty), its
    errors."""
    extra: dict[str, Any] = {}
    if model is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=model.__name__)}}}}
    content = {ok_type: {"schema": ok}, **(_STREAM if stream else {})} if ok is not None else None
    answer = {"description": "the answer", **({"content": content} if content else {})}
    responses: dict[Any, Any] = {200: answer, **_errors(*errors)}
    # FastAPI documents its default JSON body for a 200 unless the route's response class says otherwise
    kind = Response if ok is None else PlainTextResponse if ok_type == "text/plain" else JSONResponse
    return {"openapi_extra": extra, "responses": responses, "response_class": kind}


API_ERRORS = ("400", "401", "404", "408", "413", "415", "421", "429", "500", "503")
BODY_ERRORS = ("400", "401", "404", "408", "413", "415", "421", "500", "503")
GET_ERRORS = ("401", "404", "421", "500", "503")

ROUTES: dict[str, dict[str, Any]] = {
    "completions": operation(CompletionRequest, COMPLETION, *API_ERRORS, stream=True),
    "chat": operation(ChatCompletionRequest, CHAT_COMPLETION, *API_ERRORS, stream=True),
    "tokenize": operation(TokenizeRequest, TOKENIZE, *BODY_ERRORS),
    "detokenize": operation(DetokenizeRequest, DETOKENIZE, *BODY_ERRORS),
    "models": operation(None, MODELS, *GET_ERRORS),
    "model": operation(None, MODEL, *GET_ERRORS),
    "health": operation(None, None, "421", "500", "503"),
    "metrics": operation(None, {"type": "string"}, "421", "500", "503", ok_type="text/plain"),
    "trace": operation(None, {}, *GET_ERRORS, ok_type="text/html"),
    "embeddings": operation(EmbeddingRequest, {"type": "object", "required": ["object", "data", "model", "usage"]},
                            *API_ERRORS),
    "response": operation(None, {"type": "object", "required": ["id", "object"]}, *GET_ERRORS),
}
# Anthropic's error body, on /v1/messages and /v1/messages/count_tokens (anthropic/events.py writes it).
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


def anthropic_operation(model: type[BaseModel] | None, ok: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    """A Messages route's `responses`: its 200 body and each error status in Anthropic's error body."""
    op = operation(model, ok, stream=stream)
    op["responses"].update({s: {"description": ERRORS[s], "content": {"application/json": {"schema": ANTHROPIC_ERROR}}}
                            for s in API_ERRORS})
    return op


MESSAGE = {"type": "object", "required": ["id", "type", "content"]}
COUNT = {"type": "object", "required": ["input_tokens"]}
RESPONSE = {"type": "object", "required": ["id", "object", "output"]}


def components(*more: type[BaseModel]) -> dict[str, Any]:
    """The request models' JSON Schemas (and the models they use), for the document's components.schemas; `more`:
    the other APIs' request models (app.py passes the Responses, Messages and /infill bodies)."""
    out: dict[str, Any] = {}
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest,
                  *more):
        schema = model.model_json_schema(ref_template=REF, by_alias=True)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out
