"""Targeted tests for MG005-MG008 beyond their VALID/INVALID examples: import forms, the precision escapes
each rule documents, fixes on awkward shapes, and the measured findings on the real test beds."""

from __future__ import annotations

import textwrap
from functools import cache
from pathlib import Path

import pytest

from maingrad.analyzer.context import RuleSettings
from maingrad.analyzer.engine import analyze_source, fix_source
from maingrad.analyzer.rules import rules_by_id
from maingrad.contracts.report import Finding
from tests.testbeds import testbed as bed_dir

RULES = ("MG005", "MG006", "MG007", "MG008")


def findings(rule_id: str, code: str, path: str = "model.py") -> list[Finding]:
    result = analyze_source(textwrap.dedent(code), path, [rules_by_id()[rule_id]()], RuleSettings())
    assert result.parse_error is None
    return [f for f in result.findings if f.rule == rule_id]


def fixed(rule_id: str, code: str, path: str = "model.py") -> str:
    return fix_source(textwrap.dedent(code), path, [rules_by_id()[rule_id]()], RuleSettings(), unsafe=True)


# MG005 ------------------------------------------------------------------------------------------------
_MG005_BODY = """\
class M:
    def _make(self):
        seq = {seq}()
        op = {op}(4, 4, device="meta")
        op.weight = self.linear_fc1.weight
        seq.append(op)
        self._fused = (seq,)
"""


@pytest.mark.parametrize(
    ("imports", "seq", "op"),
    [
        ("import transformer_engine as te", "te.pytorch.ops.Sequential", "te.pytorch.ops.BasicLinear"),
        ("import transformer_engine.pytorch as tep", "tep.ops.Sequential", "tep.ops.BasicLinear"),
        ("from transformer_engine.pytorch import ops", "ops.Sequential", "ops.BasicLinear"),
        ("from transformer_engine.pytorch.ops import Sequential as Seq, BasicLinear", "Seq", "BasicLinear"),
        (
            "import transformer_engine as te\nte_ops = te.pytorch.ops",
            "te_ops.Sequential",
            "te_ops.BasicLinear",
        ),
        ("from transformer_engine.pytorch.ops.sequential import Sequential", "Sequential", "Linear"),
    ],
)
def test_mg005_every_import_form(imports: str, seq: str, op: str) -> None:
    code = imports + "\n\n" + _MG005_BODY.format(seq=seq, op=op)
    found = findings("MG005", code)
    assert len(found) == 1
    assert f"seq = {seq}()" in found[0].snippet


def test_mg005_recursive_builder_is_not_its_own_caller() -> None:
    """A builder that returns a container is judged by where its callers keep the result. Its own recursive
    call (whose result it returns, so it reaches the same callers) is not one of them: `run` keeps the
    container in a local that nothing hooks, so the finding stands (counting the recursion as a caller
    that loses the result made the rule abstain)."""
    code = """\
    import transformer_engine.pytorch.ops as teops

    def fuse(linear, depth=0):
        if depth:
            return fuse(linear, depth - 1)
        seq = teops.Sequential()
        op = teops.BasicLinear(4, 4, device="meta")
        op.weight = linear.weight
        seq.append(op)
        return seq

    def run(linear, x):
        fused = fuse(linear, 1)
        return fused(x)
    """
    assert [f.line for f in findings("MG005", code)] == [6]
    # Hooked where the caller keeps it: no finding, recursion or not.
    hooked = code.replace(
        "        return fused(x)\n",
        "        fused.register_forward_pre_hook(replay)\n        return fused(x)\n\n"
        "    def replay(module, args):\n"
        "        for hook in module.linear._forward_pre_hooks.values():\n"
        "            hook(module, args)\n",
    )
    assert findings("MG005", hooked) == []


def test_mg005_other_sequentials_are_not_op_fusers() -> None:
    for imports, seq in [
        ("import torch", "torch.nn.Sequential"),
        ("from torch.nn import Sequential", "Sequential"),
        ("from mylib import Sequential", "Sequential"),
    ]:
        assert findings("MG005", imports + "\n\n" + _MG005_BODY.format(seq=seq, op="Op")) == []


