"""Parameter schemas: is a tool's ``parameters`` a JSON schema we can hold a call to, and do a
call's arguments satisfy it.

``check_parameters`` refuses a schema whose keywords have the wrong kinds of values (a
``type`` that names no JSON type, ``required`` that is not a list of names, ...) and a top
level that is not an object schema (OpenAI's rule). ``violation`` checks arguments against
the keywords of JSON Schema that describe data: ``type``, ``enum``, ``const``,
``properties``, ``required``, ``additionalProperties``, ``items``, ``prefixItems``,
``minItems``/``maxItems``, ``uniqueItems``, ``minLength``/``maxLength``, ``minimum``/
``maximum`` (and the exclusive ones), ``multipleOf``, ``minProperties``/``maxProperties``,
``anyOf``/``oneOf``/``allOf``/``not`` and local ``$ref`` (``#/$defs/...``,
``#/definitions/...``). ``pattern`` and ``format`` are not checked here (a regular
expression run by Python can take exponential time on a stranger's text); under a
constrained ``tool_choice`` the grammar enforces them while the call is generated.

The schema was bounded by ``structured_bounds.check_schema`` first (depth 64, size 64 KiB),
and checking stops ``MAX_DEPTH`` levels down, so neither walk can run away.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["check_parameters", "violation"]

MAX_DEPTH = 64  # schema levels (with $ref followed) one check goes down
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA = ("additionalProperties", "items", "not", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_COUNTS = (
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
)
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def check_parameters(schema: Mapping[str, Any], field: str) -> None:
    """Refuse ``schema`` (a tool's ``parameters``) unless it is an object schema whose
    keywords hold values of the right kinds; the message names ``field`` and the path."""
    top = schema.get("type", "object")
    if top != "object":
        raise InvalidRequestError(f"{field}: must describe an object (type 'object'), not {top!r}")
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, Mapping):
            raise InvalidRequestError(f"{field}{path}: a schema must be an object or a boolean")
        _check_keywords(node, f"{field}{path}")
        for key in _SUBSCHEMA:
            if key in node:
                stack.append((node[key], f"{path}.{key}"))
        for key in _SCHEMA_LISTS:
            if key in node:
                items = node[key]
                if not isinstance(items, list) or not items:
                    raise InvalidRequestError(f"{field}{path}.{key}: must be a non-empty list")
                stack.extend((s, f"{path}.{key}[{i}]") for i, s in enumerate(items))
        for key in _SCHEMA_MAPS:
            if key in node:
                members = node[key]
                if not isinstance(members, Mapping):
                    raise InvalidRequestError(f"{field}{path}.{key}: must be an object")
                stack.extend((s, f"{path}.{key}.{k}") for k, s in members.items())


def _check_keywords(node: Mapping[str, Any], where: str) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if (not kinds and kind is not None) or not all(k in _TYPES for k in kinds):
        raise InvalidRequestError(f"{where}.type: {kind!r} names no JSON type ({sorted(_TYPES)})")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidRequestError(f"{where}.required: must be a list of property names")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise InvalidRequestError(f"{where}.enum: must be a non-empty list")
    for key in _COUNTS:
        value = node.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidRequestError(f"{where}.{key}: must be a non-negative integer")
    for key in _NUMBERS:
        value = node.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(f"{where}.{key}: must be a number")
    if node.get("multipleOf", 1) <= 0:
        raise InvalidRequestError(f"{where}.multipleOf: must be greater than 0")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise InvalidRequestError(f"{where}.$ref: only local references (#/...) are allowed")


def violation(instance: Any, schema: Any, root: Any = None, depth: int = 0) -> str | None:
    """Why ``instance`` does not satisfy ``schema`` (a JSON path and a reason), or None."""
    return _Checker(schema if root is None else root).check(instance, schema, "$", depth)


class _Checker:
    def __init__(self, root: Any) -> None:
        self.root = root

    def check(self, value: Any, schema: Any, path: str, depth: int) -> str | None:
        if depth > MAX_DEPTH:
            return f"{path}: nested too deeply to check (over {MAX_DEPTH} levels)"
        if schema is True or schema is None:
            return None
        if schema is False:
            return f"{path}: no value is allowed here"
        if not isinstance(schema, Mapping):
            return None
        if "$ref" in schema:
            target = self.resolve(schema["$ref"])
            if target is None:
                return f"{path}: the schema's $ref {schema['$ref']!r} points nowhere"
            found = self.check(value, target, path, depth + 1)
            if found:
                return found
        for rule in (self.kind, self.values, self.combined):
            found = rule(value, schema, path, depth)
            if found:
                return found
        if isinstance(value, dict):
            return self.object(value, schema, path, depth)
        if isinstance(value, list):
            return self.array(value, schema, path, depth)
        return self.scalar(value, schema, path)

    def resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, Mapping) else None
        return node

    def kind(self, value: Any, schema: Mapping[str, Any], path: str, _depth: int) -> str | None:
        kind = schema.get("type")
        if kind is None:
            return None
        kinds = kind if isinstance(kind, list) else [kind]
        if any(_is_type(value, k) for k in kinds):
            return None
        return f"{path}: expected {' or '.join(map(str, kinds))}, got {_type_name(value)}"

    def values(self, value: Any, schema: Mapping[str, Any], path: str, _depth: int) -> str | None:
        if "const" in schema and not _equal(value, schema["const"]):
            return f"{path}: must be {schema['const']!r}"
        enum = schema.get("enum")
        if isinstance(enum, list) and not any(_equal(value, e) for e in enum):
            return f"{path}: must be one of {enum!r}"[:300]
        return None

    def combined(self, value: Any, schema: Mapping[str, Any], path: str, depth: int) -> str | None:
        for sub in schema.get("allOf", []):
            found = self.check(value, sub, path, depth + 1)
            if found:
                return found
        if "anyOf" in schema:
            if all(self.check(value, s, path, depth + 1) for s in schema["anyOf"]):
                return f"{path}: matches none of anyOf"
        if "oneOf" in schema:
            hits = sum(self.check(value, s, path, depth + 1) is None for s in schema["oneOf"])
            if hits != 1:
                return f"{path}: matches {hits} of oneOf (exactly one is needed)"
        if "not" in schema and self.check(value, schema["not"], path, depth + 1) is None:
            return f"{path}: matches the schema under 'not'"
        return None

    def object(
        self, value: dict[str, Any], schema: Mapping[str, Any], path: str, depth: int
    ) -> str | None:
        for name in schema.get("required", []):
            if name not in value:
                return f"{path}: the required property {name!r} is missing"
        if (
            not schema.get("minProperties", 0)
            <= len(value)
            <= schema.get("maxProperties", math.inf)
        ):
            return f"{path}: has {len(value)} properties, outside the schema's bounds"
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            where = f"{path}.{name}"
            sub = properties.get(name) if isinstance(properties, Mapping) else None
            if sub is None:
                if extra is False:
                    return f"{where}: no such property (additionalProperties is false)"
                sub = extra
            found = self.check(item, sub, where, depth + 1)
            if found:
                return found
        return None

    def array(
        self, value: list[Any], schema: Mapping[str, Any], path: str, depth: int
    ) -> str | None:
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf):
            return f"{path}: has {len(value)} items, outside the schema's bounds"
        if schema.get("uniqueItems") is True:
            seen = [json_key(v) for v in value]
            if len(set(seen)) != len(seen):
                return f"{path}: items must be unique"
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items", True)
            found = self.check(item, sub, f"{path}[{i}]", depth + 1)
            if found:
                return found
        return None

    def scalar(self, value: Any, schema: Mapping[str, Any], path: str) -> str | None:
        if isinstance(value, str):
            if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", math.inf):
                return f"{path}: its length {len(value)} is outside the schema's bounds"
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf):
            return f"{path}: {value} is outside [minimum, maximum]"
        low, high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if (_number(low) and value <= low) or (_number(high) and value >= high):
            return f"{path}: {value} is outside the exclusive bounds"
        step = schema.get("multipleOf")
        if _number(step) and step > 0 and not _multiple(value, step):
            return f"{path}: {value} is not a multiple of {step}"
        return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _multiple(value: float, step: float) -> bool:
    if isinstance(value, int) and isinstance(step, int):
        return value % step == 0
    quotient = value / step
    return math.isfinite(quotient) and abs(quotient - round(quotient)) < 1e-9


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return _number(value) and float(value).is_integer()
    if kind == "number":
        return _number(value)
    expected = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
    }.get(kind)
    return expected is not None and isinstance(value, expected)


def _type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def json_key(value: Any) -> str:
    """A key equal for JSON-equal values (1 and 1.0 alike, booleans apart from numbers)."""
    import json

    def norm(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            return float(v) if math.isfinite(v) else str(v)
        if isinstance(v, list):
            return [norm(x) for x in v]
        return {k: norm(x) for k, x in v.items()}

    return json.dumps(norm(value), sort_keys=True)


def _equal(a: Any, b: Any) -> bool:
    return json_key(a) == json_key(b)
