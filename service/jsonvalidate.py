"""A small JSON Schema validator for request bodies, so the server enforces exactly the schema it publishes.

The OpenAPI document describes the report and record bodies with the schemas in `bodyschema.py`; this module
checks a parsed body against the same dictionaries. Publishing one schema and enforcing another is what let
contract fuzzers reach crashing parsers (and what makes them report valid requests rejected, or invalid ones
accepted). Only the keywords those schemas use are implemented: type, enum, const, minimum, maximum,
minLength, maxLength, pattern, minItems, maxItems, properties, required, additionalProperties, items.

The first violation raises `BodyInvalid` with its JSON pointer (RFC 6901), e.g. `/runs/0/results/3/level`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
    "integer": (int,),
    "number": (int, float),
}


class BodyInvalid(Exception):
    """The first place a body breaks its schema: `pointer` (RFC 6901) and what is wrong there."""

    def __init__(self, pointer: str, message: str) -> None:
        super().__init__(f"{pointer or '/'}: {message}")
        self.pointer = pointer
        self.message = message


def pointer_token(key: str | int) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _is_type(value: Any, name: str) -> bool:
    kind = type(value)
    if name == "integer":
        return kind is int
    if name == "number":
        return kind is int or kind is float
    return kind in JSON_TYPES[name]


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if type(value) is bool:
        return "a boolean"
    if type(value) is int:
        return "an integer"
    if type(value) is float:
        return "a number"
    if type(value) is str:
        return "a string"
    if type(value) is list:
        return "an array"
    return "an object"


Path = tuple[Any, Any] | None  # (parent path, key): the pointer is spelled out only for the error


def pointer_of(path: Path) -> str:
    keys: list[Any] = []
    while path is not None:
        path, key = path
        keys.append(key)
    return "".join("/" + pointer_token(k) for k in reversed(keys))


def validate(value: Any, schema: dict[str, Any], pointer: str = "") -> None:
    """Raise BodyInvalid at the first violation (depth-first, in document order)."""
    try:
        _validate(value, schema, None)
    except _Invalid as exc:
        raise BodyInvalid(pointer + pointer_of(exc.path), exc.message) from None


class _Invalid(Exception):
    def __init__(self, path: Path, message: str) -> None:
        self.path = path
        self.message = message


def _validate(value: Any, schema: dict[str, Any], path: Path) -> None:
    # Pointers are built only for the error: spelling one out for each of a 25,000-result report's
    # 400,000 values took a third of the validation's time.
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        if not any(_is_type(value, n) for n in names):
            raise _Invalid(path, f"must be {' or '.join(names)}, not {_describe(value)}")
    if "const" in schema and not _same(value, schema["const"]):
        raise _Invalid(path, f"must be {schema['const']!r}")
    if "enum" in schema and not any(_same(value, v) for v in schema["enum"]):
        raise _Invalid(path, f"must be one of {schema['enum']}")
    check = _BY_KIND.get(type(value))
    if check is not None:
        check(value, schema, path)


def _number(value: float, schema: dict[str, Any], path: Path) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        raise _Invalid(path, f"must be >= {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise _Invalid(path, f"must be <= {schema['maximum']}")


def _string(value: str, schema: dict[str, Any], path: Path) -> None:
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        raise _Invalid(path, f"longer than {schema['maxLength']} characters")
    if "minLength" in schema and len(value) < schema["minLength"]:
        raise _Invalid(path, f"shorter than {schema['minLength']} characters")
    if "pattern" in schema and not _compiled(schema["pattern"]).search(value):
        raise _Invalid(path, f"does not match {schema['pattern']}")


def _array(value: list[Any], schema: dict[str, Any], path: Path) -> None:
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise _Invalid(path, f"more than {schema['maxItems']} items")
    if "minItems" in schema and len(value) < schema["minItems"]:
        raise _Invalid(path, f"fewer than {schema['minItems']} items")
    items = schema.get("items")
    if items is not None:
        for i, item in enumerate(value):
            _validate(item, items, (path, i))


def _object(value: dict[str, Any], schema: dict[str, Any], path: Path) -> None:
    for name in schema.get("required", ()):
        if name not in value:
            raise _Invalid(path, f"missing required property {name!r}")
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        sub = props.get(key)
        if sub is not None:
            _validate(item, sub, (path, key))
        elif extra is False:
            raise _Invalid((path, key), "is not an allowed property")
        elif isinstance(extra, dict):
            _validate(item, extra, (path, key))


_BY_KIND: dict[type, Any] = {int: _number, float: _number, str: _string, list: _array, dict: _object}


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and True differ (Python says they are equal)."""
    return type(a) is type(b) and a == b


