"""The syntax gate (`maingrad.analyzer.syntax_index` + each rule's `gate`): results never change, files are
skipped, and each gate is sound at its edges.

Soundness is checked the same way everywhere: whenever the rule reports something with the gate off, its
gate must pass; on top of that each snippet states whether the gate passes, so a gate that filters nothing
fails as well.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import libcst as cst
import pytest

from maingrad.analyzer import engine, facts, syntax_index
from maingrad.analyzer.context import RuleSettings
from maingrad.analyzer.engine import analyze_source, fix_source
from maingrad.analyzer.rules import all_rules, rules_by_id
from maingrad.analyzer.rules import mg007_wgrad_dtype as mg007
from maingrad.analyzer.rules.base import Example, Rule
from maingrad.analyzer.syntax_index import NO_GATE_ENV, build_index
from maingrad.cli.main import main
from tests.testbeds import TESTBEDS
from tests.testbeds import testbed as bed_dir

RULES = rules_by_id()


def _settings(config: typing.Mapping[str, object] | None = None) -> RuleSettings:
    helpers = (config or {}).get("exposure-helpers", ())
    return RuleSettings(exposure_helpers=frozenset(helpers))  # type: ignore[arg-type]


def _report(result) -> tuple[list[dict], dict | None]:  # type: ignore[no-untyped-def]
    error = result.parse_error.to_dict() if result.parse_error is not None else None
    return [f.to_dict() for f in result.findings], error


def _gate(rule_id: str, code: str, path: str = "pkg/mod.py", settings: RuleSettings | None = None) -> bool:
    index = build_index(textwrap.dedent(code), path)
    assert index is not None
    return RULES[rule_id]().gate(index, settings or RuleSettings())


def _findings(rule_id: str, code: str, path: str = "pkg/mod.py") -> list[str]:
    result = analyze_source(textwrap.dedent(code), path, [RULES[rule_id]()], gate=False)
    assert result.parse_error is None
    return [f.message for f in result.findings]


# 1. Real code: megatron-core 0.18.2 / 0.19.2 and Transformer Engine 2.20.2 -------------------------------
def _check(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    config = tmp_path / "pyproject.toml"
    config.write_text("[tool.maingrad]\n", encoding="utf-8")
    capsys.readouterr()
    code = main(
        [
            "check",
            str(root),
            "--config",
            str(config),
            "--format",
            "json",
            "--no-cache",
            "--no-progress",
            *extra,
        ]
    )
    out = capsys.readouterr().out
    assert code in (0, 1), out[-2000:]
    return json.loads(out)


# Measured (files that pass the text needles -> files libcst-parsed with the gate): 0.18.2 26 -> 3,
# 0.19.2 32 -> 4 (exactly the four files with findings), TE 2.20.2 22 -> 8.
_BEDS = {"megatron-core-0.18.2": 4, "megatron-core-0.19.2": 6, "transformer-engine-2.20.2": 14}


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("bed", sorted(_BEDS))
def test_real_code_same_report_with_and_without_gate(
    bed: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = bed_dir(bed)
    args = ("--warn-unused-ignores", "--jobs", "1")
    gated = _check(root, tmp_path, capsys, *args)
    monkeypatch.setenv(NO_GATE_ENV, "1")
    plain = _check(root, tmp_path, capsys, *args)
    monkeypatch.delenv(NO_GATE_ENV)
    assert gated["findings"] == plain["findings"]  # rule, path, positions, message, fingerprint, fix, snippet
    assert gated["parse_errors"] == plain["parse_errors"]
    assert gated["files_scanned"] == plain["files_scanned"]
    # The gate skips part of what the needles let through (plain: everything that passed the needles); in TE
    # most needle files are real candidates of MG007-MG010 (its wgrad code), so the share skipped is smaller.
    assert plain["files_parsed"] >= 20
    assert gated["files_parsed"] <= _BEDS[bed] < plain["files_parsed"]
    if bed == "megatron-core-0.19.2":
        assert len(plain["findings"]) >= 7
        pooled = _check(root, tmp_path, capsys, "--warn-unused-ignores", "--jobs", "2")
        assert pooled["findings"] == gated["findings"] and pooled["files_parsed"] == gated["files_parsed"]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("bed", sorted(TESTBEDS))
def test_every_test_bed_same_findings_with_and_without_gate(bed: str) -> None:
    """Acceptance: on every pinned real code base (`docs/real-world.md`), file by file, every rule's findings
    and parse errors are identical with the syntax gate on and off."""
    root = bed_dir(bed)
    rules = [rule() for rule in all_rules()]
    parsed = {"gated": 0, "plain": 0}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8", errors="replace")
        gated = analyze_source(source, rel, rules, gate=True)
        plain = analyze_source(source, rel, rules, gate=False)
        assert _report(gated) == _report(plain), rel
        parsed["gated"] += gated.parsed
        parsed["plain"] += plain.parsed
    assert parsed["gated"] <= parsed["plain"]


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("bed", sorted(_BEDS))
def test_prefilters_never_skip_what_a_rule_reports(bed: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-filters (text needles, large-file segments, and the syntax gate, whose `ast` mirrors of
    `rules._common` are a second copy of the rules' semantics) against none at all: every .py file of the
    bed parsed whole by libcst and every rule run on it. Wherever a rule reports there, the shipped path
    reports exactly the same findings (rule, position, message, fingerprint, fix), file by file."""
    root = bed_dir(bed)
    rules = [rule() for rule in all_rules()]
    settings = RuleSettings()
    every_rule = lambda source, candidates: list(candidates)  # noqa: E731 - no needle filters anything
    fired: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8", errors="replace")
        with monkeypatch.context() as patch:
            patch.setattr(engine, "needed_rules", every_rule)
            unfiltered = engine._analyze_whole(source, rel, rules, settings, None, False, False)
        if not unfiltered.findings:
            continue
        shipped = analyze_source(source, rel, rules, settings)
        assert [f.to_dict() for f in shipped.findings] == [f.to_dict() for f in unfiltered.findings], rel
        for finding in unfiltered.findings:
            fired[finding.rule] = fired.get(finding.rule, 0) + 1
    assert fired, f"no rule reports anything on {bed}: the comparison would be empty"


