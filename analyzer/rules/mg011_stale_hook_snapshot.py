"""MG011: a pre-forward hook that replays a snapshot of other modules' `_forward_pre_hooks` taken when it was
built, instead of the hooks registered at each call.

A fused container (TE op fuser, a LoRA wrapper running the base layer and the adapter as fused ops) runs
parameters of submodules whose `forward` never runs, so it replays their pre-forward hooks (MG005). The
replay must behave as `nn.Module.__call__` would: run the hooks registered *now*. Data-parallel wrappers
change those hooks during training: Megatron DDP with the distributed optimizer removes its param all-gather
hooks (`disable_forward_pre_hook`) and registers new ones (`enable_forward_pre_hook`), and Megatron-LM's
training loop keeps them disabled through the first iteration, which is when lazily built fused containers
take their snapshot. A snapshot is then empty (and the replay hook, registered only "if any", is never
installed) or holds removed hooks.

Not judged: a snapshot taken over `self.modules()` in a subclass of a Transformer Engine module that has no
submodules (`RMSNorm`, `LayerNorm`, `Linear`, ...) and adds none (no `self.X = <call>`, `add_module`,
`register_module`): it holds only the module's own hooks, and its own `__call__` runs the current ones
anyway (megatron-core's `TEFusedResidualRMSNorm`).

What is judged, per function `F`: a read of `X._forward_pre_hooks` in `F` itself that fills a local `L`
(`L.append(...)` in a loop over the hooks, `L = [...]`, `L.extend(...)`), and a hook function nested in `F`
that reads `L` without reading any `_forward_pre_hooks` itself, registered with
`register_forward_pre_hook` in `F` or returned by `F` (a hook factory).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import syntax_index, walk
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import PRE_HOOKS_ATTR
from maingrad.analyzer.rules._common import code_of, own_nodes
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity

REGISTER = "register_forward_pre_hook"
# Transformer Engine modules without submodules: a subclass that adds none replays, through
# `self.modules()`, only its own hooks, which its own `__call__` already runs (current ones) at each call.
_LEAF_MODULES = frozenset({"RMSNorm", "LayerNorm", "Linear", "LayerNormLinear", "GroupedLinear"})
_OWN_MODULES = frozenset({"modules", "named_modules", "children", "named_children"})
_FILL_METHODS = frozenset({"append", "extend", "insert", "add", "update", "setdefault"})


def _reads_hooks(node: cst.CSTNode) -> bool:
    return any(isinstance(n, cst.Attribute) and n.attr.value == PRE_HOOKS_ATTR for n in walk.walk(node))


def _filled_name(stmt: cst.CSTNode, loop: bool) -> str | None:
    """The local a statement fills: `L.append(...)` (`extend`, `insert`, `add`, `update`), `L[k] = ...`,
    and outside a loop body also `L = <...>` (inside one, a plain assignment is rebound every iteration)."""
    for node in walk.walk(stmt):
        if isinstance(node, cst.Assign):
            for target in node.targets:
                inner = target.target
                if isinstance(inner, cst.Name) and not loop:
                    return inner.value
                if isinstance(inner, cst.Subscript) and isinstance(inner.value, cst.Name):
                    return inner.value.value
        if (
            isinstance(node, cst.Call)
            and isinstance(node.func, cst.Attribute)
            and node.func.attr.value in _FILL_METHODS
            and isinstance(node.func.value, cst.Name)
        ):
            return node.func.value.value
    return None


class StaleHookSnapshot(Rule):
    id = "MG011"
    name = "stale-hook-snapshot"
    severity = Severity.ERROR
    summary = "a pre-forward hook replays a build-time snapshot of `_forward_pre_hooks` instead of the current hooks"
    needles = (PRE_HOOKS_ATTR,)
    fixable = True
    docs = """\
## What it does
Finds a pre-forward hook (registered with `register_forward_pre_hook`, or returned by a hook factory) that
replays other modules' pre-forward hooks from a list its builder filled from `X._forward_pre_hooks` when it
ran, instead of reading `_forward_pre_hooks` when the hook runs.

