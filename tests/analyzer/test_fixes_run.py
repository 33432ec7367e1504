"""Autofixes proven by running the fixed code, on CPU, against stand-ins of the real callees.

A stand-in has the signature read at test time from the released package's own source (the downloaded
megatron-core / Transformer Engine wheels, see tests/testbeds.py), so a fix that passes a keyword the real
function does not take fails here with the same TypeError it would raise at the first backward. Its body
does what the real GEMM does, on CPU: D = B^T A for layout "NT", written into `out` (added to it with
`accumulate=True`), cast to `out_dtype`.

Each test runs the fixed code over two micro-batches and checks the buffer against autograd's own sum (flag
`False`: accumulate) and against the last micro-batch (flag `True`: overwrite), and runs the unfixed code the
same way to show the assertion fails on the bug. After the fix, `check` must still report what the fix could
not repair.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path

import libcst as cst
import pytest

from maingrad.analyzer.engine import analyze_source, fix_source
from maingrad.analyzer.rules.mg009_write_ignores_overwrite_flag import WriteIgnoresOverwriteFlag

torch = pytest.importorskip("torch")


def _load_testbeds() -> typing.Any:
    spec = importlib.util.spec_from_file_location(
        "maingrad_testbeds", Path(__file__).parents[1] / "testbeds.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("maingrad_testbeds", module)
    spec.loader.exec_module(module)
    return module


bed_root = _load_testbeds().testbed
MCORE = "megatron-core-0.19.2"
TE = "transformer-engine-2.20.2"
_NO_DEFAULT = inspect.Parameter.empty


def real_signature(bed: str, relpath: str, name: str) -> inspect.Signature:
    """The signature of function `name` (the first def of that name, nested ones included) in a test bed's
    source; defaults that are not literals become None (only the names and kinds matter for binding)."""
    tree = ast.parse((bed_root(bed) / relpath).read_text(encoding="utf-8"))
    func = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    args = func.args
    params: list[inspect.Parameter] = []
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)

    def default(node: ast.expr | None) -> object:
        if node is None:
            return _NO_DEFAULT
        try:
            return ast.literal_eval(node)
        except ValueError:
            return None

    for index, arg in enumerate(positional):
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if index < len(args.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        params.append(inspect.Parameter(arg.arg, kind, default=default(defaults[index])))
    if args.vararg is not None:
        params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, default=default(kw_default)))
    if args.kwarg is not None:
        params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def stand_in(signature: inspect.Signature, body: Callable[..., object]) -> Callable[..., object]:
    """A function that binds its arguments exactly as one with `signature` would (TypeError otherwise),
    then runs `body` on the bound arguments, defaults applied."""

    def call(*args: object, **kwargs: object) -> object:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(**bound.arguments)

    call.__signature__ = signature  # type: ignore[attr-defined]
    return call


def _gemm(A, B, out_dtype=None, layout="TN", out=None, accumulate=False, **_: object):  # noqa: N803
    """TE's general_gemm on CPU for the layouts the wgrad paths use (D = B^T A for "NT")."""
    assert layout == "NT", layout
    result = (B.t().float() @ A.float()).to(out_dtype or A.dtype)
    if out is None:
        return [result, None, None, None]
    if accumulate:
        out.add_(result.to(out.dtype))
    else:
        out.copy_(result)
    return [out, None, None, None]


def _wrapper_gemm(A, B, out_dtype=None, layout="TN", out=None, bias=None, grad=False):  # noqa: N803
    """megatron-core's te_general_gemm: TE's general_gemm with accumulate=False, always."""
    return _gemm(A, B, out_dtype=out_dtype, layout=layout, out=out, accumulate=False)


def mcore_te_general_gemm() -> Callable[..., object]:
    signature = real_signature(MCORE, "megatron/core/extensions/transformer_engine.py", "te_general_gemm")
    assert "accumulate" not in signature.parameters  # the wrapper the issue is about
    return stand_in(signature, _wrapper_gemm)


def te_general_gemm() -> Callable[..., object]:
    signature = real_signature(TE, "transformer_engine/pytorch/cpp_extensions/gemm.py", "general_gemm")
    assert "accumulate" in signature.parameters
    return stand_in(signature, _gemm)


# ---------------------------------------------------------------------------------------------------------
# MG009 on the real megatron-core 0.19.2 layers.py


def _fsdp_branch(source: str) -> cst.If:
    """The `if hasattr(weight, "__fsdp_param__"):` statement of the wgrad in
    LinearWithGradAccumulationAndAsyncCommunication.backward."""
    module = cst.parse_module(source)
    found: list[cst.If] = []

    class Finder(cst.CSTVisitor):
        def __init__(self) -> None:
            self.classes: list[str] = []

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            self.classes.append(node.name.value)

        def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
            self.classes.pop()

        def visit_If(self, node: cst.If) -> None:
            test = module.code_for_node(node.test)
            if (
                self.classes[-1:] == ["LinearWithGradAccumulationAndAsyncCommunication"]
                and "__fsdp_param__" in test
            ):
                found.append(node)

    module.visit(Finder())
    assert len(found) == 1
    return found[0]


