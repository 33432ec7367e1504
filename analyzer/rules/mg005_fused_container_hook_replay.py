"""MG005: a TE op-fuser container that adopts other modules' parameters but never replays their
pre-forward hooks.

Data-parallel wrappers hook the modules that own parameters (Megatron-FSDP unshards in a pre-forward hook,
Megatron DDP with `overlap_param_gather` waits for the all-gather in one). A fused container whose ops adopt
`self.linear_fc1.weight` runs those weights without ever calling `linear_fc1.forward`, so unless a
pre-forward hook on the container replays `linear_fc1._forward_pre_hooks`, the fused ops read weights that
were never gathered.

The analysis is per function, in source order: it tracks which local op values adopt a foreign parameter
(`op.weight = self.sub.weight`, `setattr(op, "weight0", getattr(self.sub, "weight0"))`,
`op.register_parameter(n, sub.get_parameter(n))`, also through same-file helpers), which of them are added
to a container, and whether a replaying hook is registered on that container (directly, through a
same-file helper, or later on the attribute the container is stored in). Whatever cannot be resolved
(a hook or helper imported from elsewhere) is assumed to replay: precision before recall.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import libcst as cst

from maingrad.analyzer import syntax_index, walk
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import CONTAINER_NAMES, CONTAINERS, HOOKABLE_CONTAINER, PRE_HOOKS_ATTR
from maingrad.analyzer.facts import PRE_HOOKS_ATTR as _REPLAY_TEXT
from maingrad.analyzer.names import dotted_name, names_match, package_of, resolve_relative
from maingrad.analyzer.rules._common import first_param as _first_param
from maingrad.analyzer.rules._common import literal_value, local_bindings
from maingrad.analyzer.rules.base import Example, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, pos
from maingrad.contracts.report import Severity

_MEMBER_METHODS = {"append": 0, "insert": 1, "add_module": 1, "extend": 0}
_PARAM_LIKE = re.compile(r"(weight|bias)", re.IGNORECASE)
# Callees that receive a container without being able to register hooks on it.
_INNOCUOUS = frozenset(
    {"len", "isinstance", "id", "type", "print", "repr", "str", "tuple", "list", "iter", "hasattr", "getattr"}
)
_MAX_DEPTH = 4


_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def _walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Pre-order, source-order walk that does not enter nested functions, classes or lambdas."""
    return walk.walk(node, lambda n: isinstance(n, _SCOPES))


def _walk_all(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Pre-order walk that includes nested functions (for "does this function do X anywhere")."""
    return walk.walk(node)


def _mentions_hooks(node: cst.CSTNode) -> bool:
    """Does the subtree read some module's `_forward_pre_hooks` (the replay's signature)?"""
    return any(isinstance(n, cst.Attribute) and n.attr.value == _REPLAY_TEXT for n in walk.walk(node))


def _strip_subscripts(node: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(node, cst.Subscript):
        node = node.value
    return node


def _packs(expr: cst.BaseExpression, name: str) -> int | None:
    """-1 when `expr` is the Name `name`, its position when it is an element of a tuple/list display
    (`(name,)`, `(a, name)`), else None."""
    if isinstance(expr, cst.Name):
        return -1 if expr.value == name else None
    if isinstance(expr, (cst.Tuple, cst.List)):
        for position, element in enumerate(expr.elements):
            if isinstance(element.value, cst.Name) and element.value.value == name:
                return position
    return None


def _covers(coverage: set[tuple[str, bool]], owner: str) -> bool:
    for chain, recursive in coverage:
        if chain == "*" or owner == chain:
            return True
        if recursive and owner.startswith(chain + "."):
            return True
        if chain.endswith(".*") and owner.rpartition(".")[0] == chain[:-2]:
            return True
    return False


def _string_text(node: cst.BaseExpression) -> str | None:
    """Literal text of a string or the literal parts of an f-string."""
    if isinstance(node, cst.SimpleString):
        value = literal_value(node)
        return value if isinstance(value, str) else None
    if isinstance(node, cst.FormattedString):
        return "".join(p.value for p in node.parts if isinstance(p, cst.FormattedStringText))
    if isinstance(node, cst.ConcatenatedString):
        left, right = _string_text(node.left), _string_text(node.right)
        return None if left is None or right is None else left + right
    return None


def _held(expr: cst.BaseExpression, containers: dict) -> list[str]:
    """Container names `expr` evaluates to or packs directly (`seq`, `(seq,)`, `[a, seq]`), not ones it
    merely uses (`seq(x)`, `len(seq)`)."""
    if isinstance(expr, cst.Name):
        return [expr.value] if expr.value in containers else []
    if isinstance(expr, (cst.Tuple, cst.List)):
        return [n for e in expr.elements for n in _held(e.value, containers)]
    return []


def _param_names(func: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in (*func.params.posonly_params, *func.params.params)]


def _is_staticmethod(func: cst.FunctionDef) -> bool:
    return any(dotted_name(d.decorator) == "staticmethod" for d in func.decorators)


@dataclass
class _FileIndex:
    """Functions and classes of one file, for resolving `self.m(...)`, nested helpers and base classes."""

    ctx: FileContext
    owner: dict[cst.FunctionDef, cst.ClassDef | None] = field(default_factory=dict)
    enclosing: dict[cst.FunctionDef, cst.FunctionDef | None] = field(default_factory=dict)
    classes: dict[str, list[cst.ClassDef]] = field(default_factory=dict)
    module_funcs: dict[str, list[cst.FunctionDef]] = field(default_factory=dict)

    @classmethod
    def build(cls, ctx: FileContext) -> _FileIndex:
        index = cls(ctx)
        for node in ctx.nodes(cst.FunctionDef, cst.ClassDef):
            if isinstance(node, cst.ClassDef):
                index.classes.setdefault(node.name.value, []).append(node)
                continue
            assert isinstance(node, cst.FunctionDef)
            klass: cst.ClassDef | None = None
            func: cst.FunctionDef | None = None
            for ancestor in ctx.ancestors(node):
                if isinstance(ancestor, cst.FunctionDef):
                    func = ancestor
                    break
                if isinstance(ancestor, cst.ClassDef):
                    klass = ancestor
                    break
            index.owner[node] = klass
            index.enclosing[node] = func
            if klass is None and func is None:
                index.module_funcs.setdefault(node.name.value, []).append(node)
        return index

    # Classes ---------------------------------------------------------------------------------------------
    def method_class(self, func: cst.FunctionDef) -> tuple[cst.ClassDef | None, cst.FunctionDef | None]:
        """The class of the method `func` is (or is nested in), and that method."""
        current: cst.FunctionDef | None = func
        while current is not None:
            klass = self.owner.get(current)
            if klass is not None:
                return klass, current
            current = self.enclosing.get(current)
        return None, None

    def hierarchy(self, klass: cst.ClassDef) -> list[cst.ClassDef]:
        """The class, its same-file bases (transitively) and same-file subclasses (transitively)."""
        seen: list[cst.ClassDef] = []
        todo = [klass]
        while todo:
            current = todo.pop()
            if current in seen:
                continue
            seen.append(current)
            for base in current.bases:
                name = dotted_name(base.value)
                if name:
                    todo.extend(self.classes.get(name.rsplit(".", 1)[-1], []))
            for candidates in self.classes.values():
                for other in candidates:
                    if any(
                        (dotted_name(b.value) or "").rsplit(".", 1)[-1] == current.name.value
                        for b in other.bases
                    ):
                        todo.append(other)
        return seen

    def methods(self, klass: cst.ClassDef, name: str) -> list[cst.FunctionDef]:
        found = []
        for member in self.hierarchy(klass):
            for stmt in member.body.body:
                if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
                    found.append(stmt)
        return found

    def class_functions(self, klass: cst.ClassDef) -> list[cst.FunctionDef]:
        return [f for f, k in self.owner.items() if k is not None and k in self.hierarchy(klass)]

    # Call resolution -------------------------------------------------------------------------------------
    def resolve(
        self, func_expr: cst.BaseExpression, where: cst.FunctionDef
    ) -> tuple[list[cst.FunctionDef], int]:
        """Same-file functions a callee expression may name, and how many leading parameters the call
        binds implicitly (1 for `self.method`). Empty when unresolvable."""
        if isinstance(func_expr, cst.Name):
            name = func_expr.value
            scope: cst.FunctionDef | None = where
            while scope is not None:
                nested = [f for f, outer in self.enclosing.items() if outer is scope and f.name.value == name]
                if nested:
                    return nested, 0
                scope = self.enclosing.get(scope)
            return self.module_funcs.get(name, []), 0
        if isinstance(func_expr, cst.Attribute):
            klass, method = self.method_class(where)
            if klass is None or method is None:
                return [], 0
            receiver = func_expr.value
            self_name = _first_param(method)
            is_self = isinstance(receiver, cst.Name) and receiver.value in {self_name, "cls"}
            is_super = isinstance(receiver, cst.Call) and dotted_name(receiver.func) == "super"
            if is_self or is_super:
                found = self.methods(klass, func_expr.attr.value)
                return found, 0
        return [], 0


def _bound_offset(callee: cst.FunctionDef, index: _FileIndex, via_attribute: bool) -> int:
    if via_attribute and index.owner.get(callee) is not None and not _is_staticmethod(callee):
        return 1
    return 0


def _callee_param_for(call: cst.Call, callee: cst.FunctionDef, offset: int, matches) -> list[str]:
    """Names of `callee`'s parameters bound to arguments of `call` for which `matches(arg)` holds."""
    names = _param_names(callee)
    bound: list[str] = []
    position = offset
    for arg in call.args:
        if arg.star:
            continue
        if arg.keyword is not None:
            if matches(arg.value):
                bound.append(arg.keyword.value)
            continue
        if matches(arg.value) and position < len(names):
            bound.append(names[position])
        position += 1
    return bound


