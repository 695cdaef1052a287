"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ...errors import NextTokenError, UnknownLoraError


class APIError(NextTokenError):
    """A request the server refuses; becomes an OpenAI error body with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def client_error(e: NextTokenError) -> APIError:
    """A request's own error raised while it runs: a 400, except an adapter that is gone (unloaded after the request
    named it): OpenAI's 404 model_not_found, as for a `model` that names nothing."""
    if isinstance(e, UnknownLoraError):
        return APIError(404, f"{e}: the model the request names is no longer served", "model",
                        code="model_not_found")
    return bad_request(str(e))


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path (e.g. `messages.0.role`)."""
    errors = e.errors(include_url=False)
    err = errors[0]
    # A union field (str | list of parts) reports every member's complaint; a validator's own message on the same
    # field ("content parts of type 'image_url' ...") says more than "Input should be a valid string".
    first = _path(err["loc"])
    err = next((x for x in errors if x["type"] == "value_error" and _path(x["loc"])[: len(first)] == first), err)
    if err["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
    if err["type"] == "model_type" and not err["loc"]:
        return bad_request("the request body must be a JSON object")
    # Union members add their type name to the path ("prompt", "list[int]", 0): keep the field names.
    param = ".".join(_path(err["loc"])) or None
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = f"unknown field {param!r}: not an option of this endpoint"
    elif err["type"] == "missing":
        message = f"{param} is required"
    else:
        got = repr(err.get("input"))
        got = got if len(got) <= 200 else got[:200] + "..."  # the client's own value, cut short
        message = f"{param}: {message} (got {got})" if param else message
    return bad_request(message, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "ContentPart"}


def _path(loc: tuple) -> list[str]:
    """A field path without pydantic's union member tags."""
    return [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)  # the routes that answer in Anthropic's body


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


OLLAMA_PATHS = ("/api/",)  # the routes that answer in Ollama's body


def ollama_error_body(message: str) -> dict[str, Any]:
    """Ollama's error body: `{"error": "..."}` (the status says the kind)."""
    return {"error": message}


def error_body_for(path: str, status: int, message: str, type: str, code: str | None = None) -> dict[str, Any]:
    """The error body in the API's own format: Anthropic's and Ollama's on their routes, OpenAI's elsewhere."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_error_body(status, message)
    if path.startswith(OLLAMA_PATHS):
        return ollama_error_body(message)
    return error_body(message, type, None, code)
