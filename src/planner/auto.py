"""The values the planner chooses: every ``auto`` of :data:`AUTO_KEYS` (the search's
cheapest fit) and the block policy where the size policy would split blocks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.planner.constants import budget_bytes, machine_budget_bytes
from src.planner.costs import Checkpointing, ac_cost
from src.planner.estimate import fmt_bytes, with_margin
from src.planner.inputs import build_meta_model, plan_of
from src.planner.pipeline import stage_plans
from src.planner.run_estimate import estimate_cfg
from src.planner.search import Candidate, fmt_value, search, splits_blocks
from src.planner.settings import (
    AC_EVERY_KEY,
    AC_KEY,
    mem_margin,
    pipeline_stages,
    setting,
    with_values,
)
from src.resolved import RunPlan, resolve_devices, resolve_policies
from src.sharding import backend_class

#: The keys ``auto`` may stand for, and what the planner searches.
AUTO_KEYS = ("sharding.min_params", "trainer.grad_accum", "trainer.grad_sync", AC_KEY)


def auto_keys(cfg: DictConfig) -> list[str]:
    return [k for k in AUTO_KEYS if OmegaConf.select(cfg, k, default=None) == "auto"]


#: Stand-ins for ``auto`` values, the search's starting point (costs are relative to it).
_AUTO_START: dict[str, Any] = {
    "sharding.min_params": 1e8,
    "trainer.grad_accum": 1,
    "trainer.grad_sync": "last",
    AC_KEY: "none",
}


def resolve_auto(
    cfg: DictConfig, resolved: RunPlan, world: int | None = None
) -> tuple[DictConfig, list[str]]:
    """``cfg`` with every ``auto`` value of :data:`AUTO_KEYS` chosen by the planner:
    the cheapest setting that fits the budget (``trainer.mem_budget_gib``, else this
    machine's memory per rank), or the smallest estimate if none fits. Returns the
    new config and one line per choice saying why."""
    keys = auto_keys(cfg)
    quiet = {}
    accum = OmegaConf.select(cfg, "trainer.grad_accum")
    if "trainer.grad_sync" in keys and accum == 1:
        quiet["trainer.grad_sync"] = "last"  # one micro-batch: nothing to choose
        keys.remove("trainer.grad_sync")
    cfg = with_values(cfg, quiet) if quiet else cfg
    if not keys:
        return cfg, []
    world = world or resolve_devices(cfg.trainer.devices)
    budget = budget_bytes(OmegaConf.select(cfg, "trainer.mem_budget_gib"))
    source = "trainer.mem_budget_gib"
    if budget is None:
        budget, source = machine_budget_bytes(world), "this machine's memory per rank"
    start = with_values(cfg, {k: _AUTO_START[k] for k in keys})
    best, smallest = search(start, resolved, keys, budget, world)
    chosen = best or smallest
    values: dict[str, Any] = {}
    for k in keys:
        v = chosen.overrides.get(k)
        values[k] = v.mode if isinstance(v, Checkpointing) else v
        if v is None:
            values[k] = OmegaConf.select(start, k)
    out = with_values(cfg, {**values, **chosen.settings()})
    est = chosen.estimate
    verdict = (
        f"the cheapest setting whose estimate, {with_margin(est, mem_margin(cfg))}, "
        f"fits {fmt_bytes(budget)} "
        f"({source})"
        if best
        else f"nothing fits {fmt_bytes(budget)} ({source}); this is the smallest estimate, "
        f"{fmt_bytes(est.total)}"
    )
    reasons = [
        f"auto: {k}={fmt_value(v)}: {verdict}" for k, v in values.items() if k != AC_KEY
    ]
    if AC_KEY in keys:
        reasons.append(_ac_reason(out, resolved, chosen, world, verdict))
    return out, reasons


def _ac_reason(
    cfg: DictConfig, resolved: RunPlan, chosen: Candidate, world: int, verdict: str
) -> str:
    """Why ``auto`` checkpointing is what it is: which blocks, the recompute cost, and
    the estimate without any."""
    ac = chosen.overrides.get(AC_KEY)
    every = int(setting(cfg, AC_EVERY_KEY))
    line = f"auto: {AC_KEY}={cfg.sharding.activation_checkpointing}"
    if not isinstance(ac, Checkpointing) or ac.mode == "none":
        return f"{line}: {verdict}"
    if ac.mode == "full":
        line += f" {AC_EVERY_KEY}={every}"
    _, bare = estimate_cfg(with_values(cfg, {AC_KEY: "none"}), resolved, world)
    return (
        f"{line}: {ac.recomputed} of {ac.blocks} blocks recomputed in backward "
        f"(compute x{ac_cost(ac):.2f}); without checkpointing the estimate is "
        f"{fmt_bytes(bare.total)}; {verdict}"
    )


POLICY_KEYS = ("sharding.policy", "sharding.min_params")


def default_policy(
    cfg: DictConfig, resolved: RunPlan, user_keys: set[str]
) -> tuple[DictConfig, RunPlan, str]:
    """``cfg`` with the block policy when the size policy's threshold was not chosen for
    this model: the user set neither key of :data:`POLICY_KEYS` and, with the group's
    default ``sharding.min_params`` (tuned so each block of the CPU models is one unit),
    the size policy would cut a block into several units (``model=llama3_8b``: one per
    Linear, 227 units). One unit per block is what the planner's estimates assume for
    selective checkpointing, and what FSDP users pick for large models. Returns the
    config, its run object (``resolved`` with the block policy when it changed) and
    the line saying so (empty when nothing changed)."""
    s = cfg.sharding
    if (
        set(POLICY_KEYS) & user_keys
        or s.policy != "size"
        or s.min_params == "auto"
        or not backend_class(s.backend).shards_parameters
    ):
        return cfg, resolved, ""
    units = with_values(cfg, {AC_KEY: "none"})  # the units do not depend on it
    if pipeline_stages(cfg) > 1:  # the first stage's blocks tell (not the whole model)
        plan = stage_plans(units, resolved, only=0).plans(resolved, resolved.world_size)
        plan = plan[0][1]
    else:
        plan = plan_of(resolved, build_meta_model(units, resolved), resolved.world_size)
    if not splits_blocks(plan):
        return cfg, resolved, ""
    inside = sum(1 for u in plan.units if u.path)
    block = replace(resolved, policies=resolve_policies("block"))
    return (
        with_values(cfg, {"sharding.policy": "block"}),
        block,
        (
            f"sharding.policy=block: with sharding.min_params={fmt_value(s.min_params)} the "
            f"size policy would make {inside} units, splitting model={cfg.model.name}'s blocks; "
            "one unit per block (set sharding.policy or sharding.min_params to choose)"
        ),
    )