# --- a compiled form of the same checks, for the common case of a valid body ---------------------------------
# Walking the schema dictionaries for each of a 25,000-result report's 425,000 values (keyword lookups, a
# generator per type check) took 0.7 s of CPU. `compile_schema` turns a schema into nested closures that answer
# only "valid or not", with the keywords looked up once; `validate` with a checker runs it first and walks the
# schema as above only when it says no, so the first violation and its pointer are found exactly as before. A
# checker never accepts what the walk refuses: each closure makes the same tests in the same terms.

Checker = Any  # Callable[[Any], bool]
_WRONG: Any = object()


def compile_schema(schema: dict[str, Any]) -> Checker:
    return _compile(schema, {})


def _compile(schema: dict[str, Any], seen: dict[int, Checker]) -> Checker:
    done = seen.get(id(schema))
    if done is not None:
        return done
    expected = schema.get("type")
    types: frozenset[type] | None = None
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        types = frozenset(t for n in names for t in JSON_TYPES[n])
        # `integer` is int only, `number` int or float; JSON_TYPES says so, and bool is its own type
    has_const = "const" in schema
    const = schema.get("const")
    enum = schema.get("enum")
    by_kind: dict[type, Checker] = {}
    number = _compile_number(schema)
    if number is not None:
        by_kind[int] = by_kind[float] = number
    string = _compile_string(schema)
    if string is not None:
        by_kind[str] = string
    by_kind[list] = _compile_array(schema, seen)
    by_kind[dict] = _compile_object(schema, seen)

    if has_const or enum is not None:

        def check(value: Any) -> bool:
            kind = type(value)
            if types is not None and kind not in types:
                return False
            if has_const and not (kind is type(const) and value == const):
                return False
            if enum is not None and not any(kind is type(v) and value == v for v in enum):
                return False
            sub = by_kind.get(kind)
            return sub is None or sub(value)

    elif types is None:

        def check(value: Any) -> bool:
            sub = by_kind.get(type(value))
            return sub is None or sub(value)

    else:  # the common case: a type, then that type's keywords (one lookup: absent means a wrong type)
        allowed = {t: by_kind.get(t) for t in types}
        if len(allowed) == 1:
            ((only, only_sub),) = allowed.items()
            if only_sub is None:

                def check(value: Any) -> bool:
                    return type(value) is only

            else:

                def check(value: Any) -> bool:
                    return type(value) is only and only_sub(value)

        else:

            def check(value: Any) -> bool:
                sub = allowed.get(type(value), _WRONG)
                return sub is None or (sub is not _WRONG and sub(value))

    seen[id(schema)] = check
    return check


def _compile_number(schema: dict[str, Any]) -> Checker | None:
    if "minimum" not in schema and "maximum" not in schema:
        return None
    low = schema.get("minimum")
    high = schema.get("maximum")
    return lambda v: not ((low is not None and v < low) or (high is not None and v > high))


def _compile_string(schema: dict[str, Any]) -> Checker | None:
    if not any(k in schema for k in ("maxLength", "minLength", "pattern")):
        return None
    longest = schema.get("maxLength")
    shortest = schema.get("minLength")
    search = _compiled(schema["pattern"]).search if "pattern" in schema else None

    def check(v: str) -> bool:
        if longest is not None and len(v) > longest:
            return False
        if shortest is not None and len(v) < shortest:
            return False
        return search is None or search(v) is not None

    return check


def _compile_array(schema: dict[str, Any], seen: dict[int, Checker]) -> Checker:
    most = schema.get("maxItems")
    least = schema.get("minItems")
    items = schema.get("items")
    item = _compile(items, seen) if items is not None else None

    def check(v: list[Any]) -> bool:
        if most is not None and len(v) > most:
            return False
        if least is not None and len(v) < least:
            return False
        if item is not None:
            for x in v:
                if not item(x):
                    return False
        return True

    return check


def _compile_object(schema: dict[str, Any], seen: dict[int, Checker]) -> Checker:
    required = tuple(schema.get("required", ()))
    props = {k: _compile(s, seen) for k, s in schema.get("properties", {}).items()}
    extra = schema.get("additionalProperties", True)
    closed = extra is False
    extra_check = _compile(extra, seen) if isinstance(extra, dict) else None

    def check(v: dict[str, Any]) -> bool:
        for name in required:
            if name not in v:
                return False
        for key, x in v.items():
            sub = props.get(key)
            if sub is not None:
                if not sub(x):
                    return False
            elif closed or (extra_check is not None and not extra_check(x)):
                return False
        return True

    return check


def check_then_validate(value: Any, schema: dict[str, Any], checker: Checker, pointer: str = "") -> None:
    """`validate`, with the compiled `checker` of `schema` as the fast path for a valid value."""
    try:
        if checker(value):
            return
    except RecursionError:
        pass
    validate(value, schema, pointer)
