"""The planner's answers for a run: what ``prepare`` asks before the ranks start
(:func:`plan_run`) and a sweep's budget check."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from src.config.run_plan import OVERRIDES, RunPlan
from src.errors import ConfigError
from src.planner.auto import AUTO_FIELDS, default_policy, resolve_auto
from src.planner.constants import available_memory
from src.planner.estimate import (
    Estimate,
    fmt_bytes,
    needed,
    planned_peak_gib,
    with_margin,
)
from src.planner.run_estimate import estimate_plan
from src.planner.search import search
from src.planner.settings import PP, PRECISION, mem_margin, run_budget_bytes
from src.planner.step_time import StepTime, predicted_step
from src.sharding import GIB


def budget_check(resolved: RunPlan) -> tuple[float, float] | None:
    """``(needed GiB, budget GiB)`` when the planner says the run cannot fit its
    budget (``trainer.mem_budget_gib``, else ``sweep.mem_cap_gib``); None when it
    fits or no budget is set. For sweeps: such points are skipped, not launched."""
    budget = run_budget_bytes(resolved)
    if budget is None:
        return None
    resolved, _, _ = resolve_auto(resolved)
    _, est = estimate_plan(resolved, resolved.world_size)
    need = needed(est, mem_margin(resolved))
    return (need / GIB, budget / GIB) if need > budget else None


@dataclass(frozen=True)
class Planned:
    """What the planner decides for a run before its ranks start (:func:`plan_run`)."""

    resolved: RunPlan  # every ``auto`` value chosen; the block policy where chosen
    reasons: tuple[str, ...]  # one line per choice: the policy's, then each auto's
    overrides: dict  # the choices as the overrides a user types (the run's record)
    estimate: Estimate | None = None  # the run's peak (a pipeline: its worst stage's)
    unplanned: str = ""  # why there is no estimate, where one was asked for
    step: StepTime | None = None  # the predicted step (src/planner/step_time.py)
    unpredicted: str = ""  # why there is no predicted step, where one was asked for

    @property
    def planned_peak_gib(self) -> float | None:
        """The estimate as the quantity a run measures (:func:`planned_peak_gib`)."""
        return planned_peak_gib(self.estimate) if self.estimate else None

    @property
    def planned_peak_pp_rank(self) -> int | None:
        """The pp rank the estimate is of (a pipeline's worst stage); else None."""
        return self.estimate.pp_rank if self.estimate else None

    def recorded(self) -> dict:
        """What the run plan records of the planner's answer (rank 0 logs it beside
        what it measures): the planned peak, its pp rank, the predicted step."""
        return {
            "planned_peak_gib": self.planned_peak_gib,
            "planned_peak_pp_rank": self.planned_peak_pp_rank,
            "predicted": self.step.summary() if self.step else None,
        }

    @property
    def step_line(self) -> str:
        """The predicted step time as the run's start says it ('' where not asked)."""
        if self.step is not None:
            return (
                f"planner: step time {self.step.total_s * 1e3:,.1f} ms predicted "
                f"({self.step.source})"
            )
        return (
            self.unpredicted and f"planner: no step time predicted ({self.unpredicted})"
        )

    @property
    def lower_bound(self) -> str:
        """Why the run's peak may grow past the estimate ('' where it does not)."""
        return self.estimate.caveat if self.estimate else ""


def plan_run(
    resolved: RunPlan,
    user_keys: set[str],
    world: int | None = None,
    estimate: bool = True,
    say: Callable[[str], object] | None = None,
    predict: bool = False,
) -> Planned:
    """The planner's answer for a run about to start, in one call: the block policy
    where the size policy would split blocks (:func:`default_policy`; ``user_keys``:
    the keys the user set), every ``auto`` value chosen for ``world`` ranks
    (:func:`resolve_auto`; default: ``trainer.devices``), each choice's line handed
    to ``say`` as it is made, then (``estimate``) the run's estimate, computed once
    before the ranks start so each run logs it beside what it measures. A config
    error is raised; any other failure to estimate (e.g. a custom model the meta
    device cannot build) is said in ``unplanned``: training does not depend on it.
    ``predict``: also its step time (src/planner/step_time.py), said to ``say``."""
    resolved, policy, chose = default_policy(resolved, user_keys)
    resolved, reasons, auto = resolve_auto(resolved, world)
    reasons = [policy, *reasons] if policy else reasons
    if say is not None:
        for line in reasons:
            say(line)
    plan = Planned(resolved, tuple(reasons), {**chose, **auto})
    if not estimate:
        return plan
    try:
        wrap, est = estimate_plan(resolved, world or resolved.world_size)
    except ConfigError:  # a config every rank would fail on: said before they start
        raise
    except Exception as err:
        return replace(plan, unplanned=f"{type(err).__name__}: {err}")
    if not predict:
        return replace(plan, estimate=est)
    step, why = predicted_step(resolved, wrap, world)
    plan = replace(plan, estimate=est, step=step, unpredicted=why)
    if say is not None and plan.step_line:
        say(plan.step_line)
    return plan


#: Ranks per core past which a CPU run is said to be oversubscribed.
_RANKS_PER_CORE = 2


def machine_check(resolved: RunPlan, est: Estimate, local_ranks: int) -> None:
    """No run bigger than the machine, before any rank allocates: the planner's
    per-rank figure (with its safety margin) against one GPU's memory, or, on CPU,
    times ``local_ranks`` (the ranks on this host) against ``MemAvailable``. Too
    big is a ConfigError naming ``trainer.memory_check`` with the figure and the
    cheapest change of sharding, precision or pipeline that fits (searched only
    then: a start that fits costs one read of /proc/meminfo)."""
    if not resolved.budget.memory_check:
        return
    if (est.shape.device == "cuda") != torch.cuda.is_available():
        return  # planned for another machine's device (an accelerator budget)
    have, what = available_memory()
    ranks = 1 if est.shape.device == "cuda" else max(1, local_ranks)
    need = needed(est, mem_margin(resolved))
    if need * ranks <= have:
        return
    shown = with_margin(est, mem_margin(resolved))
    figure = f"{shown} per rank" + (
        f" x {ranks} ranks = {fmt_bytes(need * ranks)}" if ranks > 1 else ""
    )
    key = OVERRIDES["budget.memory_check"]
    raise ConfigError(
        key,
        f"the planner's estimate of this run, {figure}, is more than this "
        f"machine's {what}, {fmt_bytes(have)}; {_cheapest_fit(resolved, have // ranks)}; "
        f"set {key}=false to start it anyway",
    )


def _cheapest_fit(resolved: RunPlan, budget: int) -> str:
    """The cheapest change of the same ranks that fits ``budget`` per rank, said."""
    keys = [*AUTO_FIELDS, PRECISION, PP]
    try:
        best, smallest = search(resolved, keys, budget, resolved.world_size)
    except Exception as err:  # the refusal stands without a proposal
        return f"no change searched ({type(err).__name__}: {err})"
    if best is not None:
        return (
            f"the cheapest change that fits: {best.describe()} -> "
            f"{fmt_bytes(best.estimate.total)} per rank"
        )
    return (
        "no change of sharding, precision or pipeline fits (the smallest estimate "
        f"is {fmt_bytes(smallest.estimate.total)} per rank, with "
        f"{smallest.describe()}): a smaller model or a bigger machine"
    )


def oversubscribed(local_ranks: int) -> str | None:
    """A line when the CPU ranks on this host are many more than its cores (each
    then waits for a core most of the time: slower than fewer ranks); else None."""
    if torch.cuda.is_available():
        return None
    cores = len(os.sched_getaffinity(0))
    if local_ranks <= _RANKS_PER_CORE * cores:
        return None
    return (
        f"trainer.devices: {local_ranks} ranks share this machine's {cores} CPU "
        f"core{'s' if cores > 1 else ''}: each waits for a core most of the time, "
        "so the run is slower than with fewer ranks (the layout, not the speed, "
        "is what such a run tests)"
    )
