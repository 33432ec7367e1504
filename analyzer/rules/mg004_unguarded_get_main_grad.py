"""MG004: `X.get_main_grad()` without a guard, in code that also serves DDP parameters."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import syntax_index
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.rules._common import (
    CAUGHT,
    PRESENT,
    code_of,
    enclosing_class,
    in_fsdp_only_code,
    is_simple_chain,
    main_grad_receiver,
    path_facts,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity


class UnguardedGetMainGrad(Rule):
    id = "MG004"
    name = "unguarded-get-main-grad"
    severity = Severity.ERROR
    summary = "`X.get_main_grad()` called without a guard in code that also serves DDP parameters"
    needles = ("get_main_grad",)
    fixable = True
    docs = """\
## What it does
Flags calls `X.get_main_grad()` that are not protected by a check that `X` is a Megatron-FSDP parameter:
`hasattr(X, "get_main_grad")`, `getattr(X, "get_main_grad", None) is not None`, `hasattr(X,
"__fsdp_param__")` / `getattr(X, "__fsdp_param__", False)`, an enclosing `if`/`elif`/`else`/ternary or an
earlier early exit (`if not hasattr(X, "get_main_grad"): return`), an `assert`, or a `try` that catches
`AttributeError`. Code that only ever sees Megatron-FSDP parameters (an `fsdp` package or module, a class or
function whose name says FSDP) and `self.get_main_grad()` inside a class that defines it are not flagged.

## Why is this bad?
Only Megatron-FSDP attaches `get_main_grad` to its parameters. Under Megatron's DDP (or plain PyTorch) the
parameter has `main_grad` but no `get_main_grad`, so the same code raises `AttributeError` there. Model code
(layers, experts, fused containers) runs under both wrappers.

## Example
```python
for param in linear.parameters(recurse=False):
    param.main_grad = param.get_main_grad()
```

## Use instead
```python
for param in linear.parameters(recurse=False):
    if hasattr(param, "get_main_grad"):
        param.main_grad = param.get_main_grad()
```
The fix wraps the statement in `if hasattr(X, "get_main_grad"):` when skipping it under DDP is exactly right
(an exposure `X.main_grad = X.get_main_grad()` or a bare call); an assignment to another name gets an unsafe
fix `X.get_main_grad() if hasattr(X, "get_main_grad") else X.main_grad`.

