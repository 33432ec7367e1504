"""MG012 and MG013 beyond their examples: each gate is sound (it passes wherever the rule reports with the gate
off) and filters (it rejects files the rule cannot report on), and the data-flow helpers they share
(`analyzer/dataflow.py`) follow names, loop targets and guards as documented."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from maingrad.analyzer import dataflow
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.engine import analyze_source
from maingrad.analyzer.rules import rules_by_id
from maingrad.analyzer.syntax_index import build_index

RULES = rules_by_id()

EDGES = [
    # MG012: the gated write, through a flag local and an alias.
    (
        "MG012",
        True,
        "def f(w, g):\n    done = w.grad_added_to_main_grad\n    buf = w.main_grad\n    if not done:\n        buf.add_(g)\n",
    ),
    # The hook moving .grad (directly, and autograd.grad results through a loop target): no finding, gated out.
    (
        "MG012",
        False,
        "def hook(p):\n    if not p.grad_added_to_main_grad:\n        p.main_grad.add_(p.grad.data)\n",
    ),
    (
        "MG012",
        False,
        "import torch\ndef cap(ps, o, i):\n    gs = torch.autograd.grad(o, i)\n    for p, g in zip(ps, gs):\n"
        "        if not getattr(p, 'grad_added_to_main_grad', False):\n            p.main_grad.add_(g)\n",
    ),
    # Only an existence test and a store of the flag: gated out.
    (
        "MG012",
        False,
        "def backward(ctx, w, g):\n    if hasattr(w, 'grad_added_to_main_grad'):\n        w.main_grad.add_(g)\n"
        "        w.grad_added_to_main_grad = True\n",
    ),
    # The flag read in another function than the write: gated out.
    (
        "MG012",
        False,
        "def a(w):\n    return w.grad_added_to_main_grad\ndef b(w, g):\n    w.main_grad.add_(g)\n",
    ),
    # An in-place helper on the buffer.
    (
        "MG012",
        True,
        "def f(w, g):\n    if not w.grad_added_to_main_grad:\n        inplace_add_(w.main_grad, g)\n",
    ),
    # MG013: Megatron code, a weight hook that all-reduces.
    (
        "MG013",
        True,
        "import torch\nfrom megatron.core import mpu\ndef f(m):\n    def h(g):\n        torch.distributed.all_reduce(g)\n"
        "        return g\n    m.weight.register_hook(h)\n",
    ),
    # Not Megatron/TE code: gated out.
    (
        "MG013",
        False,
        "import torch\ndef f(m):\n    def h(g):\n        torch.distributed.all_reduce(g)\n        return g\n"
        "    m.weight.register_hook(h)\n",
    ),
    # A hook on an autograd node or an activation: gated out.
    (
        "MG013",
        False,
        "from megatron.core import mpu\ndef f(self, p):\n    acc = p.expand_as(p).grad_fn.next_functions[0][0]\n"
        "    acc.register_hook(self._hook(p))\n",
    ),
    # Under megatron/ by path, a parameter argument through a tuple and a loop.
    (
        "MG013",
        True,
        "import torch\ndef f(weight: torch.nn.Parameter, bias):\n    for t in (weight, bias):\n"
        "        t.register_hook(lambda g: g * 2)\n",
    ),
]


@pytest.mark.parametrize(("rule_id", "passes", "code"), EDGES)
def test_gate_edges(rule_id: str, passes: bool, code: str) -> None:
    path = "megatron/core/x.py" if "Parameter" in code else "pkg/mod.py"
    index = build_index(code, path)
    assert index is not None
    gate = RULES[rule_id]().gate(index, RuleSettings())
    found = analyze_source(code, path, [RULES[rule_id]()], gate=False).findings
    assert gate == passes, [f.message for f in found]
    if found:
        assert gate  # soundness: a finding with the gate off implies the gate passes
    assert bool(found) == passes  # each edge is also a rule case (the gate is not the only filter)


def _ctx(code: str) -> FileContext:
    source = textwrap.dedent(code)
    return FileContext(path="m.py", source=source, module=cst.parse_module(source))


def test_deciding_tests_cover_guards_elif_chains_and_operands() -> None:
    ctx = _ctx(
        """\
        def f(a, b, c, d, buf, g):
            if a:
                return
            if b:
                pass
            elif c:
                d and buf.add_(g)
        """
    )
    call = next(
        n
        for n in ctx.nodes(cst.Call)
        if isinstance(n, cst.Call) and "add_" in cst.Module([]).code_for_node(n)
    )
    tests = {cst.Module([]).code_for_node(t) for t in dataflow.deciding_tests(ctx, call)}
    assert tests == {"a", "b", "c", "d"}


def test_bindings_follow_loop_targets_and_reads_skip_hasattr() -> None:
    ctx = _ctx(
        """\
        def f(ps, gs):
            for p, g in zip(ps, gs):
                flag = getattr(p, "grad_added_to_main_grad", False)
                probe = hasattr(p, "grad_added_to_main_grad")
        """
    )
    func = next(n for n in ctx.nodes(cst.FunctionDef) if isinstance(n, cst.FunctionDef))
    bindings = dataflow.local_bindings(func)
    assert set(bindings) >= {"p", "g", "flag", "probe"}
    assert dataflow.reads_attribute_value(cst.Name("flag"), "grad_added_to_main_grad", bindings)
    assert not dataflow.reads_attribute_value(cst.Name("probe"), "grad_added_to_main_grad", bindings)
    assert dataflow.derives_from(
        cst.Name("g"), lambda n: isinstance(n, cst.Name) and n.value == "gs", bindings
    )
