"""The layout search: the layouts of a run's ranks that fit its budget, ranked by the
step-time model's tokens/s per device (plan-only's top :data:`TOP`; a run's
``trainer.layout=fastest`` trains with the first).

Pruned by degrees, not products: each dimension's degrees are the powers of two that
divide the ranks (tp within a node), replicate only 1, one node's shard or all data
ranks; every point is first predicted on the whole model's units (formula work) and
estimated for memory in that order, fastest first, until :data:`TOP` fit."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from src.config.run_plan import OVERRIDES, RunPlan, varied
from src.planner.estimate import needed, planned_peak_gib
from src.planner.inputs import build_meta_model, plan_of
from src.planner.profiles import profile_for
from src.planner.run_estimate import estimate_plan
from src.planner.search import (
    cp_options,
    ep_options,
    fmt_value,
    n_blocks,
    splits_blocks,
    splitting_batch,
)
from src.planner.settings import accelerator_name, device_type, mem_margin
from src.planner.step_time import StepTime, predict
from src.sharding import LayoutError, backend_class, refusal
from src.sharding.pipeline import SCHEDULES, microbatches_problem

#: Layouts plan-only lists.
TOP = 5
#: Degrees tried above 1 (each where it divides the ranks).
DEGREES = (2, 4, 8, 16)
#: Checkpointing modes tried (``full``: every block).
AC_MODES = ("none", "selective", "full")
#: Gradient-accumulation steps tried (each where it splits the batch).
ACCUMS = (1, 2, 4, 8)
#: Points estimated for memory at most, fastest predicted first (pipelined ones, whose
#: stages are built each time: :data:`MAX_PIPELINED`).
MAX_ESTIMATED = 20
MAX_PIPELINED = 4


@dataclass(frozen=True)
class Layout:
    """One layout that fits: its overrides (config keys, the run's values left out),
    its predicted tokens/s (all ranks) and its planned peak per rank."""

    overrides: dict[str, Any]
    predicted_tokens_per_s: float
    peak_gib: float
    world: int

    def args(self) -> str:
        """The overrides as a command line writes them."""
        return " ".join(f"{k}={fmt_value(v)}" for k, v in self.overrides.items())

    def line(self) -> str:
        per = self.predicted_tokens_per_s / self.world
        return (
            f"{per:,.0f} tokens/s per device, {self.peak_gib:.2f} GiB: "
            f"{self.args() or '(as set)'}"
        )

    def record(self) -> dict[str, Any]:
        """As summary.json's ``layouts`` holds it."""
        return {
            "overrides": dict(self.overrides),
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "peak_gib": self.peak_gib,
        }


@dataclass(frozen=True)
class _Point:
    fields: dict[str, Any]  # run plan fields (src.config.run_plan.OVERRIDES' keys)
    guess: float  # tokens/s predicted on the whole model's units (the order)


def layout_search(
    resolved: RunPlan,
    world: int,
    budget: int,
    precisions: tuple[str, ...] = (),
    every: bool = False,
) -> tuple[list[Layout], int]:
    """The :data:`TOP` fastest layouts of ``world`` ranks whose estimate fits
    ``budget`` bytes per rank (``precisions``: tried besides the run's), and how
    many points were predicted. ``every``: all that fit, none pruned by the caps
    (what bench.layout_ranking measures; slow on a big model)."""
    device, accel = device_type(resolved), accelerator_name(resolved)
    profile = profile_for(device, accel)
    if profile is None:
        return [], 0
    blocks = n_blocks(resolved)
    search = _Search(resolved, world, profile, blocks, capped=not every)
    points = sorted(search.points(precisions), key=lambda p: p.guess, reverse=True)
    found: list[Layout] = []
    margin = mem_margin(resolved)
    for point in points:
        if not every and (len(found) == TOP or search.estimated >= MAX_ESTIMATED):
            break
        if not search.may_fit(point, budget, margin):
            continue
        fitted = search.fitted(point, budget, margin)
        if fitted is not None:
            found.append(fitted)
    found.sort(key=lambda lay: lay.predicted_tokens_per_s, reverse=True)
    return (found if every else found[:TOP]), len(points)


class _Search:
    """The points of one search and what they share (meta models, by degrees)."""

    def __init__(
        self, resolved: RunPlan, world: int, profile, blocks: int, capped: bool = True
    ) -> None:
        self.r, self.world, self.profile, self.blocks = (
            resolved, world, profile, blocks,
        )  # fmt: skip
        self.capped = capped  # at most MAX_PIPELINED pipelined estimates
        self.backend = backend_class(resolved.backend)
        self.seq_len = int(resolved.spec.seq_len(resolved.model_config))
        self.models: dict[tuple[int, int], Any] = {}
        self.wraps: dict[tuple, Any] = {}
        self.frugal: dict[tuple, bool] = {}  # a group's verdict with full checkpointing
        self.estimated = 0  # points estimated for memory
        self.pipelined = 0  # of them pipelined
        self.estimates: dict[tuple, Any] = {}
        self.batch = int(resolved.batch.batch_size)

    def _degrees(self) -> Iterator[dict[str, int]]:
        r, w, b = self.r, self.world, self.backend
        up = [d for d in DEGREES if w % d == 0]
        tps = [1]
        if b.tensor_parallel and r.spec.tp_plan is not None:
            tps += [d for d in up if d <= self.profile.ranks_per_node]
        pps = [1]
        if b.pipeline_parallel and r.spec.init_tensor is not None:
            pps += [d for d in up if d <= self.blocks]
        cps = cp_options(r) or [1]
        eps = ep_options(r) or [1]
        for tp, pp, cp, ep in itertools.product(tps, pps, cps, eps):
            if w % (tp * pp * cp):
                continue
            dp = w // (tp * pp * cp)
            node = max(1, self.profile.ranks_per_node // (tp * cp))
            for rep in sorted(
                {1, dp // min(dp, node), dp} if b.shards_parameters else {1}
            ):
                yield {"pp": pp, "dp_replicate": rep, "tp": tp, "cp": cp, "ep": ep}

    def points(self, precisions: tuple[str, ...]) -> Iterator[_Point]:
        """Every point whose layout the one rule takes, predicted."""
        precs = [
            self.r.precision.name,
            *(p for p in precisions if p != self.r.precision.name),
        ]
        for degrees in self._degrees():
            try:
                layout = replace(self.r.layout, world_size=self.world, **degrees)
            except LayoutError:
                continue
            pp = degrees["pp"]
            schedules = list(self._schedules(pp)) if pp > 1 else [(None, 1)]
            for prec in precs:
                if refusal(layout, self.backend, prec, self.seq_len):
                    continue
                for (schedule, m), mode, accum in itertools.product(
                    schedules, AC_MODES, ACCUMS
                ):
                    fields = self._fields(layout, prec, schedule, m, mode, accum)
                    if fields is not None:
                        guess = self._predict(fields)
                        if guess is not None:
                            yield _Point(fields, guess.tokens_per_s)

    def _schedules(self, pp: int) -> Iterator[tuple[str, int]]:
        cur = int(self.r.pipeline.microbatches)
        for name, sched in SCHEDULES.items():
            if sched.refused or pp * sched.stages_per_rank > self.blocks:
                continue
            m = max(cur, pp)
            if not microbatches_problem(name, pp, m):
                yield name, m

    def _fields(self, layout, prec, schedule, m, mode, accum) -> dict | None:
        if self.batch % accum and accum > 1:
            return None
        pp = layout.pp
        fields: dict[str, Any] = {
            "layout": layout,
            "precision": prec,
            "checkpointing.mode": mode,
            "checkpointing.every": 1,
            "batch.grad_accum": accum,
            "batch.batch_size": splitting_batch(
                self.batch, layout, self.world, accum, pp, m
            ),
        }
        if pp > 1:
            fields.update({"pipeline.schedule": schedule, "pipeline.microbatches": m})
        least = splitting_batch(self.batch, layout, self.world, 1, pp, m)
        if accum > 1 and fields["batch.batch_size"] != least:
            return None  # accumulation that grows the batch further: not a layout
        return fields

    def _predict(self, fields: dict[str, Any]) -> StepTime | None:
        """The point's step on the whole model's units (a pipeline's: 1/pp)."""
        plan_run = varied(self.r, fields)
        lay = plan_run.layout
        key = (lay.tp, lay.ep)
        if key not in self.models:
            base = varied(
                plan_run, {"layout": replace(lay, pp=1), "checkpointing.mode": "none"}
            )
            try:
                self.models[key] = build_meta_model(base)
            except Exception:
                self.models[key] = None
        model = self.models[key]
        if model is None:
            return None
        at = (lay.pp, lay.dp_replicate, lay.tp, lay.cp, lay.ep)
        if at not in self.wraps:
            self.wraps[at] = plan_of(plan_run, model, self.world // lay.pp)
        wrap = self.wraps[at]
        if fields["checkpointing.mode"] == "selective" and splits_blocks(wrap):
            return None  # a run refuses it: selective needs each block one unit
        try:
            return predict(plan_run, wrap, self.profile, self.world, self.blocks)
        except Exception:
            return None

    def may_fit(self, point: _Point, budget: int, margin: float) -> bool:
        """Whether ``point``'s layout fits with full checkpointing and the most
        accumulation (one estimate for the points that differ in those only: the
        others hold more)."""
        f = point.fields
        at = (f["layout"], f["precision"], f.get("pipeline.schedule"))
        if at not in self.frugal:
            m = f.get("pipeline.microbatches", 1)
            frugal = next(
                g
                for a in reversed(ACCUMS)
                if (g := self._fields(f["layout"], f["precision"], at[2], m, "full", a))
            )
            self.frugal[at] = self._estimate(frugal, budget, margin) is not None
        return self.frugal[at]

    def _estimate(self, fields: dict, budget: int, margin: float):
        """``(run, wrap plan, estimate)`` of ``fields`` where it fits ``budget``."""
        key = tuple(fields.items())
        if key not in self.estimates:
            run = varied(self.r, fields)
            lay = run.layout
            model = self.models.get((lay.tp, lay.ep)) if lay.pp == 1 else None
            if lay.pp > 1 and self.capped and self.pipelined >= MAX_PIPELINED:
                return None
            self.estimated += 1
            self.pipelined += lay.pp > 1
            try:
                self.estimates[key] = (run, *estimate_plan(run, self.world, model))
            except Exception:
                self.estimates[key] = None
        found = self.estimates[key]
        return found if found and needed(found[2], margin) <= budget else None

    def fitted(self, point: _Point, budget: int, margin: float) -> Layout | None:
        """``point`` as a :class:`Layout` where its estimate fits ``budget``."""
        found = self._estimate(point.fields, budget, margin)
        if found is None:
            return None
        run, wrap, est = found
        step = predict(run, wrap, self.profile, self.world, self.blocks)
        return Layout(
            self._overrides(run),
            step.tokens_per_s,
            planned_peak_gib(est),
            self.world,
        )

    def _overrides(self, run: RunPlan) -> dict[str, Any]:
        """The fields of ``run`` that differ from the run as set, as config keys."""
        from src.config.run_plan import field_of

        names = [f"layout.{d}" for d in ("pp", "dp_replicate", "tp", "cp", "ep")]
        names += ["pipeline.schedule", "pipeline.microbatches", "checkpointing.mode"]
        names += ["batch.grad_accum", "batch.batch_size", "precision"]
        out = {}
        for name in names:
            value = field_of(run, name)
            if value != field_of(self.r, name):
                key = "precision" if name == "precision" else OVERRIDES[name]
                out[key] = value
        if run.checkpointing.mode == "full" and self.r.checkpointing.every != 1:
            out[OVERRIDES["checkpointing.every"]] = 1
        return out


def run_layouts(resolved: RunPlan, world: int) -> tuple[list[Layout], str]:
    """The fastest layouts of ``resolved``'s ``world`` ranks that fit its budget
    (``trainer.mem_budget_gib``, else a sweep's cap, else this machine's memory per
    rank), and the line that heads them."""
    from src.planner.constants import machine_budget_bytes
    from src.planner.estimate import fmt_bytes
    from src.planner.settings import run_budget_bytes

    budget, source = run_budget_bytes(resolved), "the run's budget"
    if budget is None:
        budget, source = machine_budget_bytes(world), "this machine's memory per rank"
    found, points = layout_search(
        resolved, world, budget, resolved.budget.layout_precisions
    )
    head = (
        f"layouts of {world} ranks that fit {fmt_bytes(budget)} ({source}), fastest "
        f"predicted first ({points} points predicted; add a line's overrides to this "
        "command, or trainer.layout=fastest for the first):"
    )
    return found, head