## In real code
No real instance is known: it reported nothing on the 14 code bases of `docs/real-world.md` (megatron-core
0.16.1/0.18.2/0.19.2, Transformer Engine 2.20.2, megatron-bridge, NeMo, ModelOpt, nanotron, DeepSpeed,
ColossalAI, torchtitan, and Megatron-LM, TE and Megatron-Bridge main). It guards the contract against new code.
"""

    VALID = [
        Example(
            """\
            for param in module.parameters(recurse=False):
                if hasattr(param, "get_main_grad"):
                    param.main_grad = param.get_main_grad()
            """
        ),
        Example(
            """\
            def expose(weight):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
            """
        ),
        Example(
            """\
            def expose(param):
                if getattr(param, "get_main_grad", None) is None:
                    return
                param.main_grad = param.get_main_grad()
            """
        ),
        Example(
            """\
            def expose(params):
                for p in params:
                    if not getattr(p, "__fsdp_param__", False):
                        continue
                    p.main_grad = p.get_main_grad()
            """
        ),
        Example(
            """\
            def grad_buffer(p):
                return p.get_main_grad() if hasattr(p, "get_main_grad") else p.main_grad
            """
        ),
        Example(
            """\
            def expose(p):
                is_fsdp = hasattr(p, "__fsdp_param__")
                if is_fsdp and p.requires_grad:
                    p.main_grad = p.get_main_grad()
            """
        ),
        Example(
            """\
            def expose(p):
                try:
                    p.main_grad = p.get_main_grad()
                except AttributeError:
                    pass
            """
        ),
        Example(
            """\
            def expose(p):
                assert hasattr(p, "get_main_grad"), "Megatron-FSDP parameter expected"
                p.main_grad = p.get_main_grad()
            """
        ),
        Example(
            """\
            def expose(p):
                if not hasattr(p, "get_main_grad"):
                    p.main_grad = None
                else:
                    p.main_grad = p.get_main_grad()
            """
        ),
        Example(
            """\
            class MegatronFSDP:
                def _grad_acc(self, param):
                    param.main_grad = param.get_main_grad()
            """
        ),
        Example(
            """\
            class Buffer:
                def get_main_grad(self):
                    return self.data

                def refresh(self):
                    self.main_grad = self.get_main_grad()
            """
        ),
        Example(
            """\
            def expose(p):
                get_main_grad = getattr(p, "get_main_grad", None)
                if get_main_grad is not None and getattr(p, "main_grad", None) is None:
                    p.main_grad = get_main_grad()
            """
        ),
        Example(
            """\
            # a reference, not a call: evaluated only where FSDP is known
            main_grad_func = weight.get_main_grad if hasattr(weight, "__fsdp_param__") else None
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            def expose(linear):
                for param in linear.parameters(recurse=False):
                    param.main_grad = param.get_main_grad()
            """,
            line=3,
            fixed="""\
            def expose(linear):
                for param in linear.parameters(recurse=False):
                    if hasattr(param, "get_main_grad"):
                        param.main_grad = param.get_main_grad()
            """,
        ),
        Example(
            """\
            def forward_pre_hook(module, *_):
                for p in module.parameters():
                    # allocate the unsharded buffer
                    p.get_main_grad()
            """,
            line=4,
            fixed="""\
            def forward_pre_hook(module, *_):
                for p in module.parameters():
                    # allocate the unsharded buffer
                    if hasattr(p, "get_main_grad"):
                        p.get_main_grad()
            """,
        ),
        Example(
            """\
            def expose(p):
                if hasattr(p, "main_grad"):
                    p.main_grad = p.get_main_grad()
            """,
            line=3,
            fixed="""\
            def expose(p):
                if hasattr(p, "main_grad"):
                    if hasattr(p, "get_main_grad"):
                        p.main_grad = p.get_main_grad()
            """,
        ),
        Example(
            """\
            def wgrad(weight, x, dy):
                buf = weight.get_main_grad()
                buf.add_(dy.t() @ x)
            """,
            line=2,
            fixed="""\
            def wgrad(weight, x, dy):
                buf = weight.get_main_grad() if hasattr(weight, "get_main_grad") else weight.main_grad
                buf.add_(dy.t() @ x)
            """,
        ),
        Example(
            """\
            def expose(p, q):
                if hasattr(q, "get_main_grad"):
                    p.main_grad = p.get_main_grad()
            """,
            line=3,
        ),
        Example(
            """\
            def expose(p):
                if hasattr(p, "__fsdp_param__") or p.requires_grad:
                    p.main_grad = p.get_main_grad()
            """,
            line=3,
        ),
        Example(
            """\
            def expose(p):
                try:
                    p.main_grad = p.get_main_grad()
                except RuntimeError:
                    pass
            """,
            line=3,
        ),
        Example(
            """\
            def total(params):
                return sum(p.get_main_grad().sum() for p in params)
            """,
            line=2,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: some `X.get_main_grad(...)` call that `_exempt` does not exempt (the
        same tests: an `fsdp` path part, an enclosing def/class named for FSDP, `self`/`cls` in a class that
        defines `get_main_grad`; spans are exact for defs and classes) and that is not provably guarded.
        "Provably" is the part of `path_facts` decided exactly: an enclosing if/while/ternary body or later
        `and` operand under `hasattr(X, "get_main_grad"|"__fsdp_param__")` written plainly (a dotted chain
        and a simple string, so texts equal libcst's `code_of`), or a `try` body catching AttributeError.
        Other guards only remove more findings: ignored."""
        if any("fsdp" in part for part in index.path.replace("\\", "/").lower().split("/")):
            return False
        for call in index.get_main_grad_calls:
            around = index.enclosing(syntax_index.pos(call))
            if any("fsdp" in s.name.lower() or "fullyshard" in s.name.lower() for s in around):
                continue
            receiver = call.func.value  # type: ignore[attr-defined]
            classes = [s for s in around if s.kind == "class"]
            on_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
            if on_self and classes and classes[-1].defines_get_main_grad:
                continue
            key = syntax_index.chain_before(index, call.func, "get_main_grad")
            if key is not None and _ast_guarded(index, call, key):
                continue
            return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        for call in ctx.nodes(cst.Call):
            assert isinstance(call, cst.Call)
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "get_main_grad"):
                continue
            receiver = func.value
            if self._exempt(ctx, call, receiver):
                continue
            facts = path_facts(ctx, call, receiver)
            if PRESENT in facts or CAUGHT in facts:
                continue
            where = code_of(receiver)
            yield Violation(
                node=call,
                message=(
                    f"`{where}.get_main_grad()` is called without checking that `{where}` is a Megatron-FSDP "
                    f"parameter; DDP parameters have no `get_main_grad` (AttributeError). Guard it with "
                    f'`hasattr({where}, "get_main_grad")`.'
                ),
                fix=self._fix(ctx, call, receiver),
                context_node=_context(ctx, call),
            )

    @staticmethod
    def _exempt(ctx: FileContext, call: cst.Call, receiver: cst.BaseExpression) -> bool:
        if in_fsdp_only_code(ctx, call):
            return True
        if isinstance(receiver, cst.Name) and receiver.value in ("self", "cls"):
            owner = enclosing_class(ctx, call)
            if owner is not None and any(
                isinstance(stmt, cst.FunctionDef) and stmt.name.value == "get_main_grad"
                for stmt in owner.body.body
            ):
                return True
        return False

    @staticmethod
    def _fix(ctx: FileContext, call: cst.Call, receiver: cst.BaseExpression) -> Fix | None:
        if not is_simple_chain(receiver):
            return None
        line = ctx.parent(ctx.parent(call) or call)
        small = ctx.parent(call)
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            return None
        if not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
            return None
        key = code_of(receiver)
        guard = cst.parse_expression(f'hasattr({code_of(receiver)}, "get_main_grad")')
        # Exposure `X.main_grad = X.get_main_grad()` or a bare call: skipping it under DDP is exactly right.
        is_exposure = (
            isinstance(small, cst.Assign)
            and small.value is call
            and len(small.targets) == 1
            and (target := main_grad_receiver(small.targets[0].target)) is not None
            and code_of(target) == key
        )
        if is_exposure or (isinstance(small, cst.Expr) and small.value is call):
            wrapped = cst.If(
                test=guard,
                body=cst.IndentedBlock(body=[line.with_changes(leading_lines=[])]),
                leading_lines=line.leading_lines,
            )
            return Fix({line: wrapped}, f'wrap in `if hasattr({key}, "get_main_grad"):`')
        # `buf = X.get_main_grad()`: fall back to the DDP buffer; changes what DDP runs do (unsafe).
        if isinstance(small, cst.Assign) and small.value is call:
            fallback = cst.IfExp(
                test=guard,
                body=call,
                orelse=cst.Attribute(value=receiver, attr=cst.Name("main_grad")),
            )
            return Fix({call: fallback}, "use `X.main_grad` when there is no `get_main_grad`", safe=False)
        return None


