"""The planner's answers for a run: a sweep's budget check."""

from __future__ import annotations

from omegaconf import DictConfig

from src.planner.auto import resolve_auto
from src.planner.estimate import needed
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
