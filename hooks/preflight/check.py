"""One preflight call's state and runs: the wrapper's calls, the runs from zeroed buffers (every micro-batch
alone, then all of them in the rotated order, then the repeat where a verdict could be noise) and the loss
evaluations the finite differences make. The finite differences themselves live in `loss_fd.py` (on the
loss) and `local_fd.py` (on a module's own output, inside the runs' backwards); `Check` owns one of each,
and both read the runs' state from it. `run.py` drives the call; `classify.py` turns the numbers into
verdicts."""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from maingrad.hooks.preflight import local
from maingrad.hooks.preflight.graphs import LossGraph
from maingrad.hooks.preflight.local_fd import LocalFD
from maingrad.hooks.preflight.loss_fd import LossFD
from maingrad.hooks.preflight.measure import (
    SUBSET,
    Dist,
    Stats,
    Subsets,
    copies,
    copy_dtype,
    flat,
    foreach_add_,
    foreach_mul_,
    foreach_sub_,
    fused_kinds,
    leaf_pattern,
    norms,
    some,
    unit_roundoff,
)
from maingrad.hooks.preflight.result import ParamResult
from maingrad.hooks.preflight.state import (
    BufferState,
    RngPair,
    RngState,
    StepStart,
    fp8_state_pairs,
    fp8_tensors,
)
from maingrad.hooks.preflight.wrappers import Adapter, Entry

# the fit-by-position verdicts whose residual can rule out run-to-run noise (0/1 patterns: a random scale per
# backward would have to be about 1 to make them, while any other coefficient could be such a scale), and the
# fewest subset elements for that, per direction of the fit (N singles and the sequence)
NOT_NOISE_IF_FITTED = frozenset({"grad_overwritten", "grad_lost"})
FIT_DIM = 16

RunMicrobatch = Callable[[torch.nn.Module, Any], Any]
LossFn = Callable[[torch.nn.Module, Any], Any]
FP8_FD_RTOL = 0.25  # 4 units of e4m3's round-off: an FP8 weight's factor within 1.25 is not judged
# weights of at most this many elements are always in the probe on the first micro-batch's loss (biases, norms:
# a sliver of the bytes moved; through them it checks the gradient each module's output got)
END_TO_END_MAX = 1 << 16
# where the module-local screening runs first, the copies of G(first) kept for that probe: at most this share
# of the copy's bytes
LATE_SHARE = 0.25
# the probe on the first micro-batch's loss after the screening (`plan_loss_level`): off, the probe runs first
# and moves every weight. On the H200 the path after the screening cost 4.49 training steps on a correct 541M
# bf16 GPT against 4.05 with the probe first, and more loss forwards on every bf16 GPT of the zoo (10-40 against
# 6-8); before the spread rule of `LossFD._spread_band` it cost 13.6
AFTER_SCREENING = False


