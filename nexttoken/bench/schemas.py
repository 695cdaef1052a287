"""A corpus of JSON Schemas of the kinds extraction and agent pipelines send: the structured-output tests validate
every output against them, and `nexttoken bench --structured` times and compares grammar engines on them.

Strings and arrays are mostly bounded (maxLength, maxItems), as real extraction schemas are, so that a small model
finishes its objects within a test's token budget; a few are left open on purpose.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_AGE = {"type": "integer", "minimum": 0, "maximum": 120}
_COORD = {"type": "integer", "minimum": -100, "maximum": 100}
_ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string", "maxLength": 16}, "city": {"type": "string", "maxLength": 10},
                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["street", "city", "zip"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat-object": {"type": "object", "properties": {"name": _NAME, "age": _AGE},
                    "required": ["name", "age"], "additionalProperties": False},
    "optional-fields": {"type": "object", "properties": {"name": _NAME, "nickname": _NAME, "age": _AGE},
                        "required": ["name"], "additionalProperties": False},
    "all-optional": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                     "additionalProperties": False},
    "nested-object": {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": _NAME, "address": _ADDRESS}, "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array-min-max": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                      "minItems": 2, "maxItems": 4},
    "array-of-objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False},
    "string-enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"], "additionalProperties": False},
    "mixed-enum": {"enum": ["yes", 1, None, True, {"k": "v"}]},
    "const": {"type": "object", "properties": {"kind": {"const": "event"}, "id": _AGE},
              "required": ["kind", "id"], "additionalProperties": False},
    "any-of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, _NAME, {"type": "null"}]}},
               "required": ["value"], "additionalProperties": False},
    "one-of-disjoint": {"oneOf": [{"type": "object", "properties": {"cat": _NAME}, "required": ["cat"],
                                   "additionalProperties": False},
                                  {"type": "object", "properties": {"dog": _NAME}, "required": ["dog"],
                                   "additionalProperties": False}]},
    "all-of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                          "additionalProperties": False},
                         {"properties": {"a": {"minimum": 10, "maximum": 20}}}]},
    "ref-defs": {"$defs": {"point": {"type": "object", "properties": {"x": _COORD, "y": _COORD},
                                     "required": ["x", "y"], "additionalProperties": False}},
                 "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
                 "required": ["start", "end"], "additionalProperties": False},
    "ref-recursive": {"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 6},
        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["label"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "definitions-legacy": {"definitions": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                           "type": "object", "properties": {"id": {"$ref": "#/definitions/id"}}, "required": ["id"],
                           "additionalProperties": False},
    "string-pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}},
                       "required": ["code"], "additionalProperties": False},
    "string-length": {"type": "string", "minLength": 3, "maxLength": 8},
    "format-date": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
                    "required": ["when"], "additionalProperties": False},
    "format-date-time": {"type": "string", "format": "date-time"},
    "format-email": {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
                     "required": ["email"], "additionalProperties": False},
    "format-uuid": {"type": "string", "format": "uuid"},
    "format-ipv4": {"type": "string", "format": "ipv4"},
    "integer-bounds": {"type": "integer", "minimum": -5, "maximum": 5},
    "number-bounds": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "exclusive-bounds": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 14},
    "multiple-of": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
    "nullable-types": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 8}},
                       "required": ["note"], "additionalProperties": False},
    "boolean-and-null": {"type": "array", "items": {"type": ["boolean", "null"]}, "maxItems": 3},
    "tuple-prefix-items": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, _COORD],
                           "items": False, "minItems": 2},
    "open-object": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    "additional-typed": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "max-properties": {"type": "object", "properties": {"a": _AGE, "b": _AGE}, "required": ["a", "b"],
                       "maxProperties": 2, "additionalProperties": False},
    "pattern-properties": {"type": "object", "patternProperties": {"^x_[a-z]{1,3}$": _AGE},
                           "additionalProperties": False, "maxProperties": 2},
    "deep-nesting": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "extraction-invoice": {"type": "object", "properties": {
        "invoice": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
        "date": {"type": "string", "format": "date"},
        "total": {"type": "number", "minimum": 0, "maximum": 9999},
        "currency": {"enum": ["EUR", "USD", "GBP"]},
        "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
            "text": {"type": "string", "maxLength": 10}, "amount": {"type": "number"}},
            "required": ["text", "amount"], "additionalProperties": False}}},
        "required": ["invoice", "date", "total", "currency", "lines"], "additionalProperties": False},
    "agent-action": {"type": "object", "properties": {
        "thought": {"type": "string", "maxLength": 20},
        "action": {"enum": ["search", "answer", "ask"]},
        "input": {"type": "string", "maxLength": 16}},
        "required": ["thought", "action", "input"], "additionalProperties": False},
}

# Keywords the grammar engine does not enforce: each must be refused by name unless best effort is asked for.
UNSUPPORTED: dict[str, dict[str, Any]] = {
    "not": {"type": "integer", "not": {"const": 3}},
    "if": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"const": 1}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 2}},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
}
# Enforced only in part, refused even with best effort: min/maxProperties over optional keys.
PARTIAL = {"min/maxProperties": {"type": "object", "properties": {"a": _AGE, "b": _AGE, "c": _AGE},
                                 "minProperties": 2, "additionalProperties": False}}
