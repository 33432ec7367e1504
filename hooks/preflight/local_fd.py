"""Finite differences on a module's own output (`local.py` for the reruns inside a backward): the weights of
Linear-like modules are judged on their module's output, rerun inside the backward of the second micro-batch's
single (screening: a module's weights moved together) and of the sequence (refinement: each weight alone where
a set deviated or bounded a weight loosely; zero gradients along random directions). No run is added.
`LocalFD` plans the moves, judges the reruns' sums and lays its verdicts over the loss-level ones
(`loss_fd.py`); the runs are its `Check`'s (`check.py`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from maingrad.contracts.anomalies import PREFLIGHT_ANOMALIES
from maingrad.hooks.preflight import judge, local
from maingrad.hooks.preflight.measure import norms, some, stack_to_host, unit_roundoff

if TYPE_CHECKING:
    from maingrad.hooks.preflight.check import Check

# verdicts that already account for a module-local deviation (or are the same finding)
LOCAL_EXPLAINED = frozenset(
    {
        "grad_lost",
        "grad_scaled",
        "grad_inconsistent",
        "grad_overwritten",
        "grad_stale",
        "grad_nondeterministic",
    }
)
UNSURE = 0.5  # a screened set is judged again where one of its weights could hide a factor of 1.5 (or 0.5)
BYPASSED = "its module's hooks called by a fused implementation"
# a module_fd_classes class whose rerun with nothing moved does not give its forward's output
IRREPRODUCIBLE = (
    "its module's rerun does not reproduce its forward (randomness or state in a module_fd_classes class)"
)
BOUND_ENOUGH = 0.25  # a weight the loss-level probe bounds within x1.25 is not screened on its module
# the screening and the refinement hold forward outputs for their one-sided reruns up to this share of the
# gradient copy's bytes (`local.LocalProbe.hold_bytes`): the copy is most of a call's memory above a step's
# (half the gradients' bytes for bf16 weights with fp32 gradients: at most 0.7x with the held outputs), and
# the held outputs grow with the micro-batch's tokens where the copy does not
HOLD_SHARE = 0.4


class LocalFD:
    """The module-local finite differences of one preflight call: on a single process (a shard is not what a
    module computes with), for the wrappers whose module tensors `Adapter.module_tensors` finds."""

    def __init__(self, check: Check, module_fd: bool, declared: tuple[type, ...] = ()) -> None:
        self.check = check
        self.declared = declared  # the caller's own probed module classes (`local.probed_kind`)
        self.on = (
            check.finite_differences
            and module_fd
            and check.adapter.kind in ("plain", "megatron-ddp", "megatron-fsdp", "fsdp2")
            and check.dist.world == 1
            and len(check.batches) > 1
        )
        # entry index -> the tensor its module computes with (set after the first run: FSDP2 creates its
        # unsharded parameters at the first all-gather)
        self.params: dict[int, torch.Tensor] = {}
        self.weights: dict[int, int] = {}  # id(entry's raw parameter) -> entry index
        self.escapes: dict[int, str] = {}  # weights used outside their module's call: where
        self.verdicts: dict[
            int, local.LocalVerdict
        ] = {}  # per entry: the module-local verdict that judged it
        self.share: dict[int, float] = {}  # per entry: its share of its screened set's prediction
        # per entry judged on another module's output than its own (`LocalProbe.measured_on`): that module's path
        self.measured_on: dict[int, str] = {}
        self.suspects: list[int] = []  # weights of screened sets that deviated (judged alone next)
        # weights of screened sets bounded too loosely (judged again, weight by weight)
        self.unsure: list[int] = []
        self.deferred: list[int] = []  # zero-gradient weights left to the sequence's module reruns
        # the weights the sequence's reruns judge alone (set after the last single) and their predictions
        self.refine_plan: dict[int, local.Move] = {}
        self.refine_predicted: dict[tuple[int, int], torch.Tensor] = {}  # by (entry, sides)
        self.reruns = 0
        # screened calls whose forward output was held for a one-sided rerun, and those the hold bound left central
        self.held_calls = 0
        self.unheld_calls = 0
        self.errors: list[str] = []
        self.not_judged: dict[str, set[int]] = {}

    def defer(self, zero: list[int]) -> list[int]:
        """Of the weights with a zero gradient on every micro-batch, those the sequence's module reruns judge
        first (no loss forwards) are kept here; the others are returned, for the loss-level probe."""
        if not self.on:
            return zero
        check = self.check
        owner = {i: check.owners.get(id(check.entries[i].raw_param)) for i in zero}
        self.deferred = [
            i
            for i in zero
            if id(check.entries[i].raw_param) in self.weights
            and (
                local.probed_kind(owner[i], self.declared) is not None
                or local.zero_probed(owner[i]) is not None
            )
        ]
        deferred = set(self.deferred)
        return [i for i in zero if i not in deferred]

    def judged_ok(self) -> set[int]:
        """The weights a module-local verdict judged `ok`."""
        return {i for i, v in self.verdicts.items() if v.verdict == "ok"}

    def unjudgeable(self) -> list[int]:
        """The weights the screening cannot judge whatever it finds: no tensor of a module it reruns, a module
        of another kind or computing in FP8, a tensor subclass whose uses cannot be watched."""
        check = self.check
        out = []
        for i, e in enumerate(check.entries):
            t = self.params.get(i)
            owner = check.owners.get(id(e.raw_param))
            if (
                t is None
                or type(t) is not torch.nn.Parameter
                or local.probed_kind(owner, self.declared) is None
                or i in check.fp8_entries
            ):
                out.append(i)
        return out

    def left(self) -> list[int]:
        """The deferred weights the module reruns left without a verdict (back to the loss-level probe)."""
        return [i for i in self.deferred if i not in self.verdicts]

    def judge_refinement(self, probe: local.LocalProbe | None, reported: list[torch.Tensor | None]) -> None:
        """The sequence's reruns judged against the sum of the singles (`reported`) or the predictions made
        after the last single; the plan is spent either way."""
        if probe is not None:
            self.judge(probe, reported, screening=False, predicted=self.refine_predicted)
        self.refine_plan, self.refine_predicted = {}, {}

    def start(self, i: int) -> torch.Tensor:
        """Weight i as its module computes with it (the start of a rerun's moves): the optimizer's target, cast
        to the module tensor's dtype where a wrapper casts it for the forward (FSDP2's param_dtype)."""
        t = self.check.adapter.target(self.check.entries[i])
        dtype = self.params[i].dtype
        return t if t.dtype == dtype else t.to(dtype)

    def find_tensors(self) -> None:
        """The tensors the probed modules compute with, from the wrapper (after a run: FSDP2 creates its
        unsharded parameters at the first all-gather), and the modules holding them."""
        found = self.check.adapter.module_tensors()
        self.params = {}
        for i, e in enumerate(self.check.entries):
            owner, t = found.get(id(e.raw_param), (None, None))
            if t is None:
                continue
            if owner is not None:
                self.check.owners[id(e.raw_param)] = owner
            self.params[i] = t
        self.weights = {id(self.check.entries[i].raw_param): i for i in self.params}

    def floor(self, indexes: Sequence[int]) -> float:
        """A correct gradient's deviation beyond the rounding error bar: 4 units of round-off of the compute
        dtype (the backward's own GEMM rounding), at least 2^-10; the caller's fd_rtol where given."""
        if self.check.fd_rtol is not None:
            return self.check.fd_rtol
        u = max(unit_roundoff(self.check.adapter.compute_dtype(self.check.entries[i])) for i in indexes)
        return max(4 * u, 2.0**-10)

    def screening(self) -> local.LocalProbe | None:
        """Every probed module's weights moved together along the first micro-batch's gradient (the copy, still
        G(first) here), each weight at a step that gives it a comparable share of its module's change,
        measured on the second micro-batch's backward. Where the loss-level probe ran first, weights it already
        bounds within a factor 1 +- BOUND_ENOUGH (a large share of its change: an embedding, an output layer)
        are left where they are: the module reruns cost about a forward where they are all needed."""
        if not (self.on and self.check.loss_fd.gnorms):
            return None
        by_owner: dict[int, list[int]] = {}
        for i in self.weights.values():
            g = self.check.loss_fd.gnorms[i]
            if self.check.copy[i] is None or not (g > 0 and math.isfinite(g)) or i in self.check.written:
                continue
            bound = self.check.loss_fd.resolution.get(i)
            if bound is not None and bound - 1 < BOUND_ENOUGH:  # the loss-level probe already bounds it
                reason = f"bounded within x{1 + BOUND_ENOUGH:g} by the loss-level probe"
                self.not_judged.setdefault(reason, set()).add(i)
                continue
            owner = self.check.owners.get(id(self.check.entries[i].raw_param))
            by_owner.setdefault(id(owner), []).append(i)
        plan: dict[int, local.Move] = {}
        gnorm = dict(enumerate(self.check.loss_fd.gnorms))
        for members in by_owner.values():
            eps = self._balanced(members, gnorm)
            columns = self._columns(members)
            for i in members:
                plan[i] = local.Move(
                    h=eps[i] * self.check.loss_fd.sizes[i] / self.check.loss_fd.gnorms[i],
                    direction=self.check.copy[i],
                    columns=columns.get(i),
                )
        if not plan:
            return None
        return self._probe(plan, one_sided_unpinned=True)

    def plan_refinement(self, flats: list[torch.Tensor | None], k: int) -> None:
        """After the last single (the copy now the sum of the singles, S): the moves of the weights to judge
        alone, along S, and their predictions <reported single k, the move>, so that the sequence reruns their
        modules only in micro-batch k's backward (the same true gradient as in its single: the weights and
        random state are the same) instead of in every micro-batch's. A weight whose single k is zero (an
        expert that got no tokens there) is measured in every micro-batch of the sequence, against S."""
        if not self.on:
            return
        wanted = [i for i in dict.fromkeys((*self.suspects, *self.unsure)) if self.check.copy[i] is not None]
        if not wanted:
            return
        own = [i for i in wanted if flats[i] is not None]
        values = norms(some(self.check.copy, wanted) + some(flats, own)).double().cpu().tolist()
        self.check.syncs += 1
        gnorm = dict(zip(wanted, values[: len(wanted)], strict=True))
        single = dict(zip(own, values[len(wanted) :], strict=True))
        for i in wanted:
            if not (gnorm[i] > 0 and math.isfinite(gnorm[i])):
                continue
            h = local.EPS_BIG * self.check.loss_fd.sizes[i] / gnorm[i]
            f = flats[i]
            if f is not None and single.get(i, 0.0) > 0 and math.isfinite(single[i]):
                move = local.Move(h=h, direction=self.check.copy[i], label="", only=k)
                for sides in (1, 2):  # (the hold bound decides at the forward which one is measured)
                    self.refine_predicted[(i, sides)] = local.prediction(self.start(i), move, f, sides)
            else:
                move = local.Move(h=h, direction=self.check.copy[i], label="")
            self.refine_plan[i] = move

    def refinement(self) -> local.LocalProbe | None:
        """In the sequence's backwards, each weight alone: those of a screened set that deviated, and those of
        a set the screening could not bound well (its micro-batch's gradient nearly orthogonal to the first
        one's, or a weight's share too small), along the sum of the singles (`_plan_refinement`); and the
        weights whose reported gradient is zero on every micro-batch, along random directions (their module's
        output must not move): one by one where a module has a few, together where it has many."""
        if not self.on or not (self.refine_plan or self.deferred):
            return None
        plan: dict[int, local.Move] = dict(self.refine_plan)
        zero_by_owner: dict[int, list[int]] = {}
        for i in self.deferred:
            zero_by_owner.setdefault(
                id(self.check.owners.get(id(self.check.entries[i].raw_param))), []
            ).append(i)
        for members in zero_by_owner.values():
            # a few (an expert's weights) one by one, so a lost one is named; many (idle experts) together
            label = "" if len(members) <= local.EACH_MAX else "zero"
            for i in members:
                plan[i] = local.Move(
                    h=local.EPS_BIG * self.check.loss_fd.sizes[i],
                    direction=None,
                    seed=1009 * (i + 1),
                    label=label,
                )
        if not plan:
            return None
        return self._probe(plan, one_sided_unpinned=False)

    def _probe(self, plan: dict[int, local.Move], one_sided_unpinned: bool) -> local.LocalProbe:
        """The probe of one run: its sets measured against their forward's held output where they are affine
        in their moves and the held outputs fit in HOLD_SHARE of the copy (`local.LocalProbe`);
        `one_sided_unpinned` off for a run of several micro-batches."""
        return local.LocalProbe(
            self.check.model,
            self.params,
            plan,
            one_sided=True,
            declared=self.declared,
            hold_bytes=int(HOLD_SHARE * self.check.copy_bytes),
            one_sided_unpinned=one_sided_unpinned,
        )

    def _columns(self, members: list[int]) -> dict[int, tuple[int, int]]:
        """The columns each weight of one module moves on (`local.column_moves`), where the module's output
        multiplies two of them (`local.PRODUCTS`): so that the set is measured against its forward's own output
        (one rerun instead of two)."""
        owner = self.check.owners.get(id(self.check.entries[members[0]].raw_param))
        if local.probed_kind(owner, self.declared) not in local.PRODUCTS or len(members) < 2:
            return {}
        roles = {
            i: (local.product_role(self.check.entries[i].leaf, self.params[i]), self.params[i])
            for i in members
        }
        return local.column_moves(roles)

    def _balanced(self, members: list[int], gnorm: dict[int, float]) -> dict[int, float]:
        """Relative steps for weights moved together. The change a weight predicts at relative step eps is about
        eps x |w| x |G|; the module is linear in each weight, so a larger step only makes the output's rounding
        a smaller part of the change: the weight with the smallest change moves by EPS_BIG, the others less, each
        to a comparable change (never below EPS_FLOOR, where a bf16 weight stops moving)."""
        mags = {i: self.check.loss_fd.sizes[i] * gnorm[i] for i in members}
        low = min(mags.values())
        return {i: min(max(local.EPS_BIG * low / mags[i], local.EPS_FLOOR), local.EPS_BIG) for i in members}

    def _sets(self, probe: local.LocalProbe) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
        """The sets of weights to judge: the reruns' sets, merged where they share a weight (a tied one); a set
        holding a weight one of whose calls could not be measured is left out (its weights noted, with why)."""
        for i in probe.plan:
            if i in probe.bypassed:
                self.not_judged.setdefault(BYPASSED, set()).add(i)
            elif i in probe.escaped:
                self.escapes.setdefault(i, probe.escaped[i])
                self.not_judged.setdefault("used outside its module's call", set()).add(i)
            elif i in probe.failed:
                self.not_judged.setdefault("its module could not be rerun", set()).add(i)
            elif i in probe.nonaffine:
                reason = (
                    f"read by {probe.nonaffine[i]}, not affine in it (only zero gradients are judged there)"
                )
                self.not_judged.setdefault(reason, set()).add(i)
        parent: dict[int, int] = {}

        def find(i: int) -> int:
            while parent.setdefault(i, i) != i:
                i = parent[i]
            return i

        for key in probe.sums:
            for i in key[1:]:
                parent[find(i)] = find(key[0])
        components: dict[int, list[tuple[int, ...]]] = {}
        for key in probe.sums:
            components.setdefault(find(key[0]), []).append(key)
        sets = []
        for keys in components.values():
            members = tuple(sorted({i for key in keys for i in key}))
            mixed = len({n for key in keys for n in probe.sums[key].sides}) > 1
            if mixed and any(probe.plan[i].direction is not None for i in members):
                # some calls against the forward's own output, others central: no one move to predict with (a
                # zero gradient's prediction is zero either way)
                self.not_judged.setdefault("its module could not be rerun", set()).update(members)
                continue
            if all(probe.complete(i) for i in members):
                sets.append((members, keys))
        return sets

    def judge(
        self,
        probe: local.LocalProbe,
        reported: list[torch.Tensor | None],
        screening: bool,
        predicted: dict[tuple[int, int], torch.Tensor] | None = None,
    ) -> None:
        """Compare, per set of weights moved together, the reruns' <dy, y+ - y-> with <reported gradient, the
        move> (`predicted` where it was computed earlier, else from `reported`); one host transfer."""
        self.reruns += probe.reruns
        self.held_calls += probe.held_calls
        self.unheld_calls += probe.unheld_calls
        self.errors += probe.errors[: max(0, 3 - len(self.errors))]
        self.measured_on.update(probe.measured_on)
        sets = self._sets(probe)
        if not sets:
            return
        values: list[torch.Tensor] = []
        preds: dict[int, int] = {}
        # per set: where its reruns' measured sums, variances and rounding bounds start in `values`, how many
        # (each a device scalar: they are added on the host, not with two launches per set)
        starts: list[tuple[int, int]] = []
        # per set: where its declared calls' reproductions start in `values` (value, variance, rounding per call)
        # and how many values
        reproductions: list[tuple[int, int]] = []
        for members, keys in sets:
            sums = [probe.sums[key] for key in keys]
            starts.append((len(values), sum(len(x.measured) for x in sums)))
            values += [v for x in sums for v in x.measured]
            values += [v for x in sums for v in x.variance]
            values += [v for x in sums for v in x.summing]
            reproduced = [v for x in sums for v in x.reproduced]
            reproductions.append((len(values), len(reproduced)))
            values += reproduced
            sides = {n for key in keys for n in probe.sums[key].sides}
            for i in members:
                g = reported[i]
                move = probe.plan[i]
                if g is None or move.direction is None:
                    continue
                preds[i] = len(values)
                early = predicted.get((i, min(sides))) if predicted else None
                values.append(
                    early if early is not None else local.prediction(self.start(i), move, g, sides=min(sides))
                )
        host = stack_to_host(values)
        self.check.syncs += 1
        for (members, keys), (at, n), (r, m) in zip(sets, starts, reproductions, strict=True):
            if not all(local.reproduces(*host[k : k + 3]) for k in range(r, r + m, 3)):
                self.not_judged.setdefault(IRREPRODUCIBLE, set()).update(members)
                continue
            p = {i: host[preds[i]] for i in members if i in preds}
            zero = all(probe.plan[i].direction is None for i in members)
            floor = self.floor(members)
            if zero:
                # the reported gradient is zero in every micro-batch: so must each micro-batch's derivative be
                # (its calls and outputs summed), judged one by one (summed over the micro-batches, those of a
                # nonlinear module's large random move can cancel)
                labels = [b for key in keys for b in probe.sums[key].batches]
                verdict = self._zero_verdict(members, host, at, n, labels, floor)
            else:  # summed over every call
                measured, variance, summing = (
                    math.fsum(host[at + k * n : at + (k + 1) * n]) for k in range(3)
                )
                verdict = local.judge(members, sum(p.values()), measured, variance, floor, False, summing)
            if verdict.verdict == "deviates":
                if screening:
                    self.suspects.extend(members)
                continue  # (in the refinement a set is never a deviating one: deviating weights go alone)
            if verdict.verdict == "moves" and len(members) > 1:
                continue  # one of them lost its gradient: left to the loss-level probes (fd_left)
            total = sum(abs(v) for v in p.values())
            shares = {i: abs(p.get(i, 0.0)) / total if total > 0 else 0.0 for i in members}
            loose: list[
                int
            ] = []  # judged again in the sequence, weight by weight, along the aligned direction
            if screening and verdict.verdict == "unknown":
                loose = list(members)
            elif screening and verdict.verdict == "ok" and len(members) > 1:
                # the set passed: a weight with a share s is bounded by judge.hidden_factor; only those that
                # could hide x(1 + UNSURE) are judged again (the others keep the set's verdict)
                band = floor + 2 * (verdict.error or 0.0)
                loose = [i for i in members if judge.hidden_factor(band, shares[i]) - 1 >= UNSURE]
            self.unsure.extend(loose)
            if verdict.verdict == "unknown":
                if not screening:
                    self.not_judged.setdefault("below the output's rounding", set()).update(members)
                continue
            for i in members:
                if i not in loose:
                    self.verdicts[i] = verdict
                    self.share[i] = shares[i]

    @staticmethod
    def _zero_verdict(
        members: tuple[int, ...], host: list[float], at: int, n: int, labels: list[int | None], floor: float
    ) -> local.LocalVerdict:
        """A zero gradient's verdict from its reruns (`n` calls from `at` in `host`: measured, variances and
        rounding bounds), per micro-batch of `labels`: `moves` where one micro-batch's output moved, else
        `unknown` where one could not be read, else `unused`."""
        groups: dict[int | None, list[int]] = {}
        for k, b in enumerate(labels):
            groups.setdefault(b, []).append(k)
        verdicts = []
        for ks in groups.values():
            measured, variance, summing = (math.fsum(host[at + j * n + k] for k in ks) for j in range(3))
            verdicts.append(local.judge(members, 0.0, measured, variance, floor, True, summing))
        return next(
            (v for v in verdicts if v.verdict == "moves"),
            next((v for v in verdicts if v.verdict != "unused"), verdicts[0]),
        )

    def apply(self) -> None:
        """The module-local verdicts over the loss-level ones: a failure is a failure; an ok bounds what the
        parameter could hide more tightly than a shared loss probe (fd_resolution: the tighter of the two)."""
        kind = self.check.adapter.kind
        for i, v in self.verdicts.items():
            r = self.check.results[i]
            where = f"module {self.measured_on.get(i, self.check.entries[i].module) or '(root)'}"
            if v.verdict == "unused":
                if r.fd_probe is None or r.unused or r.inconclusive:
                    r.fd_probe, r.unused, r.inconclusive = where, True, False
                    r.notes = [n for n in r.notes if not n.startswith("finite differences:")]
                continue
            r.fd_local = v.ratio if v.verdict != "moves" else 0.0
            r.fd_local_error = v.error
            if v.verdict == "ok":
                # the set's true log-ratio: within the accepted band and the estimate's own error bar
                band = self.floor(v.indexes) + 2 * (v.error or 0.0)
                share = self.share.get(i, 0.0) if len(v.indexes) > 1 else 1.0
                if share > 0:
                    bound = judge.hidden_factor(band, share)
                    r.fd_resolution = bound if r.fd_resolution is None else min(r.fd_resolution, bound)
                if r.fd_probe is None or r.inconclusive:
                    r.fd_probe, r.fd_scale, r.fd_error = where, v.ratio, v.error
                    r.inconclusive, r.unused = False, False
                    r.notes = [n for n in r.notes if not n.startswith("finite differences:")]
                continue
            verdict = {"moves": "lost", "lost": "lost", "scaled": "scaled", "wrong": "wrong"}[v.verdict]
            scale = 0.0 if verdict == "lost" else v.ratio
            r.fd_probe, r.fd_scale, r.fd_error = where, scale, v.error
            r.inconclusive = r.unused = False
            r.notes = [n for n in r.notes if not n.startswith("finite differences:")]
            # the singles the comparison sums were themselves off where the accumulation verdicts name a pattern
            # (the backward count, the position, a stale or overwritten buffer): that verdict says it
            if not set(r.anomalies) & LOCAL_EXPLAINED:
                judge.fd_verdict(r, verdict, scale, kind)
                r.anomalies = sorted(dict.fromkeys(r.anomalies), key=PREFLIGHT_ANOMALIES.index)