## Why is this bad?
A fused container replays its submodules' hooks because the data-parallel wrapper gathers their parameters
in them. Those hooks change after the container is built: Megatron DDP with the distributed optimizer
removes its param all-gather hooks and registers new ones on every `disable_forward_pre_hook` /
`enable_forward_pre_hook`, and Megatron-LM's training loop disables them for the first iteration, exactly
when lazily built containers (`if self._fused is None: self._fused = self._make_fused()`) take their
snapshot. The snapshot is then empty (a replay hook registered only `if hooks:` is never installed) or
holds removed hooks: the fused ops read parameters before their all-gather finished, silently.

## Example
```python
forward_pre_hooks = []
for submodule in self.modules():
    for hook in submodule._forward_pre_hooks.values():
        forward_pre_hooks.append((submodule, hook))
if forward_pre_hooks:

    def forward_pre_hook(module, *_):
        for submodule, hook in forward_pre_hooks:
            hook(submodule, None)

    fused.register_forward_pre_hook(forward_pre_hook)
```

## Use instead
```python
def forward_pre_hook(module, *_):
    for submodule in self.modules():
        for hook in list(submodule._forward_pre_hooks.values()):
            hook(submodule, None)

fused.register_forward_pre_hook(forward_pre_hook)
```
Register the replay unconditionally and read the hooks at each call (as megatron-core's
`TEGroupedMLP._make_fused_impl_pre_forward_hook` does, and as Megatron-LM #6132 did for `TEFusedMLP`: keep the
modules, not their hooks, leaving out `self`, whose own `__call__` runs its hooks). The (unsafe) fix does that
for the common shape: the loop `for hook in m._forward_pre_hooks.values(): L.append((m, hook))` becomes
`L.append(m)` (`if m is not self:` when the outer loop walks `self.modules()`), and the hook's
`for m, hook in L:` becomes `for m in L:` / `for hook in list(m._forward_pre_hooks.values()):`. Other shapes
(hooks with kwargs, several lists) keep the finding with no fix.

