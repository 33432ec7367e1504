"""Targeted tests for MG001-MG004 beyond each rule's VALID/INVALID examples: import forms, relative imports
inside TE, reachability of exposure code, fix placement/safety/byte preservation, and guard analysis."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from maingrad.analyzer.context import RuleSettings
from maingrad.analyzer.engine import analyze_source, fix_source
from maingrad.analyzer.rules.base import Rule
from maingrad.analyzer.rules.mg001_fused_op_without_exposure import METHOD, FusedOpWithoutExposure
from maingrad.analyzer.rules.mg002_fused_wgrad_without_exposure import FusedWgradWithoutExposure
from maingrad.analyzer.rules.mg003_main_grad_truth_test import MainGradTruthTest
from maingrad.analyzer.rules.mg004_unguarded_get_main_grad import UnguardedGetMainGrad


def lines(rule: type[Rule], code: str, path: str = "example.py", helpers: tuple[str, ...] = ()) -> list[int]:
    settings = RuleSettings(exposure_helpers=frozenset(helpers))
    result = analyze_source(textwrap.dedent(code), path, [rule()], settings)
    assert result.parse_error is None
    return [f.line for f in result.findings if f.rule == rule.id]


def fixed(rule: type[Rule], code: str, unsafe: bool = False, path: str = "example.py") -> str:
    return fix_source(textwrap.dedent(code), path, [rule()], unsafe=unsafe)


# MG001: import forms ------------------------------------------------------------------------------------
OP_CALL = "GroupedLinear(4, 8, 8, accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation)"


@pytest.mark.parametrize(
    ("imports", "callee"),
    [
        ("import transformer_engine as te", "te.pytorch.ops.GroupedLinear"),
        ("import transformer_engine", "transformer_engine.pytorch.ops.GroupedLinear"),
        ("import transformer_engine.pytorch as tep", "tep.ops.GroupedLinear"),
        ("from transformer_engine.pytorch import ops", "ops.GroupedLinear"),
        ("from transformer_engine.pytorch import ops as te_ops", "te_ops.GroupedLinear"),
        ("from transformer_engine.pytorch.ops import GroupedLinear as GL", "GL"),
        ("from transformer_engine.pytorch.ops import GroupedLinear", "GroupedLinear"),
        ("from transformer_engine.pytorch.ops.basic import GroupedLinear", "GroupedLinear"),
        ("from transformer_engine.pytorch.ops.basic.grouped_linear import GroupedLinear", "GroupedLinear"),
        ("import transformer_engine as te\nte_ops = te.pytorch.ops", "te_ops.GroupedLinear"),
        ("from transformer_engine import pytorch as tp\nlinear_ops = tp.ops", "linear_ops.GroupedLinear"),
        (
            "try:\n    import transformer_engine as te\nexcept ImportError:\n    te = None",
            "te.pytorch.ops.GroupedLinear",
        ),
    ],
)
def test_mg001_resolves_every_import_form(imports: str, callee: str) -> None:
    code = f"{imports}\n\nclass M:\n    def build(self):\n        return {callee}(4, 8, 8, accumulate_into_main_grad=True)\n"
    assert lines(FusedOpWithoutExposure, code) == [
        code.splitlines().index(
            next(line for line in code.splitlines() if "accumulate_into_main_grad" in line)
        )
        + 1
    ]


@pytest.mark.parametrize(
    "code",
    [
        # BasicLinear and Linear refresh main_grad themselves in backward (TE 2.20): not flagged.
        "import transformer_engine as te\nop = te.pytorch.ops.BasicLinear(8, 8, accumulate_into_main_grad=True)\n",
        "import transformer_engine as te\nop = te.pytorch.ops.Linear(8, 8, accumulate_into_main_grad=True)\n",
        # The TE *module* GroupedLinear takes fuse_wgrad_accumulation and handles FSDP itself.
        "import transformer_engine as te\nm = te.pytorch.GroupedLinear(4, 8, 8, fuse_wgrad_accumulation=True)\n",
        # Not TE: an unresolved or unrelated GroupedLinear.
        "op = self.te_ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=True)\n",
        "from mylib.ops import GroupedLinear\nop = GroupedLinear(4, 8, 8, accumulate_into_main_grad=True)\n",
        # Provably false flags.
        "from transformer_engine.pytorch.ops import GroupedLinear\nop = GroupedLinear(4, 8, 8, accumulate_into_main_grad=None)\n",
        "from transformer_engine.pytorch.ops import GroupedLinear\nop = GroupedLinear(4, 8, 8, accumulate_into_main_grad=0)\n",
        "from transformer_engine.pytorch.ops import GroupedLinear\nop = GroupedLinear(4, 8, 8, **{'accumulate_into_main_grad': False})\n",
    ],
)
def test_mg001_not_flagged(code: str) -> None:
    assert lines(FusedOpWithoutExposure, code) == []


def test_mg001_relative_import_inside_transformer_engine_resolves() -> None:
    code = (
        "from ..basic import GroupedLinear\n\nop = GroupedLinear(4, 8, 8, accumulate_into_main_grad=True)\n"
    )
    assert lines(FusedOpWithoutExposure, code, "transformer_engine/pytorch/ops/fused/custom.py") == [3]
    # The same relative import elsewhere is not TE's op.
    assert lines(FusedOpWithoutExposure, code, "mypkg/layers/fused/custom.py") == []


@pytest.mark.parametrize(
    "kwargs_code",
    [
        "kwargs = dict(device='meta', accumulate_into_main_grad=flag)\n        return GroupedLinear(4, 8, 8, **kwargs)",
        "kwargs = {}\n        kwargs['accumulate_into_main_grad'] = flag\n        return GroupedLinear(4, 8, 8, **kwargs)",
        "return GroupedLinear(4, 8, 8, **{'accumulate_into_main_grad': flag})",
    ],
)
def test_mg001_flag_through_kwargs(kwargs_code: str) -> None:
    code = (
        "from transformer_engine.pytorch.ops import GroupedLinear\n\n"
        f"class M:\n    def build(self, flag):\n        {kwargs_code}\n"
    )
    assert len(lines(FusedOpWithoutExposure, code)) == 1


# MG001: exposure reachability ------------------------------------------------------------------------------
BUILD = """\
import transformer_engine as te