def _micro_batches(
    branch_code: str, gemm: Callable[..., object], overwrite: bool | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the FSDP branch for two micro-batches on one Megatron-FSDP-like parameter: its main_grad and
    each micro-batch's true weight gradient."""
    fake = types.ModuleType("megatron.core.extensions.transformer_engine")
    fake.te_general_gemm = gemm  # type: ignore[attr-defined]
    names = ["megatron", "megatron.core", "megatron.core.extensions"]
    saved = {name: sys.modules.get(name) for name in [*names, fake.__name__]}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[fake.__name__] = fake
    try:
        namespace: dict[str, object] = {"torch": torch}
        body = textwrap.indent(branch_code, "    ")
        exec(compile(f"def wgrad(weight, total_input, grad_output):\n{body}", "<fixed>", "exec"), namespace)
        wgrad = typing.cast(Callable[..., None], namespace["wgrad"])
        generator = torch.Generator().manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(4, 3, generator=generator, dtype=torch.bfloat16))
        buffer = torch.zeros(4, 3, dtype=torch.float32)  # a persistent (unsharded) fp32 grad buffer
        weight.__fsdp_param__ = True  # type: ignore[attr-defined]
        weight.get_main_grad = lambda: buffer  # type: ignore[attr-defined]
        if overwrite is not None:
            weight.overwrite_main_grad = overwrite  # type: ignore[attr-defined]
        grads = []
        for _ in range(2):
            x = torch.randn(5, 3, generator=generator, dtype=torch.bfloat16)
            dy = torch.randn(5, 4, generator=generator, dtype=torch.bfloat16)
            wgrad(weight, x, dy)
            grads.append(dy.t().float() @ x.float())
        return buffer, grads[0], grads[1]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


@pytest.fixture(scope="module")
def layers_source() -> str:
    return (bed_root(MCORE) / "megatron/core/tensor_parallel/layers.py").read_text(encoding="utf-8")


def test_mg009_fix_of_real_layers_py_runs_against_the_real_wrapper_signature(layers_source: str) -> None:
    rule = WriteIgnoresOverwriteFlag()
    fixed = fix_source(layers_source, "megatron/core/tensor_parallel/layers.py", [rule], unsafe=True)
    assert fixed != layers_source
    branch = cst.Module(body=[_fsdp_branch(fixed)]).code
    gemm = mcore_te_general_gemm()
    # Flag False (DDP-like persistent buffer): the two micro-batches add up.
    buffer, first, second = _micro_batches(branch, gemm, overwrite=False)
    torch.testing.assert_close(buffer, first + second, rtol=1e-5, atol=1e-5)
    # Flag absent: the same (TE's reading: getattr(w, "overwrite_main_grad", False)).
    buffer, first, second = _micro_batches(branch, gemm, overwrite=None)
    torch.testing.assert_close(buffer, first + second, rtol=1e-5, atol=1e-5)
    # Flag True (Megatron-FSDP hands out a buffer to replace): the last micro-batch only.
    buffer, first, second = _micro_batches(branch, gemm, overwrite=True)
    torch.testing.assert_close(buffer, second, rtol=1e-5, atol=1e-5)


def test_mg009_the_unfixed_branch_fails_the_same_assertion(layers_source: str) -> None:
    branch = cst.Module(body=[_fsdp_branch(layers_source)]).code
    buffer, first, second = _micro_batches(branch, mcore_te_general_gemm(), overwrite=False)
    torch.testing.assert_close(buffer, second, rtol=1e-5, atol=1e-5)  # the bug: micro-batch 0 is lost
    with pytest.raises(AssertionError):
        torch.testing.assert_close(buffer, first + second, rtol=1e-5, atol=1e-5)


def test_mg009_an_accumulate_keyword_on_the_wrapper_raises_type_error(layers_source: str) -> None:
    """What the earlier fix wrote: `te_general_gemm(..., accumulate=...)`. The stand-in with the real
    signature rejects it, as the real wrapper does at the first backward."""
    branch = cst.Module(body=[_fsdp_branch(layers_source)]).code
    naive = branch.replace(
        "grad=True,", 'grad=True, accumulate=not getattr(weight, "overwrite_main_grad", False),'
    )
    assert naive != branch
    with pytest.raises(TypeError, match="accumulate"):
        _micro_batches(naive, mcore_te_general_gemm(), overwrite=False)


def test_mg009_after_the_fix_check_still_reports_the_matmul_it_cannot_fix(layers_source: str) -> None:
    rule = WriteIgnoresOverwriteFlag()
    path = "megatron/core/tensor_parallel/layers.py"
    before = [f for f in analyze_source(layers_source, path, [rule]).findings]
    fixed = fix_source(layers_source, path, [rule], unsafe=True)
    after = analyze_source(fixed, path, [rule]).findings
    assert len(before) == 2  # te_general_gemm(out=...) and torch.matmul(out=...)
    assert len(after) == 1
    assert "matmul" in after[0].message and not after[0].fix_available
    assert fixed.splitlines()[after[0].line - 1].strip().startswith("torch.matmul(")
    assert fix_source(fixed, path, [rule], unsafe=True) == fixed  # nothing more to do