@pytest.mark.network
@pytest.mark.slow
def test_big_megatron_files_are_not_parsed() -> None:
    root = bed_dir("megatron-core-0.19.2")
    rules = [rule() for rule in all_rules()]
    for rel in (
        "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py",
        "megatron/training/training.py",
        "megatron/core/transformer/cuda_graphs.py",
        "megatron/core/optimizer/distrib_optimizer.py",
        "megatron/training/arguments.py",
    ):
        result = analyze_source((root / rel).read_text(encoding="utf-8"), rel, rules)
        assert not result.parsed and result.findings == [], rel
        assert analyze_source((root / rel).read_text(encoding="utf-8"), rel, rules, gate=False).parsed


# 2. Every rule's examples --------------------------------------------------------------------------------
def _examples() -> list[pytest.param]:
    params = []
    for rule in all_rules():
        for kind in ("VALID", "INVALID"):
            for number, example in enumerate(getattr(rule, kind)):
                params.append(pytest.param(rule, kind, example, id=f"{rule.id}-{kind.lower()}-{number}"))
    return params


@pytest.mark.parametrize(("rule", "kind", "example"), _examples())
def test_examples_same_with_and_without_gate(rule: type[Rule], kind: str, example: Example) -> None:
    source = textwrap.dedent(example.code)
    settings = _settings(example.config)
    gated = analyze_source(source, "example.py", [rule()], settings, gate=True)
    plain = analyze_source(source, "example.py", [rule()], settings, gate=False)
    assert _report(gated) == _report(plain)
    index = build_index(source, "example.py")
    assert index is not None
    if kind == "INVALID":
        assert rule().gate(index, settings), f"{rule.id}'s gate rejects its own INVALID example"
        assert gated.parsed
        for unsafe in (False, True):
            assert fix_source(
                source, "example.py", [rule()], settings, unsafe=unsafe, gate=True
            ) == fix_source(source, "example.py", [rule()], settings, unsafe=unsafe, gate=False)


