"""JSON schemas of the kinds API clients send (nested objects, arrays, enums, numbers, required
fields, additionalProperties: false) for the structured-output tests.

Strings carry a maxLength: the tiny checkpoints' random weights almost never pick a closing
quote among a thousand allowed tokens, so an unbounded string runs until max_tokens.
"""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: list[str] | None = None,
         closed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties,
                              "required": list(properties) if required is None else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


NAME = {"type": "string", "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SCORE = {"type": "number", "minimum": 0, "maximum": 1}
COLOR = {"enum": ["red", "green", "blue"]}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": NAME, "age": AGE}),
    "enum_only": _obj({"color": COLOR}),
    "boolean_flags": _obj({"active": {"type": "boolean"}, "admin": {"type": "boolean"}}),
    "bounded_number": _obj({"score": SCORE}),
    "integer_range": _obj({"count": {"type": "integer", "minimum": -5, "maximum": 5}}),
    "nested_address": _obj({"name": NAME, "address": _obj(
        {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    "array_of_enums": _obj({"tags": {"type": "array", "items": COLOR, "maxItems": 4}}),
    "array_of_objects": _obj({"items": {"type": "array", "maxItems": 3, "items": _obj(
        {"sku": {"type": "string", "maxLength": 6}, "qty": AGE})}}),
    "optional_fields": _obj({"name": NAME, "nickname": NAME, "age": AGE}, required=["name"]),
    "open_object": _obj({"id": AGE}, closed=False),
    "nullable": _obj({"note": {"anyOf": [NAME, {"type": "null"}]}}),
    "const_and_enum": _obj({"version": {"const": "v1"}, "level": {"enum": [1, 2, 3]}}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    "matrix": _obj({"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}}}}),
    "one_of_shapes": _obj({"shape": {"oneOf": [
        _obj({"kind": {"const": "circle"}, "r": AGE}),
        _obj({"kind": {"const": "square"}, "side": AGE})]}}),
    "min_items": _obj({"xs": {"type": "array", "items": {"type": "boolean"}, "minItems": 2,
                              "maxItems": 3}}),
    "top_level_array": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "ref_definitions": {"$defs": {"point": _obj({"x": AGE, "y": AGE})},
                        **_obj({"start": {"$ref": "#/$defs/point"},
                                "end": {"$ref": "#/$defs/point"}})},
    "mixed_order": _obj({"z": {"type": "boolean"}, "a": COLOR, "m": SCORE, "b": NAME}),
}

WEATHER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": _obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}})}}
TIME_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": _obj({"zone": {"enum": ["UTC", "CET", "PST"]}, "seconds": {
        "type": "boolean"}})}}
