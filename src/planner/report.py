"""Plan-only (``trainer.plan_only=true``): the wrap plan, the estimate part by part, the
gradient-accumulation modes and the verdict against the budget, printed; no rank
starts."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import torch

from src.config.run_plan import OVERRIDES, RunPlan, budget_bytes, field_of, varied
from src.config.schema import GRAD_SYNC
from src.observe.loggers import Logger
from src.planner.auto import AUTO_FIELDS
from src.planner.costs import (
    cost_factors,
    pipeline_cost,
    precision_cost,
    precision_cost_basis,
)
from src.planner.estimate import Estimate, fmt_bytes, needed, with_margin
from src.planner.inputs import build_meta_model
from src.planner.layouts import run_layouts
from src.planner.pipeline import (
    bubble_line,
    pipeline_estimates,
    pipeline_report,
    stage_plans,
    worst_stage,
)
from src.planner.run_estimate import estimate_plan
from src.planner.search import (
    Candidate,
    ac_options,
    cp_options,
    ep_options,
    fit_search,
    splitting_batch,
)
from src.planner.settings import (
    AC,
    BATCH,
    CP,
    DEVICES,
    EP,
    MICRO,
    PP,
    PRECISION,
    SYNC,
    accelerator_name,
    mem_margin,
)
from src.planner.step_time import predicted_step
from src.sharding import GIB, WrapPlan, get_precision

log = logging.getLogger(__name__)


def grad_sync_costs(resolved: RunPlan, world: int, model: torch.nn.Module) -> str:
    """Both gradient-accumulation modes side by side (memory and collectives)."""
    accum = int(resolved.batch.grad_accum)
    lines = [f"gradient accumulation modes ({OVERRIDES[SYNC]}):"]
    for mode in GRAD_SYNC:
        _, est = estimate_plan(varied(resolved, {SYNC: mode}), world, model)
        scatters = 1 if mode == "last" else accum
        lines.append(
            f"  {mode:<5} {fmt_bytes(est.total):>12} peak, {scatters} gradient reduction(s)"
            f" per step{' (unsharded gradients held)' if mode == 'last' and accum > 1 else ''}"
        )
    return "\n".join(lines)


def fit_report(resolved: RunPlan, est: Estimate, world: int) -> tuple[str, dict]:
    """The verdict against ``trainer.mem_budget_gib`` (and, if it does not fit, the
    cheapest change that does); empty when no budget is set."""
    budget = budget_bytes(resolved.budget.mem_budget)
    if budget is None:
        return "", {}
    pct = mem_margin(resolved)
    need = needed(est, pct)
    margin = budget - need
    info = {
        "budget_gib": budget / GIB,
        "fits": margin >= 0,
        "margin_gib": margin / GIB,
        "mem_margin": pct,
    }
    if margin >= 0:
        return (
            f"fits: {with_margin(est, pct)} of {fmt_bytes(budget)} per rank "
            f"(headroom {fmt_bytes(margin)}, {margin / budget:.0%})"
        ), info
    lines = [
        f"does not fit: needs {with_margin(est, pct)} > budget {fmt_bytes(budget)} per rank"
    ]
    fixed = resolved.budget.fixed_devices
    keys = [*AUTO_FIELDS, PRECISION, PP, *([] if fixed else [DEVICES])]
    if len(ep_options(resolved)) > 1:  # an MoE model: its experts can split
        keys.append(EP)
    found = fit_search(
        resolved, keys, budget, world, max_world=world * 64, complete_batch=True,
        by_model=True,
    )  # fmt: skip
    if found.best is None and len(cp_options(resolved)) > 1:
        # context parallelism last: it helps once a micro-batch is one sequence, and
        # searching it multiplies the points by its degrees
        with_cp = fit_search(
            resolved, [*keys, CP], budget, world, max_world=world * 64,
            complete_batch=True, by_model=True,
        )  # fmt: skip
        smaller = with_cp.smallest.estimate.total < found.smallest.estimate.total
        if with_cp.best is not None or smaller:
            found = with_cp
    here, fixed_key = (
        f"{OVERRIDES[DEVICES]}={world}",
        OVERRIDES["budget.fixed_devices"],
    )
    if found.best is None:
        lines.append(
            "no searched change fits"
            + (f" at {here} ({fixed_key}=true)" if fixed else "")
            + f"; the smallest estimate is {fmt_bytes(found.smallest.estimate.total)}"
            f" with {found.smallest.describe()}"
        )
        return "\n".join(lines), info
    lines.append(
        proposal_line("cheapest change that fits", resolved, found.best, budget)
    )
    info["fix"] = found.best.describe()
    if found.best_here is None and found.smallest_here is not None:
        small = found.smallest_here
        lines.append(
            f"at {here} ({fixed_key}=true) no searched change fits; the "
            f"smallest estimate there is {fmt_bytes(small.estimate.total)} "
            f"({small.describe()})"
        )
    elif found.best_here is not found.best:
        title = f"cheapest change that fits at {here} ({fixed_key}=true)"
        lines.append(proposal_line(title, resolved, found.best_here, budget))
        info["fix_at_devices"] = found.best_here.describe()
    lines.extend(effects(resolved, est, found.best))
    if found.best_here is not None and found.best_here is not found.best:
        lines.extend(effects(resolved, est, found.best_here))
    return "\n".join(lines), info


def proposal_line(title: str, resolved: RunPlan, best: Candidate, budget: int) -> str:
    """A proposal: the overrides that run as printed (the batch included where the
    ranks change), its estimate and headroom, and its relative cost factor by
    factor."""
    pct = mem_margin(resolved)
    m = budget - needed(best.estimate, pct)
    return (
        f"{title}: {best.describe()} -> {with_margin(best.estimate, pct)} (headroom "
        f"{fmt_bytes(m)}; {cost_line(resolved, best)})"
    )


def cost_line(resolved: RunPlan, best: Candidate) -> str:
    """What a proposal's relative cost measures, and its factors (or the
    step-time model it comes from)."""
    if best.basis:
        return (
            f"predicted device time per token x{best.cost:.2f} against the run as "
            f"set: {best.basis}"
        )
    currents = {k: field_of(resolved, k) for k in best.changes}
    currents[DEVICES] = resolved.world_size
    currents[PRECISION] = resolved.precision.name
    ac = best.changes.get(AC)
    if ac is not None:  # as the search's starting point: the configured checkpointing
        cur = resolved.checkpointing
        currents[AC] = ac_options(str(cur.mode), int(cur.every), ac.blocks)[0]
    device = (best.estimate.shape.device, accelerator_name(resolved))
    factors = cost_factors(currents, best.changes, device)
    rest = best.cost / math.prod(f for _, f in factors) if factors else best.cost
    if abs(rest - 1) > 1e-9:
        factors.append(("pipeline bubble", rest))
    each = ", ".join(f"{name} x{f:.2f}" for name, f in factors)
    return (
        f"relative cost x{best.cost:.2f}: compute time per token x machines against "
        f"the run as set{': ' + each if each else ''}"
    )


def effects(resolved: RunPlan, est: Estimate, best: Candidate) -> list[str]:
    """What a proposal changes besides memory: a new global batch, the pipeline,
    the precision."""
    lines = []
    if BATCH in best.changes:
        batch = best.changes[BATCH]
        lines.append(
            f"{OVERRIDES[BATCH]}={batch} (was {resolved.batch.batch_size}) changes the "
            "training: each data-parallel rank needs whole sequences of the global "
            "batch, so it grows (the learning rate may want retuning)"
        )
    if PP in best.changes:
        lines.append(pipeline_effects(resolved, best))
    if PRECISION in best.changes:
        name = best.changes[PRECISION]
        device = (est.shape.device, accelerator_name(resolved))
        lines.append(
            f"precision={name} changes more than memory: "
            f"{get_precision(name).effects}; compute x"
            f"{precision_cost(name, *device):.2f} "
            f"({precision_cost_basis(name, *device)})"
        )
    return lines


def pipeline_effects(resolved: RunPlan, best: Candidate) -> str:
    """What a proposed stage count changes besides memory."""
    s, key = resolved.pipeline, OVERRIDES[PP]
    pp = best.changes[PP]
    m = best.changes.get(MICRO, int(s.microbatches))
    schedule = str(s.schedule)
    if pp == 1:
        was = resolved.layout.pp
        return (
            f"{key}=1 changes more than memory: no pipeline, so no bubble (the "
            f"{bubble_line(schedule, was, int(s.microbatches))} of a step now); "
            "every rank holds shards of all the blocks"
        )
    return (
        f"{key}={pp} changes more than memory: {pp} stages of the model's "
        f"blocks, each sharded over {best.estimate.shape.world} ranks; "
        f"{schedule} over {m} micro-batches idles each rank for the "
        f"{bubble_line(schedule, pp, m)} of a step (compute "
        f"x{pipeline_cost(schedule, pp, m):.2f}); activations pass between stages "
        "point to point (docs/sharding.md)"
    )


def uneven_batch(resolved: RunPlan, world: int) -> str:
    """A warning line when ``trainer.batch_size`` does not split into
    ``trainer.grad_accum`` micro-batches of whole sequences on each data-parallel
    rank of ``world`` (and, pipelined, into ``sharding.pp_microbatches`` pipeline
    micro-batches; the estimate plans the busiest rank's share, at least one
    sequence; a run refuses such a batch); empty when it splits."""
    batch, accum = int(resolved.batch.batch_size), int(resolved.batch.grad_accum)
    pp = resolved.layout.pp
    m = int(resolved.pipeline.microbatches) if pp > 1 else 1
    dp = resolved.layout.stage(world // pp).dp
    if splitting_batch(batch, resolved.layout, world, accum, pp, m) == batch:
        return ""
    share = batch / accum / dp / m
    into = f" and {m} pipeline micro-batches" if pp > 1 else ""
    return (
        f"warning: trainer.batch_size={batch} in {accum} micro-batch(es){into} over "
        f"{dp} data-parallel rank(s) is {share:g} sequence(s) per rank: planned as "
        f"micro-batch {max(1, math.ceil(share))}, the busiest rank's share; a run needs "
        f"trainer.batch_size a multiple of {accum * dp * m}"
    )


def plan_only(
    resolved: RunPlan, run_dir: str, world_size: int | None = None
) -> WrapPlan:
    """Print the wrap plan, the per-rank training peak estimate part by part, the
    gradient-accumulation modes and, with ``trainer.mem_budget_gib``, the verdict,
    for ``trainer.devices`` ranks; no rank starts and nothing is allocated (the model
    is built on the meta device with the recording-only ``plan`` backend)."""
    world = world_size or resolved.world_size
    stages: dict[str, Any] = {}
    if resolved.layout.pp > 1:  # each stage planned, never the whole model
        estimates = pipeline_estimates(resolved, world)
        plan, est = worst_stage(estimates)
        # the worst rank's own blocks (alike ranks share one build)
        rank, plan = stage_plans(resolved, only=est.pp_rank).plans(resolved, world)[0]
        plan = replace(
            plan,
            layout=replace(plan.layout, world_size=world, pp=rank.pp),
            stages=rank.stages,
            num_stages=rank.n_stages,
        )
        log.info(plan.tree())
        log.info(pipeline_report(resolved, estimates))
        log.info(est.table())
        stages = {
            "worst_pp_rank": est.pp_rank,
            "stage_total_gib": [e.total / GIB for _, e in estimates],
        }
    else:
        model = build_meta_model(resolved)
        plan, est = estimate_plan(resolved, world, model)
        log.info(plan.tree())
        log.info(est.table())
    if uneven_batch(resolved, world):
        log.warning(uneven_batch(resolved, world))
    if resolved.layout.pp == 1:
        log.info(grad_sync_costs(resolved, world, model))
    verdict, info = fit_report(resolved, est, world)
    if verdict:
        log.info(verdict)
    step, why = predicted_step(resolved, plan, world)
    log.info(step.table() if step else f"step time: not predicted ({why})")
    layouts, head = run_layouts(resolved, world)
    log.info(
        "\n".join([head, *(f"  {i}. {x.line()}" for i, x in enumerate(layouts, 1))])
    )
    logger = Logger.files(run_dir)
    logger.log_table("wrap_plan", plan.rows())
    logger.log_summary(
        {
            "world_size": world,
            "replicate": plan.layout.dp_replicate,
            "tensor_parallel": plan.layout.tp,
            "shard_size": plan.shard_size,
            "wrap_units": len(plan.units),
            "peak_phase": est.phase,
            **est.gib(),
            **stages,
            **info,
            **(step.summary() if step else {}),
            "layouts": [x.record() for x in layouts],
        }
    )
    logger.finish()
    return plan