def test_every_rule_has_a_gate() -> None:
    assert all(rule.has_gate() for rule in all_rules())


# 3. Gates at their edges ---------------------------------------------------------------------------------
EDGES = [
    # MG001: the op resolved through any import form; the flag as keyword or through `**`.
    (
        "MG001",
        True,
        "from transformer_engine.pytorch.ops import GroupedLinear as GL\nop = GL(1, 2, 3, accumulate_into_main_grad=True)\n",
    ),
    (
        "MG001",
        True,
        "import transformer_engine as te\ndef f():\n    kw = {'accumulate_into_main_grad': True}\n    return te.pytorch.ops.GroupedLinear(1, 2, 3, **kw)\n",
    ),
    ("MG001", False, "from x import Linear\nop = Linear(1, accumulate_into_main_grad=True)\n"),
    (
        "MG001",
        False,
        '"""accumulate_into_main_grad"""\nfrom transformer_engine.pytorch.ops import GroupedLinear\nop = GroupedLinear(1, 2, 3)\n',
    ),
    # MG002: a write into main_grad, not provably exposed before.
    (
        "MG002",
        True,
        "def f(w, x, dy):\n    wgrad_gemm_accum_fp32(\n        x,\n        dy,\n        w.main_grad,\n    )\n",
    ),
    ("MG002", True, "def f(w, x, dy):\n    w.main_grad.addmm_(dy, x)\n"),
    (
        "MG002",
        True,
        "def f(w, x, dy):\n    torch.matmul(dy, x, out=w.main_grad)\n    w.main_grad = w.get_main_grad()\n",
    ),
    (
        "MG002",
        True,
        "def f(w, x, dy):\n    (w).main_grad = w.get_main_grad()\n    wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG002",
        True,
        "def f(w, x, dy, c):\n    if c:\n        w.main_grad = w.get_main_grad()\n    else:\n        wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG002",
        True,
        "def f(w, x, dy, c):\n    try:\n        w.main_grad = w.get_main_grad()\n    finally:\n        wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG002",
        True,
        "def f(w, x, dy):\n    def g():\n        w.main_grad = w.get_main_grad()\n    wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG002",
        True,
        "def f(w, v, x, dy):\n    v.main_grad = v.get_main_grad()\n    wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG002",
        False,
        "def f(w, x, dy):\n    if hasattr(w, '__fsdp_param__'):\n        w.main_grad = w.get_main_grad()\n    wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG002",
        False,
        "def f(w, x, dy):\n    if c:\n        w.main_grad = w.get_main_grad()\n        general_gemm(x, dy, out=w.main_grad)\n",
    ),
    ("MG002", False, "def f(w, x, dy):\n    partial.redistribute(w.main_grad.placements, out=w.main_grad)\n"),
    # MG003: main_grad values (and names bound to them) in truth contexts.
    ("MG003", True, "def f(p):\n    if p.main_grad:\n        pass\n"),
    ("MG003", True, "def f(p):\n    g = getattr(p, 'main_grad', None)\n    if g:\n        pass\n"),
    ("MG003", True, "def f(p, y):\n    if (\n        y\n        and p.main_grad\n    ):\n        pass\n"),
    ("MG003", True, "def f(p):\n    assert p.get_main_grad()\n"),
    ("MG003", True, "def f(ps):\n    return [p for p in ps if p.main_grad]\n"),
    ("MG003", True, "def f(p):\n    return bool(p.main_grad)\n"),
    ("MG003", True, "def f(p):\n    return not getattr(p, 'main_grad')\n"),
    ("MG003", True, "def f(p, q):\n    return p.main_grad or q\n"),
    ("MG003", False, "def f(p):\n    g = p.main_grad\n    if g is None:\n        pass\n    return g\n"),
    (
        "MG003",
        False,
        "# if p.main_grad:\ndef f(p):\n    '''if p.main_grad: and not p.main_grad'''\n    return p.grad\n",
    ),
    # MG004: get_main_grad() without the guards `_exempt` and plain `path_facts` prove.
    ("MG004", True, "def f(p):\n    return p.get_main_grad()\n"),
    (
        "MG004",
        True,
        "def f(p):\n    if hasattr((p), 'get_main_grad'):\n        p.main_grad = p.get_main_grad()\n",
    ),
    (
        "MG004",
        True,
        "def f(p):\n    if hasattr(p, 'get_' 'main_grad'):\n        p.main_grad = p.get_main_grad()\n",
    ),
    (
        "MG004",
        True,
        "def f(p, q):\n    if hasattr(q, 'get_main_grad'):\n        p.main_grad = p.get_main_grad()\n",
    ),
    (
        "MG004",
        True,
        "def f(p):\n    return not hasattr(p, '__fsdp_param__') and hasattr(p, 'get_main_grad') and p.get_main_grad()\n",
    ),
    (
        "MG004",
        True,
        "def f(p):\n    if hasattr(p, 'get_main_grad'):\n        pass\n    else:\n        p.get_main_grad()\n",
    ),
    (
        "MG004",
        True,
        "class A:\n    def get_main_grad(self):\n        pass\n\n    class B:\n        def g(self):\n            return self.get_main_grad()\n",
    ),
    ("MG004", True, "def f(p):\n    try:\n        p.get_main_grad()\n    except KeyError:\n        pass\n"),
    (
        "MG004",
        False,
        "def f(p):\n    if hasattr(p, 'get_main_grad'):\n        p.main_grad = p.get_main_grad()\n",
    ),
    ("MG004", False, 'def f(p):\n    return hasattr(p, "__fsdp_param__") and p.get_main_grad()\n'),
    (
        "MG004",
        False,
        "def f(p):\n    while hasattr(p.w, 'get_main_grad'):\n        x = p.w.get_main_grad() if hasattr(p.w, 'get_main_grad') else None\n",
    ),
    (
        "MG004",
        False,
        "def f(p):\n    try:\n        return p.get_main_grad()\n    except (KeyError, AttributeError):\n        return None\n",
    ),
    (
        "MG004",
        False,
        "class A:\n    def get_main_grad(self):\n        pass\n\n    def g(self):\n        return self.get_main_grad()\n",
    ),
    ("MG004", False, "class FSDPParam:\n    def g(self, p):\n        return p.get_main_grad()\n"),
    # MG005: a container call that may resolve to TE's op fuser.
    (
        "MG005",
        True,
        "import transformer_engine as te\nte_ops = te.pytorch.ops\nclass M:\n    def f(self, x):\n        seq = te_ops.Sequential()\n        op = te_ops.BasicLinear(1, 2)\n        op.weight = self.fc.weight\n        seq.append(op)\n        return seq(x)\n",
    ),
    (
        "MG005",
        True,
        "from transformer_engine.pytorch.ops import Sequential as Seq\ndef f(self):\n    seq = Seq()\n",
    ),
    (
        "MG005",
        False,
        "import torch.nn as nn\nimport transformer_engine.pytorch\ndef f(self):\n    seq = nn.Sequential()\n",
    ),
    (
        "MG005",
        False,
        "from transformer_engine.pytorch.ops import Sequential\ndef f(m):\n    return isinstance(m, Sequential)\n",
    ),
    (
        "MG005",
        False,
        "import torch\nimport transformer_engine as te\ntorch.nn.modules.module.register_module_forward_pre_hook(h)\ndef f(self):\n    seq = te.pytorch.ops.Sequential()\n",
    ),
    # MG006: a truthy `overwrite_main_grad` outside the wrapper.
    ("MG006", True, "def f(p):\n    p.overwrite_main_grad = True\n"),
    ("MG006", True, "def f(p):\n    setattr(p, 'overwrite_main_grad', 1)\n"),
    ("MG006", True, "def f(p):\n    flag = True\n    p.overwrite_main_grad = flag\n"),
    ("MG006", False, "def f(p):\n    p.overwrite_main_grad = False\n"),
    ("MG006", False, "class MyDDPWrapper:\n    def f(self, p):\n        p.overwrite_main_grad = True\n"),
    # MG007: writes whose dtype is not provably taken from main_grad.
    ("MG007", True, "def f(w, x, dy):\n    w.main_grad.fused.wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n"),
    (
        "MG007",
        True,
        "import torch\ndef f(w, x, dy):\n    if w.main_grad.dtype == torch.float16:\n        k.wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    (
        "MG007",
        True,
        "import torch\nfrom torch import float16 as half_t\ndef f(w, x, dy):\n    if w.main_grad.dtype == half_t:\n        k.wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n",
    ),
    ("MG007", True, "import torch\ndef f(w, a, b):\n    torch.matmul(a, b, out=w.main_grad)\n"),
    ("MG007", True, "from torch import mm as mul\ndef f(w, a, b):\n    mul(a, b, out=w.main_grad)\n"),
    (
        "MG007",
        True,
        "import torch\ndef f(w, a, b):\n    gemm(a, b, out=w.main_grad, out_dtype=torch.bfloat16)\n",
    ),
    (
        "MG007",
        True,
        "import torch\ndef f(w, g):\n    buf = w.main_grad\n    view = buf.view(-1)\n    view.add_(g.to(torch.bfloat16))\n",
    ),
    (
        "MG007",
        False,
        "import torch\ndef f(w, x, dy):\n    if w.main_grad.dtype == torch.float32:\n        k.wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n    elif w.main_grad.dtype in (torch.float16, torch.bfloat16):\n        k.wgrad_gemm_accum_fp16(x, dy, w.main_grad)\n",
    ),
    ("MG007", False, "def f(w, a):\n    a.redistribute(w.main_grad.placements, out=w.main_grad)\n"),
    ("MG007", False, "import torch\ndef f(w, g):\n    w.main_grad.add_(g)\n"),
    # MG008: a backward writing main_grad.
    ("MG008", True, "def backward(ctx, w, x, dy):\n    k.wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n"),
    ("MG008", True, "def _wgrad_backward(w, g):\n    def inner():\n        w.main_grad += g\n    inner()\n"),
    ("MG008", False, "def forward(ctx, w, x, dy):\n    k.wgrad_gemm_accum_fp32(x, dy, w.main_grad)\n"),
    ("MG008", False, "def backward(ctx, w, x, dy):\n    k.wgrad_gemm_accum_fp32(x, dy, w.grad)\n"),
]


