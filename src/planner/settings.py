"""What the planner reads of a run plan: the fields its search varies (plan field
names, never config keys: :data:`src.config.run_plan.OVERRIDES` says them as overrides), the
budget, margin and device an estimate is for."""

from __future__ import annotations

import torch

from src.config.run_plan import ACCELERATORS_GIB, RunPlan, budget_bytes

#: The run plan's fields the fit search varies (see :func:`src.config.run_plan.varied`).
DEVICES = "layout.world_size"
PP = "layout.pp"
CP = "layout.cp"
EP = "layout.ep"
PRECISION = "precision"
AC = "checkpointing"  # a :class:`~src.planner.costs.Checkpointing` (mode and every)
MICRO = "pipeline.microbatches"
BATCH = "batch.batch_size"
ACCUM = "batch.grad_accum"
SYNC = "batch.grad_sync"
MIN_PARAMS = "wrap.min_params"


def mem_margin(plan: RunPlan) -> float:
    """The safety margin of a fit (``budget.margin``)."""
    return float(plan.budget.margin)


def run_budget_bytes(plan: RunPlan) -> int | None:
    """The per-rank budget a run is judged against: its memory budget, else a
    sweep's cap; None when neither is set."""
    budget = budget_bytes(plan.budget.mem_budget)
    if budget is None:
        budget = budget_bytes(plan.budget.sweep_cap, "sweep.mem_cap_gib")
    return budget


def _named_accelerator(plan: RunPlan) -> str | None:
    """The accelerator the memory budget names (as budget_bytes reads it)."""
    budget = plan.budget.mem_budget
    if isinstance(budget, str) and budget.strip().lower() in ACCELERATORS_GIB:
        return budget.strip().lower()
    return None


def accelerator_name(plan: RunPlan) -> str:
    """The accelerator the estimate is for: the one the memory budget names, else
    this machine's GPU; empty on a CPU."""
    named = _named_accelerator(plan)
    if named:
        return named
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def device_type(plan: RunPlan) -> str:
    """The device the estimate is for: a named accelerator budget means CUDA;
    otherwise this machine's."""
    if _named_accelerator(plan) or torch.cuda.is_available():
        return "cuda"
    return "cpu"
