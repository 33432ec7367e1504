"""The vectorised steady-state path (large sites) and the per-parameter path must record and repair the same
things: the same scenarios run once with each path forced give identical records, counts and gradients."""

from __future__ import annotations

import pytest
import torch
from emulators import STRATEGIES, MegatronFSDP, batches, fsdp_run, make_layer

from maingrad.hooks import MainGradContractError, install, instrument
from maingrad.hooks.records import CallEntry, FlaggedRow, view

_VOLATILE = ("t_ns", "run")


def _scenario(mode: str, strategy: str, semantics: str, version: str, monkeypatch, threshold: int):
    monkeypatch.setattr(instrument, "VECTORISED_MIN_PARAMS", threshold)
    taken = {"vectorised": 0}
    original = instrument.Site._inspect_vectorised

    def counting(self, *args):
        result = original(self, *args)
        taken["vectorised"] += result is not instrument._SLOW
        return result

    monkeypatch.setattr(instrument.Site, "_inspect_vectorised", counting)
    model = MegatronFSDP(make_layer(version=version), strategy, semantics=semantics)
    handle = install(model, mode, run="paths")
    try:
        grads, losses = fsdp_run(model, batches(2, 3), on_step=handle.step)
        error = None
    except (MainGradContractError, RuntimeError) as exc:  # check mode, or TE failing in observe mode
        grads, losses, error = None, None, str(exc)
    records = [{k: v for k, v in r.items() if k not in _VOLATILE} for r in handle.records()]
    for r in records:  # addresses differ between runs (and so does the allocator's reuse of them)
        r["data_ptr"] = r["data_ptr"] is not None
    summary = handle.summary()
    counts = [(m.module, m.forward_calls, m.backward_calls, m.exposed, m.anomalies) for m in summary.modules]
    handle.remove()
    monkeypatch.undo()
    return records, counts, grads, losses, error, taken["vectorised"]


