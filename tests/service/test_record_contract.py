"""The record contract (`contracts/records.py`) against its two hand-written hot paths: the service's
`parse_batch` accepts exactly the records `json_schema` accepts (on a population of records mutated field by
field), and what the hooks write is `new_record` of the same values, valid by `validate`."""

from __future__ import annotations

import html
import itertools
import json
import random
from typing import Any

import pytest
from conftest import ProjectCtx
from svc_helpers import login_nonce, ndjson, record

from maingrad.contracts import records as contract
from maingrad.contracts.anomalies import ANOMALIES
from maingrad.service.bodyschema import BodyLimits, record_schema
from maingrad.service.jsonvalidate import BodyInvalid, validate
from maingrad.service.problems import ProblemError
from maingrad.service.records import parse_batch

RUN = "run-1"
LIMITS = BodyLimits()

# Values every field is tried with: each type, the bounds of every integer column and string limit, and the
# enumerations' members and near misses.
POOL: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**31 - 1, 2**31, -(2**31) + 1, -(2**31), 2**62 - 1, 2**62, -(2**62) + 1,
    -(2**62), 2**63 - 1, -(2**63), 1.5, "", "x", "x" * 255, "x" * 256, "x" * 4096, "x" * 4097, "main_grad_none",
    "0123abc", "abc.def-1_2", "-bad", "a b", [], [1, 2], {}, {"a": 1},
    *contract.PHASES, *contract.ACTIONS, *contract.MODES, "Forward", "none ",
]  # fmt: skip


def _base(**values: Any) -> dict[str, Any]:
    return contract.new_record(
        id=contract.record_id(RUN, 0, 1), run=RUN, rank=0, step=3, phase="backward", module="decoder.fc1",
        param="weight", mode="fix", t_ns=1_700_000_000_000_000_000, **values,
    )  # fmt: skip


def _population(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    checked = list(contract.json_schema()["properties"])
    out = [_base(), _base(commit="abc123", anomaly="main_grad_none", action="raised")]
    for name in checked:
        for value in POOL:
            out.append({**_base(), name: value})
        without = _base()
        del without[name]
        out.append(without)
    for _ in range(400):  # two or three fields wrong at once
        record = _base()
        for name in rng.sample(checked, rng.randint(2, 3)):
            record[name] = rng.choice(POOL)
        out.append(record)
    return out


def _schema_accepts(record: dict[str, Any]) -> bool:
    try:
        validate(record, record_schema(LIMITS))
    except BodyInvalid:
        return False
    # What a schema cannot say, and the parser adds: a record's run is the run in the URL.
    return record.get("run", RUN) == RUN


def _parser_accepts(record: dict[str, Any]) -> bool:
    try:
        parse_batch(
            json.dumps(record).encode(), RUN, max_records=10, max_string=LIMITS.max_record_string_chars
        )
    except ProblemError as exc:
        assert exc.status == 422, exc
        return False
    return True


def test_json_schema_is_the_service_schema() -> None:
    assert record_schema(LIMITS) == contract.json_schema(
        contract.RecordBounds(
            max_string_chars=LIMITS.max_record_string_chars,
            commit_pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        )  # fmt: skip
    )
    assert set(contract.json_schema()["required"]) == {"id", "rank", "step", "phase"}


@pytest.mark.parametrize("seed", [0, 1])
def test_parse_batch_accepts_exactly_what_the_schema_accepts(seed: int) -> None:
    population = _population(seed)
    verdicts = [(_schema_accepts(r), _parser_accepts(r)) for r in population]
    disagree = [r for r, (s, p) in zip(population, verdicts, strict=True) if s != p]
    assert disagree == [], f"{len(disagree)} of {len(population)} records judged differently: {disagree[:3]}"
    accepted = sum(s for s, _ in verdicts)
    assert 50 < accepted < len(population) - 500  # the population exercises both verdicts


def test_new_record_fills_the_table_and_refuses_unknown_or_missing_fields() -> None:
    record = _base()
    assert tuple(record) == contract.FIELDS and contract.validate(record) == []
    assert {f.name: record[f.name] for f in contract.RECORD_FIELDS if f.default is not contract.REQUIRED} == {
        f.name: f.default for f in contract.RECORD_FIELDS if f.default is not contract.REQUIRED
    }
    with pytest.raises(TypeError, match="unknown record fields"):
        _base(colour="red")
    with pytest.raises(TypeError, match="'t_ns' is required"):
        contract.new_record(
            id="r:0:1", run="r", rank=0, step=0, phase="forward", module="m", param="p", mode="fix"
        )


def test_every_field_has_a_json_type_the_validator_agrees_with() -> None:
    """`validate` (complete records, as the hooks write them) and the table agree on each field's type."""
    for field, value in itertools.product(contract.RECORD_FIELDS, POOL):
        record = {**_base(), field.name: value}
        type_ok = (value is None and field.nullable) or (
            value is not None
            and isinstance(value, field.kind)
            and (field.kind is bool or not isinstance(value, bool))
        )
        problems = [p for p in contract.validate(record) if p.startswith(field.name) and ("type" in p or "null" in p or "bool" in p)]  # fmt: skip
        assert (problems == []) == type_ok, (field.name, value, problems)


def test_the_run_page_shows_anomaly_meanings_and_counts_distinct_parameters(project: ProjectCtx) -> None:
    """Dashboard: each anomaly code with its summary and fix from `contracts.anomalies`; Params counts
    distinct (module, param) pairs, so two modules' `weight0` are two parameters of a rank."""
    # 2 modules x 4 parameter names, one rank
    recs = [record("dash", i, param=f"weight{(i // 2) % 4}") for i in range(16)]
    recs[3]["anomaly"] = "main_grad_none"
    recs[5]["anomaly"] = "main_grad_none"
    recs[6]["anomaly"] = "overwrite_discards_microbatch"
    r = project.client.post(
        project.url("/runs/dash/records"), content=ndjson(recs), headers=project.headers("upload")
    )
    assert r.status_code == 200, r.text
    run = project.client.get(project.url("/runs/dash"), headers=project.headers("read")).json()
    assert [m["params"] for m in run["modules"]] == [4, 4]
    assert [m["params"] for m in run["ranks"]] == [8]  # names alone would say 4
    project.client.cookies.clear()
    nonce = login_nonce(project.client)
    r = project.client.post("/login", data={"token": project.tokens["read"], "csrf": nonce})
    assert r.status_code == 200
    page = project.client.get(f"/projects/{project.name}/runs/dash").text
    project.client.cookies.clear()
    codes = page[
        page.index('class="anomaly-codes"') : page.index("</table>", page.index('class="anomaly-codes"'))
    ]
    for code, count in (("main_grad_none", 2), ("overwrite_discards_microbatch", 1)):
        anomaly = ANOMALIES[code]
        assert f"<code>{code}</code>" in codes and f"<td>{count}</td>" in codes
        assert anomaly.summary in html.unescape(codes) and anomaly.remedy in html.unescape(codes)
    assert codes.index("main_grad_none") < codes.index("overwrite_discards_microbatch")  # fatal first
    assert "(fatal)" in codes