def test_mg005_each_container_is_judged_by_its_own_ops() -> None:
    # `op` is rebound: the first container holds an op with its own weights, the second the adopting one,
    # and only the second replays. Value tracking must not blame the first container.
    code = """\
    import transformer_engine as te

    class M:
        def _make(self):
            plain = te.pytorch.ops.Sequential()
            op = te.pytorch.ops.BasicLinear(4, 4)
            plain.append(op)
            fused = te.pytorch.ops.Sequential()
            op = te.pytorch.ops.RMSNorm(4, device="meta")
            op.weight = self.norm.weight
            fused.append(op)
            fused.register_forward_pre_hook(self._replay)
            self._fused = (plain, fused)

        def _replay(self, module, *_):
            for hook in self.norm._forward_pre_hooks.values():
                hook(self.norm, ())
    """
    assert findings("MG005", code) == []
    # Without the replay, the adopting container (and only it) is reported.
    found = findings("MG005", code.replace("fused.register_forward_pre_hook(self._replay)", "pass"))
    assert [f.snippet.strip() for f in found] == ["fused = te.pytorch.ops.Sequential()"]


def test_mg005_adoption_after_append_and_through_helpers() -> None:
    code = """\
    import transformer_engine as te

    def adopt(target, source):
        setattr(target, "weight0", getattr(source, "weight0"))

    class M:
        def _make(self):
            seq = te.pytorch.ops.Sequential()
            op = te.pytorch.ops.GroupedLinear(1, 4, 4, device="meta")
            seq.append(op)
            adopt(op, self.linear_fc1)
            (stored,) = (seq,)
            self._fused = (seq,)
    """
    assert len(findings("MG005", code)) == 1


@pytest.mark.parametrize(
    "registration",
    [
        # a lambda that replays
        "seq.register_forward_pre_hook(lambda m, a: [h(self.fc, a) for h in self.fc._forward_pre_hooks.values()])",
        # functools.partial of a replaying method
        "seq.register_forward_pre_hook(functools.partial(self._replay, self.fc))",
        # registered later, in forward, through a tuple-unpacking alias of the stored attribute
        None,
    ],
)
def test_mg005_replay_forms(registration: str | None) -> None:
    code = """\
    import functools
    import transformer_engine as te

    class M:
        def _make(self):
            seq = te.pytorch.ops.Sequential()
            op = te.pytorch.ops.BasicLinear(4, 4, device="meta")
            op.weight = self.fc.weight
            seq.append(op)
            REGISTRATION
            self._fused = (seq,)

        def _replay(self, source, module, *_):
            for hook in source._forward_pre_hooks.values():
                hook(source, ())

        def forward(self, x):
            if self._fused is None:
                self._make()
                (ops,) = self._fused
                LATER
            return self._fused[0](x)
    """
    code = textwrap.dedent(code)
    if registration is None:
        code = code.replace("REGISTRATION", "pass").replace(
            "LATER", "ops.register_forward_pre_hook(functools.partial(self._replay, self.fc))"
        )
    else:
        code = code.replace("REGISTRATION", registration).replace("LATER", "pass")
    assert findings("MG005", code) == []
    # And the same class whose hook replays nothing is flagged.
    silent = code.replace(
        "for hook in source._forward_pre_hooks.values():\n            hook(source, ())", "print(source)"
    )
    silent = silent.replace("[h(self.fc, a) for h in self.fc._forward_pre_hooks.values()]", "None")
    assert silent.count("_forward_pre_hooks") == 0
    assert len(findings("MG005", silent)) == 1


def test_mg005_operation_fuser_needs_a_manual_replay() -> None:
    code = """\
    from transformer_engine.pytorch.ops.fuser import OperationFuser
    import transformer_engine as te

    class M:
        def forward(self, x):
            op = te.pytorch.ops.BasicLinear(4, 4, device="meta")
            op.weight = self.fc.weight
            fuser = OperationFuser([op])
            return fuser(x)
    """
    code = textwrap.dedent(code)
    assert len(findings("MG005", code)) == 1
    replayed = code.replace(
        "fuser = OperationFuser([op])",
        "for hook in self.fc._forward_pre_hooks.values():\n            hook(self.fc, ())\n"
        "        fuser = OperationFuser([op])",
    )
    assert findings("MG005", replayed) == []


def test_mg005_global_module_hooks_make_the_rule_abstain() -> None:
    code = "from torch.nn.modules.module import register_module_forward_pre_hook\n\n" + _MG005_BODY.format(
        seq="te.pytorch.ops.Sequential", op="te.pytorch.ops.BasicLinear"
    )
    assert findings("MG005", "import transformer_engine as te\n" + code) == []