## In real code
megatron-bridge `peft/lora_layers.py` `TEFusedLoRALinear._make_fused_branches` (0.3.1 and main) and
megatron-core's `TEFusedMLP._register_hooks_on_fused_impl` (0.16.1 to Megatron-LM main, also used by
`TEFusedMLPWithGroupedLinear`) build their fused containers on the first forward and snapshot the hooks then.
"""

    VALID = [
        # Hooks read at call time (megatron-core TEGroupedMLP style).
        Example(
            """\
            class M:
                def _make(self):
                    seq = Sequential()

                    def forward_pre_hook(module, *_):
                        for submodule in self.modules():
                            for hook in submodule._forward_pre_hooks.values():
                                hook(submodule, None)

                    seq.register_forward_pre_hook(forward_pre_hook)
                    return seq
            """
        ),
        # Saved and restored around a capture: not a replay.
        Example(
            """\
            def capture(module):
                saved = dict(module._forward_pre_hooks)
                module._forward_pre_hooks.clear()
                try:
                    run(module)
                finally:
                    module._forward_pre_hooks.update(saved)
            """
        ),
    ]
    VALID.append(
        # megatron-core TEFusedResidualRMSNorm: a leaf TE module replaying only its own hooks.
        Example(
            """\
            class TEFusedResidualRMSNorm(te.pytorch.RMSNorm):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **kwargs)
                    self._fused_impl = None

                def _register_hooks_on_fused_impl(self, fused_impl):
                    forward_pre_hooks = []
                    for submodule in self.modules():
                        for hook in submodule._forward_pre_hooks.values():
                            forward_pre_hooks.append((submodule, hook))
                    if forward_pre_hooks:

                        def forward_pre_hook(module, *_):
                            for submodule, hook in forward_pre_hooks:
                                hook(submodule, None)

                        fused_impl.register_forward_pre_hook(forward_pre_hook)
            """
        )
    )
    INVALID = [
        # megatron-bridge TEFusedLoRALinear style.
        Example(
            """\
            class TEFusedLoRALinear:
                def _make_fused_branches(self):
                    main_branch = self._make_main_branch()
                    forward_pre_hooks = []
                    for submodule in self.modules():
                        for hook in submodule._forward_pre_hooks.values():
                            forward_pre_hooks.append((submodule, hook))
                    if forward_pre_hooks:

                        def forward_pre_hook(module, *_) -> None:
                            for submodule, hook in forward_pre_hooks:
                                hook(submodule, None)

                        main_branch.register_forward_pre_hook(forward_pre_hook)
                    return main_branch
            """,
            line=6,
            fixed="""\
            class TEFusedLoRALinear:
                def _make_fused_branches(self):
                    main_branch = self._make_main_branch()
                    forward_pre_hooks = []
                    for submodule in self.modules():
                        if submodule is not self:
                            forward_pre_hooks.append(submodule)
                    if forward_pre_hooks:

                        def forward_pre_hook(module, *_) -> None:
                            for submodule in forward_pre_hooks:
                                for hook in list(submodule._forward_pre_hooks.values()):
                                    hook(submodule, None)

                        main_branch.register_forward_pre_hook(forward_pre_hook)
                    return main_branch
            """,
        ),
        # A hook factory returning a closure over a list comprehension snapshot.
        Example(
            """\
            def make_replay(modules):
                hooks = [(m, h) for m in modules for h in m._forward_pre_hooks.values()]

                def replay(module, *_):
                    for m, h in hooks:
                        h(m, ())

                return replay
            """,
            line=2,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: some def reads `X._forward_pre_hooks` outside its nested defs (the
        snapshot) and has a def nested in it (the hook); lambdas and classes count as nesting too."""
        for func in ast.walk(index.tree):
            if not isinstance(func, syntax_index.FUNCTION_NODES):
                continue
            reads = nested = False
            stack = list(ast.iter_child_nodes(func))
            while stack and not (reads and nested):
                node = stack.pop()
                if isinstance(node, (*syntax_index.FUNCTION_NODES, ast.Lambda, ast.ClassDef)):
                    nested = nested or isinstance(node, syntax_index.FUNCTION_NODES)
                    continue
                if isinstance(node, ast.Attribute) and node.attr == PRE_HOOKS_ATTR:
                    reads = True
                stack.extend(ast.iter_child_nodes(node))
            if reads and nested:
                return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        for func in ctx.nodes(cst.FunctionDef):
            assert isinstance(func, cst.FunctionDef)
            snapshots = self._snapshots(ctx, func)
            if not snapshots or _replays_only_itself(ctx, func, snapshots):
                continue
            reported: set[str] = set()
            for hook, registration in self._hooks(func):
                if _reads_hooks(hook):
                    continue  # it reads the current hooks itself
                params = {p.name.value for p in walk.find(hook.params, cst.Param) if isinstance(p, cst.Param)}
                used = {n.value for n in walk.find(hook.body, cst.Name) if isinstance(n, cst.Name)} - params
                for name in sorted(used & snapshots.keys()):
                    if name in reported:
                        continue
                    reported.add(name)
                    guarded = registration is not None and self._guarded_by(ctx, registration, name, func)
                    if isinstance(registration, cst.Call) and isinstance(registration.func, cst.Attribute):
                        where = f"registered on `{code_of(registration.func.value)}`"
                    else:
                        where = f"returned by `{func.name.value}`"
                    tail = " (and installs no replay at all when it is empty)" if guarded else ""
                    yield Violation(
                        fix=_refresh_fix(ctx, snapshots[name], hook, name),
                        node=snapshots[name],
                        message=(
                            f"`{hook.name.value}` ({where}) replays `{name}`, a snapshot of `_forward_pre_hooks` "
                            f"taken when `{func.name.value}` ran{tail}: hooks a data-parallel wrapper registers or "
                            "re-enables later (Megatron DDP's param all-gather hooks, disabled during the first "
                            "iteration) are never run, so the fused ops read parameters before their all-gather; "
                            "read `submodule._forward_pre_hooks` inside the hook, at each call."
                        ),
                    )

    @staticmethod
    def _snapshots(ctx: FileContext, func: cst.FunctionDef) -> dict[str, cst.CSTNode]:
        """Local name -> the statement of `func` (not of a nested def) that fills it from `_forward_pre_hooks`."""
        found: dict[str, cst.CSTNode] = {}
        for read in own_nodes(func.body, cst.Attribute):
            if not isinstance(read, cst.Attribute) or read.attr.value != PRE_HOOKS_ATTR:
                continue
            for ancestor in ctx.ancestors(read):
                if ancestor is func:
                    break
                if isinstance(ancestor, cst.For):
                    name = _filled_name(ancestor.body, loop=True)
                    if name is not None:
                        found.setdefault(name, ancestor)
                        break
                elif isinstance(ancestor, cst.SimpleStatementLine):
                    name = _filled_name(ancestor, loop=False)
                    # `dict(m._forward_pre_hooks)` saved to be restored is not a replay source by itself: only
                    # names a nested hook later reads count (checked by the caller).
                    if name is not None:
                        found.setdefault(name, ancestor)
                        break
        return found

    @staticmethod
    def _hooks(func: cst.FunctionDef) -> Iterator[tuple[cst.FunctionDef, cst.Call | str | None]]:
        """Defs nested in `func` that it registers as pre-forward hooks (with the registering call) or
        returns (a hook factory: registration None)."""
        nested = {
            n.name.value: n for n in own_nodes(func.body, cst.FunctionDef) if isinstance(n, cst.FunctionDef)
        }
        for node in own_nodes(func.body, cst.Call, cst.Return):
            if isinstance(node, cst.Return):
                if isinstance(node.value, cst.Name) and node.value.value in nested:
                    yield nested[node.value.value], None
                continue
            assert isinstance(node, cst.Call)
            if not (isinstance(node.func, cst.Attribute) and node.func.attr.value == REGISTER and node.args):
                continue
            hook = node.args[0].value
            if isinstance(hook, cst.Name) and hook.value in nested:
                yield nested[hook.value], node

    @staticmethod
    def _guarded_by(ctx: FileContext, registration: cst.Call | str, name: str, func: cst.FunctionDef) -> bool:
        """Is the registration inside `if <name>:` (registered only when the snapshot is non-empty)?"""
        if isinstance(registration, str):
            return False
        for ancestor in ctx.ancestors(registration):
            if ancestor is func:
                return False
            if isinstance(ancestor, cst.If) and name in {
                n.value for n in walk.find(ancestor.test, cst.Name) if isinstance(n, cst.Name)
            }:
                return True
        return False