@pytest.mark.parametrize(("rule_id", "passes", "code"), EDGES)
def test_gate_edges(rule_id: str, passes: bool, code: str) -> None:
    found = _findings(rule_id, code)
    assert _gate(rule_id, code) == passes, found
    if found:
        assert passes  # soundness, stated for the reader (the expectation above must then be True)


@pytest.mark.parametrize(
    ("rule_id", "code", "gated_path", "open_path"),
    [
        ("MG004", "def f(p):\n    return p.get_main_grad()\n", "core/fsdp/x.py", "core/x.py"),
        ("MG006", "def f(p):\n    p.overwrite_main_grad = True\n", "tests/test_x.py", "core/x.py"),
        (
            "MG006",
            "def f(p):\n    p.overwrite_main_grad = True\n",
            "megatron/core/distributed/x.py",
            "core/x.py",
        ),
        (
            "MG008",
            "def backward(w, g):\n    w.main_grad += g\n",
            "pkg/distributed_data_parallel.py",
            "pkg/x.py",
        ),
    ],
)
def test_gate_path_exemptions(rule_id: str, code: str, gated_path: str, open_path: str) -> None:
    assert not _gate(rule_id, code, gated_path) and not _findings(rule_id, code, gated_path)
    assert _gate(rule_id, code, open_path) and _findings(rule_id, code, open_path)