@dataclass
class _Container:
    name: str
    call: cst.Call
    statement: cst.CSTNode
    hookable: bool
    members: list[tuple[str, int]] = field(default_factory=list)
    replayed: bool = False  # a replaying (or unresolvable) hook is registered on it
    in_tree: bool = False  # assigned straight to a module attribute: wrappers see and hook it
    stores: list[str] = field(default_factory=list)  # attribute chains it is stored under
    returned: bool = False


class _Analysis:
    """Everything MG005 needs about one file."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.index = _FileIndex.build(ctx)
        self._foreign_cache: dict[cst.FunctionDef, set[str]] = {}
        # (function, (op name, binding version)) -> the statements adopting a foreign parameter into it
        self.adoptions: dict[tuple[int, tuple[str, int]], list[cst.CSTNode]] = {}

    # Foreign parameters ----------------------------------------------------------------------------------
    def _self_name(self, func: cst.FunctionDef) -> str | None:
        _, method = self.index.method_class(func)
        return _first_param(method) if method is not None else None

    def foreign_locals(self, func: cst.FunctionDef) -> set[str]:
        """Local names assigned a parameter of another module somewhere in `func` (flow-insensitive)."""
        cached = self._foreign_cache.get(func)
        if cached is not None:
            return cached
        names: set[str] = set()
        self._foreign_cache[func] = names
        for _ in range(2):
            for node in _walk(func.body):
                if isinstance(node, cst.Assign) and len(node.targets) == 1:
                    target = node.targets[0].target
                    if isinstance(target, cst.Name) and self.is_foreign(
                        node.value, func, names, param_name=True
                    ):
                        names.add(target.value)
        return names

    def is_foreign(
        self,
        value: cst.BaseExpression,
        func: cst.FunctionDef,
        local: set[str] | None = None,
        *,
        param_name: bool,
    ) -> bool:
        """Does `value` evaluate to a parameter owned by another module than the one running `func`?

        `param_name`: the name it is stored under already looks like a parameter (weight/bias), so a plain
        attribute chain counts; otherwise only `get_parameter(...)`/`getattr(m, "weight...")` do.
        """
        local = self.foreign_locals(func) if local is None else local
        self_name = self._self_name(func)
        if isinstance(value, cst.IfExp):
            return self.is_foreign(value.body, func, local, param_name=param_name) or self.is_foreign(
                value.orelse, func, local, param_name=param_name
            )
        if isinstance(value, cst.Name):
            return value.value in local
        if isinstance(value, cst.Call):
            func_name = dotted_name(value.func)
            if isinstance(value.func, cst.Attribute) and value.func.attr.value == "get_parameter":
                return self._foreign_owner(value.func.value, self_name)
            if func_name == "getattr" and len(value.args) >= 2:
                name = _string_text(value.args[1].value)
                return bool(name and _PARAM_LIKE.search(name)) and self._foreign_owner(
                    value.args[0].value, self_name
                )
            return False
        dotted = dotted_name(value)
        if dotted is None or not param_name:
            return False
        parts = dotted.split(".")
        if len(parts) < 2 or not _PARAM_LIKE.search(parts[-1]):
            return False
        if parts[0] in self.ctx.names.aliases:  # an imported module's attribute, not a parameter
            return False
        return len(parts) >= 3 if parts[0] == self_name else True

    def _foreign_owner(self, owner: cst.BaseExpression, self_name: str | None) -> bool:
        """`owner` names a module other than the running one (`self.sub`, a `linear` argument)."""
        if isinstance(owner, cst.Name):
            return owner.value != self_name and owner.value not in self.ctx.names.aliases
        dotted = dotted_name(_strip_subscripts(owner))
        return dotted is not None

    def adoption_target(self, node: cst.CSTNode, func: cst.FunctionDef) -> str | None:
        """The local name that adopts a foreign parameter in statement/call `node`, if it does."""
        if isinstance(node, (cst.Assign, cst.AnnAssign)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            value = node.value
            if value is None:
                return None
            for target in targets:
                if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name):
                    param_like = bool(_PARAM_LIKE.search(target.attr.value))
                    if self.is_foreign(value, func, param_name=param_like):
                        return target.value.value
            return None
        if isinstance(node, cst.Call):
            args = [a for a in node.args if not a.star]
            if dotted_name(node.func) == "setattr" and len(args) >= 3 and isinstance(args[0].value, cst.Name):
                name = _string_text(args[1].value)
                param_like = bool(name and _PARAM_LIKE.search(name))
                if self.is_foreign(args[2].value, func, param_name=param_like):
                    return args[0].value.value
            if (
                isinstance(node.func, cst.Attribute)
                and node.func.attr.value == "register_parameter"
                and isinstance(node.func.value, cst.Name)
                and len(args) >= 2
                and self.is_foreign(args[1].value, func, param_name=True)
            ):
                return node.func.value.value
        return None

    def adopts_into(self, func: cst.FunctionDef, param: str, depth: int = 0) -> bool:
        """Does `func` make its parameter `param` adopt a foreign parameter (directly or via helpers)?"""
        if depth > _MAX_DEPTH:
            return False
        for node in _walk(func.body):
            if self.adoption_target(node, func) == param:
                return True
            if isinstance(node, cst.Call) and self._passes_to_adopting_helper(node, func, param, depth):
                return True
        return False

    def _passes_to_adopting_helper(
        self, call: cst.Call, func: cst.FunctionDef, name: str, depth: int
    ) -> bool:
        if not any(isinstance(a.value, cst.Name) and a.value.value == name for a in call.args):
            return False
        callees, _ = self.index.resolve(call.func, func)
        for callee in callees:
            offset = _bound_offset(callee, self.index, isinstance(call.func, cst.Attribute))
            params = _callee_param_for(
                call, callee, offset, lambda v: isinstance(v, cst.Name) and v.value == name
            )
            if any(self.adopts_into(callee, p, depth + 1) for p in params):
                return True
        return False

    # Hook replay -----------------------------------------------------------------------------------------
    def function_replays(self, func: cst.FunctionDef, depth: int = 0) -> bool:
        """Does the hook function `func` call submodules' `_forward_pre_hooks` (or plausibly so)?"""
        if depth > _MAX_DEPTH:
            return False
        if _mentions_hooks(func):
            return True
        outer = self.index.enclosing.get(func)
        while outer is not None:  # a closure over hooks collected by the function that defines it
            if _mentions_hooks(outer):
                return True
            outer = self.index.enclosing.get(outer)
        for node in _walk_all(func.body):
            if not isinstance(node, cst.Call):
                continue
            callees, _ = self.index.resolve(node.func, func)
            if callees:
                if any(self.function_replays(c, depth + 1) for c in callees):
                    return True
            else:
                name = dotted_name(node.func) or ""
                if "hook" in name.rsplit(".", 1)[-1].lower():
                    return True
        return False

    def hook_replays(self, hook: cst.BaseExpression, where: cst.FunctionDef, depth: int = 0) -> bool:
        """Does registering `hook` (an expression in `where`) replay submodule hooks? Unknown -> True."""
        if depth > _MAX_DEPTH:
            return True
        if isinstance(hook, cst.Lambda):
            code = self.ctx.code(hook)
            return _REPLAY_TEXT in code or "hook" in code.split(":", 1)[-1]
        if isinstance(hook, cst.Call):
            name = dotted_name(hook.func) or ""
            if name.rsplit(".", 1)[-1] == "partial" and hook.args:
                return self.hook_replays(hook.args[0].value, where, depth + 1)
            callees, _ = self.index.resolve(hook.func, where)
            return any(self.function_replays(c) for c in callees) if callees else True
        if isinstance(hook, (cst.Name, cst.Attribute)):
            callees, _ = self.index.resolve(hook, where)
            if callees:
                return any(self.function_replays(c) for c in callees)
            if isinstance(hook, cst.Name):
                for node in _walk(where.body):
                    if (
                        isinstance(node, cst.Assign)
                        and len(node.targets) == 1
                        and isinstance(node.targets[0].target, cst.Name)
                        and node.targets[0].target.value == hook.value
                    ):
                        return self.hook_replays(node.value, where, depth + 1)
            return True
        return True

    def registers_replay(self, func: cst.FunctionDef, matches, depth: int = 0) -> bool:
        """Does `func` register a replaying pre-forward hook on a value for which `matches(expr)` holds, or
        hand such a value to a callee that may (unresolvable callees count as "may")?"""
        if depth > _MAX_DEPTH:
            return True
        aliases: set[str] = set()
        for node in _walk_all(func.body):
            if isinstance(node, cst.Assign) and matches(_strip_subscripts(node.value)):
                for target in node.targets:
                    inner = target.target
                    elements = inner.elements if isinstance(inner, (cst.Tuple, cst.List)) else [inner]
                    for element in elements:
                        value = element.value if isinstance(element, cst.Element) else element
                        if isinstance(value, cst.Name):
                            aliases.add(value.value)

        def hit(expr: cst.BaseExpression) -> bool:
            expr = _strip_subscripts(expr)
            return matches(expr) or (isinstance(expr, cst.Name) and expr.value in aliases)

        for node in _walk_all(func.body):
            if not isinstance(node, cst.Call):
                continue
            if isinstance(node.func, cst.Attribute) and hit(node.func.value):
                method = node.func.attr.value
                if (
                    method == "register_forward_pre_hook"
                    and node.args
                    and self.hook_replays(node.args[0].value, func)
                ):
                    return True
                continue
            if any(hit(a.value) for a in node.args) and self._helper_may_register(node, func, hit, depth):
                return True
        return False

    def _helper_may_register(self, call: cst.Call, func: cst.FunctionDef, hit, depth: int) -> bool:
        callees, _ = self.index.resolve(call.func, func)
        if not callees:
            name = (dotted_name(call.func) or "").rsplit(".", 1)[-1]
            return name not in _INNOCUOUS
        for callee in callees:
            offset = _bound_offset(callee, self.index, isinstance(call.func, cst.Attribute))
            params = set(_callee_param_for(call, callee, offset, hit))
            if params and self.registers_replay(
                callee, lambda e, ps=params: isinstance(e, cst.Name) and e.value in ps, depth + 1
            ):
                return True
        return False

    # Sibling replays: coverage and order ------------------------------------------------------------------
    def adopted_owners(self, func: cst.FunctionDef, box: _Container) -> set[str] | None:
        """Attribute chains (with `self` for the method's own first parameter) of the modules whose
        parameters the container's ops adopt in `func`; None when one of them cannot be told."""
        bindings = local_bindings(func)
        owners: set[str] = set()
        for member in box.members:
            for node in self.adoptions.get((id(func), member), []):
                value = self._adopted_value(node)
                chains = self._owner_chains(value, bindings, func, 0) if value is not None else None
                if chains is None:
                    return None
                owners |= chains
        return owners

    @staticmethod
    def _adopted_value(node: cst.CSTNode) -> cst.BaseExpression | None:
        if isinstance(node, (cst.Assign, cst.AnnAssign)):
            return node.value
        if isinstance(node, cst.Call):
            args = [a for a in node.args if not a.star]
            if dotted_name(node.func) == "setattr" and len(args) >= 3:
                return args[2].value
            if len(args) >= 2:
                return args[1].value
        return None

    def _owner_chains(
        self, value: cst.BaseExpression, bindings: dict, func: cst.FunctionDef, depth: int
    ) -> set[str] | None:
        if depth > _MAX_DEPTH:
            return None
        if isinstance(value, cst.IfExp):
            left = self._owner_chains(value.body, bindings, func, depth + 1)
            right = self._owner_chains(value.orelse, bindings, func, depth + 1)
            return None if left is None or right is None else left | right
        if isinstance(value, cst.Name):
            if value.value == "None":
                return set()
            values = bindings.get(value.value)
            if not values:
                return None
            found: set[str] = set()
            for bound in values:
                chains = self._owner_chains(bound, bindings, func, depth + 1)
                if chains is None:
                    return None
                found |= chains
            return found
        owner: cst.BaseExpression | None = None
        if isinstance(value, cst.Call):
            if isinstance(value.func, cst.Attribute) and value.func.attr.value == "get_parameter":
                owner = value.func.value
            elif dotted_name(value.func) == "getattr" and value.args:
                owner = value.args[0].value
        elif isinstance(value, cst.Attribute):
            owner = value.value
        chain = dotted_name(owner) if owner is not None else None
        if chain is None:
            return None
        return {self._normalise(chain, func)}

    def _normalise(self, chain: str, func: cst.FunctionDef) -> str:
        """`self.x` whatever the method calls its first parameter."""
        me = self._self_name(func)
        head, _, rest = chain.partition(".")
        return ("self" + ("." + rest if rest else "")) if me is not None and head == me else chain

    def hook_coverage(self, hook: cst.BaseExpression, where: cst.FunctionDef) -> set[tuple[str, bool]]:
        """(chain, recursive) pairs of the modules whose hooks a registered replay runs; ("*", True) when
        that cannot be told (counts as covering everything: precision first)."""
        functions: list[cst.FunctionDef] = []
        if isinstance(hook, (cst.Name, cst.Attribute)):
            functions, _ = self.index.resolve(hook, where)
        elif isinstance(hook, cst.Call):
            callees, _ = self.index.resolve(hook.func, where)
            functions = [f for c in callees for f in _walk_all(c) if isinstance(f, cst.FunctionDef)]
        if not functions:
            return {("*", True)}
        covered: set[tuple[str, bool]] = set()
        for function in functions:
            scopes = [function]
            outer = self.index.enclosing.get(function)
            while outer is not None:  # a closure over hooks its builder collected
                scopes.append(outer)
                outer = self.index.enclosing.get(outer)
            for scope in scopes:
                for node in _walk_all(scope.body):
                    if isinstance(node, cst.For) and _mentions_hooks(node.body):
                        covered |= self._iterated(node.iter, scope)
                    elif (
                        isinstance(node, cst.Attribute)
                        and node.attr.value == PRE_HOOKS_ATTR
                        and dotted_name(node.value) is not None
                        and dotted_name(node.value) != "self"
                    ):
                        chain = dotted_name(node.value) or ""
                        covered.add((self._normalise(chain, scope), False))
        return covered or {("*", True)}

    def _iterated(self, expr: cst.BaseExpression, scope: cst.FunctionDef) -> set[tuple[str, bool]]:
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            method = expr.func.attr.value
            chain = dotted_name(expr.func.value)
            if method in ("modules", "named_modules") and chain is not None:
                return {(self._normalise(chain, scope), True)}
            if method in ("children", "named_children") and chain is not None:
                return {(self._normalise(chain, scope) + ".*", False)}
            if method in ("values", "items"):
                return set()  # the inner loop over one module's hooks: the outer loop says which modules
        if isinstance(expr, (cst.Tuple, cst.List)):
            chains = [dotted_name(e.value) for e in expr.elements]
            if all(chains):
                return {(self._normalise(c or "", scope), False) for c in chains}
        return {("*", True)}  # a local list, an argument: which modules it holds is not followed

    def handles(self, func: cst.FunctionDef, name: str, depth: int = 0) -> set[str]:
        """Texts that denote the container bound to `name` in `func` where it is run: the name itself,
        attribute chains it is stored in, and names and chains its callers keep it under (through
        returned tuples and their unpacking)."""
        out = {name}
        if depth > _MAX_DEPTH:
            return out
        returned: list[int | None] = []
        for node in _walk(func.body):
            if isinstance(node, cst.Assign) and _packs(node.value, name) is not None:
                for target in node.targets:
                    chain = dotted_name(_strip_subscripts(target.target))
                    if chain is not None and not isinstance(target.target, cst.Name):
                        out.add(self._normalise(chain, func))
            if isinstance(node, cst.Return) and node.value is not None:
                position = _packs(node.value, name)
                if position is not None:
                    returned.append(None if position == -1 else position)
        for position in returned:
            for call, caller in self._callers(func):
                for node in _walk(caller.body):
                    if not isinstance(node, cst.Assign) or not any(n is call for n in _walk(node.value)):
                        continue
                    wrapped = node.value is not call  # `(self._make(),)`
                    for target in node.targets:
                        inner = target.target
                        if isinstance(inner, (cst.Tuple, cst.List)):
                            if position is not None and position < len(inner.elements):
                                element = inner.elements[position].value
                                if isinstance(element, cst.Name):
                                    out |= self.handles(caller, element.value, depth + 1)
                        elif isinstance(inner, cst.Name) and position is None and not wrapped:
                            out |= self.handles(caller, inner.value, depth + 1)
                        else:
                            chain = dotted_name(_strip_subscripts(inner))
                            if chain is None:
                                continue
                            chain = self._normalise(chain, caller)
                            if position is None:
                                out.add(chain)  # the container, or a 1-tuple run as `chain[0](...)`
                            else:
                                out |= self._unpacked(chain, position)  # one of several: its own name
        return out

    def _unpacked(self, chain: str, position: int) -> set[str]:
        """Names bound by `a, b = <chain>` anywhere in the file, at `position`."""
        found: set[str] = set()
        for function in self.index.owner:
            for node in _walk(function.body):
                if not isinstance(node, cst.Assign) or dotted_name(node.value) is None:
                    continue
                if self._normalise(dotted_name(node.value) or "", function) != chain:
                    continue
                for target in node.targets:
                    inner = target.target
                    if isinstance(inner, (cst.Tuple, cst.List)) and position < len(inner.elements):
                        element = inner.elements[position].value
                        if isinstance(element, cst.Name):
                            found.add(element.value)
        return found

    def runs(self, klass: cst.ClassDef, handles: set[str]) -> dict[cst.FunctionDef, list[int]]:
        """Where the class calls a container it holds under one of `handles`: function -> positions."""
        found: dict[cst.FunctionDef, list[int]] = {}
        for function in self.index.class_functions(klass):
            for node in _walk(function.body):
                if not isinstance(node, cst.Call):
                    continue
                chain = dotted_name(_strip_subscripts(node.func))
                if chain is not None and self._normalise(chain, function) in handles:
                    found.setdefault(function, []).append(self.ctx.index(node))
        return found

    def sibling_verdict(self, box: _Container, func: cst.FunctionDef) -> tuple[str, str, str] | None:
        """("covered", ...) when another container of the class registers a replay covering the modules
        whose parameters `box` adopts and runs before `box` wherever `box` runs; ("late", sibling, owner)
        when such a replay runs only after `box`; None otherwise."""
        klass, _ = self.index.method_class(func)
        if klass is None:
            return None
        owners = self.adopted_owners(func, box)
        if not owners:
            return None
        mine = self.handles(func, box.name) | set(box.stores)
        my_runs = self.runs(klass, mine)
        if not my_runs:
            return None
        late: tuple[str, str, str] | None = None
        for registrar in self.index.class_functions(klass):
            for node in _walk_all(registrar.body):
                if not (
                    isinstance(node, cst.Call)
                    and isinstance(node.func, cst.Attribute)
                    and node.func.attr.value == "register_forward_pre_hook"
                    and node.args
                ):
                    continue
                receiver = _strip_subscripts(node.func.value)
                chain = dotted_name(receiver)
                if chain is None or not self.hook_replays(node.args[0].value, registrar):
                    continue
                coverage = self.hook_coverage(node.args[0].value, registrar)
                if not all(_covers(coverage, owner) for owner in owners):
                    continue
                theirs = self._registration_handles(registrar, chain)
                if theirs & mine:
                    continue  # the container itself
                their_runs = self.runs(klass, theirs)
                shared = [f for f in my_runs if f in their_runs]
                if not shared:
                    continue
                if all(min(their_runs[f]) < min(my_runs[f]) for f in shared):
                    return ("covered", chain, sorted(owners)[0])
                late = ("late", chain, sorted(owners)[0])
        return late

    def _registration_handles(self, registrar: cst.FunctionDef, chain: str) -> set[str]:
        """Handles of the container a hook is registered on: a local of `registrar`, or a parameter it
        receives from same-class callers."""
        if "." in chain:
            return {self._normalise(chain, registrar)}
        params = _param_names(registrar)
        if chain not in params:
            return self.handles(registrar, chain)
        out = {chain}
        offset = 1 if self.index.owner.get(registrar) is not None and not _is_staticmethod(registrar) else 0
        position = params.index(chain) - offset
        for call, caller in self._callers(registrar):
            args = [a for a in call.args if not a.star and a.keyword is None]
            value = args[position].value if 0 <= position < len(args) else None
            if isinstance(value, cst.Name):
                out |= self.handles(caller, value.value)
        return out

    # Containers ------------------------------------------------------------------------------------------
    def container_kind(self, value: cst.BaseExpression) -> str | None:
        if isinstance(value, cst.Call):
            name = self.ctx.names.qualified_name(value.func)
            if name is not None and self.ctx.names.matches(value.func, *CONTAINERS):
                return "hookable" if self.ctx.names.matches(value.func, HOOKABLE_CONTAINER) else "fuser"
        return None

    def scan(self, func: cst.FunctionDef) -> list[_Container]:  # noqa: C901 - one source-order pass
        """Containers built in `func` that hold ops adopting foreign parameters and lack a replay hook."""
        ids: dict[str, int] = {}
        counter = 0
        adopted: set[tuple[str, int]] = set()
        containers: dict[str, _Container] = {}
        statement: cst.CSTNode | None = None

        def current(name: str) -> tuple[str, int]:
            return name, ids.get(name, 0)

        def is_container(expr: cst.BaseExpression) -> bool:
            return isinstance(expr, cst.Name) and expr.value in containers

        for node in _walk(func.body):
            if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
                statement = node
            if isinstance(node, cst.Assign):
                kind = self.container_kind(node.value)
                for target in node.targets:
                    inner = target.target
                    if isinstance(inner, cst.Name):
                        counter += 1
                        ids[inner.value] = counter
                        held = _held(node.value, containers)
                        if isinstance(node.value, cst.Name) and held:
                            containers[inner.value] = containers[held[0]]  # a plain alias: same container
                        else:
                            for name in held:  # packed into a local structure we do not follow
                                containers[name].replayed = True
                        if kind is not None and isinstance(node.value, cst.Call):
                            box = _Container(inner.value, node.value, statement or node, kind == "hookable")
                            for arg in node.value.args:
                                value = arg.value
                                values = value.elements if isinstance(value, (cst.List, cst.Tuple)) else [arg]
                                for element in values:
                                    if isinstance(element.value, cst.Name) and not arg.star:
                                        box.members.append(current(element.value.value))
                            containers[inner.value] = box
                    elif isinstance(inner, (cst.Attribute, cst.Subscript)):
                        if isinstance(inner, cst.Subscript) and is_container(inner.value):
                            if isinstance(node.value, cst.Name) and isinstance(inner.value, cst.Name):
                                containers[inner.value.value].members.append(current(node.value.value))
                            continue
                        self._record_store(inner, node.value, containers, func)
            owner = self.adoption_target(node, func)
            if owner is not None:
                adopted.add(current(owner))
                self.adoptions.setdefault((id(func), current(owner)), []).append(node)
            if isinstance(node, cst.Call):
                self._record_call(node, func, containers, current, adopted)
            if isinstance(node, cst.Return) and node.value is not None:
                for held_name in _held(node.value, containers):
                    containers[held_name].returned = True

        flagged = []
        for box in containers.values():
            if box.replayed or box.in_tree or not any(m in adopted for m in box.members):
                continue
            if not box.hookable and self._replays_manually(func):
                continue
            if (box.stores or box.returned) and self._replayed_elsewhere(box, func):
                continue
            flagged.append(box)
        return flagged

    def _replays_manually(self, func: cst.FunctionDef) -> bool:
        """An OperationFuser cannot hold hooks: accept a replay anywhere in the function or its class."""
        klass, _ = self.index.method_class(func)
        return _mentions_hooks(klass if klass is not None else func)

    def _record_store(self, target: cst.BaseExpression, value: cst.BaseExpression, containers, func) -> None:
        if (
            isinstance(value, cst.Name)
            and value.value in containers
            and isinstance(target, cst.Attribute)
            and isinstance(target.value, cst.Name)
            and target.value.value == self._self_name(func)
        ):
            containers[value.value].in_tree = True  # a registered submodule: wrappers hook it
            return
        for held in _held(value, containers):
            chain = dotted_name(_strip_subscripts(target))
            if chain is not None:
                containers[held].stores.append(chain)
            else:
                containers[held].replayed = True  # stored somewhere we cannot follow

    def _record_call(self, call: cst.Call, func, containers, current, adopted) -> None:
        callee = call.func
        receiver = callee.value if isinstance(callee, cst.Attribute) else None
        if (
            isinstance(callee, cst.Attribute)
            and isinstance(receiver, cst.Name)
            and receiver.value in containers
        ):
            box = containers[receiver.value]
            method = callee.attr.value
            if method in _MEMBER_METHODS:
                args = [a for a in call.args if not a.star]
                position = _MEMBER_METHODS[method]
                if len(args) > position:
                    value = args[position].value
                    values = (
                        [e.value for e in value.elements]
                        if isinstance(value, (cst.List, cst.Tuple))
                        else [value]
                    )
                    box.members.extend(current(v.value) for v in values if isinstance(v, cst.Name))
            elif (
                method == "register_forward_pre_hook"
                and call.args
                and self.hook_replays(call.args[0].value, func)
            ):
                box.replayed = True
            return
        if dotted_name(call.func) == "setattr" and len(call.args) >= 3:
            value = call.args[2].value
            if isinstance(value, cst.Name) and value.value in containers:
                name = _string_text(call.args[1].value)
                if name:
                    containers[value.value].stores.append(f"{dotted_name(call.args[0].value)}.{name}")
                else:
                    containers[value.value].replayed = True
            return
        for arg in call.args:
            if isinstance(arg.value, cst.Name) and arg.value.value in containers:
                box = containers[arg.value.value]
                name = arg.value.value
                if self._helper_may_register(
                    call, func, lambda e, n=name: isinstance(e, cst.Name) and e.value == n, 0
                ):
                    box.replayed = True
        # Ops handed to same-file helpers that adopt parameters into them.
        for arg in call.args:
            if isinstance(arg.value, cst.Name) and self._passes_to_adopting_helper(
                call, func, arg.value.value, 0
            ):
                adopted.add(current(arg.value.value))

    def _replayed_elsewhere(self, box: _Container, func: cst.FunctionDef) -> bool:
        """A stored or returned container: is a replaying hook registered on it elsewhere in the class?"""
        klass, _ = self.index.method_class(func)
        functions = self.index.class_functions(klass) if klass is not None else list(self.index.owner)
        keys = set(box.stores)
        if box.returned:
            callers = self._callers(func)
            if not callers:
                return True  # built for code outside this file: cannot tell
            for call, caller in callers:
                stored = self._result_store(call, caller)
                if stored is None:
                    return True
                if isinstance(stored, str):
                    keys.add(stored)
                elif self.registers_replay(
                    caller, lambda e, n=stored.value: isinstance(e, cst.Name) and e.value == n
                ):
                    return True
        if not keys:
            return False

        def matches(expr: cst.BaseExpression) -> bool:
            return dotted_name(expr) in keys

        return any(self.registers_replay(f, matches) for f in functions if f is not func)

    def _callers(self, func: cst.FunctionDef) -> list[tuple[cst.Call, cst.FunctionDef]]:
        name = func.name.value
        found = []
        for other in self.index.owner:
            for node in _walk(other.body):
                if isinstance(node, cst.Call):
                    callee = (
                        node.func.attr.value
                        if isinstance(node.func, cst.Attribute)
                        else dotted_name(node.func)
                    )
                    if callee == name and other is not func:
                        found.append((node, other))
        return found

    def _result_store(self, call: cst.Call, caller: cst.FunctionDef) -> str | cst.Name | None:
        """Where the caller keeps a returned container: an attribute chain, a local Name, or None (lost)."""
        for node in _walk(caller.body):
            if isinstance(node, cst.Assign) and any(n is call for n in _walk(node.value)):
                target = node.targets[0].target
                if isinstance(target, cst.Name):
                    return target
                return dotted_name(_strip_subscripts(target))
            if (
                isinstance(node, cst.Return)
                and node.value is not None
                and any(n is call for n in _walk(node.value))
            ):
                return None
        return None