_HASATTR = re.compile(
    rf"hasattr\s*\(\s*({syntax_index._CHAIN})\s*,\s*([\"'])(get_main_grad|__fsdp_param__)\2\s*\)"
)


def _ast_present(index: SyntaxIndex, test: ast.AST, key: str) -> bool:
    """`Condition.implies(test, True) == PRESENT`, for the plain form `_HASATTR` reads exactly. For a true
    `a and b and ...` libcst takes the first operand that implies anything: only the first one is safe."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return _ast_present(index, test.values[0], key)
    if not (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr"):
        return False
    match = _HASATTR.fullmatch(index.segment(test) or "")
    return match is not None and match.group(1) == key


def _ast_guarded(index: SyntaxIndex, call: ast.Call, key: str) -> bool:
    """True only when `path_facts` holds PRESENT or CAUGHT for the call's receiver (see `gate`)."""
    func = syntax_index.enclosing_function(index, call)
    child: ast.AST = call
    for parent in index.ancestors(call):
        if isinstance(parent, (ast.If, ast.While)):
            in_body = any(s is child for s in parent.body)
            if in_body and _ast_present(index, parent.test, key):
                return True
        elif isinstance(parent, ast.IfExp):
            if child is parent.body and _ast_present(index, parent.test, key):
                return True
        elif isinstance(parent, ast.BoolOp) and isinstance(parent.op, ast.And):
            # libcst nests `a and b and c` to the left: an operand after the first sees the earlier ones.
            if parent.values[0] is not child and _ast_present(index, parent.values[0], key):
                return True
        elif isinstance(parent, syntax_index.TRY_NODES):
            caught = any(_ast_catches_attribute_error(h) for h in parent.handlers)  # type: ignore[attr-defined]
            if caught and any(s is child for s in parent.body):  # type: ignore[attr-defined]
                return True
        if parent is func:
            break
        child = parent
    return False


def _ast_catches_attribute_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(syntax_index.dotted(t) in ("AttributeError", "Exception", "BaseException") for t in types)


def _context(ctx: FileContext, call: cst.Call) -> cst.CSTNode:
    line = ctx.enclosing(call, cst.SimpleStatementLine)
    return line if line is not None else call