def test_mg005_relative_import_inside_te() -> None:
    code = "from .fuser import OperationFuser\ndef f(ops):\n    return OperationFuser(ops)\n"
    assert _gate("MG005", code, "transformer_engine/pytorch/ops/x.py")
    assert not _gate("MG005", code, "other/pkg/x.py")


def test_mg005_self_referential_aliases_terminate() -> None:
    code = (
        "from transformer_engine.pytorch import ops\n"
        + "ops = ops.inner\n" * 50
        + "def f():\n    ops.Sequential()\n"
    )
    assert _gate("MG005", code)


def test_segments_follow_the_tokenizer_lines() -> None:
    """Columns are UTF-8 bytes, and only \\n, \\r\\n and \\r end a line (not form feeds)."""
    source = 'x = 1\x0c\ny = "é"; z = a.b.main_grad\r\nw = (\n  q.main_grad)\rv = 1\n'
    index = build_index(source, "m.py")
    assert index is not None
    found = [
        index.segment(n)
        for n in ast.walk(index.tree)
        if isinstance(n, ast.Attribute) and n.attr == "main_grad"
    ]
    assert sorted(found) == ["a.b.main_grad", "q.main_grad"]  # type: ignore[type-var]
    assert syntax_index.chain_before(index, index.tree.body[3].value, "main_grad") == "q"  # type: ignore[attr-defined]