_MAX_ALIASES = 5000


def _possible_aliases(index: SyntaxIndex) -> dict[str, set[str]] | None:
    """Every qualified name `NameResolver` could map each local name to, whatever the binding order (None:
    too many to enumerate; the gate then passes)."""
    package = package_of(index.path)
    aliases: dict[str, set[str]] = {}
    for node in index.imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None:
                    aliases.setdefault(alias.asname, set()).add(alias.name)
                else:
                    head = alias.name.split(".", 1)[0]
                    aliases.setdefault(head, set()).add(head)
            continue
        base = node.module or ""
        if node.level:
            base = resolve_relative(package, base, node.level)
        for alias in node.names:
            if alias.name == "*":
                continue
            local = alias.asname or alias.name
            aliases.setdefault(local, set()).add(f"{base}.{alias.name}" if base else alias.name)
    # `te_ops = te.pytorch.ops` chains. NameResolver applies each assignment once, in source order, so
    # len(alias_assigns) rounds cover every chain it can build; `x = x.y` grows forever without the cap.
    for _ in range(len(index.alias_assigns)):
        grew = False
        for assign in index.alias_assigns:
            target = assign.targets[0].id  # type: ignore[attr-defined]
            source = syntax_index.dotted(assign.value)
            if source is None:
                continue
            for resolved in _possible_names(assign.value, aliases):
                if resolved != source and resolved not in aliases.setdefault(target, set()):
                    aliases[target].add(resolved)
                    grew = True
        if not grew:
            break
        if sum(len(v) for v in aliases.values()) > _MAX_ALIASES:
            return None
    return aliases


