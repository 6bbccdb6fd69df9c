"""Closing JSON Schema objects: `additionalProperties: false` where a schema left it open.

JSON Schema lets an object carry any key it does not name; a grammar built from
that lets the model append invented keys until max_tokens. Measured on the
embedded model over 64 real-world function-call schemas (greedy, 96 tokens):
6 of 64 outputs finished as written, 58 of 64 once objects were closed. xgrammar
(strict mode) and OpenAI's strict structured outputs close objects the same way.

Closing only ever *adds* a constraint, so whatever matches the closed schema
also validates against the original one. It is skipped where it could make a
schema unsatisfiable: an object that requires a key it does not list, bounds
its number of keys, or combines `properties` with applicators (allOf, $ref,
if/then/else, ...) that may name further keys. Values of enum, const, default
and examples are data, never rewritten.
"""

from __future__ import annotations

from typing import Any

# keywords whose value is one subschema / a map of subschemas / a list of subschemas
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalProperties")  # fmt: skip
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# an object schema with any of these keeps the JSON Schema default (open)
_KEEP_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf",
              "oneOf", "$ref", "if", "then", "else", "not", "dependencies", "dependentSchemas",
              "dependentRequired", "minProperties", "maxProperties")  # fmt: skip


def close_objects(schema: Any) -> Any:
    """A copy of `schema` with every safely closable object schema given additionalProperties: false."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    # 1. recurse into every subschema, by keyword (so enum/const/default data is left alone)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    # 2. close this object if that cannot conflict with a key named elsewhere
    properties = out.get("properties")
    if isinstance(properties, dict) and not any(k in out for k in _KEEP_OPEN):
        required = out.get("required", [])
        if isinstance(required, list) and all(name in properties for name in required):
            out["additionalProperties"] = False
    return out