class Check:
    """One preflight call: the runs, the wrapper's calls and their bookkeeping; its finite differences on the
    loss (`loss_fd`) and on the modules' outputs (`local_fd`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        run_microbatch: RunMicrobatch,
        batches: list[Any],
        *,
        loss_fn: LossFn | None,
        adapter: Adapter,
        params: str | Sequence[str] | None,
        finite_differences: bool,
        fd_groups: str,
        fd_step: float | None,
        fd_rtol: float | None,
        rtol: float | None,
        rng_states: Sequence[RngPair],
        module_fd: bool = True,
        module_fd_classes: tuple[type, ...] = (),
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.run_microbatch = run_microbatch
        self.batches = batches
        self.loss_fn = loss_fn
        self.adapter = adapter
        self.finite_differences = finite_differences
        self.fd_groups = fd_groups
        self.fd_step = fd_step
        self.fd_rtol = fd_rtol
        self.rtol = rtol
        n = len(batches)
        # the sequence, rotated by one against the singles
        self.order = [*range(1, n), 0] if n > 1 else [0, 0]
        entries = adapter.entries
        if params is not None:
            patterns = [params] if isinstance(params, str) else list(params)
            entries = [e for e in entries if any(fnmatch.fnmatchcase(e.name, pat) for pat in patterns)]
        self.entries: list[Entry] = entries
        self.passes = 0
        self.forwards = 0
        self.syncs = 0
        self.timings: dict[str, float] = {}
        self.dist = Dist(sharded=adapter.sharded)
        kinds = fused_kinds(model)
        self.results = [self._result(e, kinds.get(e.name)) for e in entries]
        self.stats = Stats(len(entries), self.dist)
        self.subsets = Subsets(entries)
        self.present: dict[str, set[int]] = {}
        self.copy: list[torch.Tensor | None] = [None] * len(entries)
        self.copy_bytes = 0
        self.copy_dtypes: set[str] = set()
        # per parameter whose only failure is the fit by position: (its coefficients by micro-batch, the
        # singles' squared norm on its subset); the fit's residual decides whether the repeat is needed
        self.fits: dict[int, tuple[list[float], float]] = {}
        self.first_loss: Any = None
        # the probe on the first micro-batch's loss runs after the module-local screening (`plan_loss_level`)
        # and moves these weights (`loss_level`)
        self.late = False
        self.fd_first: list[int] = []
        self.fd_anchors: list[int] = []
        fp8 = fp8_tensors(model)
        self.rng = RngState([*fp8_state_pairs(model, fp8), *rng_states])
        self.fp8_known = {id(t) for t in fp8}
        self.step_start = StepStart(model)
        # the module buffers as the caller left them: every run and every loss evaluation starts from them, as
        # a training step starts from the last one's (without it, a forward that updates a buffer it computes
        # with - spectral norm's power iteration - starts each run where the last one left off); within a run
        # they move as in training. The buffers a run wrote: `stateful`
        self.buffers = BufferState(model)
        self.stateful: set[str] = set()
        # parameters a run's forward wrote in place (an Embedding's max_norm renormalises the rows it looks up):
        # the loss is not a function of the weight their gradient is for (`Adapter.tracks_writes`)
        self.written: set[int] = set()
        self.owners = {id(p): m for m in model.modules() for p in m._parameters.values() if p is not None}
        self.fp8_entries: set[int] = set()  # parameters whose module computed in FP8 (known after a run)
        self.synced = False  # prepare() or commit() ran after the last change of the weights
        self.zeroed = False  # zero() ran after the last backward
        self.uninstalled = False  # weights moved or restored in place since the last commit()
        # the loss's round-off (coarser for a bf16 loss: `loss`)
        self.loss_unit = unit_roundoff(torch.float32)
        # (pyright reads this file also as `hooks.preflight.check`, the folder it lives in, where the parts
        # expect the installed name's `Check`: the same class)
        self.graphs = LossGraph(self, cuda_graphs)  # pyright: ignore[reportArgumentType]
        self.loss_fd = LossFD(self)  # pyright: ignore[reportArgumentType]
        self.local_fd = LocalFD(self, module_fd, module_fd_classes)  # pyright: ignore[reportArgumentType]

    def _result(self, e: Entry, kind: str | None) -> ParamResult:
        module_type = f"{e.parent_type}/{e.owner_type}.{leaf_pattern(e.leaf)}"
        mechanism = kind or "autograd"
        if self.fd_groups == "param":
            group = e.name
        elif self.fd_groups == "module_type":
            group = f"{mechanism}:{module_type}"
        else:
            group = mechanism
        return ParamResult(
            name=e.name,
            module=e.module,
            leaf=e.leaf,
            module_type=module_type,
            mechanism_kind=mechanism,
            group=group,
            numel=int(e.opt_param.numel()),
        )

    def tolerance(self, i: int, grad_dtype: torch.dtype) -> float:
        """Linearity tolerance of parameter i: 8 units of round-off of the least precise of the gradient's,
        the compute and the optimizer parameter's dtypes (at least 4e-6), or the caller's rtol."""
        e = self.entries[i]
        u = max(
            unit_roundoff(grad_dtype),
            unit_roundoff(self.adapter.compute_dtype(e)),
            unit_roundoff(e.opt_param.dtype),
        )
        return self.rtol if self.rtol is not None else max(8 * u, 4e-6)

    def fd_tolerance(self, i: int) -> float:
        """How far a reported gradient may differ from the loss's derivative beyond the estimate's error bar:
        16 units of round-off of the compute dtype (the backward's own rounding), FP8_FD_RTOL for a weight of
        a module that computes in FP8 (its forward and backward GEMMs round operands to 3 or 2 mantissa bits),
        or the caller's fd_rtol."""
        if self.fd_rtol is not None:
            return self.fd_rtol
        if i in self.fp8_entries:
            return FP8_FD_RTOL
        return 16 * unit_roundoff(self.adapter.compute_dtype(self.entries[i]))

    def adopt_fp8_state(self) -> bool:
        """After the first run: TE creates its FP8 scaling state at a module's first FP8 forward, so a model that
        never ran one ran that micro-batch with fresh scales and left new ones. Fix the new state from now on
        and say whether the run must be repeated (every run must start from the same state). Also notes which
        parameters computed in FP8."""
        self.fp8_entries = {
            i
            for i, e in enumerate(self.entries)
            if getattr(self.owners.get(id(e.raw_param)), "fp8", False) is True
        }
        new = [t for t in fp8_tensors(self.model) if id(t) not in self.fp8_known]
        if not new:
            return False
        self.fp8_known.update(id(t) for t in new)
        self.rng.adopt(fp8_state_pairs(self.model))
        self.stats = Stats(len(self.entries), self.dist)
        self.subsets = Subsets(self.entries)
        self.present = {}
        self.copy = [None] * len(self.entries)
        self.copy_bytes = 0
        self.copy_dtypes = set()
        self.first_loss = None
        return True

    # -- the wrapper's calls ----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """The training loop's `start_param_sync()` after the weights changed (and before the first run)."""
        if not self.synced:
            self.adapter.prepare()
            self.synced = True

    def commit(self) -> None:
        """Install weights moved in place (and prepare them for the next forward)."""
        self.adapter.commit()
        self.synced, self.uninstalled = True, False

    def _zero(self) -> None:
        """Zero the gradient buffers through the wrapper, unless nothing ran backward since they were zeroed."""
        if not self.zeroed:
            self.adapter.zero()
            self.zeroed = True

    def _microbatch(self, batch: Any) -> Any:
        self.rng.apply()
        self.zeroed = False
        loss = self.run_microbatch(self.model, batch)
        self.passes += 1
        return loss

    def host(self, keys: Sequence[str] | None = None) -> dict[str, list[float | None]]:
        self.syncs += 1
        return self.stats.host(keys)

    # -- runs -------------------------------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for e in self.entries:
            g = self.adapter.grad(e)
            out.append(None if g is None else flat(g))
        return out

    def _run(
        self, key: str, which: Sequence[int], probe: local.LocalProbe | None = None
    ) -> list[torch.Tensor | None]:
        """Zero; read what the optimizer would see right after zeroing (must be nothing); run the micro-batches
        `which` from the saved random state each; finish the sync. Returns the wrapper's own flattened
        gradients (never kept past the next run); their squared norms and subsets are recorded under `key`."""
        self._prepare()
        self._zero()
        left = self._grads()
        stale = [i for i, f in enumerate(left) if f is not None]
        if stale:
            self.stats.add("stale2", stale, norms(some(left, stale)) ** 2)
            self.stats.add("stale_n", stale, torch.ones(len(stale)), shard_sum=False)
        del left
        self.buffers.restore(aliased=False)
        self.step_start.begin()
        # (preflight's own moves go through .data: a tensor with a version counter of its own; a tensor subclass,
        # a quantized weight, may update its own caches in place: not watched)
        versions = {
            i: e.raw_param._version
            for i, e in enumerate(self.entries)
            if self.adapter.tracks_writes and type(e.raw_param) is torch.nn.Parameter
        }
        with probe.watching() if probe is not None else contextlib.nullcontext():
            for b in which:
                if probe is not None:
                    probe.current = b
                loss = self._microbatch(self.batches[b])
                if key == "s0" and self.loss_fn is None:
                    self.first_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self.adapter.finish()
        self.stateful.update(self.buffers.moved())
        self.written.update(i for i, v in versions.items() if self.entries[i].raw_param._version != v)
        flats = self._grads()
        present = [i for i, f in enumerate(flats) if f is not None]
        self.present[key] = set(present)
        if present:
            self.stats.add(f"n:{key}", present, norms(some(flats, present)) ** 2)
        self.subsets.take(key, flats)
        return flats

    def first(self) -> None:
        """The first micro-batch alone; its gradient is copied (rounded) for the finite differences' directions
        and the sum of the singles, then the wrapper's own gradients are released."""
        flats = self._run("s0", [0])
        for i, f in enumerate(flats):
            if f is not None:
                self.results[i].dtype = str(f.dtype)
        idx = [i for i, f in enumerate(flats) if f is not None]
        live = some(flats, idx)
        views = copies(
            live, [copy_dtype(f.dtype, self.tolerance(i, f.dtype)) for i, f in zip(idx, live, strict=True)]
        )
        for i, view in zip(idx, views, strict=True):
            self.copy[i] = view
            self.copy_bytes += view.numel() * view.element_size()
            self.copy_dtypes.add(str(view.dtype))
        del flats, live
        self._zero()  # releases the wrapper's own G (Megatron-FSDP, plain .grad) while the weights move
        if self.local_fd.on:
            self.local_fd.find_tensors()
        if self.finite_differences:
            self.loss_fd.measure()

    def plan_loss_level(self) -> None:
        """Whether the probe on the first micro-batch's loss waits for the module-local screening (`late`): then
        it moves only the weights the screening did not judge, and the small ones (`loss_level`). It waits
        where the weights the screening cannot judge whatever it finds (not in a module it reruns, or in one
        computing in FP8) and the small ones are at most LATE_SHARE of the copy (their copies are kept until
        the probe), and there is a small weight for it to move: else it runs first and moves every weight.
        Only where AFTER_SCREENING is set (off by default)."""
        self.late = False
        if not (AFTER_SCREENING and self.finite_differences and self.local_fd.on):
            return
        now = self.loss_fd.now
        small = self._small(now)
        unjudged = set(self.local_fd.unjudgeable()) | small
        need = sum(self._copy_bytes(i) for i in now if i in unjudged)
        self.late = bool(small) and need <= LATE_SHARE * self.copy_bytes

    def loss_level(self) -> tuple[list[int], list[int], list[int]]:
        """After the screening: the weights the probe on the first micro-batch's loss moves (every weight with a
        gradient there that the screening did not judge `ok`, and every small one: the probe's check of the
        gradient that reached each module's output, which the module-local one takes as given); those it
        leaves to the probe on all micro-batches' loss (`LossFD.probe_rest`, along the sum of the singles)
        where keeping their copies would pass LATE_SHARE of the copy (a screening that judged few weights);
        and its anchors (`LossFD.probe_first`): per group of those weights, the weight judged `ok` whose
        predicted change |w| |G| is the largest whose copy still fits in LATE_SHARE."""
        now = self.loss_fd.now
        ok = self.local_fd.judged_ok()
        small = self._small(now)
        wanted = [i for i in now if i not in ok or i in small]
        budget = LATE_SHARE * self.copy_bytes - sum(self._copy_bytes(i) for i in wanted if i in small)
        first, rest = [], []
        for i in wanted:
            if i in small or self._copy_bytes(i) <= budget:
                first.append(i)
                budget -= 0 if i in small else self._copy_bytes(i)
            else:
                rest.append(i)
        anchors: dict[str, int] = {}
        change = {i: self.loss_fd.sizes[i] * self.loss_fd.gnorms[i] for i in now}
        groups = {self.results[i].group for i in first}
        for i in sorted((i for i in now if i in ok and i not in small), key=lambda i: -change[i]):
            group = self.results[i].group
            if group in groups and group not in anchors and self._copy_bytes(i) <= budget:
                anchors[group] = i
                budget -= self._copy_bytes(i)
        return first, rest, list(anchors.values())

    def upstream(self) -> None:
        """After the probe on the first micro-batch's loss, where it ran after the screening: a weight it blames
        that its own module judged `ok` got a gradient at the module's output that was already off (a wrong
        backward upstream, a loss scaled in the backward only), and so may every weight the module-local check
        judged: those it did not move go to the probe on all micro-batches' loss (`LossFD.probe_rest`), which
        names each of them."""
        ok = self.local_fd.judged_ok()
        if not self.loss_fd.blamed() & ok:
            return
        moved = set(self.fd_first) | set(self.loss_fd.anchored)
        self.loss_fd.later += [i for i in self.loss_fd.now if i in ok and i not in moved]

    def _small(self, indexes: list[int]) -> set[int]:
        """The weights of `indexes` the loss-level probe always moves (END_TO_END_MAX)."""
        return {i for i in indexes if self.results[i].numel <= END_TO_END_MAX}

    def _copy_bytes(self, i: int) -> int:
        c = self.copy[i]
        return 0 if c is None else c.numel() * c.element_size()

    def single(self, k: int) -> None:
        """Micro-batch k alone, added into the copy. The second one's backward holds the module-local
        screening; where the probe on the first micro-batch's loss waits for it (`late`), the gradients that
        probe moves along are copied before this single is added."""
        last = len(self.batches) - 1
        probe = self.local_fd.screening() if k == 1 else None
        flats = self._run(f"s{k}", [k], probe)
        if probe is not None:
            self.local_fd.judge(probe, flats, screening=True)
        if k == 1 and self.late:
            first, rest, anchors = self.loss_level()
            self.loss_fd.keep([*first, *anchors])
            self.loss_fd.later += rest
            self.fd_first, self.fd_anchors = first, anchors
        adds: list[int] = []
        for i in self.present[f"s{k}"]:
            f = cast(torch.Tensor, flats[i])
            if self.copy[i] is None:
                dtype = copy_dtype(f.dtype, self.tolerance(i, f.dtype))
                self.copy[i] = f.to(dtype, copy=True)
                self.copy_bytes += f.numel() * dtype.itemsize
                self.copy_dtypes.add(str(dtype))
            else:
                adds.append(i)
        if adds:  # one multi-tensor launch, not one add per parameter
            foreach_add_(some(self.copy, adds), some(flats, adds))
        if k == last:
            self.local_fd.plan_refinement(flats, k)
        del flats
        if k == 1 and self.late:
            self._zero()  # (as after the first run)

    def sequence(self) -> None:
        """All micro-batches accumulated in the rotated order, subtracted from the sum of the singles in place."""
        copy = self.copy
        held = [i for i, c in enumerate(copy) if c is not None]
        if len(self.batches) == 1 and held:
            foreach_mul_(some(copy, held), 2.0)  # (A, A) against 2 G(A)
        probe = self.local_fd.refinement()
        flats = self._run("seq", self.order, probe)
        self.local_fd.judge_refinement(probe, copy)
        both = [i for i in self.present["seq"] if copy[i] is not None]
        if both:
            cs = some(copy, both)
            foreach_sub_(cs, some(flats, both))
            self.stats.add("d2", both, norms(cs) ** 2)
        only_seq = [i for i in self.present["seq"] if copy[i] is None]
        if only_seq:
            self.stats.add("d2", only_seq, norms(some(flats, only_seq)) ** 2)
        gone = [i for i in held if i not in self.present["seq"]]
        if gone:  # a gradient that vanished in the sequence counts as zero there
            self.stats.add("d2", gone, norms(some(copy, gone)) ** 2)
            self.stats.add("n:seq", gone, torch.zeros(len(gone)))
            self.present["seq"].update(gone)
        del flats
        self.copy = [None] * len(copy)
        keys = [f"s{k}" for k in range(len(self.batches))] + ["seq"]
        self.subsets.gram(self.stats, keys)

    def needs_repeat(self, suspects: list[int]) -> list[int]:
        """The failing parameters whose evidence run-to-run noise could explain: the ones the repeat decides.

        An overwritten or lost gradient named by the fit by position alone, whose residual |G(seq) - sum_k c_k
        G(k)| on the subset is below an eighth of the linearity tolerance of the singles' norm, is not noise:
        runs that differ by d (relative) leave about d of each run outside the span of the singles (on a subset
        of at least FIT_DIM elements per direction: N singles and the sequence), and the repeat calls a
        difference above half the tolerance nondeterminism. A random scale per backward stays inside the span,
        but would have to be near -1 or 0 to make those 0/1 coefficients. Those skip the repeat (one
        forward+backward less on the failing path); every other failing verdict, a coefficient tied to the
        backward count included, gets it."""
        keys = [f"s{k}" for k in range(len(self.batches))] + ["seq"]
        fitted = {
            i: [*self.fits[i][0], -1.0]
            for i in suspects
            if i in self.fits
            and min(self.results[i].numel, SUBSET) >= FIT_DIM * len(keys)
            and set(self.results[i].anomalies) <= NOT_NOISE_IF_FITTED
        }
        if not fitted:
            return suspects
        self.subsets.residual2(self.stats, "fit_res2", keys, fitted)
        column = self.host(["fit_res2"])["fit_res2"]
        left = []
        for i in suspects:
            res2 = column[i]
            if i not in fitted or res2 is None or not self.fits[i][1] > 0:
                left.append(i)
                continue
            r = self.results[i]
            r.fit_residual = math.sqrt(max(res2, 0.0) / self.fits[i][1])
            if not r.fit_residual <= r.tolerance / 8:
                left.append(i)
        return left

    def repeat(self, suspects: list[int]) -> dict[str, list[float | None]]:
        """The first micro-batch again from zeroed buffers, compared with its first run on the subset."""
        self._run("r", [0])
        self.subsets.distance2(self.stats, "rep2", "r", "s0", suspects)
        self.subsets.gram(self.stats, ["s0"], only=suspects)
        return self.host()

    # -- loss evaluations (the finite differences': `loss_fd.py`) --------------------------------------------
    def _new_step(self) -> None:
        """Before a loss evaluation: the buffers as the call found them and a new step's flags (the weights
        moved: a new step's FP8 cast)."""
        self.buffers.restore(aliased=False)
        self.step_start.begin()

    def _before_loss(self) -> None:
        """What every forward of `loss_fn` starts from: `_new_step` and the saved random state."""
        self._new_step()
        self.rng.apply()

    def _loss_forward(self, batch: Any) -> Any:  # noqa: ANN401 - the caller's loss_fn returns what it returns
        assert self.loss_fn is not None
        with torch.no_grad():
            return self.loss_fn(self.model, batch)

    def loss(self, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            self.forwards += 1
            # (the first micro-batch's, after its first evaluation: replayed from a CUDA graph, `graphs.py`)
            loss = self.graphs.loss(batch, self._before_loss, self._loss_forward)
        else:
            self._new_step()  # (the micro-batch sets the random state itself)
            self._prepare()
            self._zero()
            loss = self._microbatch(batch)
            self.adapter.finish()
        if loss is None:
            raise ValueError(
                "finite differences need the loss: pass loss_fn=, or return the loss from run_microbatch"
            )
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        self.loss_unit = max(self.loss_unit, unit_roundoff(loss.dtype))  # a bf16 loss is quantized to it
        return self.dist.mean_loss(loss)
