"""The values the planner chooses: every ``auto`` of :data:`AUTO_FIELDS` (the search's
cheapest fit) and the block policy where the size policy would split blocks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from src.config.run_plan import (
    OVERRIDES,
    RunPlan,
    budget_bytes,
    field_of,
    resolve_policies,
    varied,
)
from src.planner.constants import machine_budget_bytes
from src.planner.costs import Checkpointing, ac_cost
from src.planner.estimate import fmt_bytes, with_margin
from src.planner.inputs import build_meta_model, plan_of
from src.planner.pipeline import stage_plans
from src.planner.run_estimate import estimate_plan
from src.planner.search import Candidate, fmt_value, search, splits_blocks
from src.planner.settings import AC, ACCUM, MIN_PARAMS, SYNC, mem_margin
from src.sharding import backend_class

#: The run plan's fields ``auto`` may stand for, and what the planner searches.
AUTO_FIELDS = (MIN_PARAMS, ACCUM, SYNC, AC)


def auto_fields(plan: RunPlan) -> list[str]:
    return [k for k in AUTO_FIELDS if _value(plan, k) == "auto"]


def _value(plan: RunPlan, name: str) -> Any:
    return plan.checkpointing.mode if name == AC else field_of(plan, name)


#: Stand-ins for ``auto`` values, the search's starting point (costs are relative to it).
_AUTO_START: dict[str, Any] = {
    MIN_PARAMS: 1e8,
    ACCUM: 1,
    SYNC: "last",
    f"{AC}.mode": "none",
}


def _start(name: str) -> str:
    return f"{AC}.mode" if name == AC else name


def resolve_auto(
    plan: RunPlan, world: int | None = None
) -> tuple[RunPlan, list[str], dict[str, Any]]:
    """``plan`` with every ``auto`` value of :data:`AUTO_FIELDS` chosen by the
    planner: the cheapest setting that fits the budget (the plan's memory budget,
    else this machine's memory per rank), or the smallest estimate if none fits.
    Returns the new plan, one line per choice saying why, and the chosen values as
    the overrides a user types (what the launcher records)."""
    keys = auto_fields(plan)
    quiet = {}
    if SYNC in keys and plan.batch.grad_accum == 1:
        quiet[SYNC] = "last"  # one micro-batch: nothing to choose
        keys.remove(SYNC)
    plan = varied(plan, quiet) if quiet else plan
    if not keys:
        return plan, [], _said(quiet)
    world = world or plan.world_size
    budget = budget_bytes(plan.budget.mem_budget)
    source = OVERRIDES["budget.mem_budget"]
    if budget is None:
        budget, source = machine_budget_bytes(world), "this machine's memory per rank"
    start = varied(plan, {_start(k): _AUTO_START[_start(k)] for k in keys})
    best, smallest = search(start, keys, budget, world)
    chosen = best or smallest
    values: dict[str, Any] = {}
    for k in keys:
        v = chosen.changes.get(k)
        values[_start(k)] = v.mode if isinstance(v, Checkpointing) else v
        if v is None:
            values[_start(k)] = _value(start, k)
    changes = {**values, **chosen.fields()}
    out = varied(plan, changes)
    est = chosen.estimate
    verdict = (
        f"the cheapest setting whose estimate, {with_margin(est, mem_margin(plan))}, "
        f"fits {fmt_bytes(budget)} "
        f"({source})"
        if best
        else f"nothing fits {fmt_bytes(budget)} ({source}); this is the smallest estimate, "
        f"{fmt_bytes(est.total)}"
    )
    reasons = [
        f"auto: {OVERRIDES[k]}={fmt_value(v)}: {verdict}"
        for k, v in values.items()
        if k != f"{AC}.mode"
    ]
    if AC in keys:
        reasons.append(_ac_reason(out, chosen, world, verdict))
    return out, reasons, _said({**quiet, **changes})


def _said(changes: dict[str, Any]) -> dict[str, Any]:
    return {OVERRIDES[k]: v for k, v in changes.items()}


def _ac_reason(plan: RunPlan, chosen: Candidate, world: int, verdict: str) -> str:
    """Why ``auto`` checkpointing is what it is: which blocks, the recompute cost, and
    the estimate without any."""
    ac = chosen.changes.get(AC)
    key, every_key = OVERRIDES[f"{AC}.mode"], OVERRIDES[f"{AC}.every"]
    line = f"auto: {key}={plan.checkpointing.mode}"
    if not isinstance(ac, Checkpointing) or ac.mode == "none":
        return f"{line}: {verdict}"
    if ac.mode == "full":
        line += f" {every_key}={plan.checkpointing.every}"
    _, bare = estimate_plan(varied(plan, {f"{AC}.mode": "none"}), world)
    return (
        f"{line}: {ac.recomputed} of {ac.blocks} blocks recomputed in backward "
        f"(compute x{ac_cost(ac):.2f}); without checkpointing the estimate is "
        f"{fmt_bytes(bare.total)}; {verdict}"
    )


#: The fields whose user setting keeps the size policy (:func:`default_policy`).
POLICY_FIELDS = ("wrap.policies", MIN_PARAMS)


def default_policy(
    plan: RunPlan, user_keys: set[str]
) -> tuple[RunPlan, str, dict[str, Any]]:
    """``plan`` with the block policy when the size policy's threshold was not chosen
    for this model: the user set neither key of :data:`POLICY_FIELDS` and, with the
    group's default threshold (tuned so each block of the CPU models is one unit),
    the size policy would cut a block into several units (``model=llama3_8b``: one
    per Linear, 227 units). One unit per block is what the planner's estimates assume
    for selective checkpointing, and what FSDP users pick for large models. Returns
    the plan (with the block policy when it changed), the line saying so (empty when
    nothing changed) and the change as the override a user types."""
    w = plan.wrap
    if (
        {OVERRIDES[f] for f in POLICY_FIELDS} & user_keys
        or w.policies != ("size",)
        or w.min_params == "auto"
        or not backend_class(plan.backend).shards_parameters
    ):
        return plan, "", {}
    units = with_ac_none(plan)  # the units do not depend on it
    if plan.layout.pp > 1:  # the first stage's blocks tell (not the whole model)
        wplan = stage_plans(units, only=0).plans(plan, plan.world_size)[0][1]
    else:
        wplan = plan_of(plan, build_meta_model(units), plan.world_size)
    if not splits_blocks(wplan):
        return plan, "", {}
    inside = sum(1 for u in wplan.units if u.path)
    block = replace(plan, wrap=replace(w, policies=resolve_policies("block")))
    policy, min_params = OVERRIDES["wrap.policies"], OVERRIDES[MIN_PARAMS]
    return (
        block,
        (
            f"{policy}=block: with {min_params}={fmt_value(w.min_params)} the "
            f"size policy would make {inside} units, splitting "
            f"model={plan.model_name}'s blocks; one unit per block (set {policy} or "
            f"{min_params} to choose)"
        ),
        {policy: "block"},
    )


def with_ac_none(plan: RunPlan) -> RunPlan:
    return varied(plan, {f"{AC}.mode": "none"})