def _possible_names(expr: ast.AST, aliases: dict[str, set[str]]) -> set[str]:
    """`NameResolver.qualified_name` of a Name/Attribute chain, for every binding of its head."""
    dotted = syntax_index.dotted(expr)
    if dotted is None:
        return set()
    head, _, rest = dotted.partition(".")
    return {f"{target}.{rest}" if rest else target for target in aliases.get(head, ())}


class FusedContainerWithoutHookReplay(Rule):
    id = "MG005"
    name = "fused-container-without-hook-replay"
    severity = Severity.ERROR
    summary = (
        "a TE op-fuser container adopts other modules' parameters but never replays their pre-forward hooks"
    )
    # The container must resolve to transformer_engine.pytorch.ops: an absolute import of TE, or a relative
    # one inside TE itself. A torch.nn.Sequential alone never qualifies.
    needles = (("Sequential", "transformer_engine"), ("Sequential", "from ."), "OperationFuser")
    docs = """\
## What it does
Finds a Transformer Engine op-fuser container (`transformer_engine.pytorch.ops.Sequential`, or an
`OperationFuser`) whose ops adopt parameters owned by other modules (`op.weight = self.linear_fc1.weight`,
`setattr(op, "weight0", getattr(self.linear_fc1, "weight0"))`,
`op.register_parameter("weight", linear.get_parameter("weight"))`) when no pre-forward hook registered on
the container replays those modules' `_forward_pre_hooks`.

## Why is this bad?
Data-parallel wrappers hook the modules that own the parameters: Megatron-FSDP all-gathers (unshards) them in
a pre-forward hook, Megatron DDP with `overlap_param_gather` waits for their all-gather in one. The fused
container runs the adopted weights without calling the owning module's `forward`, so none of those hooks run:
the fused ops read sharded, stale or half-gathered weights, silently.

## Example
```python
def _make_fused_ops(self):
    ops = te.pytorch.ops.Sequential()
    op = te.pytorch.ops.GroupedLinear(n, k, m, device="meta")
    setattr(op, "weight0", getattr(self.linear_fc1, "weight0"))
    ops.append(op)
    return ops
```

## Use instead
Register a pre-forward hook on the container that replays the source modules' hooks (as megatron-core's
`TEGroupedMLP._make_fused_impl_pre_forward_hook` does):
```python
def _make_fused_ops(self):
    ops = te.pytorch.ops.Sequential()
    op = te.pytorch.ops.GroupedLinear(n, k, m, device="meta")
    setattr(op, "weight0", getattr(self.linear_fc1, "weight0"))
    ops.append(op)

    def replay(module, *_):
        for submodule in self.linear_fc1.modules():
            for hook in submodule._forward_pre_hooks.values():
                hook(submodule, ())

    ops.register_forward_pre_hook(replay)
    return ops
```
A replay registered on a sibling container of the same class covers this one when it runs the hooks of
the modules whose parameters this one adopts (`self.modules()` covers every submodule) and the class's
`forward` runs that sibling first (megatron-bridge's `TEFusedLoRALinear`: `main_branch` replays before
`lora_branch` runs); when the sibling runs only after it (megatron-core's `TEFusedMLPWithGroupedLinear`:
`norm_seq` reads `linear_fc1.layer_norm_weight` before `fused_impl`'s replay gathers it), the finding says
the replay comes too late. A replay that snapshots the hooks at build time is MG011's finding.
No automatic fix: which hooks may be replayed (hooks that read or rewrite the input cannot) is a design
decision. For precision, whatever the analyzer cannot follow counts as a replay: hooks and helpers imported
from other files, containers handed to such helpers or returned to callers outside the file, and files that
install global `register_module_forward_pre_hook`s. Containers assigned straight to a module attribute are
registered submodules, which the wrappers hook themselves.

## In real code
megatron-core 0.18.2, 0.19.2 and Megatron-LM main `TEFusedMLPWithGroupedLinear._make_fused_impl`: `norm_seq`
runs `linear_fc1.layer_norm_weight` before `fused_impl`, whose hook replays `linear_fc1`'s hooks (Megatron DDP's
param all-gather wait under `overlap_param_gather`), so the norm may read a weight whose all-gather has not
finished. megatron-bridge's `lora_branch` is covered by `main_branch`'s replay and not reported.
"""

    VALID = [
        # megatron-core 0.18.2 style: setattr adoption, replay through a hook factory method.
        Example(
            """\
            import transformer_engine as te

            class GroupedMLP:
                def _make_fused_ops(self):
                    ops = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.GroupedLinear(2, 4, 4, device="meta")
                    setattr(op, "weight0", getattr(self.linear_fc1, "weight0"))
                    ops.append(op)
                    ops.register_forward_pre_hook(self._make_hook())
                    return ops

                def _make_hook(self):
                    def forward_pre_hook(module, *_):
                        for submodule in self.linear_fc1.modules():
                            for hook in submodule._forward_pre_hooks.values():
                                hook(submodule, None)
                    return forward_pre_hook
            """
        ),
        # megatron-core 0.19.2 style: adoption through a nested helper, local closure hook.
        Example(
            """\
            from transformer_engine.pytorch import ops as te_ops

            class GroupedMLP:
                def _make_fused_ops(self):
                    def adopt(op, linear):
                        op.register_parameter("weight", linear.get_parameter("weight"))

                    seq = te_ops.Sequential()
                    op = te_ops.GroupedLinear(2, 4, 4, device="meta")
                    adopt(op, self.linear_fc1)
                    seq.append(op)

                    def forward_pre_hook(module, *_):
                        for hook in self.linear_fc1._forward_pre_hooks.values():
                            hook(self.linear_fc1, ())

                    seq.register_forward_pre_hook(forward_pre_hook)
                    return seq
            """
        ),
        # Replay registered by a helper method that collects the hooks (TEFusedMLP style).
        Example(
            """\
            import transformer_engine as te

            class FusedMLP:
                def _make_fused_impl(self):
                    fused = te.pytorch.ops.Sequential()
                    weight = self.linear_fc1.weight
                    op = te.pytorch.ops.BasicLinear(4, 4, device="meta")
                    op.weight = weight
                    fused.append(op)
                    self._register_hooks(fused)
                    return fused

                def _register_hooks(self, fused_impl):
                    hooks = []
                    for submodule in self.modules():
                        hooks.extend(submodule._forward_pre_hooks.values())

                    def pre_hook(module, *_):
                        for hook in hooks:
                            hook(module, ())

                    fused_impl.register_forward_pre_hook(pre_hook)
            """
        ),
        # Ops that own their parameters (nothing adopted): nothing to replay.
        Example(
            """\
            import transformer_engine as te

            def build(n):
                seq = te.pytorch.ops.Sequential()
                seq.append(te.pytorch.ops.BasicLinear(n, n))
                op = te.pytorch.ops.Bias(n)
                op.scale = 2.0
                seq.append(op)
                return seq
            """
        ),
        # The module's own parameter (self.weight) runs inside its own forward: its hooks already ran.
        Example(
            """\
            import transformer_engine as te

            class FusedNorm:
                def _make(self):
                    seq = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.RMSNorm(self.weight.shape, device="meta")
                    op.weight = self.weight
                    seq.append(op)
                    self._seq = (seq,)
            """
        ),
        # The hook comes from another file: assumed to replay (precision first).
        Example(
            """\
            import transformer_engine as te
            from mylib.hooks import replay_submodule_hooks

            class M:
                def _make(self):
                    seq = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.BasicLinear(4, 4, device="meta")
                    op.weight = self.fc.weight
                    seq.append(op)
                    seq.register_forward_pre_hook(replay_submodule_hooks(self.fc))
                    return seq
            """
        ),
        # Registered as a submodule (wrappers see it and hook its ops, which share the parameters).
        Example(
            """\
            import transformer_engine as te

            class M:
                def __init__(self, fc):
                    self.fc = fc
                    seq = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.BasicLinear(4, 4, device="meta")
                    op.weight = fc.weight
                    seq.append(op)
                    self.fused = seq
            """
        ),
        # Stored, and a replaying hook is registered later on the stored attribute.
        Example(
            """\
            import transformer_engine as te

            class M:
                def _build(self):
                    seq = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.BasicLinear(4, 4, device="meta")
                    op.weight = self.fc.weight
                    seq.append(op)
                    self._fused = (seq,)

                def forward(self, x):
                    if self._fused is None:
                        self._build()
                        self._fused[0].register_forward_pre_hook(self._replay)
                    return self._fused[0](x)

                def _replay(self, module, *_):
                    for hook in self.fc._forward_pre_hooks.values():
                        hook(self.fc, ())
            """
        ),
        # megatron-bridge TEFusedLoRALinear: the LoRA branch adopts the adapter's weights, and the main
        # branch, which runs first in forward, replays the hooks of every module in `self`.
        Example(
            """\
            import transformer_engine as te

            class FusedLoRA:
                def _make_branches(self):
                    main_branch = self._make_main()
                    lora_branch = self._make_lora()

                    def replay(module, *_):
                        for submodule in self.modules():
                            for hook in submodule._forward_pre_hooks.values():
                                hook(submodule, None)

                    main_branch.register_forward_pre_hook(replay)
                    return main_branch, lora_branch

                def _make_main(self):
                    seq = te.ops.Sequential()
                    op = te.ops.Linear(4, 4, device="meta")
                    op.weight = self.to_wrap.weight
                    seq.append(op)
                    return seq

                def _make_lora(self):
                    lora_branch = te.ops.Sequential()
                    op = te.ops.Linear(4, 2, device="meta")
                    op.weight = self.adapter.linear_in.weight
                    lora_branch.append(op)
                    return lora_branch

                def forward(self, x):
                    if self._branches is None:
                        self._branches = self._make_branches()
                    main_branch, lora_branch = self._branches
                    y, x2 = main_branch(x)
                    return lora_branch(x2, y)
            """
        ),
        # A plain torch.nn.Sequential is not an op fuser.
        Example(
            """\
            import torch

            def build(fc):
                seq = torch.nn.Sequential()
                lin = torch.nn.Linear(4, 4)
                lin.weight = fc.weight
                seq.append(lin)
                return seq
            """
        ),
    ]
    INVALID = [
        # megatron-core 0.18.2's TEGroupedMLP without its replay hook.
        Example(
            """\
            import transformer_engine as te

            class GroupedMLP:
                def _make_fused_ops(self):
                    ops = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.GroupedLinear(2, 4, 4, device="meta")
                    for idx in range(2):
                        setattr(op, f"weight{idx}", getattr(self.linear_fc1, f"weight{idx}"))
                    ops.append(op)
                    return ops

                def forward(self, x, splits):
                    if self._fused_ops is None:
                        self._fused_ops = (self._make_fused_ops(),)
                    (ops,) = self._fused_ops
                    return ops(x, splits)
            """,
            line=5,
        ),
        # Alias import form, direct attribute adoption through a local, stored in a tuple, run in forward.
        Example(
            """\
            import transformer_engine as te
            te_ops = te.pytorch.ops

            class FusedNorm:
                def _make(self):
                    weight = self.linear_fc1.layer_norm_weight
                    op = te_ops.RMSNorm(weight.shape, device="meta")
                    op.weight = weight
                    norm_seq = te_ops.Sequential()
                    norm_seq.append(op)
                    self._norm_seq = (norm_seq,)

                def forward(self, x):
                    return self._norm_seq[0](x)
            """,
            line=9,
        ),
        # megatron-core TEFusedMLPWithGroupedLinear: the norm runs in its own container before the one whose
        # hook replays linear_fc1's hooks, so it reads linear_fc1.layer_norm_weight before the gather.
        Example(
            """\
            import transformer_engine as te

            class FusedMLP:
                def _make_fused_impl(self):
                    op = te.pytorch.ops.RMSNorm(8, device="meta")
                    op.weight = self.linear_fc1.layer_norm_weight
                    norm_seq = te.pytorch.ops.Sequential()
                    norm_seq.append(op)
                    self._norm_seq = (norm_seq,)
                    fused_impl = te.pytorch.ops.Sequential()
                    fc1 = te.pytorch.ops.BasicLinear(8, 8, device="meta")
                    fc1.weight = self.linear_fc1.weight
                    fused_impl.append(fc1)
                    self._register_hooks(fused_impl)
                    return fused_impl

                def _register_hooks(self, fused_impl):
                    def forward_pre_hook(module, *_):
                        for submodule in self.modules():
                            for hook in submodule._forward_pre_hooks.values():
                                hook(submodule, ())

                    fused_impl.register_forward_pre_hook(forward_pre_hook)

                def forward(self, x):
                    if self._fused_impl is None:
                        self._fused_impl = (self._make_fused_impl(),)
                    normed = self._norm_seq[0](x)
                    return self._fused_impl[0](normed)
            """,
            line=7,
        ),
        # A hook is registered, but it only exposes main_grad: it replays nothing.
        Example(
            """\
            from transformer_engine.pytorch.ops import Sequential, BasicLinear

            class M:
                def _make(self):
                    op = BasicLinear(4, 4, device="meta")
                    op.register_parameter("weight", self.fc.get_parameter("weight"))
                    seq = Sequential(op)
                    seq.register_forward_pre_hook(self._expose)
                    return seq

                def _expose(self, module, *_):
                    for p in self.fc.parameters(recurse=False):
                        p.main_grad = p.get_main_grad()

                def forward(self, x):
                    seq = self._make()
                    return seq(x)
            """,
            line=7,
        ),
        # A module-level builder taking the source module as an argument; returned to a local caller.
        Example(
            """\
            import transformer_engine.pytorch.ops as teops

            def fuse(linear):
                seq = teops.Sequential()
                op = teops.BasicLinear(4, 4, device="meta")
                op.weight = linear.weight
                seq.append(op)
                return seq

            def run(linear, x):
                fused = fuse(linear)
                return fused(x)
            """,
            line=4,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: a finding is a call inside a function whose callee `ctx.names` resolves
        to one of `CONTAINERS`. `NameResolver` is mirrored on `ast` with every binding kept (it keeps the
        last one), so `_possible_names` is a superset of what it resolves. A callee written as a plain
        name is taken as a candidate without the inside-a-function test. The global-hook early return is
        mirrored exactly; adoption and replay only remove findings."""
        if "register_module_forward_pre_hook" in index.source:
            return False
        aliases = _possible_aliases(index)
        if aliases is None:
            return True
        for call in index.container_calls:
            in_function = isinstance(call.func, ast.Name) or any(
                s.kind == "def" for s in index.enclosing(pos(call))
            )
            if in_function and any(names_match(q, *CONTAINERS) for q in _possible_names(call.func, aliases)):
                return True
        for name in index.called_names:
            if any(names_match(q, *CONTAINERS) for q in aliases.get(name, ())):
                return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        if "register_module_forward_pre_hook" in ctx.source:
            return  # a global hook runs for every module, containers included: cannot reason about it
        analysis: _Analysis | None = None
        done: set[cst.FunctionDef] = set()
        for call in ctx.nodes(cst.Call):
            assert isinstance(call, cst.Call)
            if not isinstance(call.func, (cst.Name, cst.Attribute)):
                continue
            last = call.func.value if isinstance(call.func, cst.Name) else call.func.attr.value
            if last not in CONTAINER_NAMES and last not in ctx.names.aliases:
                continue
            analysis = analysis or _Analysis(ctx)
            if analysis.container_kind(call) is None:
                continue
            node = next((a for a in ctx.ancestors(call) if isinstance(a, cst.FunctionDef)), None)
            if node is None or node in done:
                continue
            done.add(node)
            for box in analysis.scan(node):
                kind = "op-fuser Sequential" if box.hookable else "OperationFuser"
                verdict = analysis.sibling_verdict(box, node)
                if verdict is not None and verdict[0] == "covered":
                    continue  # a sibling container replays those modules' hooks before this one runs
                if verdict is not None:
                    _, sibling, owner = verdict
                    yield Violation(
                        node=box.call,
                        context_node=box.statement,
                        message=(
                            f"TE {kind} `{box.name}` runs ops that adopt parameters of `{owner}`, whose pre-forward "
                            f"hooks are replayed only by the hook on `{sibling}`, which runs after `{box.name}` "
                            "already read them: the fused op may read sharded or not-yet-gathered weights; replay "
                            f"those hooks before `{box.name}` runs (register the replay on it too, or run it first)."
                        ),
                    )
                    continue
                remedy = (
                    "register a pre-forward hook on it that calls each source module's `_forward_pre_hooks` "
                    "(as megatron-core's TEGroupedMLP._make_fused_impl_pre_forward_hook does)"
                    if box.hookable
                    else "call each source module's `_forward_pre_hooks` before running it (an OperationFuser "
                    "cannot hold hooks)"
                )
                yield Violation(
                    node=box.call,
                    context_node=box.statement,
                    message=(
                        f"TE {kind} `{box.name}` runs ops that adopt parameters of other modules, but nothing "
                        "replays those modules' pre-forward hooks: data-parallel wrappers (Megatron-FSDP "
                        "unshard, DDP overlap_param_gather) hook the owning modules, whose forward the fused "
                        f"path bypasses, so the fused ops may read sharded or not-yet-gathered weights; {remedy}"
                    ),
                )