@pytest.mark.parametrize("semantics", ["main", "0.19.2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("mode", "version"),
    [("fix", "0.18.2"), ("observe", "0.19.2"), ("observe", "0.18.2"), ("check", "0.19.2")],
)
def test_vectorised_and_per_parameter_paths_agree(
    mode: str, version: str, strategy: str, semantics: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    each = _scenario(mode, strategy, semantics, version, monkeypatch, threshold=10**9)
    vectorised = _scenario(mode, strategy, semantics, version, monkeypatch, threshold=1)
    assert each[5] == 0
    if mode != "observe" or version != "0.18.2":  # observe on 0.18.2 fails at the first forward
        assert vectorised[5] > 0, "the vectorised path was never taken"
    assert vectorised[0] == each[0]
    assert vectorised[1] == each[1]
    assert vectorised[4] == each[4]
    if each[2] is not None:
        assert vectorised[3] == each[3]
        for got, want in zip(vectorised[2], each[2], strict=True):
            assert set(got) == set(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_vectorised_path_falls_back_on_a_raising_property(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter attribute that raises inside the vectorised pass: the per-parameter path records it."""
    monkeypatch.setattr(instrument, "VECTORISED_MIN_PARAMS", 1)
    model = MegatronFSDP(make_layer(version="0.19.2"), "optim_grads")
    handle = install(model, "observe")
    fsdp_run(model, batches(1, 1), on_step=handle.step)

    class Boom(torch.nn.Parameter):
        @property
        def grad_added_to_main_grad(self):  # noqa: D401 - a broken attribute
            raise ValueError("boom")

    experts = model.module.experts
    name, param = next(iter(experts.linear_fc1._parameters.items()))
    boom = Boom(param.detach().clone())
    boom.main_grad = torch.zeros_like(param)
    experts.linear_fc1._parameters[name] = boom
    (site,) = handle._sites
    site.pre_forward(experts, None)
    records = handle.records()
    assert any(r["anomaly"] == "hook_error" for r in records)
    assert handle.summary().modules[0].errors >= 1
    handle.remove()


def _general_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send every call to the general per-parameter path (no fast path of either kind)."""
    monkeypatch.setattr(instrument, "VECTORISED_MIN_PARAMS", 10**9)
    for name in ("_fast_rows", "_fast_ptrs", "_fast_backward"):
        monkeypatch.setattr(instrument.Site, name, lambda self, *args: instrument._SLOW)
    check_order = instrument.Site._check_order

    def no_lean(self, module):  # pre_forward's lean branch inlines _fast_rows: keep it off too
        check_order(self, module)
        self.route.lean = False

    monkeypatch.setattr(instrument.Site, "_check_order", no_lean)


def _run(mode: str, strategy: str, semantics: str, version: str, every: int, policy: str, fused: bool = True):
    # fused=False: the experts' GroupedLinear children are TE modules of their own (small, lean sites)
    model = MegatronFSDP(make_layer(version=version, fused=fused), strategy, semantics=semantics)
    handle = install(model, mode, run="paths", sample_every=every, overwrite_policy=policy)
    try:
        grads, _ = fsdp_run(model, batches(2, 3), on_step=handle.step)
    except (MainGradContractError, RuntimeError) as exc:
        grads = str(exc)
    records = [{k: v for k, v in r.items() if k not in _VOLATILE} for r in handle.records()]
    for r in records:
        r["data_ptr"] = r["data_ptr"] is not None
    counts = [m for m in handle.summary().to_dict()["modules"]]
    handle.remove()
    return records, counts, grads


@pytest.mark.parametrize("fused", [True, False], ids=["container", "te-modules"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("mode", "version", "semantics", "every", "policy"),
    [
        ("fix", "0.18.2", "main", 1, "keep"),
        ("fix", "0.18.2", "0.19.2", 2, "force_true"),
        ("observe", "0.19.2", "0.19.2", 1, "keep"),
        ("check", "0.19.2", "main", 0, "keep"),
        ("check", "0.19.2", "0.19.2", 1, "keep"),
    ],
)
def test_per_parameter_fast_paths_agree_with_the_general_path(
    mode: str, version: str, semantics: str, every: int, policy: str, strategy: str, fused: bool, monkeypatch
) -> None:
    taken = {"fast": 0}
    for name in ("_fast_rows", "_fast_ptrs", "_fast_backward"):
        original = getattr(instrument.Site, name)

        def counting(self, *args, original=original):
            result = original(self, *args)
            taken["fast"] += result is not instrument._SLOW
            return result

        monkeypatch.setattr(instrument.Site, name, counting)
    fast = _run(mode, strategy, semantics, version, every, policy, fused)
    monkeypatch.undo()
    # TE modules under sharded gradients hold main_grad None at forward and at the gradient hook (TE refreshes
    # it inside its own backward): the fast paths take that too
    assert taken["fast"] > 0, "no per-parameter fast path was taken"
    _general_only(monkeypatch)
    general = _run(mode, strategy, semantics, version, every, policy, fused)
    assert fast[0] == general[0]
    assert fast[1] == general[1]
    if isinstance(general[2], str):
        assert fast[2] == general[2]
    else:
        for got, want in zip(fast[2], general[2], strict=True):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


class _Fused(torch.nn.Module):
    fuse_wgrad_accumulation = True  # a TE module by duck typing

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.ones(4, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for param in self._parameters.values():
            x = x @ param
        return x


def _step(module: torch.nn.Module) -> None:
    module(torch.ones(1, 4, requires_grad=True)).sum().backward()


@pytest.mark.parametrize("vectorised", [False, True])
def test_plain_flag_reads_switch_to_getattr_where_flags_are_absent(vectorised: bool, monkeypatch) -> None:
    """DDP-like parameters (main_grad, no overwrite flag, no __fsdp_param__): the fast paths read the flags
    with getattr from the first call that meets one absent, and record exactly what the general path does."""
    monkeypatch.setattr(instrument, "VECTORISED_MIN_PARAMS", 1 if vectorised else 10**9)

    def records(general: bool) -> tuple[list[dict], bool]:
        if general:
            _general_only(monkeypatch)
        module = _Fused()
        for param in module.parameters():
            param.main_grad = torch.zeros(4, 4)
            param.grad_added_to_main_grad = False
        handle = install(module, "observe", run="flags")
        _step(module)
        _step(module)
        (site,) = handle._sites
        out = [{**r, "t_ns": None, "data_ptr": r["data_ptr"] is not None} for r in handle.records()]
        handle.remove()
        return out, site.route.flag_reads

    fast, flag_reads = records(False)
    general, _ = records(True)
    assert not flag_reads
    assert fast == general and len(fast) == 12
    assert {(r["overwrite_main_grad"], r["is_fsdp_param"], r["anomaly"]) for r in fast} == {
        (None, False, None)
    }


def test_plain_flag_reads_survive_an_absent_main_grad() -> None:
    """An absent main_grad (Megatron-FSDP before the first backward) does not switch the flag reads off."""
    module = _Fused()
    for param in module.parameters():
        param.__fsdp_param__ = True
        param.overwrite_main_grad = False
        param.grad_added_to_main_grad = False
        buf = torch.zeros(4, 4)
        param.get_main_grad = lambda buf=buf: buf
    handle = install(module, "observe")
    (site,) = handle._sites
    _step(module)  # no main_grad anywhere: the general path records it
    assert site.route.flag_reads
    for param in module.parameters():
        param.main_grad = param.get_main_grad()
    _step(module)
    assert site.route.flag_reads and handle.summary().ok
    handle.remove()


def test_a_new_buffer_at_a_known_address_is_validated_again() -> None:
    """The per-parameter fast path skips the element-count check when a slot's buffer metadata names the same
    address; the metadata is dropped whenever another buffer is validated in between (here by a call that is
    not recorded), so a wrong-sized view at the first address is still caught."""
    module = _Fused(2)
    big = torch.zeros(64)
    other = torch.zeros(4, 4)
    for param in module.parameters():
        param.main_grad = torch.zeros(4, 4)
    weight0 = module.weight0
    weight0.main_grad = big[:16].view(4, 4)
    handle = install(module, "check", sample_every=2)
    _step(module)  # recorded: weight0's metadata names big's address
    weight0.main_grad = other
    _step(module)  # not recorded, still checked: `other` validated
    weight0.main_grad = big[:8].view(2, 4)  # big's address again, 8 elements for a 16-element parameter
    with pytest.raises(MainGradContractError, match="main_grad_shape_mismatch"):
        _step(module)
    handle.remove()


@pytest.mark.parametrize("exact", [True, False], ids=["gbuf", "no-gbuf"])
@pytest.mark.parametrize("vectorised", [False, True])
def test_containers_note_their_starting_buffers_only_where_a_backward_reads_them(
    exact: bool, vectorised: bool, monkeypatch
) -> None:
    """The overwrite heuristic compares a micro-batch's starting buffers with the previous backward's, for
    micro-batches >= 1 only: a step's first micro-batch (and an unrecorded call) takes no snapshot. Once a
    backward finds Megatron-FSDP's exact answer (`_gbuf.is_data_distributed`), the snapshots stop; without
    `_gbuf` they go on, and the heuristic flags what the exact answer would."""
    monkeypatch.setattr(instrument, "VECTORISED_MIN_PARAMS", 1 if vectorised else 10**9)
    calls = []
    original = instrument.Slots.current_ptrs
    handle = None  # the micro-batch each snapshot is taken at: the site's, once installed
    monkeypatch.setattr(
        instrument.Slots, "current_ptrs", lambda self: calls.append(handle._sites[0].mb) or original(self)
    )
    model = MegatronFSDP(make_layer(version="0.19.2"), "optim")
    if not exact:
        for param in model.raw.values():
            del param._gbuf
    handle = install(model, "observe")
    fsdp_run(model, batches(2, 3), on_step=handle.step)  # the first call builds the fused object
    (site,) = handle._sites
    assert site.container.exact_overwrite is exact
    assert calls == ([1] if exact else [1, 2, 1, 2])
    # optim keeps the persistent buffer: from micro-batch 1 on every backward overwrites (0.19.2 forces it)
    flagged = [r for r in handle.records() if r["anomaly"] == "overwrite_discards_microbatch"]
    assert {(r["step"], r["microbatch"]) for r in flagged} == {(s, m) for s in (0, 1) for m in (1, 2)}
    handle.remove()


def test_a_steady_lean_site_records_its_forward_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small TE-module site recording every call: only its first forward (hook order not checked yet) goes
    through _fast_rows; later ones run the loop inlined in pre_forward, never the general path."""
    forwards = []
    fast_rows, each = instrument.Site._fast_rows, instrument.Site._inspect_each

    def counting_rows(self, mb):
        forwards.append("fast_rows")
        return fast_rows(self, mb)

    def counting_each(self, phase, *args):
        if phase == instrument.FORWARD:
            forwards.append("general")
        return each(self, phase, *args)

    monkeypatch.setattr(instrument.Site, "_fast_rows", counting_rows)
    monkeypatch.setattr(instrument.Site, "_inspect_each", counting_each)
    module = _Fused()
    for param in module.parameters():
        param.main_grad = torch.zeros(4, 4)
        param.__fsdp_param__ = True
        param.overwrite_main_grad = True
        param.grad_added_to_main_grad = False
    handle = install(module, "observe")
    (site,) = handle._sites
    for _ in range(3):
        _step(module)
        handle.step()
    assert site.route.lean and site.counters.fwd_calls == 3 and forwards == ["fast_rows"]
    records = handle.records()
    handle.remove()
    assert not site.route.lean  # released: the hook is a no-op from now on
    assert len(records) == 18
    assert {(r["anomaly"], r["is_fsdp_param"], r["overwrite_main_grad"]) for r in records} == {
        (None, True, True)
    }


@pytest.mark.parametrize("leaf_output", [False, True])
def test_backward_inspection_runs_once_per_backward(leaf_output: bool) -> None:
    """The backward recorder hangs on the output's autograd node (a pre-hook), or on the output itself when
    it has no node (a leaf the module returns as is): either way it runs at that backward. (A hook on a leaf
    stays on it, so a module returning a leaf gets one more each call, as before: one call only here.)"""

    class Leafy(_Fused):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight0 if leaf_output else super().forward(x)

    module = Leafy(2)
    for param in module.parameters():
        param.main_grad = torch.zeros(4, 4)
    handle = install(module, "observe")
    calls = 1 if leaf_output else 3
    for _ in range(calls):
        out = module(torch.ones(1, 4, requires_grad=True))
        assert (out.grad_fn is None) == leaf_output
        out.sum().backward()
        handle.step()
    (counts,) = handle.summary().modules
    assert (counts.forward_calls, counts.backward_calls) == (calls, calls)
    phases = [r["phase"] for r in handle.records()]
    assert phases == ["forward", "forward", "backward", "backward"] * calls
    handle.remove()


def _changing_run(general: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], list[tuple]]:
    """A small lean site over calls where one slot at a time changes (a flag, its buffer, an overwrite that
    is flagged), each followed by an unchanged call; returns its records and the ring's entries."""
    if general:
        _general_only(monkeypatch)
    module = _Fused(3)
    for param in module.parameters():
        param.main_grad = torch.zeros(4, 4)
        param.__fsdp_param__ = True
        param.overwrite_main_grad = False
        param.grad_added_to_main_grad = False
        param.get_main_grad = lambda param=param: torch.zeros_like(param)
    handle = install(module, "observe", run="reuse")
    params = list(module.parameters())
    changes = [
        lambda: None,
        lambda: setattr(params[0], "overwrite_main_grad", True),  # first slot; flagged from micro-batch 1 on
        lambda: setattr(params[1], "grad_added_to_main_grad", True),  # middle slot
        lambda: setattr(params[2], "main_grad", torch.zeros(4, 4)),  # last slot: another buffer
        lambda: setattr(params[0], "overwrite_main_grad", False),
        lambda: setattr(params[1], "main_grad", torch.zeros(16)),  # a flat view of the right size
        lambda: setattr(params[2], "main_grad", None),  # Megatron-FSDP between refreshes: recorded as None
        lambda: setattr(params[2], "main_grad", torch.zeros(4, 4)),
    ]
    for change in changes:
        change()
        _step(module)
        _step(module)  # unchanged
    entries = list(handle._rt.ring.current)
    records = [{**r, "t_ns": None, "data_ptr": r["data_ptr"] is not None} for r in handle.records()]
    handle.remove()
    return records, entries


def test_unchanged_small_site_calls_push_the_last_rows_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small site's steady-state call whose rows equal the last call's (same buffer metadata and flags, per
    phase) pushes the same rows tuple instead of new rows; any change in any slot builds new ones. Records stay
    exactly the general path's, a main_grad that is None (refreshable) included."""
    records, entries = _changing_run(False, monkeypatch)
    general, _ = _changing_run(True, monkeypatch)
    assert records == general and len(records) == 16 * 2 * 3
    assert all(type(e[2]) is tuple for e in entries), "a call took the general path (its rows are a list)"
    nones = [r for r in records if r["main_grad_is_none"]]
    assert len(nones) == 4 and {(r["param"], r["anomaly"]) for r in nones} == {("weight2", None)}
    overwrites = [r for r in records if r["anomaly"] == "overwrite_discards_microbatch"]
    assert overwrites and all(r["phase"] == "backward" and r["param"] == "weight0" for r in overwrites)
    calls = [view(e) for e in entries if e[0] is CallEntry]
    forwards = [e for e in calls if e.phase == instrument.FORWARD]
    backwards = [e for e in calls if e.phase == instrument.BACKWARD]
    assert len(forwards) == len(backwards) == 16
    # forward: the second call of each pair reuses the first's rows; a change never does
    reused = [b.rows is a.rows for a, b in zip(forwards, forwards[1:], strict=False)]
    assert reused[0::2] == [True] * 8
    assert not any(reused[1::2])  # every change shows in the forward's rows
    # backward rows holding an overwrite anomaly are never pushed again as the steady rows
    for entry in backwards:
        flagged = [row for row in entry.rows if row[0] is FlaggedRow]
        if flagged:
            assert all(view(row).anomaly == "overwrite_discards_microbatch" for row in flagged)
