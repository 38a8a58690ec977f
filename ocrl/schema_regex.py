"""JSON schema -> the regular language of the JSON texts it admits, for constrained decoding.

outlines-core's builder does most of it. Around it, this module (1) refuses, by name and place,
every keyword the builder would accept and silently not enforce (`not`, `if`, `uniqueItems`,
`multipleOf`, bounds on non-integers, ...); (2) enforces what the builder ignores but agents'
tool schemas use: integer bounds (`minimum`, `maximum` and their exclusive forms, as a decimal
range regex), a non-negative `number`, and `patternProperties` with one match-all pattern; and
(3) narrows what would take the compiler minutes to a subset of the schema's language: bounded
strings in printable ASCII (`bounded_string_regex`), bounded arrays to 4 items; and writes
free-form parts (`{}`, a bare `{"type": "object"}`) as JSON nested two levels, where
the builder's own deeper form takes ~20 s to compile against a 49k vocabulary. Parts it writes
itself go through the builder as placeholder constants and are spliced in afterwards.

It knows nothing of requests, tokens or engines.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

# Keywords the builder turns into the language, and annotations that constrain nothing.
_ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "minLength", "maxLength", "pattern", "format", "minProperties", "maxProperties",
}  # fmt: skip
_ANNOTATIONS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "strict", "nullable",
}  # fmt: skip
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_MATCH_ALL = {"^.*$", ".*", "^.*", ".*$", ""}

WS = r"[ ]?"  # the builder's own default: at most one space between JSON tokens
_PLACEHOLDER = "__ocrl_placeholder_{}__"
_MAX_ITEMS = 4  # a bounded array holds at most this many items (or minItems): a subset, compiled fast


class SchemaError(ValueError):
    """A schema (or a part of it, named in the message) that cannot be enforced."""


def _scalar() -> str:
    from outlines_core.json_schema import NUMBER, STRING

    return rf"(?:{STRING}|{NUMBER}|true|false|null)"


def _array(item: str) -> str:
    return rf"\[{WS}(?:{item}(?:{WS},{WS}{item})*)?{WS}\]"


def _object(value: str) -> str:
    from outlines_core.json_schema import STRING

    member = rf"{STRING}{WS}:{WS}{value}"
    return rf"\{{{WS}(?:{member}(?:{WS},{WS}{member})*)?{WS}\}}"


def json_object_regex() -> str:
    """Any JSON object, two levels deep: scalars, arrays of scalars, objects of scalars."""
    scalar = _scalar()
    return _object(rf"(?:{scalar}|{_array(scalar)}|{_object(scalar)})")


def json_value_regex() -> str:
    """Any JSON value, two levels deep."""
    scalar = _scalar()
    return rf"(?:{scalar}|{_array(scalar)}|{_object(rf'(?:{scalar}|{_array(scalar)})')})"


def bounded_string_regex(low: int, high: int | None) -> str:
    """A JSON string of low..high characters, written in printable ASCII without escapes and at
    most 64 characters past `low`: a subset of what the schema admits, which compiles in about a
    second where the builder's full-Unicode counted repetition takes minutes (its byte automaton
    multiplies by the count)."""
    if high is not None and high < low:
        raise SchemaError(f"maxLength {high} is below minLength {low}")
    top = low + 64 if high is None else min(high, max(low, 64))
    return rf'"{_PRINTABLE}{{{low},{top}}}"'


_PRINTABLE = r"[ !#-\[\]-~]"  # printable ASCII but the quote and the backslash
NON_NEGATIVE_NUMBER = r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-][0-9]+)?"


def _digits_range(start: int, stop: int) -> str:
    """start..stop, both with the same number of digits and splittable digit by digit."""
    pattern, free = "", 0
    for a, b in zip(str(start), str(stop)):
        if a == b:
            pattern += a
        elif a == "0" and b == "9":
            free += 1
        else:
            pattern += f"[{a}-{b}]"
    return pattern + ("[0-9]" + (f"{{{free}}}" if free > 1 else "") if free else "")


def _natural_range(low: int, high: int) -> list[str]:
    """low..high (0 <= low <= high) as alternatives: cut where the trailing digits run from all
    0s to all 9s, so each piece is a fixed prefix followed by digit classes."""
    stops = {high}
    for nines in itertools.count(1):  # low's tail raised to 9s: 129 -> 129, 199, 999
        stop = int(str(low)[:-nines] + "9" * nines) if nines < len(str(low)) else 10**nines - 1
        if not low <= stop < high:
            break
        stops.add(stop)
    for zeros in itertools.count(1):  # high+1's tail cut to 0s, less one: 341 -> 339, 299
        stop = (high + 1) - (high + 1) % 10**zeros - 1
        if not low < stop <= high:
            break
        stops.add(stop)
    pieces, start = [], low
    for stop in sorted(stops):
        pieces.append(_digits_range(start, stop))
        start = stop + 1
    return pieces


def integer_range_regex(low: int | None, high: int | None) -> str:
    """The decimal integers in [low, high] (None: unbounded) as JSON writes them."""
    if low is not None and high is not None and low > high:
        raise SchemaError(f"no integer is >= {low} and <= {high}")
    pieces = []
    if high is None or high >= 0:  # the non-negative part
        start = max(low, 0) if low is not None else 0
        if high is None:
            width = len(str(start))
            pieces += _natural_range(start, 10**width - 1) + [f"[1-9][0-9]{{{width},}}"]
        else:
            pieces += _natural_range(start, high)
    if low is None or low < 0:  # the negative part, as minus a positive range
        start = max(-high, 1) if high is not None else 1
        magnitudes = (
            _natural_range(start, 10 ** len(str(start)) - 1) + [f"[1-9][0-9]{{{len(str(start))},}}"]
            if low is None
            else _natural_range(start, -low)
        )
        pieces.append("-(?:" + "|".join(magnitudes) + ")")
    return "(?:" + "|".join(pieces) + ")"


class _Rewriter:
    """Walks a schema, refusing what cannot be enforced and swapping the parts this module
    writes itself for placeholder constants."""

    def __init__(self):
        self.parts: dict[str, str] = {}

    def placeholder(self, regex: str) -> dict:
        name = _PLACEHOLDER.format(len(self.parts))
        self.parts[name] = regex
        return {"const": name}

    def rewrite(self, schema: Any, where: str) -> Any:
        if isinstance(schema, bool):
            if not schema:
                raise SchemaError(f"schema `false` at {where} admits nothing")
            return self.placeholder(json_value_regex())
        if not isinstance(schema, dict):
            raise SchemaError(f"a JSON schema must be an object, at {where}")
        schema = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
        for key in schema:
            if key not in _ENFORCED and key not in _BOUNDS and key != "patternProperties":
                raise SchemaError(f"JSON schema keyword `{key}` at {where} is not supported by constrained decoding")
        if "properties" in schema:
            for key in ("anyOf", "oneOf", "allOf"):
                if key in schema:
                    raise SchemaError(f"JSON schema `{key}` beside `properties` at {where} is not supported")
        if any(key in schema for key in _BOUNDS):
            return self.bounded(schema, where)
        if schema.get("type") == "string" and {"minLength", "maxLength"} & set(schema) and set(schema) <= {"type", "minLength", "maxLength"}:
            return self.placeholder(bounded_string_regex(schema.get("minLength", 0), schema.get("maxLength")))
        if "patternProperties" in schema:
            patterns = schema.pop("patternProperties")
            if "properties" in schema or not isinstance(patterns, dict) or len(patterns) != 1 or next(iter(patterns)) not in _MATCH_ALL:
                raise SchemaError(f"JSON schema `patternProperties` at {where} is supported only as one match-all pattern")
            schema["additionalProperties"] = next(iter(patterns.values()))
        free_object = schema.get("type") == "object" and "properties" not in schema and not {"minProperties", "maxProperties"} & set(schema)
        if free_object and schema.get("additionalProperties", True) in (True, {}):
            return self.placeholder(json_object_regex())
        if not schema:
            return self.placeholder(json_value_regex())
        out = dict(schema)
        if isinstance(schema.get("maxItems"), int):  # each allowed item multiplies the automaton: at most 4
            out["maxItems"] = min(schema["maxItems"], max(schema.get("minItems", 0), _MAX_ITEMS))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(schema.get(key), list):
                out[key] = [self.rewrite(sub, f"{where}.{key}[{i}]") for i, sub in enumerate(schema[key])]
        for key in ("properties", "$defs", "definitions"):
            if isinstance(schema.get(key), dict):
                out[key] = {name: self.rewrite(sub, f"{where}.{key}.{name}") for name, sub in schema[key].items()}
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                out[key] = self.rewrite(schema[key], f"{where}.{key}")
        return out

    def bounded(self, schema: dict, where: str) -> dict:
        kind = schema.get("type")
        extra = set(schema) - {"type", *_BOUNDS}
        bounds = {k: schema[k] for k in _BOUNDS if k in schema}
        if extra or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bounds.values()):
            raise SchemaError(f"JSON schema bounds beside {sorted(extra) or 'non-numbers'} at {where} are not supported")
        if kind == "integer":
            lows = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
            lows += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
            highs = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
            highs += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
            try:
                return self.placeholder(integer_range_regex(max(lows, default=None), min(highs, default=None)))
            except SchemaError as e:
                raise SchemaError(f"{e}, at {where}") from None
        if kind == "number" and bounds == {"minimum": 0}:
            return self.placeholder(NON_NEGATIVE_NUMBER)
        named = next(iter(bounds))
        raise SchemaError(f"JSON schema `{named}` at {where} is supported on integers only (and `minimum: 0` on numbers)")


def schema_regex(schema: Any, where: str = "$") -> str:
    """The regex of the JSON texts `schema` admits; SchemaError naming what cannot be enforced."""
    from outlines_core.json_schema import build_regex_from_schema

    rewriter = _Rewriter()
    rewritten = rewriter.rewrite(schema, where)
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), WS)
    except (ValueError, TypeError) as e:
        raise SchemaError(f"unsupported JSON schema at {where}: {str(e).splitlines()[0]}") from None
    for name, part in rewriter.parts.items():
        regex = regex.replace(json.dumps(name), f"(?:{part})")
    return regex
