"""The planner's answers for a run: what ``prepare`` asks before the ranks start
(:func:`plan_run`) and a sweep's budget check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from omegaconf import DictConfig

from src.errors import ConfigError
from src.planner.auto import default_policy, resolve_auto
from src.planner.estimate import Estimate, needed, planned_peak_gib
from src.planner.run_estimate import estimate_cfg
from src.planner.settings import mem_margin, run_budget_bytes
from src.resolved import Resolved, resolve_devices
from src.sharding import GIB


def budget_check(cfg: DictConfig, resolved: Resolved) -> tuple[float, float] | None:
    """``(needed GiB, budget GiB)`` when the planner says ``cfg`` cannot fit its budget
    (``trainer.mem_budget_gib``, else ``sweep.mem_cap_gib``); None when it fits or no
    budget is set. For sweeps: such points are skipped, not launched."""
    budget = run_budget_bytes(cfg)
    if budget is None:
        return None
    cfg, _ = resolve_auto(cfg, resolved)
    _, est = estimate_cfg(cfg, resolved, resolve_devices(cfg.trainer.devices))
    need = needed(est, mem_margin(cfg))
    return (need / GIB, budget / GIB) if need > budget else None


@dataclass(frozen=True)
class RunPlan:
    """What the planner decides for a run before its ranks start (:func:`plan_run`)."""

    cfg: DictConfig  # every ``auto`` value chosen; the block policy where chosen
    resolved: Resolved  # its run object (with the block policy where chosen)
    reasons: tuple[str, ...]  # one line per choice: the policy's, then each auto's
    estimate: Estimate | None = None  # the run's peak (a pipeline: its worst stage's)
    unplanned: str = ""  # why there is no estimate, where one was asked for

    @property
    def planned_peak_gib(self) -> float | None:
        """The estimate as the quantity a run measures (:func:`planned_peak_gib`)."""
        return planned_peak_gib(self.estimate) if self.estimate else None

    @property
    def planned_peak_pp_rank(self) -> int | None:
        """The pp rank the estimate is of (a pipeline's worst stage); else None."""
        return self.estimate.pp_rank if self.estimate else None

    @property
    def lower_bound(self) -> str:
        """Why the run's peak may grow past the estimate ('' where it does not)."""
        return self.estimate.caveat if self.estimate else ""


def plan_run(
    cfg: DictConfig,
    resolved: Resolved,
    user_keys: set[str],
    world: int | None = None,
    estimate: bool = True,
    say: Callable[[str], object] | None = None,
) -> RunPlan:
    """The planner's answer for a run about to start, in one call: the block policy
    where the size policy would split blocks (:func:`default_policy`; ``user_keys``:
    the keys the user set), every ``auto`` value chosen for ``world`` ranks
    (:func:`resolve_auto`; default: ``trainer.devices``), each choice's line handed
    to ``say`` as it is made, then (``estimate``) the run's estimate, computed once
    before the ranks start so each run logs it beside what it measures. A config
    error is raised; any other failure to estimate (e.g. a custom model the meta
    device cannot build) is said in ``unplanned``: training does not depend on it."""
    cfg, resolved, policy = default_policy(cfg, resolved, user_keys)
    cfg, reasons = resolve_auto(cfg, resolved, world)
    reasons = [policy, *reasons] if policy else reasons
    if say is not None:
        for line in reasons:
            say(line)
    plan = RunPlan(cfg, resolved, tuple(reasons))
    if not estimate:
        return plan
    try:
        _, est = estimate_cfg(cfg, resolved, world or resolved.world_size)
    except ConfigError:  # a config every rank would fail on: said before they start
        raise
    except Exception as err:
        return replace(plan, unplanned=f"{type(err).__name__}: {err}")
    return replace(plan, estimate=est)
