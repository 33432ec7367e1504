"""The compiled schema checker accepts exactly what the schema walk accepts (it is only the fast path)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from maingrad.service.bodyschema import BodyLimits, maingrad_report_schema, sarif_schema
from maingrad.service.jsonvalidate import BodyInvalid, compile_schema, validate

SARIF: dict[str, Any] = {
    "version": "2.1.0",
    "runs": [
        {
            "tool": {"driver": {"name": "t", "version": "1", "rules": [{"id": "R1", "name": "r"}]}},
            "invocations": [{"executionSuccessful": True}],
            "results": [
                {
                    "ruleId": "R1",
                    "ruleIndex": 0,
                    "level": "warning",
                    "kind": "fail",
                    "message": {"text": "m", "arguments": ["a"]},
                    "locations": [
                        {
                            "physicalLocation": {
                                "artifactLocation": {"uri": "src/a.py"},
                                "region": {"startLine": 3, "startColumn": 1, "snippet": {"text": "x"}},
                            }
                        }
                    ],
                    "partialFingerprints": {"primaryLocationLineHash": "abc"},
                    "suppressions": [{"kind": "inSource", "status": "accepted"}],
                    "properties": {"bag": [1, {"k": None}]},
                }
            ],
        }
    ],
}

REPORT: dict[str, Any] = {
    "version": 1,
    "tool": {"name": "maingrad", "version": "0.1"},
    "files_scanned": 3,
    "findings": [
        {
            "rule": "MG001",
            "severity": "error",
            "path": "a.py",
            "line": 1,
            "column": 0,
            "message": "m",
            "snippet": "s",
            "fingerprint": "f1",
            "end_line": 2,
            "fix_available": False,
        }
    ],
}

ODD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    1.5,
    -0.0,
    "",
    "x",
    "warning",
    "x" * 10_000,
    [],
    {},
]


def _nodes(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nodes(v, (*path, i))
    return out


def _mutate(doc: Any, rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        inner = _nodes(doc)[1:]
        if not inner:
            break
        path = rng.choice(inner)
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        action = rng.random()
        if action < 0.5:
            parent[last] = copy.deepcopy(rng.choice(ODD))
        elif action < 0.7 and isinstance(parent, dict):
            del parent[last]
        elif action < 0.85 and isinstance(parent, dict):
            parent[rng.choice(["extra", "kind", "level", "id", "uri", "text"])] = copy.deepcopy(
                rng.choice(ODD)
            )
        elif isinstance(parent[last], list):
            parent[last] = parent[last] * rng.choice([0, 2, 30])
    return doc


def _walk_accepts(doc: Any, schema: dict[str, Any]) -> bool:
    try:
        validate(doc, schema)
    except BodyInvalid:
        return False
    return True


@pytest.mark.parametrize("which", ["sarif", "maingrad"])
def test_checker_agrees_with_the_walk(which: str) -> None:
    limits = BodyLimits(max_message_chars=100, max_snippet_chars=100, max_path_chars=100)
    schema = sarif_schema(limits) if which == "sarif" else maingrad_report_schema(limits)
    base = SARIF if which == "sarif" else REPORT
    checker = compile_schema(schema)
    assert _walk_accepts(base, schema) and checker(base)
    rng = random.Random(20261204)
    outcomes = set()
    for _ in range(3_000):
        doc = _mutate(base, rng)
        accepted = _walk_accepts(doc, schema)
        assert checker(doc) == accepted, doc
        outcomes.add(accepted)
    assert outcomes == {True, False}  # the mutations reach both answers