def _replays_only_itself(ctx: FileContext, func: cst.FunctionDef, snapshots: dict[str, cst.CSTNode]) -> bool:
    """Every snapshot loops over `self.modules()` (or children) of a class that derives only from TE modules
    without submodules and never adds one: the replay then repeats the module's own hooks, which its own
    `__call__` runs at each call anyway (the current ones), so nothing is missed."""
    owner = ctx.enclosing(func, cst.ClassDef)
    if not isinstance(owner, cst.ClassDef) or not owner.bases:
        return False
    if any(_last_name(base.value) not in _LEAF_MODULES for base in owner.bases):
        return False
    for node in walk.walk(owner.body):
        if isinstance(node, cst.Call) and _last_name(node.func) in ("add_module", "register_module"):
            return False
        if isinstance(node, cst.Assign) and isinstance(node.value, cst.Call):
            for target in node.targets:
                inner = target.target
                if (
                    isinstance(inner, cst.Attribute)
                    and isinstance(inner.value, cst.Name)
                    and inner.value.value == "self"
                ):
                    return False
    for statement in snapshots.values():
        loops = [n for n in walk.walk(statement) if isinstance(n, cst.For)]
        loops += [a for a in ctx.ancestors(statement) if isinstance(a, cst.For)]
        sources = [loop.iter for loop in loops]
        if not any(
            isinstance(src, cst.Call)
            and isinstance(src.func, cst.Attribute)
            and src.func.attr.value in _OWN_MODULES
            and isinstance(src.func.value, cst.Name)
            and src.func.value.value == "self"
            for src in sources
        ):
            return False
    return True