def test_comment_or_docstring_only_file_is_not_parsed() -> None:
    source = (
        '"""Talks about p.main_grad and get_main_grad()."""\n# if p.main_grad: p.get_main_grad()\nx = 1\n'
    )
    rules = [rule() for rule in all_rules()]
    assert not analyze_source(source, "m.py", rules).parsed
    assert analyze_source(source, "m.py", rules, gate=False).parsed


@pytest.mark.parametrize(
    "source",
    [
        "if p.main_grad:\n    pass\nx = (\n",  # neither parser reads it
        "x = 1\0\nif p.main_grad:\n    pass\n",  # NUL byte: ast raises ValueError (3.11) or SyntaxError
        "type Alias = int\nif p.main_grad:\n    pass\n",  # 3.12 syntax: ast on 3.11 fails, libcst reads it
        "print 'main_grad'\n",
        "x = " + "(" * 300 + "p.main_grad" + ")" * 300 + "\nif p.main_grad:\n    pass\n",  # too deep for ast
    ],
)
def test_files_ast_cannot_read_fall_back_to_libcst(source: str) -> None:
    rules = [rule() for rule in all_rules()]
    gated = analyze_source(source, "m.py", rules)
    assert _report(gated) == _report(analyze_source(source, "m.py", rules, gate=False))
    assert gated.parsed or gated.parse_error is not None


def test_parse_error_still_reported_when_ast_fails() -> None:
    result = analyze_source("if p.main_grad:\n    pass\nx = (\n", "m.py", [RULES["MG003"]()])
    assert result.parse_error is not None and result.parse_error.message.startswith("syntax error")


