"""Acceptance of MG001-MG004 on released code: megatron-core 0.18.2 (the #5209 bug), 0.19.2 (the fix) and
Transformer Engine 2.20.2, plus `fix` on 0.18.2's experts.py, executed against parameter stand-ins.

Expected locations are computed from the sources with libcst's own position metadata, never hard-coded.
"""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import textwrap
import typing
from collections.abc import Callable
from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from maingrad.analyzer.engine import analyze_source, fix_source
from maingrad.analyzer.rules import all_rules
from maingrad.analyzer.rules.mg001_fused_op_without_exposure import METHOD, FusedOpWithoutExposure
from maingrad.analyzer.rules.mg002_fused_wgrad_without_exposure import FusedWgradWithoutExposure
from maingrad.analyzer.rules.mg003_main_grad_truth_test import MainGradTruthTest
from maingrad.analyzer.rules.mg004_unguarded_get_main_grad import UnguardedGetMainGrad
from maingrad.contracts.report import Finding


def _load_testbeds() -> typing.Any:
    """tests/testbeds.py, loaded by path (tests/ is not a package; works under any pytest import mode)."""
    spec = importlib.util.spec_from_file_location(
        "maingrad_testbeds", Path(__file__).parents[1] / "testbeds.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bed_root = _load_testbeds().testbed
pytestmark = [pytest.mark.network, pytest.mark.slow]

OURS = (FusedOpWithoutExposure, FusedWgradWithoutExposure, MainGradTruthTest, UnguardedGetMainGrad)
EXPERTS = "megatron/core/transformer/moe/experts.py"
_SCANS: dict[str, dict[str, list[Finding]]] = {}


def scan(bed: str) -> dict[str, list[Finding]]:
    """Findings of MG001-MG004 per file of a whole test bed (every .py file), computed once per session."""
    if bed not in _SCANS:
        root = bed_root(bed)
        rules = [rule() for rule in OURS]
        results: dict[str, list[Finding]] = {}
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            result = analyze_source(path.read_text(encoding="utf-8"), rel, rules)
            assert result.parse_error is None, result.parse_error
            if result.findings:
                results[rel] = result.findings
        _SCANS[bed] = results
    return _SCANS[bed]


def by_rule(findings: dict[str, list[Finding]], rule: str) -> list[Finding]:
    return [f for fs in findings.values() for f in fs if f.rule == rule]


class _Locator(cst.CSTVisitor):
    """(class, function) of every call, and line ranges of classes, from libcst's PositionProvider."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.calls: list[tuple[tuple[str, ...], str, int]] = []
        self.classes: dict[str, tuple[int, int]] = {}

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        pos = self.get_metadata(PositionProvider, node)
        self.classes[node.name.value] = (pos.start.line, pos.end.line)
        self.stack.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.stack.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.stack.append(node.name.value)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.stack.pop()

    def visit_Call(self, node: cst.Call) -> None:
        callee = cst.Module(body=[]).code_for_node(node.func)
        self.calls.append((tuple(self.stack), callee, self.get_metadata(PositionProvider, node).start.line))


def locate(source: str) -> _Locator:
    locator = _Locator()
    MetadataWrapper(cst.parse_module(source)).visit(locator)
    return locator


def scope_of(source: str, line: int) -> tuple[str, ...]:
    (scope,) = {s for s, _, ln in locate(source).calls if ln == line and s} or {()}
    return scope


# megatron-core 0.18.2 ------------------------------------------------------------------------------------
def test_megatron_0182_grouped_mlp_fused_ops_are_flagged_at_the_op_constructors() -> None:
    source = (bed_root("megatron-core-0.18.2") / EXPERTS).read_text(encoding="utf-8")
    expected = sorted(
        line
        for scope, callee, line in locate(source).calls
        if scope == ("TEGroupedMLP", "_make_fused_ops") and callee == "te.pytorch.ops.GroupedLinear"
    )
    assert len(expected) == 2  # FC1 and FC2
    found = sorted(f.line for f in scan("megatron-core-0.18.2").get(EXPERTS, []) if f.rule == "MG001")
    assert found == expected


def test_megatron_0182_cli_reports_mg001_and_exits_1(run: Callable[..., typing.Any]) -> None:
    path = bed_root("megatron-core-0.18.2") / EXPERTS
    result = run("check", path, "--select", "MG001", "--format", "json", "--no-cache", "--jobs", "1")
    assert result.code == 1
    findings = result.json()["findings"]
    assert {f["rule"] for f in findings} == {"MG001"}
    assert len(findings) == 2


def test_megatron_0182_other_rules_are_quiet() -> None:
    findings = scan("megatron-core-0.18.2")
    assert {f.rule for fs in findings.values() for f in fs} == {"MG001"}


# megatron-core 0.19.2 ------------------------------------------------------------------------------------
# 0.19.2 exposes main_grad in TEGroupedMLP's pre-forward hook (`_ensure_main_grad_for_fused_impl`), so its
# experts.py is clean. Two other 0.19.2 classes build op-fuser GroupedLinear ops with
# accumulate_into_main_grad=self.linear_fcN.fuse_wgrad_accumulation, adopt the wrapper's parameters and only
# replay the submodules' pre-forward hooks, with no exposure: under Megatron-FSDP with gradient
# accumulation fusion their first forward reaches GroupedLinear.fuser_forward (TE's CuTe fused grouped-MLP
# op that skips the check needs NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 and an SM 10.x GPU) and raises
# "MAIN GRAD NOT FOUND", the #5209 bug. They are reported; nothing else may be.
KNOWN_019_MG001 = {
    ("megatron/core/extensions/transformer_engine.py", ("TEFusedMLPWithGroupedLinear", "_make_fused_impl")),
    (
        "megatron/core/transformer/moe/shared_experts.py",
        ("FusedSharedExpertMLP", "_make_fused_grouped_swiglu_ops"),
    ),
}


def test_megatron_0192_te_grouped_mlp_is_clean() -> None:
    assert [f for f in scan("megatron-core-0.19.2").get(EXPERTS, []) if f.rule == "MG001"] == []


def test_megatron_0192_mg001_only_on_the_unexposed_grouped_linear_containers() -> None:
    root = bed_root("megatron-core-0.19.2")
    located: dict[tuple[str, tuple[str, ...]], int] = {}
    for finding in by_rule(scan("megatron-core-0.19.2"), "MG001"):
        source = (root / finding.path).read_text(encoding="utf-8")
        scope = scope_of(source, finding.line)
        located[(finding.path, scope[-2:])] = located.get((finding.path, scope[-2:]), 0) + 1
    assert set(located) == KNOWN_019_MG001
    assert all(count == 2 for count in located.values())  # FC1 and FC2 of each


def test_megatron_0192_has_no_mg002_mg003_mg004() -> None:
    findings = scan("megatron-core-0.19.2")
    assert [f for fs in findings.values() for f in fs if f.rule != "MG001"] == []


# Transformer Engine 2.20.2 -------------------------------------------------------------------------------
def test_transformer_engine_2202_has_no_findings() -> None:
    """TE refreshes main_grad itself (get_main_grad_from_param, main_grad_func) and never builds a
    GroupedLinear op with accumulate_into_main_grad: no MG001-MG004 at all."""
    assert scan("transformer-engine-2.20.2") == {}


# fix on 0.18.2 experts.py ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def experts_0182() -> tuple[str, str]:
    source = (bed_root("megatron-core-0.18.2") / EXPERTS).read_text(encoding="utf-8")
    return source, fix_source(source, EXPERTS, [rule() for rule in all_rules()])


def test_fixed_experts_parses_has_no_mg001_and_changes_only_te_grouped_mlp(
    experts_0182: tuple[str, str],
) -> None:
    source, fixed = experts_0182
    cst.parse_module(fixed)
    assert fixed != source
    after = analyze_source(fixed, EXPERTS, [rule() for rule in all_rules()])
    assert [f for f in after.findings if f.rule == "MG001"] == []
    start, end = locate(source).classes["TEGroupedMLP"]  # 1-based, inclusive
    old, new = source.splitlines(keepends=True), fixed.splitlines(keepends=True)
    changes = [
        op for op in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes() if op[0] != "equal"
    ]
    assert changes
    for tag, i1, i2, _, _ in changes:
        if tag == "insert":
            assert start <= i1 < end, (tag, i1)  # between two lines of the class
        else:
            assert start - 1 <= i1 and i2 <= end, (tag, i1, i2)
    added = "".join(line for _, _, _, j1, j2 in changes for line in new[j1:j2])
    assert f"def {METHOD}(self)" in added and f"self.{METHOD}()" in added
    assert "overwrite_main_grad" not in added  # the fix never forces the flag (MG006)
    # Bytes outside the class are untouched.
    assert "".join(new[: start - 1]) == "".join(old[: start - 1])
    tail = len(old) - end
    assert "".join(new[len(new) - tail :]) == "".join(old[end:])
    assert fix_source(fixed, EXPERTS, [rule() for rule in all_rules()]) == fixed


def _harness(fixed: str) -> type:
    """TEGroupedMLP's fixed hook factory and exposure method, exec'd into a torch.nn.Module subclass."""
    torch = pytest.importorskip("torch")
    module = cst.parse_module(fixed)
    (owner,) = [n for n in module.body if isinstance(n, cst.ClassDef) and n.name.value == "TEGroupedMLP"]
    wanted = ("_make_fused_impl_pre_forward_hook", METHOD)
    methods = {
        s.name.value: s for s in owner.body.body if isinstance(s, cst.FunctionDef) and s.name.value in wanted
    }
    assert set(methods) == set(wanted)
    body = "".join(textwrap.indent(module.code_for_node(methods[name]), "    ") for name in wanted)
    namespace: dict[str, object] = {"torch": torch, "chain": itertools.chain, "Callable": typing.Callable}
    exec(compile(f"class TEGroupedMLP(torch.nn.Module):\n{body}", "<fixed experts.py>", "exec"), namespace)  # noqa: S102
    return typing.cast(type, namespace["TEGroupedMLP"])


class _FsdpParam:
    """Turns a Parameter into a Megatron-FSDP stand-in: `get_main_grad()` returns (allocating once) a buffer."""

    def __init__(self, param: typing.Any, buffer: typing.Any) -> None:
        self.param, self.buffer, self.calls = param, buffer, 0
        param.get_main_grad = self
        param.__fsdp_param__ = True

    def __call__(self) -> typing.Any:
        self.calls += 1
        return self.buffer


def test_fixed_hook_exposes_main_grad_on_parameter_stand_ins(experts_0182: tuple[str, str]) -> None:
    torch = pytest.importorskip("torch")
    cls = _harness(experts_0182[1])

    class Child(torch.nn.Module):
        def __init__(self, fuse: bool) -> None:
            super().__init__()
            self.fuse_wgrad_accumulation = fuse
            for name in ("weight0", "weight1", "weight2", "bias0", "extra"):
                self.register_parameter(name, torch.nn.Parameter(torch.randn(2, 2)))
            self.inner = torch.nn.Linear(2, 2)  # a nested submodule: exposure is recurse=False

    # Built like upstream's unit test for #5209: no __init__ (it needs a full TransformerConfig).
    mlp = cls.__new__(cls)
    torch.nn.Module.__init__(mlp)
    mlp.linear_fc1, mlp.linear_fc2 = Child(fuse=True), Child(fuse=False)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2

    absent = _FsdpParam(fc1.weight0, torch.zeros(2, 2))  # FSDP, main_grad absent (first forward)
    fc1.weight0.overwrite_main_grad = False  # the wrapper's choice: must survive
    none = _FsdpParam(fc1.weight1, torch.zeros(2, 2))  # FSDP, main_grad None (after zero_grad_buffer)
    fc1.weight1.main_grad = None
    already = _FsdpParam(fc1.weight2, torch.zeros(2, 2))  # FSDP, buffer already exposed
    existing = torch.ones(2, 2)
    fc1.weight2.main_grad = existing
    ddp_buffer = torch.full((2, 2), 3.0)
    fc1.bias0.main_grad = ddp_buffer  # DDP-style: main_grad from wrap time, no get_main_grad
    nested = _FsdpParam(fc1.inner.weight, torch.zeros(2, 2))
    not_fused = _FsdpParam(fc2.weight0, torch.zeros(2, 2))  # fc2 does not fuse wgrad accumulation

    replayed: list[tuple[object, object, bool]] = []

    def fsdp_unshard_hook(module: object, args: object) -> None:  # stands in for FSDP's all-gather hook
        replayed.append((module, args, hasattr(fc1.weight0, "main_grad")))

    fc1.register_forward_pre_hook(fsdp_unshard_hook)
    hook = mlp._make_fused_impl_pre_forward_hook()
    container = torch.nn.Identity()
    assert hook(container, None) is None

    assert replayed == [(fc1, None, False)]  # submodule hooks replayed first, before any exposure
    assert fc1.weight0.main_grad is absent.buffer and absent.calls == 1
    assert fc1.weight1.main_grad is none.buffer and none.calls == 1
    assert fc1.weight2.main_grad is existing and already.calls == 0
    assert fc1.bias0.main_grad is ddp_buffer and not hasattr(fc1.bias0, "get_main_grad")
    assert not hasattr(fc1.extra, "main_grad")  # DDP-style without a buffer: left alone
    assert not hasattr(fc1.inner.weight, "main_grad") and nested.calls == 0
    assert not hasattr(fc2.weight0, "main_grad") and not_fused.calls == 0
    assert fc1.weight0.overwrite_main_grad is False
    assert all(not hasattr(p, "overwrite_main_grad") for n, p in fc1.named_parameters() if n != "weight0")

    # Through PyTorch's own hook machinery, on a later step after zero_grad_buffer() reset a buffer.
    container.register_forward_pre_hook(hook)
    fc1.weight0.main_grad = None
    fresh = torch.zeros(2, 2)
    absent.buffer = fresh
    x = torch.randn(3, 2)
    assert container(x) is x
    assert fc1.weight0.main_grad is fresh and absent.calls == 2
    assert fc1.weight1.main_grad is none.buffer and none.calls == 1  # still set: not re-fetched
    assert len(replayed) == 2


def test_testbeds_are_real_wheels() -> None:
    """Guard against an empty cache directory silently making the scans vacuous."""
    counts = {
        bed: len(list(bed_root(bed).rglob("*.py")))
        for bed in ("megatron-core-0.18.2", "megatron-core-0.19.2")
    }
    assert counts["megatron-core-0.19.2"] >= 500 and counts["megatron-core-0.18.2"] >= 400
    assert len(list(Path(bed_root("transformer-engine-2.20.2")).rglob("*.py"))) >= 200


# The rest of the family (MG005, MG009, MG010, MG011) on the released wheels --------------------------------
_ALL: dict[str, dict[str, list[Finding]]] = {}


def scan_all(bed: str, prefix: str) -> dict[str, list[Finding]]:
    """Findings of every rule on the files of a bed under `prefix`, computed once per session."""
    key = f"{bed}:{prefix}"
    if key not in _ALL:
        root = bed_root(bed)
        rules = [rule() for rule in all_rules()]
        results: dict[str, list[Finding]] = {}
        for path in sorted((root / prefix).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            result = analyze_source(path.read_text(encoding="utf-8"), rel, rules)
            if result.findings:
                results[rel] = result.findings
        _ALL[key] = results
    return _ALL[key]


LAYERS = "megatron/core/tensor_parallel/layers.py"


def test_megatron_0192_fsdp_wgrad_writes_that_always_overwrite_are_flagged_at_the_write() -> None:
    source = (bed_root("megatron-core-0.19.2") / LAYERS).read_text(encoding="utf-8")
    scope = ("LinearWithGradAccumulationAndAsyncCommunication", "backward")
    expected = sorted(
        line
        for where, callee, line in locate(source).calls
        if where == scope and callee in ("te_general_gemm", "torch.matmul")
    )
    assert len(expected) == 2  # the Megatron-FSDP branch: TE's GEMM, and torch.matmul without TE
    found = [
        f
        for f in scan_all("megatron-core-0.19.2", "megatron/core/tensor_parallel")[LAYERS]
        if f.rule == "MG009"
    ]
    assert sorted(f.line for f in found) == expected
    for finding in found:
        assert "always overwrites" in finding.message and "overwrite_main_grad" in finding.message
    gemm = next(f for f in found if "te_general_gemm" in f.message)
    # megatron-core's te_general_gemm wrapper takes no `accumulate`: the fix branches on the flag instead
    # (tests/analyzer/test_fixes_run.py runs it against the wrapper's real signature).
    assert gemm.fix_available and "branch on `weight.overwrite_main_grad`" in gemm.message
    rules = [rule() for rule in all_rules() if rule.id == "MG009"]
    fixed = fix_source(source, LAYERS, rules, unsafe=True)
    assert (
        "accumulate="
        not in fixed.split("class LinearWithGradAccumulationAndAsyncCommunication")[1].split("\nclass ")[0]
    )
    assert 'if getattr(weight, "overwrite_main_grad", False):' in fixed
    assert "weight.main_grad.add_(te_general_gemm(" in fixed
    after = [f for f in analyze_source(fixed, LAYERS, rules).findings if f.rule == "MG009"]
    assert [f.message.split("`")[1] for f in after] == ["torch.matmul(...)"]  # it cannot accumulate: no fix


TE_OPS = "transformer_engine/pytorch/ops"
TE_MG010 = {
    f"{TE_OPS}/basic/basic_linear.py": ("BasicLinear", "op_backward"),
    f"{TE_OPS}/fused/backward_linear_add.py": ("BackwardLinearAdd", "fuser_backward"),
    f"{TE_OPS}/fused/backward_linear_scale.py": ("BackwardLinearScale", "fuser_backward"),
    f"{TE_OPS}/fused/userbuffers_backward_linear.py": ("UserbuffersBackwardLinear", "fuser_backward"),
}


def test_transformer_engine_2202_dummy_wgrad_decided_by_the_overwrite_flag() -> None:
    root = bed_root("transformer-engine-2.20.2")
    findings = scan_all("transformer-engine-2.20.2", "transformer_engine/pytorch")
    flagged = {path for path, fs in findings.items() if any(f.rule == "MG010" for f in fs)}
    assert flagged == set(TE_MG010)
    for path, scope in TE_MG010.items():
        source = (root / path).read_text(encoding="utf-8")
        (finding,) = [f for f in findings[path] if f.rule == "MG010"]
        assert scope_of(source, finding.line)[-2:] == scope
        assert "get_dummy_wgrads_for_params" in source.splitlines()[finding.line - 1]
        assert "overwrite_main_grad" in finding.message and "main_grad" in finding.message
    for clean in ("module/linear.py", "module/grouped_linear.py", "ops/basic/grouped_linear.py"):
        rel = f"transformer_engine/pytorch/{clean}"
        assert (root / rel).exists(), rel
        assert [f for f in findings.get(rel, []) if f.rule in ("MG009", "MG010")] == [], rel
    assert not [f for fs in findings.values() for f in fs if f.rule == "MG009"]


BRIDGE_LORA = "megatron/bridge/peft/lora_layers.py"


def test_megatron_bridge_snapshot_is_flagged_and_lora_branch_is_covered() -> None:
    source = (bed_root("megatron-bridge-0.3.1") / BRIDGE_LORA).read_text(encoding="utf-8")
    findings = scan_all("megatron-bridge-0.3.1", "megatron/bridge/peft")
    ours = findings.get(BRIDGE_LORA, [])
    assert [f.rule for f in ours] == ["MG011"]  # no MG005 on lora_branch: main_branch's replay runs first
    (snapshot,) = ours
    assert "_forward_pre_hooks" in source.splitlines()[snapshot.line - 1]
    assert scope_of_line(source, snapshot.line)[-2:] == ("TEFusedLoRALinear", "_make_fused_branches")
    assert "snapshot" in snapshot.message and "at each call" in snapshot.message


def test_megatron_0192_norm_seq_replay_runs_too_late() -> None:
    findings = scan_all("megatron-core-0.19.2", "megatron/core/extensions")
    (norm,) = [f for fs in findings.values() for f in fs if f.rule == "MG005"]
    assert "`norm_seq`" in norm.message and "runs after" in norm.message and "self.linear_fc1" in norm.message


def scope_of_line(source: str, line: int) -> tuple[str, ...]:
    """The class/function names around `line` (for statements that hold no call on that line)."""
    module = MetadataWrapper(cst.parse_module(source))
    positions = module.resolve(PositionProvider)
    stack: list[str] = []
    best: tuple[str, ...] = ()
    for node, pos in positions.items():
        if isinstance(node, (cst.ClassDef, cst.FunctionDef)) and pos.start.line <= line <= pos.end.line:
            stack.append((pos.start.line, node.name.value))  # type: ignore[arg-type]
    best = tuple(name for _, name in sorted(stack))  # type: ignore[misc]
    return best