def _last_name(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return node.value if isinstance(node, cst.Name) else None


def _refresh_fix(ctx: FileContext, snapshot: cst.CSTNode, hook: cst.FunctionDef, name: str) -> Fix | None:
    """Keep the modules and read their hooks at each call (Megatron-LM #6132's shape), for the common form:
    `for h in m._forward_pre_hooks.values(): L.append((m, h))` inside `for m in ...:`, replayed by a
    `for m2, h2 in L:` statement of the hook's body."""
    if not isinstance(snapshot, cst.For) or not isinstance(snapshot.target, cst.Name):
        return None
    hook_var = snapshot.target.value
    source = snapshot.iter
    if not (
        isinstance(source, cst.Call)
        and isinstance(source.func, cst.Attribute)
        and source.func.attr.value == "values"
        and not source.args
        and isinstance(source.func.value, cst.Attribute)
        and source.func.value.attr.value == PRE_HOOKS_ATTR
        and isinstance(source.func.value.value, cst.Name)
    ):
        return None
    module_var = source.func.value.value.value
    body = snapshot.body.body if isinstance(snapshot.body, cst.IndentedBlock) else ()
    if len(body) != 1 or not isinstance(body[0], cst.SimpleStatementLine) or len(body[0].body) != 1:
        return None
    append = body[0].body[0]
    if not (
        isinstance(append, cst.Expr)
        and isinstance(append.value, cst.Call)
        and isinstance(append.value.func, cst.Attribute)
        and append.value.func.attr.value == "append"
        and isinstance(append.value.func.value, cst.Name)
        and append.value.func.value.value == name
        and len(append.value.args) == 1
        and code_of(append.value.args[0].value).strip("()").replace(" ", "") == f"{module_var},{hook_var}"
    ):
        return None
    outer = ctx.parent(ctx.parent(snapshot) or snapshot)
    if not (
        isinstance(outer, cst.For) and isinstance(outer.target, cst.Name) and outer.target.value == module_var
    ):
        return None
    replay = next(
        (
            st
            for st in (hook.body.body if isinstance(hook.body, cst.IndentedBlock) else ())
            if isinstance(st, cst.For)
            and isinstance(st.iter, cst.Name)
            and st.iter.value == name
            and isinstance(st.target, cst.Tuple)
            and len(st.target.elements) == 2
            and all(isinstance(e.value, cst.Name) for e in st.target.elements)
        ),
        None,
    )
    if replay is None or not isinstance(replay.target, cst.Tuple):
        return None
    replay_module, replay_hook = (e.value for e in replay.target.elements)
    if not isinstance(replay_module, cst.Name) or not isinstance(replay_hook, cst.Name):
        return None
    own = code_of(outer.iter).replace(" ", "") in ("self.modules()", "self.children()")
    keep = f"{name}.append({module_var})\n"
    if own:
        keep = f"if {module_var} is not self:\n    {name}.append({module_var})\n"
    kept = cst.parse_statement(keep).with_changes(leading_lines=snapshot.leading_lines)
    inner = cst.For(
        target=replay_hook,
        iter=cst.parse_expression(f"list({code_of(replay_module)}.{PRE_HOOKS_ATTR}.values())"),
        body=replay.body,
    )
    refreshed = replay.with_changes(target=replay_module, body=cst.IndentedBlock([inner]))
    return Fix(
        {snapshot: kept, replay: refreshed},
        "keep the modules and read their pre-forward hooks when the replay runs",
        safe=False,
    )