# MG006 ------------------------------------------------------------------------------------------------
_FORCED = """\
def hook(params):
    for p in params:
        p.overwrite_main_grad = True
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("megatron/core/transformer/moe/experts.py", 1),
        ("megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py", 0),
        ("megatron/core/distributed/distributed_data_parallel.py", 0),
        ("megatron_fsdp/param_and_grad_buffer.py", 0),
        ("src/my_ddp_wrapper.py", 0),
        ("tests/unit_tests/test_fsdp_fused.py", 0),
        ("pkg/test_layers.py", 0),
        ("pkg/layers_test.py", 0),
    ],
)
def test_mg006_wrapper_and_test_paths(path: str, expected: int) -> None:
    assert len(findings("MG006", _FORCED, path)) == expected


def test_mg006_constants_and_strategy() -> None:
    assert len(findings("MG006", "def f(p):\n    p.overwrite_main_grad = 1\n")) == 1
    assert findings("MG006", "def f(p):\n    p.overwrite_main_grad = 0\n") == []
    assert findings("MG006", "def f(p, flag):\n    p.overwrite_main_grad = flag\n") == []
    # A strategy test after the assignment does not make it strategy-aware.
    late = "def f(p, s):\n    p.overwrite_main_grad = True\n    if s.sharding_strategy == 'optim':\n        pass\n"
    assert len(findings("MG006", late)) == 1
    ternary = "def f(p, s):\n    p.overwrite_main_grad = True if s.strategy != 'optim' else False\n"
    assert findings("MG006", ternary) == []
    # Inside a wrapper class, by name, anywhere.
    wrapper = "class FullyShardedDataParallel:\n    def f(self, p):\n        p.overwrite_main_grad = True\n"
    assert findings("MG006", wrapper) == []


def test_mg006_has_no_fix_and_fix_keeps_the_finding() -> None:
    """Deleting the assignment would break upstream's own test that pins it: the finding stays after
    `fix`, never silently cleaned."""
    code = textwrap.dedent(_FORCED)
    rule = rules_by_id()["MG006"]()
    assert not rule.fixable
    assert fix_source(code, "m.py", [rule], RuleSettings(), unsafe=True) == code
    assert findings("MG006", code) and not any(
        f.fix_available for f in analyze_source(code, "m.py", [rule]).findings
    )
    chained = "def f(a, b):\n    a.overwrite_main_grad = b.other = True\n"
    assert len(findings("MG006", chained)) == 1


# MG007 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("imports", "dtype"),
    [
        ("import torch", "torch.bfloat16"),
        ("import torch as T", "T.float16"),
        ("from torch import bfloat16", "bfloat16"),
        ("", '"float32"'),
        ("", "ctx.activation_dtype"),
        ("", "x.dtype"),
        ("", "self.params_dtype"),
    ],
)
def test_mg007_out_dtype_sources(imports: str, dtype: str) -> None:
    code = f"{imports}\n\ndef wgrad(ctx, self, w, x, dy):\n    general_gemm(x, dy, out=w.main_grad, out_dtype={dtype})\n"
    found = findings("MG007", code)
    assert len(found) == 1
    assert fixed("MG007", code).endswith("out=w.main_grad, out_dtype=w.main_grad.dtype)\n")


def test_mg007_unknown_or_buffer_dtypes_are_accepted() -> None:
    for dtype in (
        "dtype",
        "w.main_grad.dtype",
        "mg_dtype",
        "main_grad_dtype",
        "(w.main_grad.dtype if c else None)",
    ):
        code = (
            "def wgrad(w, x, dy, dtype, c):\n"
            "    mg_dtype = w.main_grad.dtype\n"
            f"    general_gemm(x, dy, out=w.main_grad, out_dtype={dtype})\n"
        )
        assert findings("MG007", code) == [], dtype


def test_mg007_matmul_import_forms_and_fix_needs_a_statement() -> None:
    code = "from torch import mm\n\ndef f(w, x, dy):\n    mm(dy.t(), x, out=w.main_grad)\n"
    assert len(findings("MG007", code)) == 1
    assert fixed("MG007", code).endswith("    w.main_grad.copy_(mm(dy.t(), x))\n")
    used = (
        "import torch\n\ndef f(w, x, dy):\n    r = torch.matmul(dy.t(), x, out=w.main_grad)\n    return r\n"
    )
    assert len(findings("MG007", used)) == 1
    assert fixed("MG007", used) == used  # the result is used: no rewrite
    cast = "import torch\n\ndef f(w, x, dy):\n    torch.mm(dy.t().to(w.main_grad.dtype), x.to(w.main_grad.dtype), out=w.main_grad)\n"
    assert findings("MG007", cast) == []


def test_mg007_kernel_dispatch_fix_needs_torch() -> None:
    code = (
        "import torch as T\nimport fused_weight_gradient_mlp_cuda as k\n\ndef f(w, x, dy):\n"
        "    k.wgrad_gemm_accum_fp16(x, dy, w.main_grad)\n\ndef g(w):\n    return w.main_grad.dtype\n"
    )
    assert len(findings("MG007", code)) == 1
    assert fixed("MG007", code) == code  # `torch` is not bound under that name: no rewrite
    guarded = code.replace(
        "    k.wgrad", "    if ctx.config.accumulate_allreduce_grads_in_fp32:\n        k.wgrad"
    )
    assert findings("MG007", guarded) == []


def test_mg007_casts() -> None:
    base = "import torch\n\ndef f(w, g):\n    {stmt}\n"
    flagged = [
        "w.main_grad.add_(g.half())",
        "w.main_grad.copy_(g.type(torch.float16))",
        "w.main_grad.add_(g.to(g.dtype))",
    ]
    for stmt in flagged:
        assert len(findings("MG007", base.format(stmt=stmt))) == 1, stmt
    fine = [
        "w.main_grad.add_(g.float())",
        "w.main_grad.add_(g.to(torch.float32))",
        "w.main_grad.add_(g.to(w.main_grad.dtype))",
        "w.main_grad.add_(g.to(device))",
        "w.grad.add_(g.half())",
        "w.main_grad.copy_(w.grad.to(w.dtype))",
    ]
    for stmt in fine:
        assert findings("MG007", base.format(stmt=stmt)) == [], stmt


def test_mg007_claims_hold_in_torch() -> None:
    """What MG007 says about `out=` and about its fix, checked against torch itself (CPU, no GPU needed):
    a bf16 product into an fp32 buffer through `out=` raises; `copy_`/`add_` cast to the buffer."""
    torch = pytest.importorskip("torch")
    x = torch.randn(8, 4, dtype=torch.bfloat16)
    dy = torch.randn(8, 3, dtype=torch.bfloat16)
    main_grad = torch.zeros(3, 4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.matmul(dy.t(), x, out=main_grad)
    main_grad.copy_(torch.matmul(dy.t(), x))
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad, (dy.t() @ x).float())
    # The downcast MG007 flags loses precision an fp32 accumulator keeps.
    grad = torch.full((3, 4), 1.0 + 2**-12, dtype=torch.float32)
    kept = torch.zeros(3, 4, dtype=torch.float32).add_(grad)
    rounded = torch.zeros(3, 4, dtype=torch.float32).add_(grad.to(torch.bfloat16))
    assert torch.all(kept != rounded)


# MG008 ------------------------------------------------------------------------------------------------
def test_mg008_setattr_and_reads_count_as_handling_the_flag() -> None:
    write = "def backward(ctx, dy):\n    ctx.w.main_grad.add_(dy)\n"
    assert len(findings("MG008", write)) == 1
    assert findings("MG008", write + '    setattr(ctx.w, "grad_added_to_main_grad", True)\n') == []
    assert findings("MG008", write + "    return None if ctx.w.grad_added_to_main_grad else dy\n") == []
    assert findings("MG008", write + "    mark_grad_added(ctx.w)\n") == []


def test_mg008_one_finding_per_weight_and_backward() -> None:
    code = """\
    def backward(ctx, dy):
        ctx.w.main_grad.add_(dy)
        ctx.w.main_grad.add_(dy)
        ctx.v.main_grad += dy
        return None
    """
    found = findings("MG008", code)
    assert [f.line for f in found] == [2, 4]
    out = fixed("MG008", code)
    assert out.count("grad_added_to_main_grad = True") == 2
    assert findings("MG008", out) == []


def test_mg008_scope() -> None:
    # Zeroing is not a write of a gradient; the wrapper path is the hook's home.
    assert findings("MG008", "def backward(ctx):\n    ctx.w.main_grad.zero_()\n") == []
    code = "def _post_backward(param):\n    param.main_grad.add_(param.wgrad)\n"
    assert len(findings("MG008", code)) == 1
    assert findings("MG008", code, "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py") == []


# Real test beds ---------------------------------------------------------------------------------------
@cache
def scan(bed: str) -> dict[str, list[Finding]]:
    root = bed_dir(bed)
    rules = [rules_by_id()[r]() for r in RULES]
    found: dict[str, list[Finding]] = {r: [] for r in RULES}
    for path in sorted(root.rglob("*.py")):
        result = analyze_source(path.read_text(encoding="utf-8"), path.relative_to(root).as_posix(), rules)
        assert result.parse_error is None, result.parse_error
        for finding in result.findings:
            found[finding.rule].append(finding)
    return found


def _where(found: list[Finding]) -> list[str]:
    return [f"{f.path}:{f.snippet.strip()}" for f in found]


def test_real_megatron_core_0_19_2() -> None:
    found = scan("megatron-core-0.19.2")
    # MG005: TEGroupedMLP and the shared experts replay their hooks; TEFusedMLPWithGroupedLinear's
    # separate norm container runs linear_fc1.layer_norm_weight before the fused container's replay.
    assert _where(found["MG005"]) == [
        "megatron/core/extensions/transformer_engine.py:norm_seq = te.pytorch.ops.Sequential()"
    ]
    # MG006: the forced overwrite that 0.19 added to TEGroupedMLP._ensure_main_grad.
    assert _where(found["MG006"]) == [
        "megatron/core/transformer/moe/experts.py:param.overwrite_main_grad = True"
    ]
    # MG007: the no-TE fallback of the Megatron-FSDP wgrad path (raises for bf16 inputs).
    assert _where(found["MG007"]) == [
        "megatron/core/tensor_parallel/layers.py:torch.matmul(grad_output.t(), total_input, out=weight.main_grad)"
    ]
    assert found["MG008"] == []


def test_real_megatron_core_0_18_2() -> None:
    found = scan("megatron-core-0.18.2")
    assert _where(found["MG005"]) == [
        "megatron/core/extensions/transformer_engine.py:norm_seq = te.pytorch.ops.Sequential()"
    ]
    assert found["MG006"] == []  # only Megatron-FSDP itself sets the flag in 0.18.2
    assert _where(found["MG007"]) == [
        "megatron/core/tensor_parallel/layers.py:torch.matmul(grad_output.t(), total_input, out=weight.main_grad)"
    ]
    assert found["MG008"] == []


def test_real_transformer_engine_2_20_2() -> None:
    found = scan("transformer-engine-2.20.2")
    assert {rule: len(items) for rule, items in found.items()} == dict.fromkeys(RULES, 0)


def test_real_mg006_on_0_19_2_is_reported_and_left_to_the_user_by_fix() -> None:
    root = bed_dir("megatron-core-0.19.2")
    rel = "megatron/core/transformer/moe/experts.py"
    source = (root / rel).read_text(encoding="utf-8")
    rule = rules_by_id()["MG006"]()
    assert fix_source(source, rel, [rule], RuleSettings(), unsafe=True) == source
    (finding,) = analyze_source(source, rel, [rule]).findings
    assert source.splitlines()[finding.line - 1].strip() == "param.overwrite_main_grad = True"
    assert not finding.fix_available


def test_real_mg007_fix_on_0_19_2_copies_instead_of_out() -> None:
    root = bed_dir("megatron-core-0.19.2")
    rel = "megatron/core/tensor_parallel/layers.py"
    source = (root / rel).read_text(encoding="utf-8")
    out = fix_source(source, rel, [rules_by_id()["MG007"]()], RuleSettings(), unsafe=True)
    assert "weight.main_grad.copy_(torch.matmul(grad_output.t(), total_input))" in out
    assert len(out.splitlines()) == len(source.splitlines())
    assert analyze_source(out, rel, [rules_by_id()["MG007"]()]).findings == []


def test_testbed_paths_exist() -> None:
    # Guard against silently scanning an empty directory.
    for bed in ("megatron-core-0.18.2", "megatron-core-0.19.2", "transformer-engine-2.20.2"):
        assert len(list(Path(bed_dir(bed)).rglob("*.py"))) > 200
