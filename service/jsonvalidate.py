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
# generator per type check) took 0.7 s of CPU; nested closures, one call per value, still took 0.1 s. So
# `compile_schema` writes the schema out as the source of one Python function that answers only "valid or not",
# every keyword a test on a local variable, every array a loop (no call per value), and compiles it once per
# schema. `check_then_validate` runs it first and walks the schema as above only when it says no, so the first
# violation and its pointer are found exactly as before. A checker never accepts what the walk refuses: each
# line makes the walk's test in the walk's terms (types by `type()`, so a bool is no integer; `const` and
# `enum` by type and value, so 1 is not True).

Checker = Any  # Callable[[Any], bool]
_HASHABLE = (str, int, float, bool, type(None))


class _Source:
    """The function's lines, and the objects its lines refer to (constants, types, compiled patterns)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {"_MISSING": _MISSING}
        self.count = 0

    def name(self, prefix: str, value: Any = None) -> str:
        self.count += 1
        name = f"{prefix}{self.count}"
        if value is not None:
            self.names[name] = value
        return name

    def literal(self, value: Any) -> str:
        """A str or int as a constant of the source (the fastest load), anything else as a name."""
        return repr(value) if type(value) in (str, int) else self.name("n", value)

    def line(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)


_MISSING: Any = object()


def compile_schema(schema: dict[str, Any]) -> Checker:
    src = _Source()
    _emit(schema, "value", 2, src)
    # The objects the lines name are the arguments of a factory: in `check` they are closure cells, which load
    # faster than globals.
    names = sorted(src.names)
    head = [f"def make({', '.join(names)}):", "    def check(value):"]
    source = "\n".join([*head, *src.lines, "        return True", "    return check"])
    namespace: dict[str, Any] = {}
    exec(compile(source, "<compiled schema>", "exec"), namespace)  # noqa: S102 - our source, from the schema
    return namespace["make"](*(src.names[n] for n in names))


def _emit(schema: dict[str, Any], var: str, depth: int, src: _Source) -> None:
    """Lines that `return False` unless the value in `var` satisfies `schema`."""
    kind = src.name("t")
    src.line(depth, f"{kind} = type({var})")
    kinds = _emit_type(schema, var, kind, depth, src)
    possible = kinds if kinds is not None else [int, float, str, list, dict]

    def block(of: tuple[type, ...]) -> int:
        """Open an `if` on the value's type unless the type test above left no other choice."""
        if all(k in of for k in possible):
            return depth
        test = " or ".join(f"{kind} is {src.name('k', k)}" for k in of if k in possible)
        src.line(depth, f"if {test}:")
        return depth + 1

    if (int in possible or float in possible) and ("minimum" in schema or "maximum" in schema):
        inner = block((int, float))
        if "minimum" in schema:
            src.line(inner, f"if {var} < {src.literal(schema['minimum'])}: return False")
        if "maximum" in schema:
            src.line(inner, f"if {var} > {src.literal(schema['maximum'])}: return False")
    if str in possible and any(k in schema for k in ("maxLength", "minLength", "pattern")):
        inner = block((str,))
        if "maxLength" in schema:
            src.line(inner, f"if len({var}) > {int(schema['maxLength'])}: return False")
        if "minLength" in schema:
            src.line(inner, f"if len({var}) < {int(schema['minLength'])}: return False")
        if "pattern" in schema:
            search = src.name("p", _compiled(schema["pattern"]).search)
            src.line(inner, f"if {search}({var}) is None: return False")
    if list in possible and any(k in schema for k in ("maxItems", "minItems", "items")):
        _emit_array(schema, var, block((list,)), src)
    extra = schema.get("additionalProperties", True)
    if dict in possible and (
        schema.get("required") or schema.get("properties") or extra is False or isinstance(extra, dict)
    ):
        _emit_object(schema, var, block((dict,)), src)


def _emit_type(schema: dict[str, Any], var: str, kind: str, depth: int, src: _Source) -> list[type] | None:
    """`type`, `const` and `enum`; returns the Python types a value may have past them (None: any)."""
    expected = schema.get("type")
    kinds: list[type] | None = None
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        kinds = list(dict.fromkeys(t for n in names for t in JSON_TYPES[n]))
        if len(kinds) == 1:
            src.line(depth, f"if {kind} is not {src.name('k', kinds[0])}: return False")
        else:
            src.line(depth, f"if {kind} not in {src.name('k', frozenset(kinds))}: return False")
    if "const" in schema:
        const = schema["const"]
        same = f"{kind} is {src.name('k', type(const))} and {var} == {src.name('c', [const])}[0]"
        src.line(depth, f"if not ({same}): return False")
    if "enum" in schema:
        enum = list(schema["enum"])
        if kinds is not None and all(k in _HASHABLE for k in kinds + [type(v) for v in enum]):
            # (type, value) pairs: a set lookup that still tells 1 from True and 1.0
            pairs = src.name("e", frozenset((type(v), v) for v in enum))
            src.line(depth, f"if ({kind}, {var}) not in {pairs}: return False")
        else:
            values = src.name("e", tuple(enum))
            src.line(depth, f"if not any({kind} is type(v) and {var} == v for v in {values}): return False")
    return kinds


def _emit_array(schema: dict[str, Any], var: str, depth: int, src: _Source) -> None:
    if "maxItems" in schema:
        src.line(depth, f"if len({var}) > {int(schema['maxItems'])}: return False")
    if "minItems" in schema:
        src.line(depth, f"if len({var}) < {int(schema['minItems'])}: return False")
    if schema.get("items") is not None:
        item = src.name("i")
        src.line(depth, f"for {item} in {var}:")
        _emit(schema["items"], item, depth + 1, src)


def _emit_object(schema: dict[str, Any], var: str, depth: int, src: _Source) -> None:
    props: dict[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for name in schema.get("required", ()):
        src.line(depth, f"if {src.literal(name)} not in {var}: return False")
    for name, sub in props.items():  # a present property: its schema
        item = src.name("v")
        src.line(depth, f"{item} = {var}.get({src.literal(name)}, _MISSING)")
        src.line(depth, f"if {item} is not _MISSING:")
        _emit(sub, item, depth + 1, src)
    if extra is False or isinstance(extra, dict):  # any other: refused, or the additional schema
        key, item = src.name("q"), src.name("v")
        src.line(depth, f"for {key}, {item} in {var}.items():")
        src.line(depth + 1, f"if {key} in {src.name('s', frozenset(props))}: continue")
        if extra is False:
            src.line(depth + 1, "return False")
        else:
            _emit(extra, item, depth + 1, src)


def check_then_validate(value: Any, schema: dict[str, Any], checker: Checker, pointer: str = "") -> None:
    """`validate`, with the compiled `checker` of `schema` as the fast path for a valid value."""
    if checker(value):
        return
    validate(value, schema, pointer)