{prefix}class Experts({base}):
    def _make_fused_ops(self):
        ops = te.pytorch.ops.Sequential()
        ops.append(te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation))
        ops.register_forward_pre_hook(self._hook)
        return ops

{body}
"""


@pytest.mark.parametrize(
    ("prefix", "base", "body", "flagged"),
    [
        # exposure in the registered hook method itself
        (
            "",
            "object",
            "    def _hook(self, module, args):\n        for p in self.fc1.parameters():\n"
            "            if hasattr(p, 'get_main_grad'):\n                p.main_grad = p.get_main_grad()\n",
            False,
        ),
        # through a module-level function called from the hook
        (
            "def expose(m):\n    for p in m.parameters():\n        p.main_grad = p.get_main_grad()\n\n\n",
            "object",
            "    def _hook(self, module, args):\n        expose(self.fc1)\n",
            False,
        ),
        # module-level exposure function that nothing in the class calls
        (
            "def expose(m):\n    for p in m.parameters():\n        p.main_grad = p.get_main_grad()\n\n\n",
            "object",
            "    def _hook(self, module, args):\n        pass\n",
            True,
        ),
        # exposure inherited from a base class in the same file and called from the hook
        (
            "class Base:\n    def _expose(self):\n        self.fc1.weight.main_grad = self.fc1.weight.get_main_grad()\n\n\n",
            "Base",
            "    def _hook(self, module, args):\n        self._expose()\n",
            False,
        ),
        # configured exposure helper
        ("", "object", "    def _hook(self, module, args):\n        make_main_grads_visible(self)\n", False),
        # a forward() that exposes runs before the fused ops without being referenced in the class
        (
            "",
            "object",
            "    def forward(self, x):\n        w = self.fc1.weight\n        w.main_grad = w.get_main_grad()\n"
            "        return x\n\n    def _hook(self, module, args):\n        pass\n",
            False,
        ),
        # an exposure method that is defined but never called
        (
            "",
            "object",
            "    def _hook(self, module, args):\n        pass\n\n    def _expose(self):\n"
            "        self.fc1.weight.main_grad = self.fc1.weight.get_main_grad()\n",
            True,
        ),
    ],
)
def test_mg001_exposure_must_be_reachable(prefix: str, base: str, body: str, flagged: bool) -> None:
    code = BUILD.format(prefix=prefix, base=base, body=body)
    found = lines(FusedOpWithoutExposure, code, helpers=("make_main_grads_visible",))
    assert bool(found) is flagged


# MG001: fix ------------------------------------------------------------------------------------------------
def test_mg001_fix_leaves_everything_outside_the_class_byte_identical() -> None:
    code = textwrap.dedent(
        """\
        # a header comment   with  odd   spacing
        import transformer_engine as te
        X = [1,2 ,3]   # keep me


        class Experts(torch.nn.Module):
            def _make_fused_ops(self):
                ops = te.pytorch.ops.Sequential()
                ops.append(te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation))
                return ops


        def   after( a,b ):
            return a+b
        """
    )
    out = fix_source(code, "example.py", [FusedOpWithoutExposure()])
    before, _, rest = code.partition("class Experts")
    assert out.startswith(before)
    assert out.endswith(code[code.index("\n\ndef   after") :])
    assert f"ops.register_forward_pre_hook(lambda *_: self.{METHOD}())\n        return ops" in out
    assert "overwrite_main_grad" not in out
    assert fix_source(out, "example.py", [FusedOpWithoutExposure()]) == out
    assert lines(FusedOpWithoutExposure, out) == []


def test_mg001_fix_avoids_a_taken_method_name_and_hooks_with_early_return() -> None:
    code = textwrap.dedent(
        f"""\
        import transformer_engine as te

        class Experts:
            def _make_fused_ops(self):
                ops = te.pytorch.ops.Sequential()
                ops.append(te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation))
                ops.register_forward_pre_hook(self._make_hook())
                return ops

            def _make_hook(self):
                def hook(module, *_):
                    if not self.training:
                        return None
                    replay(self.fc1)

                return hook

            def {METHOD}(self):
                return "something else"
        """
    )
    out = fix_source(code, "example.py", [FusedOpWithoutExposure()])
    # The hook can return early, so appending to it would skip the exposure: a new hook is registered.
    assert f"ops.register_forward_pre_hook(lambda *_: self.{METHOD}_2())" in out
    assert f"def {METHOD}_2(self) -> None:" in out
    assert 'return "something else"' in out
    assert lines(FusedOpWithoutExposure, out) == []


def test_mg001_no_fix_when_children_are_unknown() -> None:
    code = textwrap.dedent(
        """\
        import transformer_engine as te

        class Experts:
            def build(self, flag):
                ops = te.pytorch.ops.Sequential()
                ops.append(te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=flag))
                return ops
        """
    )
    result = analyze_source(code, "example.py", [FusedOpWithoutExposure()])
    assert [f.fix_available for f in result.findings] == [False]
    assert fix_source(code, "example.py", [FusedOpWithoutExposure()]) == code


def test_mg001_fixed_method_exposes_only_fsdp_params_without_a_buffer() -> None:
    """Execute the generated method on parameter stand-ins (a small version of the real-bed test)."""
    torch = pytest.importorskip("torch")
    code = textwrap.dedent(
        """\
        import transformer_engine as te

        class Experts:
            def build(self):
                ops = te.pytorch.ops.Sequential()
                ops.append(te.pytorch.ops.GroupedLinear(1, 2, 2, accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation))
                return ops
        """
    )
    module = cst.parse_module(fix_source(code, "example.py", [FusedOpWithoutExposure()]))
    (cls,) = [s for s in module.body if isinstance(s, cst.ClassDef)]
    (method,) = [s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == METHOD]
    namespace: dict[str, object] = {}
    exec(module.code_for_node(method), namespace)  # noqa: S102 - the code under test
    expose = namespace[METHOD]

    fc1 = torch.nn.Linear(2, 2)
    fc1.fuse_wgrad_accumulation = True
    buffer = torch.zeros(2, 2)
    fc1.weight.get_main_grad = lambda: buffer
    fc1.bias.main_grad = torch.ones(2)  # DDP-style: has main_grad, no get_main_grad
    ddp_bias = fc1.bias.main_grad

    class Host:
        pass

    host = Host()
    host.fc1 = fc1
    expose(host)
    assert fc1.weight.main_grad is buffer
    assert fc1.bias.main_grad is ddp_bias


# MG002 -----------------------------------------------------------------------------------------------------
def test_mg002_exposure_must_be_for_the_same_weight_and_in_the_same_function() -> None:
    code = """\
    def outer(weight, x, dy):
        def inner():
            weight.main_grad = weight.get_main_grad()

        inner_done = inner
        wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
    """
    assert lines(FusedWgradWithoutExposure, code) == [6]


def test_mg002_each_kernel_checked_independently() -> None:
    code = """\
    def backward(w1, w2, x, dy):
        w1.main_grad = w1.get_main_grad()
        wgrad_gemm_accum_fp32(x, dy, w1.main_grad)
        wgrad_gemm_accum_fp32(x, dy, w2.main_grad)
    """
    assert lines(FusedWgradWithoutExposure, code) == [4]


def test_mg002_ddp_only_path_by_early_exit_is_clean() -> None:
    code = """\
    def backward(weight, x, dy):
        if getattr(weight, "get_main_grad", None) is not None:
            raise NotImplementedError("Megatron-FSDP handled elsewhere")
        general_gemm(x, dy, out=weight.main_grad, accumulate=True)
    """
    assert lines(FusedWgradWithoutExposure, code) == []


def test_mg002_fix_is_idempotent_and_keeps_comments() -> None:
    code = """\
    def backward(weight, x, dy):
        # fused accumulate
        wgrad_gemm_accum_fp32(x, dy, weight.main_grad)  # into fp32
    """
    out = fixed(FusedWgradWithoutExposure, code)
    assert out == textwrap.dedent(
        """\
        def backward(weight, x, dy):
            # fused accumulate
            if hasattr(weight, "__fsdp_param__"):
                weight.main_grad = weight.get_main_grad()
            wgrad_gemm_accum_fp32(x, dy, weight.main_grad)  # into fp32
        """
    )
    assert fix_source(out, "example.py", [FusedWgradWithoutExposure()]) == out


# MG003 -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("x = (not p.main_grad)\n", "x = (p.main_grad is None)\n"),
        ("y = -bool(p.main_grad)\n", "y = -(p.main_grad is not None)\n"),
        ("if bool(p.main_grad) and ok:\n    pass\n", "if p.main_grad is not None and ok:\n    pass\n"),
        ("if (p.main_grad):\n    pass\n", "if (p.main_grad) is not None:\n    pass\n"),
        (
            "if not (p.main_grad or q.main_grad):\n    pass\n",
            "if not (p.main_grad is not None or q.main_grad is not None):\n    pass\n",
        ),
    ],
)
def test_mg003_safe_rewrites(code: str, expected: str) -> None:
    assert fixed(MainGradTruthTest, code) == expected


def test_mg003_value_uses_need_unsafe_fixes() -> None:
    code = "grad = p.main_grad or p.grad\n"
    assert fixed(MainGradTruthTest, code) == code  # safe-only: unchanged
    assert (
        fixed(MainGradTruthTest, code, unsafe=True)
        == "grad = p.main_grad if p.main_grad is not None else p.grad\n"
    )


def test_mg003_impure_left_operand_has_no_fix() -> None:
    code = "grad = get_param().main_grad or fallback\n"
    result = analyze_source(code, "example.py", [MainGradTruthTest()])
    assert [(f.line, f.fix_available) for f in result.findings] == [(1, False)]


def test_mg003_shadowed_bool_is_not_the_builtin() -> None:
    code = "from mylib import bool\nx = bool(p.main_grad)\n"
    assert lines(MainGradTruthTest, code) == []


def test_mg003_local_rebound_to_something_else_is_not_tracked() -> None:
    code = """\
    def f(p):
        g = p.main_grad
        g = compute()
        if g:
            pass
    """
    assert lines(MainGradTruthTest, code) == []


# MG004 -----------------------------------------------------------------------------------------------------
def test_mg004_fsdp_only_modules_are_exempt() -> None:
    code = "def _grad_acc(param):\n    param.main_grad = param.get_main_grad()\n"
    assert (
        lines(UnguardedGetMainGrad, code, "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py")
        == []
    )
    assert lines(UnguardedGetMainGrad, code, "megatron/core/transformer/moe/experts.py") == [2]


def test_mg004_unsafe_fix_only_with_unsafe_flag() -> None:
    code = "def f(w):\n    buf = w.get_main_grad()\n    return buf\n"
    assert fixed(UnguardedGetMainGrad, code) == code
    assert 'buf = w.get_main_grad() if hasattr(w, "get_main_grad") else w.main_grad' in fixed(
        UnguardedGetMainGrad, code, unsafe=True
    )


@pytest.mark.parametrize(
    "code",
    [
        "def f(w):\n    a = 1; w.main_grad = w.get_main_grad()\n",  # two statements on one line
        "def f(w, ok):\n    if ok: w.main_grad = w.get_main_grad()\n",  # a one-line suite
        "def f(ws):\n    ws[0].main_grad = ws[0].get_main_grad()\n",  # receiver with a subscript
    ],
)
def test_mg004_reports_without_fix_where_wrapping_is_not_possible(code: str) -> None:
    result = analyze_source(code, "example.py", [UnguardedGetMainGrad()])
    assert [f.fix_available for f in result.findings] == [False]


def test_mg004_guard_on_other_receiver_or_wrong_polarity_does_not_count() -> None:
    code = """\
    def f(p):
        if not hasattr(p, "get_main_grad"):
            p.main_grad = p.get_main_grad()
        while getattr(p, "__fsdp_param__", False):
            p.main_grad = p.get_main_grad()
    """
    assert lines(UnguardedGetMainGrad, code) == [3]