@pytest.mark.parametrize("error", [RecursionError, MemoryError, SyntaxError, ValueError])
def test_any_ast_failure_disables_the_gate(
    error: type[BaseException], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> ast.Module:
        raise error("boom")

    monkeypatch.setattr(syntax_index.ast, "parse", fail)
    assert build_index("x = p.main_grad\n", "m.py") is None
    result = analyze_source("# p.main_grad\nx = 1\n", "m.py", [RULES["MG003"]()])
    assert result.parsed  # no index: every rule passes, the file is parsed as without the gate


def test_no_gate_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    source = "# p.main_grad\nx = 1\n"
    assert not analyze_source(source, "m.py", [RULES["MG003"]()]).parsed
    monkeypatch.setenv(NO_GATE_ENV, "1")
    assert not syntax_index.gate_enabled()
    assert analyze_source(source, "m.py", [RULES["MG003"]()]).parsed
    assert not analyze_source(source, "m.py", [RULES["MG003"]()], gate=True).parsed  # explicit wins
    monkeypatch.setenv(NO_GATE_ENV, "0")
    assert syntax_index.gate_enabled()


def test_gate_errors_pass_the_rule_when_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = RULES["MG003"]()

    def broken(index: object, settings: object) -> bool:
        raise KeyError("gate bug")

    monkeypatch.setattr(rule, "gate", broken)
    with pytest.raises(KeyError):
        analyze_source("if p.main_grad:\n    pass\n", "m.py", [rule])
    result = analyze_source("if p.main_grad:\n    pass\n", "m.py", [rule], catch_rule_errors=True)
    assert [f.rule for f in result.findings] == ["MG003"]


def test_fix_source_is_gated_per_round() -> None:
    rules = [rule() for rule in all_rules()]
    source = "def f(p):\n    if p.main_grad:\n        pass\n    # not p.main_grad\n"
    fixed = fix_source(source, "m.py", rules)
    assert fixed == fix_source(source, "m.py", rules, gate=False)
    assert "p.main_grad is not None" in fixed


def test_vocabulary_has_one_definition() -> None:
    """The gate and the rules share `maingrad.analyzer.facts` itself (the same objects), no rule module
    re-declares one of its words, and no rule module imports another rule module."""
    for name in ("KERNELS", "VIEW_METHODS", "CAST_METHODS", "CONTAINER_NAMES", "MAIN_GRAD", "OVERWRITE_FLAG"):
        assert getattr(syntax_index, name) is getattr(facts, name), name
    assert {q.rsplit(".", 1)[-1] for q in facts.CONTAINERS} == facts.CONTAINER_NAMES
    assert set(facts.KERNEL_PRECISION) == facts.KERNELS
    words = {
        value
        for name, value in vars(facts).items()
        if name.isupper() and isinstance(value, (str, frozenset, tuple)) and value
    }
    for path in sorted((Path(facts.__file__).parent / "rules").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("maingrad.analyzer.rules.mg"), (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("maingrad.analyzer.rules.mg") for a in node.names), path.name
        for stmt in tree.body:  # module-level constants only
            if isinstance(stmt, ast.Assign):
                try:
                    value = ast.literal_eval(stmt.value)
                except (ValueError, SyntaxError, TypeError):
                    continue
                if isinstance(value, (list, dict, set)):
                    value = frozenset(value) if not isinstance(value, dict) else frozenset(value.items())
                assert value not in words, (path.name, ast.unparse(stmt))


def test_cast_methods_are_what_mg007_takes_for_a_cast() -> None:
    for name in syntax_index.CAST_METHODS:  # `_looks_like_cast` accepts these (and `float` is no cast)
        assert mg007._looks_like_cast(cst.parse_expression(f"g.{name}(x)"))
    assert not mg007._looks_like_cast(cst.parse_expression("g.float(x)"))


# 4. The runner: files_parsed, MG000 and the libcst-free parent -------------------------------------------
def test_runner_counts_gated_files_as_not_parsed_and_reports_unused_ignores(
    project, run, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    project(
        {
            "doc.py": "x = 1  # maingrad: ignore[MG003]\n# p.main_grad\n",
            "real.py": "def f(p):\n    if p.main_grad:  # maingrad: ignore[MG003]\n        pass\n    return p.main_grad\n",
            "bad.py": "if p.main_grad:\n    pass\nx = (\n",
        },
        'select = ["MG003"]\n',
    )
    gated = run("check", "--format", "json", "--warn-unused-ignores", "--no-cache").json()
    monkeypatch.setenv(NO_GATE_ENV, "1")
    plain = run("check", "--format", "json", "--warn-unused-ignores", "--no-cache").json()
    assert gated["findings"] == plain["findings"]
    assert [(f["path"], f["rule"]) for f in gated["findings"]] == [("doc.py", "MG000")]
    assert gated["parse_errors"] == plain["parse_errors"] and [e["path"] for e in gated["parse_errors"]] == [
        "bad.py"
    ]
    assert (gated["files_parsed"], plain["files_parsed"]) == (1, 2)


def test_warm_run_parent_never_imports_libcst(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[tool.maingrad]\n", encoding="utf-8")
    (tmp_path / "a.py").write_text("def f(p):\n    if p.main_grad:\n        pass\n", encoding="utf-8")
    (tmp_path / "b.py").write_text("# p.main_grad\n", encoding="utf-8")
    script = (
        "import sys\nfrom maingrad.cli.main import main\n"
        "code = main(['check', '.', '--quiet', '--no-progress'])\n"
        "print(code, 'libcst' in sys.modules)\n"
    )
    first = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert first.stdout.split()[-2:] == ["1", "True"], first.stderr  # cold: parsed a.py in this process
    warm = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert warm.stdout.split()[-2:] == ["1", "False"], warm.stderr


# 5. Mutations of the INVALID examples: parentheses, split strings, guards, try blocks ---------------------
class _Parenthesize(cst.CSTTransformer):
    """Puts the k-th Name/Attribute/Call in parentheses (libcst's `code_of` then includes them)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.seen = k, 0

    def _wrap(self, node: cst.BaseExpression) -> cst.BaseExpression:
        self.seen += 1
        if self.seen != self.k:
            return node
        return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        return self._wrap(updated)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        return self._wrap(updated)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        return self._wrap(updated)


class _Wrap(cst.CSTTransformer):
    """Wraps the k-th statement of an indented block in `if <test>:`, `if <test>: pass else:` or a try."""

    def __init__(self, k: int, how: str, test: str) -> None:
        super().__init__()
        self.k, self.seen, self.how, self.test = k, 0, how, test

    def leave_IndentedBlock(
        self, original: cst.IndentedBlock, updated: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        body: list[cst.BaseStatement] = []
        for stmt in updated.body:
            self.seen += 1
            if self.seen == self.k:
                block = cst.IndentedBlock([stmt])
                passing = cst.IndentedBlock([cst.SimpleStatementLine([cst.Pass()])])
                if self.how == "if":
                    stmt = cst.If(test=cst.parse_expression(self.test), body=block)
                elif self.how == "else":
                    stmt = cst.If(test=cst.parse_expression(self.test), body=passing, orelse=cst.Else(block))
                else:
                    handler = cst.ExceptHandler(body=passing, type=cst.parse_expression(self.test))
                    stmt = cst.Try(body=block, handlers=[handler])
            body.append(stmt)
        return updated.with_changes(body=body)


def _mutants(code: str) -> list[str]:
    import re

    module = cst.parse_module(code)
    receivers = sorted(set(re.findall(r"([A-Za-z_][\w.]*)\.(?:main_grad|get_main_grad)\b", code)))[:2] or [
        "p"
    ]
    transforms: list[cst.CSTTransformer] = [_Parenthesize(k) for k in range(1, 80)]
    for receiver in receivers:
        for how, test in [
            ("if", f'hasattr({receiver}, "get_main_grad")'),
            ("if", f'hasattr({receiver}, "get_" "main_grad")'),
            ("if", f'not hasattr({receiver}, "__fsdp_param__") and hasattr({receiver}, "get_main_grad")'),
            ("if", f"{receiver}.main_grad.dtype == torch.float16"),
            ("else", f'hasattr({receiver}, "__fsdp_param__")'),
            ("try", "AttributeError"),
            ("try", "KeyError"),
        ]:
            transforms += [_Wrap(k, how, test) for k in range(1, 25)]
    found = {code}
    for transform in transforms:
        try:
            mutated = module.visit(transform).code
            cst.parse_module(mutated)
        except (cst.CSTValidationError, cst.ParserSyntaxError):
            continue
        found.add(mutated)
    return sorted(found)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("rule", "example"),
    [pytest.param(r, e, id=f"{r.id}-invalid-{i}") for r in all_rules() for i, e in enumerate(r.INVALID)],
)
def test_gates_stay_sound_on_mutated_examples(rule: type[Rule], example: Example) -> None:
    """Whenever any rule reports on a mutant (gate off), its gate passes, under a plain and a wrapper path."""
    rules = [r() for r in all_rules()]
    settings = _settings(example.config)
    for source in _mutants(textwrap.dedent(example.code)):
        for path in ("pkg/mod.py", "transformer_engine/pytorch/ops/mod.py"):
            index = build_index(source, path)
            plain = analyze_source(source, path, rules, settings, gate=False)
            if index is None:  # libcst reads more than `ast` (`(p).x: T = v`): no gate, same result
                assert _report(analyze_source(source, path, rules, settings)) == _report(plain)
                continue
            fired = {f.rule for f in plain.findings}
            for checker in rules:
                if checker.id in fired:
                    assert checker.gate(index, settings), (checker.id, path, source)
