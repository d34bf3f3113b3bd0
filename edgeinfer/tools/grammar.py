"""The Lark rules (llguidance's dialect) for a call's arguments under a function's schema.

llguidance's ``%json`` lets whitespace in between every token, and a model may fill its
whole budget with it (random models do). So the top-level object of the arguments is spelled
out compactly here (``{"a": <value>, "b": <value>}``, properties in the schema's order,
optional ones present or not), each value a ``%json`` of its own schema: scalar values then
have no room for whitespace at all. Every reply the rules allow is an object whose keys are
the schema's properties, each value valid under its schema, and the required ones present,
so the arguments satisfy the schema. A schema this cannot spell out (properties beyond
``properties``, or keywords about the whole object) gets a ``%json`` of the whole schema.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["arguments_rules"]

# keywords of the top-level object the compact form honours (any other: %json of it all)
_SPELLED = frozenset(
    {"type", "properties", "required", "additionalProperties", "description", "title", "$defs",
     "definitions", "$schema", "$id", "$comment", "examples", "default"}
)  # fmt: skip


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _compact(schema: Mapping[str, Any]) -> bool:
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    return (
        set(schema) <= _SPELLED
        and isinstance(properties, Mapping)
        and all(isinstance(r, str) and r in properties for r in required)
        and schema.get("additionalProperties", True) is not None
        and not ("$defs" in schema or "definitions" in schema)  # values may $ref them
    )


def arguments_rules(schema: Mapping[str, Any], name: str) -> list[str]:
    """Rules whose start symbol ``name`` matches the arguments ``schema`` allows."""
    if not _compact(schema):
        return [f"{name}: %json {json.dumps(dict(schema))}"]
    properties = list(schema.get("properties", {}).items())
    required = set(schema.get("required", []))
    if not properties:
        return [f'{name}: "{{}}"']
    rules = []
    for i, (key, sub) in enumerate(properties):
        value = json.dumps(sub if isinstance(sub, (Mapping, bool)) else {})
        rules.append(f"{name}_v{i}: {_literal(json.dumps(key) + ': ')} {name}_j{i}")
        rules.append(f"{name}_j{i}: %json {value}")
    # first_i: the properties from i on, the first one written without a comma;
    # rest_i: the properties from i on, after one was written (each with its comma)
    n = len(properties)
    for i in reversed(range(n)):
        key = properties[i][0]
        after_rest = f" {name}_r{i + 1}" if i + 1 < n else ""
        after_first = f" | {name}_f{i + 1}" if i + 1 < n else ""
        if key in required:
            rules.append(f'{name}_r{i}: ", " {name}_v{i}{after_rest}')
            rules.append(f"{name}_f{i}: {name}_v{i}{after_rest}")
        else:
            rest_alt = f" | {name}_r{i + 1}" if i + 1 < n else ' | ""'
            rules.append(f'{name}_r{i}: ", " {name}_v{i}{after_rest}{rest_alt}')
            first_empty = "" if i + 1 < n else ' | ""'
            rules.append(f"{name}_f{i}: {name}_v{i}{after_rest}{after_first}{first_empty}")
    rules.append(f'{name}: "{{" {name}_f0 "}}"')
    return rules