# ---------------------------------------------------------------------------------------------------------
# MG009 with TE's own general_gemm (it takes `accumulate`): the keyword fix

_TE_BACKWARD = """\
def backward(ctx, grad_output):
    weight = ctx.weight
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        general_gemm(ctx.x, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", out=weight.main_grad, accumulate=True)
"""


@pytest.mark.parametrize("code", [_TE_BACKWARD, _TE_BACKWARD.replace(", accumulate=True)", ")")])
def test_mg009_keyword_fix_runs_against_te_general_gemm(code: str) -> None:
    rule = WriteIgnoresOverwriteFlag()
    fixed = fix_source(code, "layers.py", [rule], unsafe=True)
    assert "accumulate=not getattr(weight" in fixed
    assert analyze_source(fixed, "layers.py", [rule]).findings == []

    def run(source: str, overwrite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        namespace: dict[str, object] = {"general_gemm": te_general_gemm()}
        exec(compile(source, "<fixed>", "exec"), namespace)
        backward = typing.cast(Callable[..., None], namespace["backward"])
        generator = torch.Generator().manual_seed(1)
        weight = torch.nn.Parameter(torch.randn(4, 3, generator=generator, dtype=torch.bfloat16))
        buffer = torch.zeros(4, 3)
        weight.__fsdp_param__ = True  # type: ignore[attr-defined]
        weight.get_main_grad = lambda: buffer  # type: ignore[attr-defined]
        weight.overwrite_main_grad = overwrite  # type: ignore[attr-defined]
        grads = []
        for _ in range(2):
            ctx = types.SimpleNamespace(
                weight=weight, x=torch.randn(5, 3, generator=generator, dtype=torch.bfloat16)
            )
            dy = torch.randn(5, 4, generator=generator, dtype=torch.bfloat16)
            backward(ctx, dy)
            grads.append(dy.t().float() @ ctx.x.float())
        return buffer, grads[0], grads[1]

    buffer, first, second = run(fixed, overwrite=False)
    torch.testing.assert_close(buffer, first + second)
    buffer, first, second = run(fixed, overwrite=True)
    torch.testing.assert_close(buffer, second)
    # The unfixed code is wrong in one of the two cases (always accumulates, or always overwrites).
    wrong = 0
    for overwrite in (False, True):
        buffer, first, second = run(code, overwrite)
        expected = second if overwrite else first + second
        wrong += not torch.allclose(buffer, expected)
    assert wrong == 1


def test_only_rules_declaring_fixable_yield_fixes() -> None:
    """`maingrad rules` lists a rule as fixable exactly when it may carry a fix."""
    from maingrad.analyzer.rules import all_rules

    for rule_class in all_rules():
        if rule_class.fixable:
            continue
        for example in rule_class.INVALID:
            result = analyze_source(textwrap.dedent(example.code), "example.py", [rule_class()])
            assert result.findings, (rule_class.id, example.code)
            assert not any(f.fix_available for f in result.findings), rule_class.id


# ---------------------------------------------------------------------------------------------------------
# MG010 on the real TE 2.20.2 BasicLinear.op_backward (the fix modelled on TE #2923)

_BASIC_LINEAR = "transformer_engine/pytorch/ops/basic/basic_linear.py"
_COMMON = "transformer_engine/pytorch/ops/_common.py"


def _method_source(source: str, class_name: str, method: str) -> str:
    tree = ast.parse(source)
    owner = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    func = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return textwrap.dedent(ast.get_source_segment(source, func) or "")


def _run_op_backward(method_code: str, overwrite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run `op_backward` once on a weight whose main_grad holds an earlier micro-batch's gradient, then do
    what Megatron's grad hook does with the returned gradient (add it into main_grad unless the op set
    `grad_added_to_main_grad`). Returns (main_grad, earlier gradient, this micro-batch's gradient)."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(4, 3, generator=generator, dtype=torch.bfloat16))
    earlier = torch.randn(4, 3, generator=generator)
    weight.main_grad = earlier.clone()  # type: ignore[attr-defined]
    weight.overwrite_main_grad = overwrite  # type: ignore[attr-defined]
    weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
    weight.zero_out_wgrad = True  # type: ignore[attr-defined]
    x = torch.randn(5, 3, generator=generator, dtype=torch.bfloat16)
    dy = torch.randn(5, 4, generator=generator, dtype=torch.bfloat16)
    wgrad = dy.t().float() @ x.float()

    def functional_backward(*, grad_output, input, weight, grad_weight, accumulate_into_grad_weight, **_):  # noqa: A002
        dx = grad_output @ weight
        if grad_weight is None:
            return dx, (grad_output.t().float() @ input.float()).to(weight.dtype)
        if accumulate_into_grad_weight:
            grad_weight.add_(grad_output.t().float() @ input.float())
        else:
            grad_weight.copy_(grad_output.t().float() @ input.float())
        return dx, grad_weight

    def main_grad_body(weight_param, op_label=""):
        return weight_param.main_grad

    def accumulate_body(weight_param):
        return not getattr(weight_param, "overwrite_main_grad", False)

    def dummies_body(weight_params):
        out = []
        for wp in weight_params:
            wp.grad_added_to_main_grad = True
            out.append(torch.zeros(wp.shape, dtype=wp.dtype))
        return out

    namespace: dict[str, object] = {
        "torch": torch,
        "Optional": typing.Optional,
        "Iterable": typing.Iterable,
        "OperationContext": object,
        "BasicLinear": types.SimpleNamespace(_functional_backward=functional_backward),
        "clear_tensor_data": lambda *tensors: None,
        "get_main_grad_from_param": stand_in(
            real_signature(TE, _COMMON, "get_main_grad_from_param"), main_grad_body
        ),
        "get_accumulate_flag_in_param": stand_in(
            real_signature(TE, _COMMON, "get_accumulate_flag_in_param"), accumulate_body
        ),
        "get_dummy_wgrads_for_params": stand_in(
            real_signature(TE, _COMMON, "get_dummy_wgrads_for_params"), dummies_body
        ),
    }
    exec(compile(method_code, "<op_backward>", "exec"), namespace)
    op_backward = typing.cast(Callable[..., typing.Any], namespace["op_backward"])
    op = types.SimpleNamespace(
        _accumulate_into_main_grad=True,
        weight=weight,
        tensor_parallel_mode=None,
        tensor_parallel_group=None,
        sequence_parallel=False,
    )
    ctx = types.SimpleNamespace(
        saved_tensors=(x, weight.detach()),
        weight_requires_grad=True,
        input_requires_grad=True,
        dtype=torch.bfloat16,
        with_quantized_compute=False,
        input_quantizer=None,
        weight_quantizer=None,
        grad_output_quantizer=None,
        grad_input_quantizer=None,
    )
    _, (grad_weight,) = op_backward(op, ctx, dy)
    if not weight.grad_added_to_main_grad and grad_weight is not None:  # Megatron's grad hook
        weight.main_grad.add_(grad_weight.float())
    return weight.main_grad, earlier, wgrad


@pytest.fixture(scope="module")
def basic_linear_source() -> str:
    return (bed_root(TE) / _BASIC_LINEAR).read_text(encoding="utf-8")


def test_mg010_fix_of_real_basic_linear_gives_the_wrapper_one_gradient(basic_linear_source: str) -> None:
    from maingrad.analyzer.rules.mg010_grad_added_decided_by_overwrite_flag import (
        GradAddedDecidedByOverwriteFlag,
    )

    rule = GradAddedDecidedByOverwriteFlag()
    fixed = fix_source(basic_linear_source, _BASIC_LINEAR, [rule], unsafe=True)
    assert analyze_source(fixed, _BASIC_LINEAR, [rule]).findings == []
    method = _method_source(fixed, "BasicLinear", "op_backward")
    assert "if ctx.weight_requires_grad and self._accumulate_into_main_grad:" in method
    # Overwrite (Megatron-FSDP sharded strategies): main_grad holds this micro-batch's gradient once.
    main_grad, _, wgrad = _run_op_backward(method, overwrite=True)
    torch.testing.assert_close(main_grad, wgrad, rtol=1e-2, atol=1e-2)
    # Accumulate (DDP): the earlier gradient plus this one.
    main_grad, earlier, wgrad = _run_op_backward(method, overwrite=False)
    torch.testing.assert_close(main_grad, earlier + wgrad, rtol=1e-2, atol=1e-2)


def test_mg010_the_unfixed_op_backward_doubles_the_gradient(basic_linear_source: str) -> None:
    method = _method_source(basic_linear_source, "BasicLinear", "op_backward")
    main_grad, _, wgrad = _run_op_backward(method, overwrite=True)
    torch.testing.assert_close(main_grad, 2 * wgrad, rtol=1e-2, atol=1e-2)  # the bug: added a second time
    with pytest.raises(AssertionError):
        torch.testing.assert_close(main_grad, wgrad, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------------------------------------------------
# MG011: the replay reads the hooks at call time (the fix modelled on Megatron-LM #6132)


def _lora_class(code: str) -> type:
    """The rule's megatron-bridge-style example as a real nn.Module with one wrapped submodule."""
    namespace: dict[str, object] = {}
    exec(compile(code, "<lora>", "exec"), namespace)
    base = typing.cast(type, namespace["TEFusedLoRALinear"])

    class Lora(base, torch.nn.Module):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.to_wrap = torch.nn.Linear(2, 2)

        def _make_main_branch(self) -> torch.nn.Module:
            return torch.nn.Identity()

    return Lora


def _replays_hooks_registered_after_build(code: str) -> tuple[list[str], list[str]]:
    layer = _lora_class(code)()
    calls: list[str] = []
    early = layer.to_wrap.register_forward_pre_hook(lambda *_: calls.append("early"))
    early.remove()  # Megatron-LM's first iteration: DDP's pre-forward hooks disabled while the branch is built
    branch = layer._make_fused_branches()
    branch(torch.zeros(1))
    first = list(calls)
    layer.to_wrap.register_forward_pre_hook(lambda *_: calls.append("enabled"))  # enable_forward_pre_hook
    calls.clear()
    branch(torch.zeros(1))
    return first, list(calls)


def test_mg011_fix_replays_the_hooks_registered_now() -> None:
    from maingrad.analyzer.rules.mg011_stale_hook_snapshot import StaleHookSnapshot

    code = textwrap.dedent(StaleHookSnapshot.INVALID[0].code)
    fixed = fix_source(code, "lora_layers.py", [StaleHookSnapshot()], unsafe=True)
    assert analyze_source(fixed, "lora_layers.py", [StaleHookSnapshot()]).findings == []
    assert _replays_hooks_registered_after_build(fixed) == ([], ["enabled"])
    # The shipped shape: nothing is replayed, ever (the snapshot was empty, so no replay was registered).
    assert _replays_hooks_registered_after_build(code) == ([], [])


def test_mg011_fix_on_real_bridge_and_no_fix_where_the_shape_differs() -> None:
    from maingrad.analyzer.rules.mg011_stale_hook_snapshot import StaleHookSnapshot

    rule = StaleHookSnapshot()
    bridge = "megatron/bridge/peft/lora_layers.py"
    source = (bed_root("megatron-bridge-0.3.1") / bridge).read_text(encoding="utf-8")
    fixed = fix_source(source, bridge, [rule], unsafe=True)
    assert analyze_source(fixed, bridge, [rule]).findings == []
    assert "for hook in list(submodule._forward_pre_hooks.values()):" in fixed
    compile(fixed, bridge, "exec")
    # megatron-core 0.19.2's TEFusedMLP replays hooks with kwargs: no fix, the finding stays after `fix`. It is
    # the file's only MG011 finding: TEFusedResidualRMSNorm's snapshot of its own hooks (a false alarm before)
    # is not reported.
    te_ext = "megatron/core/extensions/transformer_engine.py"
    source = (bed_root(MCORE) / te_ext).read_text(encoding="utf-8")
    (finding,) = analyze_source(source, te_ext, [rule]).findings
    assert not finding.fix_available
    assert len(analyze_source(fix_source(source, te_ext, [rule], unsafe=True), te_ext, [rule]).findings) == 1


# ---------------------------------------------------------------------------------------------------------
# The other rules' fixes, on their own documented examples: fix_source must write the example's `fixed`
# text, and running both versions in the scenario the rule is about shows the original fail and the fix work.


def _example(rule_id: str, index: int) -> tuple[str, str]:
    from maingrad.analyzer.rules import rules_by_id

    rule_class = rules_by_id()[rule_id]
    example = rule_class.INVALID[index]
    code = textwrap.dedent(example.code)
    fixed = fix_source(code, "example.py", [rule_class()], unsafe=True)
    assert example.fixed is not None and fixed == textwrap.dedent(example.fixed)
    assert not [f for f in analyze_source(fixed, "example.py", [rule_class()]).findings if f.rule == rule_id]
    return code, fixed


def _load(code: str, **names: object) -> dict[str, object]:
    namespace: dict[str, object] = {"torch": torch, **names}
    exec(compile(code, "<example>", "exec"), namespace)
    return namespace


def test_mg003_fix_reads_presence_not_the_tensor_value() -> None:
    code, fixed = _example("MG003", 7)  # grad = param.main_grad or param.grad
    wrapped_code = f"def pick(param):\n{textwrap.indent(code, '    ')}    return grad\n"
    wrapped_fixed = f"def pick(param):\n{textwrap.indent(fixed, '    ')}    return grad\n"
    param = types.SimpleNamespace(main_grad=torch.zeros(()), grad=torch.ones(()))  # a present, zero main_grad
    original = typing.cast(Callable[..., typing.Any], _load(wrapped_code)["pick"])
    repaired = typing.cast(Callable[..., typing.Any], _load(wrapped_fixed)["pick"])
    assert original(param) is param.grad  # the bug: a zero main_grad reads as missing
    assert repaired(param) is param.main_grad
    multi = types.SimpleNamespace(main_grad=torch.zeros(3), grad=None)
    with pytest.raises(RuntimeError):
        original(multi)  # a multi-element tensor has no truth value
    assert repaired(multi) is multi.main_grad
    assert repaired(types.SimpleNamespace(main_grad=None, grad=param.grad)) is param.grad


def test_mg004_fix_falls_back_to_main_grad_under_ddp() -> None:
    code, fixed = _example("MG004", 3)
    ddp_weight = types.SimpleNamespace(main_grad=torch.zeros(2, 3))  # Megatron DDP: no get_main_grad
    x, dy = torch.ones(4, 3), torch.ones(4, 2)
    with pytest.raises(AttributeError):
        typing.cast(Callable[..., None], _load(code)["wgrad"])(ddp_weight, x, dy)
    typing.cast(Callable[..., None], _load(fixed)["wgrad"])(ddp_weight, x, dy)
    torch.testing.assert_close(ddp_weight.main_grad, dy.t() @ x)
    fsdp_buffer = torch.zeros(2, 3)
    fsdp_weight = types.SimpleNamespace(get_main_grad=lambda: fsdp_buffer, main_grad=None)
    typing.cast(Callable[..., None], _load(fixed)["wgrad"])(fsdp_weight, x, dy)
    torch.testing.assert_close(fsdp_buffer, dy.t() @ x)


def test_mg008_fix_keeps_the_wrapper_hook_from_adding_again() -> None:
    code, fixed = _example("MG008", 1)

    def run(source: str) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.zeros(2, 3))
        weight.main_grad = torch.zeros(2, 3)  # type: ignore[attr-defined]
        weight.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        ctx = types.SimpleNamespace(weight=weight, x=torch.ones(4, 3))
        returned = typing.cast(Callable[..., typing.Any], _load(source)["_wgrad_backward"])(
            ctx, torch.ones(4, 2)
        )
        if not weight.grad_added_to_main_grad:  # Megatron DDP's grad hook: main_grad += param.grad
            weight.main_grad.add_(returned)  # type: ignore[attr-defined]
        return weight.main_grad  # type: ignore[attr-defined, no-any-return]

    with pytest.raises(TypeError):
        run(code)  # the hook trips on the None gradient
    torch.testing.assert_close(run(fixed), torch.ones(4, 2).t() @ torch.ones(4, 3))


def test_mg002_fix_exposes_the_fsdp_buffer_before_the_kernel() -> None:
    code, fixed = _example("MG002", 2)

    def accum(total_input, grad_output, main_grad):  # apex's fused_weight_gradient_mlp_cuda kernel, on CPU
        main_grad.add_(grad_output.t().float() @ total_input.float())

    buffer = torch.zeros(2, 3)
    weight = types.SimpleNamespace(main_grad=None, get_main_grad=lambda: buffer, __fsdp_param__=True)
    x, dy = torch.ones(4, 3), torch.ones(4, 2)
    names = {"wgrad_gemm_accum_fp32": accum, "wgrad_gemm_accum_fp16": accum}
    with pytest.raises(AttributeError):
        typing.cast(Callable[..., None], _load(code, **names)["wgrad"])(weight, x, dy)
    typing.cast(Callable[..., None], _load(fixed, **names)["wgrad"])(weight, x, dy)
    torch.testing.assert_close(buffer, dy.t() @ x)


# ---------------------------------------------------------------------------------------------------------
# The splicing fixer (maingrad.analyzer.fixes) against the whole-module libcst transform it replaced


def test_spliced_and_piecewise_fixes_equal_the_whole_module_transform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maingrad.analyzer import segments
    from maingrad.analyzer.context import FileContext
    from maingrad.analyzer.engine import parse
    from maingrad.analyzer.fixes import apply_fixes
    from maingrad.analyzer.rules import all_rules

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        from fix import fixable_file  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    header = "import torch\n\n\n# a comment before the first function\n"
    source = header + fixable_file(300) + "def last(p):\n    return p.main_grad or 1"  # no final newline
    rules = [rule() for rule in all_rules()]
    module = parse(source, "f.py")
    assert isinstance(module, cst.Module)
    ctx = FileContext(path="f.py", source=source, module=module)
    fixes = [v.fix for rule in rules for v in rule.check(ctx) if v.fix is not None]
    assert len(fixes) > 300
    reference = apply_fixes(module, fixes).code
    assert fix_source(source, "f.py", rules, unsafe=True) == reference
    monkeypatch.setenv("MAINGRAD_SEGMENT_MIN_CHARS", "0")
    monkeypatch.setattr(segments, "CHUNK_CHARS", 2_000)
    monkeypatch.setattr(segments, "GROUP_CHARS", 5_000)
    assert fix_source(source, "f.py", rules, unsafe=True) == reference


def test_mg007_matmul_fix_writes_bf16_products_into_an_fp32_buffer() -> None:
    """megatron-core's fallback `torch.matmul(..., out=main_grad)`: with bf16 activations and an fp32 buffer
    torch refuses the `out=`; the fix computes the product and copies it in (casting to the buffer's dtype)."""
    code, fixed = _example("MG007", 2)
    x = torch.randn(8, 3).to(torch.bfloat16)
    dy = torch.randn(8, 2).to(torch.bfloat16)

    def weight() -> types.SimpleNamespace:
        buffer = torch.zeros(2, 3, dtype=torch.float32)
        return types.SimpleNamespace(get_main_grad=lambda: buffer, main_grad=None)

    with pytest.raises(RuntimeError):
        typing.cast(Callable[..., None], _load(code)["backward"])(weight(), x, dy)
    w = weight()
    typing.cast(Callable[..., None], _load(fixed)["backward"])(w, x, dy)
    assert w.main_grad.dtype == torch.float32
    torch.testing.assert_close(w.main_grad, (dy.t() @ x).float())


def test_mg007_cast_fix_keeps_the_accumulator_exact() -> None:
    """A wgrad rounded to bf16 before `add_` loses the fp32 accumulator's precision; the fix adds it as is."""
    code, fixed = _example("MG007", 5)
    x = torch.randn(16, 3, dtype=torch.float32)
    dy = torch.randn(16, 2, dtype=torch.float32)

    def run(source: str) -> torch.Tensor:
        w = types.SimpleNamespace(main_grad=torch.zeros(2, 3), dtype=torch.bfloat16)
        typing.cast(Callable[..., None], _load(source)["backward"])(None, w, x, dy)
        return w.main_grad

    exact = 2 * (dy.t().matmul(x))
    assert not torch.equal(run(code), exact)  # the bug: each add rounded to bf16
    torch.testing.assert_close(run(fixed), exact, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# MG007's kernel-dispatch fix, against kernels whose dtype contract is megatron-core's own dispatch
def megatron_kernel_dtypes() -> dict[str, frozenset[str]]:
    """kernel name -> the `main_grad` dtypes megatron-core 0.19.2 hands it, read from its own dispatch in
    `drain_embedding_wgrad_compute` (`if weight.main_grad.dtype == torch.float32: ..._fp32(...) elif
    weight.main_grad.dtype in (torch.float16, torch.bfloat16): ..._fp16(...)`)."""
    source = (bed_root(MCORE) / "megatron" / "core" / "utils.py").read_text(encoding="utf-8")
    found: dict[str, frozenset[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        left, op, right = node.test.left, node.test.ops[0], node.test.comparators[0]
        if not (isinstance(left, ast.Attribute) and left.attr == "dtype"):
            continue
        if isinstance(op, ast.Eq):
            dtypes = [right]
        elif isinstance(op, ast.In) and isinstance(right, ast.Tuple):
            dtypes = list(right.elts)
        else:
            continue
        names = frozenset(d.attr for d in dtypes if isinstance(d, ast.Attribute))
        for call in (c for stmt in node.body for c in ast.walk(stmt) if isinstance(c, ast.Call)):
            if isinstance(call.func, ast.Attribute) and call.func.attr.startswith("wgrad_gemm_accum_"):
                found.setdefault(call.func.attr, names)
    return found


def _kernel(name: str, dtypes: frozenset[str]) -> Callable[[object, object, object], None]:
    """A CPU stand-in of `fused_weight_gradient_mlp_cuda.<name>(input, grad_output, main_grad)`: refuses a
    buffer of another dtype than megatron hands it (the real kernel reinterprets its memory), else
    accumulates grad_output^T @ input into it."""

    def kernel(total_input: typing.Any, grad_output: typing.Any, main_grad: typing.Any) -> None:
        if str(main_grad.dtype).removeprefix("torch.") not in dtypes:
            raise RuntimeError(f"{name} on a {main_grad.dtype} buffer")
        main_grad.add_((grad_output.t().float() @ total_input.float()).to(main_grad.dtype))

    return kernel


def test_megatron_dispatch_is_read_from_the_wheel() -> None:
    assert megatron_kernel_dtypes() == {
        "wgrad_gemm_accum_fp32": frozenset({"float32"}),
        "wgrad_gemm_accum_fp16": frozenset({"float16", "bfloat16"}),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mg007_dispatch_fix_calls_the_kernel_megatron_calls(
    dtype: typing.Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unfixed call uses the fp32 kernel whatever the buffer; the fixed one picks the kernel megatron
    picks, over two micro-batches, and the buffer holds their sum."""
    code, fixed = _example("MG007", 3)
    kernels = types.ModuleType("fused_weight_gradient_mlp_cuda")
    for name, dtypes in megatron_kernel_dtypes().items():
        setattr(kernels, name, _kernel(name, dtypes))
    monkeypatch.setitem(sys.modules, "fused_weight_gradient_mlp_cuda", kernels)
    x1, x2 = torch.randn(8, 3), torch.randn(8, 3)
    dy1, dy2 = torch.randn(8, 2), torch.randn(8, 2)

    def run(source: str) -> typing.Any:
        namespace = _load(source)
        weight = types.SimpleNamespace(main_grad=torch.zeros(2, 3, dtype=dtype))
        backward = typing.cast(Callable[..., None], namespace["backward"])
        backward(weight, x1.to(dtype), dy1.to(dtype))
        backward(weight, x2.to(dtype), dy2.to(dtype))
        return weight.main_grad

    expected = (dy1.to(dtype).t().float() @ x1.to(dtype).float()).to(dtype)
    expected = expected + (dy2.to(dtype).t().float() @ x2.to(dtype).float()).to(dtype)
    torch.testing.assert_close(run(fixed), expected)
    if dtype == torch.float32:
        torch.testing.assert_close(run(code), expected)
    else:
        with pytest.raises(RuntimeError, match="wgrad_gemm_accum_fp32 on a"):
            run(code)


def _measured_gemm(A, B, out_dtype=None, out=None, accumulate=False, **_: object):  # noqa: N803
    """TE 2.20.2's general_gemm with an `out=` buffer as measured on the H200 (tests/gpu/mg007_out_dtype.py,
    docs/gpu-evidence.md): an `out_dtype` other than the buffer's raises in the compiled GEMM; a matching one
    (or None) writes the wgrad D = B^T A into the buffer itself, adding to it with accumulate=True."""
    if out is not None and out_dtype is not None and out_dtype != out.dtype:
        raise RuntimeError("gemm.cpp:210 in function gemm: output dtype does not match out_dtype")
    result = B.t().float() @ A.float()
    if out is None:
        return [result.to(out_dtype or A.dtype), None, None, None]
    if accumulate:
        out.add_(result.to(out.dtype))
    else:
        out.copy_(result.to(out.dtype))
    return [out, None, None, None]


def test_mg007_out_dtype_fix_turns_the_raising_gemm_into_accumulation() -> None:
    """`out_dtype=torch.bfloat16` into an fp32 `main_grad`: TE raises; after the fix (`out_dtype` from the buffer)
    two micro-batches accumulate their wgrads in fp32. The stand-in binds TE's real signature."""
    code, fixed = _example("MG007", 0)
    signature = real_signature(TE, "transformer_engine/pytorch/cpp_extensions/gemm.py", "general_gemm")
    gemm = stand_in(signature, _measured_gemm)
    xs = [torch.randn(8, 3).to(torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(8, 2).to(torch.bfloat16) for _ in range(2)]
    weight = types.SimpleNamespace(main_grad=torch.zeros(2, 3, dtype=torch.float32))
    original = typing.cast(Callable[..., None], _load(code, general_gemm=gemm)["backward"])
    with pytest.raises(RuntimeError):
        original(None, weight, xs[0], dys[0])
    repaired = typing.cast(Callable[..., None], _load(fixed, general_gemm=gemm)["backward"])
    for x, dy in zip(xs, dys, strict=True):
        repaired(None, weight, x, dy)
    expected = sum(dy.t().float() @ x.float() for x, dy in zip(xs, dys, strict=True))
    assert weight.main_grad.dtype == torch.float32
    torch.testing.assert_close(weight.main_grad, expected)


def _fused_stack(init_signature: inspect.Signature) -> types.SimpleNamespace:
    """`te.pytorch.ops` as the H200 showed it (docs/gpu-evidence.md): a fused `Sequential` whose forward checks
    its GroupedLinear's first weight, `MAIN GRAD NOT FOUND` without the attribute, `MAIN GRAD IS NONE` when it
    is None; the GroupedLinear stand-in binds TE 2.20.2's real constructor signature."""

    class GroupedLinear(torch.nn.Module):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__()
            init_signature.bind(self, *args, **kwargs)
            self.weights: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = self.weights[0]
            if not hasattr(first, "main_grad"):
                raise RuntimeError("MAIN GRAD NOT FOUND")
            if first.main_grad is None:
                raise RuntimeError("MAIN GRAD IS NONE")
            return x

    class Sequential(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ops = torch.nn.ModuleList()

        def append(self, op: torch.nn.Module) -> None:
            self.ops.append(op)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for op in self.ops:
                x = op(x)
            return x

    return types.SimpleNamespace(pytorch=types.SimpleNamespace(ops=types.SimpleNamespace(
        Sequential=Sequential, GroupedLinear=GroupedLinear)))  # fmt: skip


def test_mg001_fix_exposes_main_grad_before_the_fused_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused container whose pre-forward hook never exposes Megatron-FSDP's lazily created `main_grad`: the
    fused forward raises as on the H200; after the fix the hook takes the buffer from `get_main_grad()` (and a
    DDP parameter, without `get_main_grad`, keeps its own)."""
    code, fixed = _example("MG001", 0)
    init = real_signature(TE, "transformer_engine/pytorch/ops/basic/grouped_linear.py", "__init__")
    te = _fused_stack(init)
    monkeypatch.setitem(
        sys.modules, "transformer_engine", te
    )  # the example's `import transformer_engine as te`
    buffer = torch.zeros(8, 8)

    class FsdpWeight(torch.nn.Parameter):
        def get_main_grad(self) -> torch.Tensor:
            return buffer

    def experts(source: str) -> torch.nn.Module:
        cls = typing.cast(type, _load(source)["Experts"])
        module = cls()
        module.linear_fc1 = torch.nn.Module()
        module.linear_fc1.fuse_wgrad_accumulation = True
        module.linear_fc1.weight0 = FsdpWeight(torch.zeros(8, 8))
        ops = module._make_fused_ops()
        ops.ops[0].weights = [module.linear_fc1.weight0]
        module.ops = ops
        return module

    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        experts(code).ops(torch.ones(2, 8))
    repaired = experts(fixed)
    repaired.ops(torch.ones(2, 8))
    assert repaired.linear_fc1.weight0.main_grad is buffer
