"""Property-based tests over the body grammars (Hypothesis): whatever a report or a record batch holds, the
answer is a 2xx or a 4xx problem, never a server error; and every body valid under the published schema is
stored. Example counts are bounded and generation is derandomized, so CI time is fixed and failures replay.
"""

from __future__ import annotations

import json
from typing import Any

from conftest import ProjectCtx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maingrad.contracts import records as contract

EXAMPLES = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

# Scalars that broke parsers and columns: wide integers (INTEGER, BIGINT and past 64 bits), non-finite
# numbers (written as JSON text below), odd strings (NUL, surrogate-free non-ASCII, long).
WIDE_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30])
ODD_TEXT = st.one_of(st.text(max_size=20), st.just("\x00"), st.just("é" * 300), st.just("x" * 9000))
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    WIDE_INTS,
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    ODD_TEXT,
)
ANY_JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the valid value, sometimes anything at all (a wrong type, a wide integer, a container)."""
    return st.one_of(valid, valid, valid, ANY_JSON)


def fields(**props: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """An object with any subset of these properties (each possibly mangled)."""
    return st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in props.items()})


LINE = st.integers(0, 2**31 - 1)
URI = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        ["file://[x/a.py", "file:///abs/a.py", "file://host:99999/a.py", "%2e%2e/a.py", "a\\b.py"]
    ),
)
REGION = fields(
    startLine=LINE, startColumn=LINE, endLine=LINE, endColumn=LINE, snippet=fields(text=st.text(max_size=30))
)
RESULT = fields(
    ruleId=st.text(min_size=1, max_size=10),
    ruleIndex=st.integers(-1, 5),
    level=st.sampled_from(["none", "note", "warning", "error"]),
    kind=st.sampled_from(["fail", "pass", "open"]),
    message=fields(
        text=st.text(max_size=40), id=st.just("m"), arguments=st.lists(st.text(max_size=10), max_size=3)
    ),
    locations=st.lists(
        fields(physicalLocation=fields(artifactLocation=fields(uri=URI), region=REGION)),
        max_size=2,
    ),
    suppressions=st.lists(fields(status=st.sampled_from(["accepted", "rejected"])), max_size=1),
    partialFingerprints=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=2),
)
RULE = fields(
    id=st.text(min_size=1, max_size=8),
    messageStrings=st.dictionaries(st.just("m"), fields(text=st.text(max_size=30)), max_size=1),
)
RUN = st.fixed_dictionaries(
    {
        "tool": maybe(
            st.fixed_dictionaries(
                {"driver": fields(name=st.text(min_size=1, max_size=10), rules=st.lists(RULE, max_size=2))}
            )
        )
    },
    optional={
        "results": maybe(st.lists(maybe(RESULT), max_size=4)),
        "invocations": st.lists(fields(executionSuccessful=st.booleans()), max_size=1),
    },
)
SARIF = st.fixed_dictionaries(
    {"version": maybe(st.just("2.1.0")), "runs": maybe(st.lists(RUN, min_size=1, max_size=2))}
)
FINDING = fields(
    rule=st.text(min_size=1, max_size=300),
    severity=st.sampled_from(["info", "warning", "error"]),
    path=st.text(max_size=20),
    line=LINE,
    column=LINE,
    end_line=LINE,
    message=st.text(max_size=30),
    fingerprint=st.text(max_size=70),
    snippet=st.text(max_size=30),
)
MAINGRAD = st.fixed_dictionaries(
    {"version": maybe(st.just(1)), "tool": maybe(st.fixed_dictionaries({"name": st.just("maingrad")}))},
    optional={
        "files_scanned": maybe(LINE),
        "findings": maybe(st.lists(FINDING, max_size=4)),
        "parse_errors": st.lists(
            fields(path=st.text(max_size=5), message=st.text(max_size=5), line=LINE), max_size=1
        ),
        "duration_s": maybe(st.floats(0, 100)),
    },
)
# Text mutations JSON encoders never produce: non-finite numbers and integers of thousands of digits.
NUMBER_TEXT = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 5000, "1.5", "-0"])


def post_report(project: ProjectCtx, body: bytes) -> Any:
    return project.upload(body, "c0ffee", params={"category": "prop"})


def no_server_error(response: Any) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        problem = response.json()
        assert problem["status"] == response.status_code and problem["code"] and problem["detail"]


@EXAMPLES
@given(doc=st.one_of(SARIF, MAINGRAD, ANY_JSON), number=st.one_of(st.none(), NUMBER_TEXT))
def test_any_report_is_stored_or_refused_never_500(project: ProjectCtx, doc: Any, number: str | None) -> None:
    text = json.dumps(doc)
    if number is not None and '"startLine": ' in text:
        text = text.replace('"startLine": ', f'"startLine": {number}, "x": ', 1)
    response = post_report(project, text.encode())
    no_server_error(response)
    assert response.status_code in (200, 201, 413, 422), response.text


# Valid documents only (the published schema's shapes): each must be stored.
VALID_RESULT = st.fixed_dictionaries(
    {"message": st.fixed_dictionaries({"text": st.text(max_size=30)})},
    optional={
        "ruleId": st.text(min_size=1, max_size=10),
        "level": st.sampled_from(["none", "note", "warning", "error"]),
        "locations": st.lists(
            st.fixed_dictionaries(
                {
                    "physicalLocation": st.fixed_dictionaries(
                        {"region": st.fixed_dictionaries({"startLine": LINE})}
                    )
                }
            ),
            max_size=2,
        ),
    },
)
VALID_SARIF = st.fixed_dictionaries(
    {
        "version": st.just("2.1.0"),
        "runs": st.lists(
            st.fixed_dictionaries(
                {
                    "tool": st.fixed_dictionaries(
                        {"driver": st.fixed_dictionaries({"name": st.text(min_size=1, max_size=10)})}
                    ),
                    "results": st.lists(VALID_RESULT, max_size=5),
                }
            ),
            min_size=1,
            max_size=3,
        ),
    }
)


@EXAMPLES
@given(doc=VALID_SARIF)
def test_every_schema_valid_sarif_log_is_stored(project: ProjectCtx, doc: dict[str, Any]) -> None:
    response = post_report(project, json.dumps(doc).encode())
    assert response.status_code in (200, 201), response.text


RECORD = fields(
    schema=st.just(contract.SCHEMA_VERSION),
    id=st.text(min_size=1, max_size=12),
    rank=st.integers(0, 2**31 - 1),
    step=st.integers(-(2**62) + 1, 2**62 - 1),
    microbatch=st.integers(-(2**31) + 1, 2**31 - 1),
    phase=st.sampled_from(contract.PHASES),
    action=st.sampled_from(contract.ACTIONS),
    module=st.text(max_size=10),
    param=st.text(max_size=10),
    has_main_grad=st.booleans(),
    anomaly=st.sampled_from([None, "main_grad_missing"]),
    commit=st.sampled_from([None, "abc1234"]),
    t_ns=st.integers(-(2**63), 2**63 - 1),
)
LINE_TEXT = st.one_of(RECORD.map(json.dumps), ANY_JSON.map(json.dumps), st.text(max_size=30), NUMBER_TEXT)


@EXAMPLES
@given(lines=st.lists(LINE_TEXT, max_size=6))
def test_any_record_batch_is_stored_or_refused_never_500(project: ProjectCtx, lines: list[str]) -> None:
    body = "\n".join(lines).encode("utf-8", "surrogatepass")
    response = project.client.post(
        project.url("/runs/prop/records"), content=body, headers=project.headers("upload")
    )
    no_server_error(response)
    assert response.status_code in (200, 409, 413, 422), response.text
    if response.status_code == 422 and response.json()["code"] == "invalid_record":
        assert response.json()["line"] >= 1


VALID_RECORD = st.fixed_dictionaries(
    {
        "id": st.text(min_size=1, max_size=12),
        "rank": st.integers(0, 2**31 - 1),
        "step": st.integers(-(2**62) + 1, 2**62 - 1),
        "phase": st.sampled_from(contract.PHASES),
    },
    optional={
        "microbatch": st.one_of(st.none(), st.integers(-(2**31) + 1, 2**31 - 1)),
        "action": st.sampled_from(contract.ACTIONS),
        "module": st.text(max_size=10),
        "has_main_grad": st.one_of(st.none(), st.booleans()),
        "t_ns": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    },
)


@EXAMPLES
@given(records=st.lists(VALID_RECORD, min_size=1, max_size=6))
def test_every_schema_valid_record_batch_is_stored(
    project: ProjectCtx, records: list[dict[str, Any]]
) -> None:
    body = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8", "surrogatepass")
    response = project.client.post(
        project.url("/runs/valid/records"), content=body, headers=project.headers("upload")
    )
    assert response.status_code == 200, response.text
    assert response.json()["received"] == len(records)
