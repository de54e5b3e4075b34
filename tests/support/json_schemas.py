"""The ten JSON schemas of the structured-output tests (structured_output/test_structured_outputs.py,
cli/test_cli_structured.py) and of benchmarks/grammar_backends.py."""
_STR = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
_OBJ = lambda props, required, **kw: {"type": "object", "properties": props, "required": required, "additionalProperties": False, **kw}  # noqa: E731

# ten kinds: flat, nested objects, arrays with min/max items, enums, numbers and integers with
# ranges, optional fields, string patterns, a top-level array, arrays of objects, const and anyOf
SCHEMAS = [
    _OBJ({"name": _STR(12), "age": {"type": "integer", "minimum": 0, "maximum": 120}}, ["name", "age"]),
    _OBJ({"person": _OBJ({"first": _STR(8), "address": _OBJ({"city": _STR(8), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                            ["city", "zip"])}, ["first", "address"])}, ["person"]),
    _OBJ({"tags": {"type": "array", "items": _STR(6), "minItems": 1, "maxItems": 3}}, ["tags"]),
    _OBJ({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}, ["color", "size"]),
    _OBJ({"score": {"type": "number", "multipleOf": 0.25, "minimum": -1.5, "maximum": 2.5}, "count": {"type": "integer", "minimum": 10, "maximum": 99}},
         ["score", "count"]),
    _OBJ({"id": {"type": "integer", "minimum": 0, "maximum": 999}, "note": _STR(10), "ok": {"type": "boolean"}}, ["id"]),
    _OBJ({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}},
         ["code", "email"]),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    _OBJ({"items": {"type": "array", "items": _OBJ({"k": _STR(4), "v": {"type": "integer", "minimum": 0, "maximum": 50}}, ["k", "v"]),
                    "maxItems": 2}}, ["items"]),
    _OBJ({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -5, "maximum": 5},
          "y": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]}}, ["kind", "x", "y"]),
]
