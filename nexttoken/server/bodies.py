"""What every API's request body shares: null means "not given" (OpenAI's, Anthropic's and llama.cpp's clients send
null for options left unset), and the JSON Schema in /openapi.json says so."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def _optionals_nullable(schema: dict[str, Any], model: type) -> None:
    """The JSON Schema says what NullIsAbsent accepts: every optional property may also be null (/openapi.json is
    the contract clients and fuzzers read; a property declared non-null that takes null misleads both)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        constrained = any(k in prop for k in ("type", "anyOf", "oneOf", "allOf", "$ref", "enum", "const"))
        if name in required or not constrained or _nullable(prop):
            continue
        schema["properties"][name] = {"anyOf": [{k: v for k, v in prop.items() if k not in _ANNOTATIONS},
                                                {"type": "null"}],
                                      **{k: v for k, v in prop.items() if k in _ANNOTATIONS}}


_ANNOTATIONS = ("title", "description", "default", "examples", "deprecated")


def _nullable(prop: dict[str, Any]) -> bool:
    kind = prop.get("type")
    return kind == "null" or (isinstance(kind, list) and "null" in kind) or any(
        _nullable(p) for p in prop.get("anyOf", []) + prop.get("oneOf", []))


class NullIsAbsent(BaseModel):
    """A request body whose optional fields are nullable, null meaning "not given": the default applies (OpenAI's
    and Anthropic's SDKs send null for options left unset). Its JSON Schema says so (_optionals_nullable)."""

    model_config = ConfigDict(json_schema_extra=_optionals_nullable)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
