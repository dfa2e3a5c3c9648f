"""Plan-only (``trainer.plan_only=true``): the wrap plan, the estimate part by part, the
gradient-accumulation modes and the verdict against the budget, printed; no rank
starts."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from src.observe.loggers import Logger
from src.planner.auto import AUTO_KEYS
from src.planner.constants import budget_bytes
from src.planner.costs import (
    cost_factors,
    pipeline_cost,
    precision_cost,
    precision_cost_basis,
)
from src.planner.estimate import Estimate, fmt_bytes, needed, with_margin
from src.planner.inputs import build_meta_model
from src.planner.pipeline import (
    bubble_line,
    pipeline_estimates,
    pipeline_report,
    stage_plans,
    worst_stage,
)
from src.planner.run_estimate import estimate_cfg
from src.planner.search import (
    BATCH_KEY,
    Candidate,
    ac_options,
    cp_options,
    ep_options,
    fit_search,
    splitting_batch,
)
from src.planner.settings import (
    AC_EVERY_KEY,
    AC_KEY,
    CP_KEY,
    EP_KEY,
    PP_KEY,
    PP_MICRO_KEY,
    PRECISION_KEY,
    accelerator_name,
    mem_margin,
    pipeline_stages,
    setting,
    with_values,
)
from src.resolved import RunPlan, resolve_devices
from src.schema import GRAD_SYNC
from src.sharding import GIB, WrapPlan, get_precision

log = logging.getLogger(__name__)


def grad_sync_costs(
    cfg: DictConfig, resolved: RunPlan, world: int, model: torch.nn.Module
) -> str:
    """Both gradient-accumulation modes side by side (memory and collectives)."""
    accum = int(cfg.trainer.grad_accum)
    lines = ["gradient accumulation modes (trainer.grad_sync):"]
    for mode in GRAD_SYNC:
        sync = with_values(cfg, {"trainer.grad_sync": mode})
        _, est = estimate_cfg(sync, resolved, world, model)
        scatters = 1 if mode == "last" else accum
        lines.append(
            f"  {mode:<5} {fmt_bytes(est.total):>12} peak, {scatters} gradient reduction(s)"
            f" per step{' (unsharded gradients held)' if mode == 'last' and accum > 1 else ''}"
        )
    return "\n".join(lines)


def fit_report(
    cfg: DictConfig, resolved: RunPlan, est: Estimate, world: int
) -> tuple[str, dict]:
    """The verdict against ``trainer.mem_budget_gib`` (and, if it does not fit, the
    cheapest change that does); empty when no budget is set."""
    budget = budget_bytes(OmegaConf.select(cfg, "trainer.mem_budget_gib"))
    if budget is None:
        return "", {}
    pct = mem_margin(cfg)
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
    fixed = bool(OmegaConf.select(cfg, FIXED_DEVICES_KEY, default=False))
    keys = [*AUTO_KEYS, PRECISION_KEY, PP_KEY, *([] if fixed else ["trainer.devices"])]
    if len(ep_options(cfg, resolved)) > 1:  # an MoE model: its experts can split
        keys.append(EP_KEY)
    found = fit_search(
        cfg, resolved, keys, budget, world, max_world=world * 64, complete_batch=True
    )
    if found.best is None and len(cp_options(cfg, resolved)) > 1:
        # context parallelism last: it helps once a micro-batch is one sequence, and
        # searching it multiplies the points by its degrees
        with_cp = fit_search(
            cfg, resolved, [*keys, CP_KEY], budget, world, max_world=world * 64,
            complete_batch=True,
        )  # fmt: skip
        smaller = with_cp.smallest.estimate.total < found.smallest.estimate.total
        if with_cp.best is not None or smaller:
            found = with_cp
    here = f"trainer.devices={world}"
    if found.best is None:
        lines.append(
            "no searched change fits"
            + (f" at {here} ({FIXED_DEVICES_KEY}=true)" if fixed else "")
            + f"; the smallest estimate is {fmt_bytes(found.smallest.estimate.total)}"
            f" with {found.smallest.describe()}"
        )
        return "\n".join(lines), info
    lines.append(proposal_line("cheapest change that fits", cfg, found.best, budget))
    info["fix"] = found.best.describe()
    if found.best_here is None and found.smallest_here is not None:
        small = found.smallest_here
        lines.append(
            f"at {here} ({FIXED_DEVICES_KEY}=true) no searched change fits; the "
            f"smallest estimate there is {fmt_bytes(small.estimate.total)} "
            f"({small.describe()})"
        )
    elif found.best_here is not found.best:
        title = f"cheapest change that fits at {here} ({FIXED_DEVICES_KEY}=true)"
        lines.append(proposal_line(title, cfg, found.best_here, budget))
        info["fix_at_devices"] = found.best_here.describe()
    lines.extend(effects(cfg, est, found.best))
    if found.best_here is not None and found.best_here is not found.best:
        lines.extend(effects(cfg, est, found.best_here))
    return "\n".join(lines), info


#: The key that keeps the planner's proposals at the configured device count.
FIXED_DEVICES_KEY = "trainer.fixed_devices"


def proposal_line(title: str, cfg: DictConfig, best: Candidate, budget: int) -> str:
    """A proposal: the overrides that run as printed (the batch included where the
    ranks change), its estimate and headroom, and its relative cost factor by
    factor."""
    pct = mem_margin(cfg)
    m = budget - needed(best.estimate, pct)
    return (
        f"{title}: {best.describe()} -> {with_margin(best.estimate, pct)} (headroom "
        f"{fmt_bytes(m)}; {cost_line(cfg, best)})"
    )


def cost_line(cfg: DictConfig, best: Candidate) -> str:
    """What a proposal's relative cost measures, and its factors."""
    currents = {k: setting(cfg, k) for k in best.overrides}
    currents["trainer.devices"] = resolve_devices(cfg.trainer.devices)
    currents[PRECISION_KEY] = cfg.precision.name
    ac = best.overrides.get(AC_KEY)
    if ac is not None:  # as the search's starting point: the configured checkpointing
        currents[AC_KEY] = ac_options(
            str(setting(cfg, AC_KEY)), int(setting(cfg, AC_EVERY_KEY)), ac.blocks
        )[0]
    device = (best.estimate.shape.device, accelerator_name(cfg))
    factors = cost_factors(currents, best.overrides, device)
    rest = best.cost / math.prod(f for _, f in factors) if factors else best.cost
    if abs(rest - 1) > 1e-9:
        factors.append(("pipeline bubble", rest))
    each = ", ".join(f"{name} x{f:.2f}" for name, f in factors)
    return (
        f"relative cost x{best.cost:.2f}: compute time per token x machines against "
        f"the run as set{': ' + each if each else ''}"
    )


def effects(cfg: DictConfig, est: Estimate, best: Candidate) -> list[str]:
    """What a proposal changes besides memory: a new global batch, the pipeline,
    the precision."""
    lines = []
    if BATCH_KEY in best.overrides:
        batch = best.overrides[BATCH_KEY]
        lines.append(
            f"{BATCH_KEY}={batch} (was {cfg.trainer.batch_size}) changes the "
            "training: each data-parallel rank needs whole sequences of the global "
            "batch, so it grows (the learning rate may want retuning)"
        )
    if PP_KEY in best.overrides:
        lines.append(pipeline_effects(cfg, best))
    if PRECISION_KEY in best.overrides:
        name = best.overrides[PRECISION_KEY]
        device = (est.shape.device, accelerator_name(cfg))
        lines.append(
            f"precision={name} changes more than memory: "
            f"{get_precision(name).effects}; compute x"
            f"{precision_cost(name, *device):.2f} "
            f"({precision_cost_basis(name, *device)})"
        )
    return lines


def pipeline_effects(cfg: DictConfig, best: Candidate) -> str:
    """What a proposed stage count changes besides memory."""
    s = cfg.sharding
    pp = best.overrides[PP_KEY]
    m = best.overrides.get(PP_MICRO_KEY, int(s.pp_microbatches))
    schedule = str(s.pp_schedule)
    if pp == 1:
        was = pipeline_stages(cfg)
        return (
            f"{PP_KEY}=1 changes more than memory: no pipeline, so no bubble (the "
            f"{bubble_line(schedule, was, int(s.pp_microbatches))} of a step now); "
            "every rank holds shards of all the blocks"
        )
    return (
        f"{PP_KEY}={pp} changes more than memory: {pp} stages of the model's "
        f"blocks, each sharded over {best.estimate.shape.world} ranks; "
        f"{schedule} over {m} micro-batches idles each rank for the "
        f"{bubble_line(schedule, pp, m)} of a step (compute "
        f"x{pipeline_cost(schedule, pp, m):.2f}); activations pass between stages "
        "point to point (docs/sharding.md)"
    )


def uneven_batch(cfg: DictConfig, resolved: RunPlan, world: int) -> str:
    """A warning line when ``trainer.batch_size`` does not split into
    ``trainer.grad_accum`` micro-batches of whole sequences on each data-parallel
    rank of ``world`` (and, pipelined, into ``sharding.pp_microbatches`` pipeline
    micro-batches; the estimate plans the busiest rank's share, at least one
    sequence; a run refuses such a batch); empty when it splits."""
    t = cfg.trainer
    batch, accum = int(t.batch_size), int(t.grad_accum)
    pp = pipeline_stages(cfg)
    m = int(setting(cfg, PP_MICRO_KEY)) if pp > 1 else 1
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
    cfg: DictConfig, resolved: RunPlan, run_dir: str, world_size: int | None = None
) -> WrapPlan:
    """Print the wrap plan, the per-rank training peak estimate part by part, the
    gradient-accumulation modes and, with ``trainer.mem_budget_gib``, the verdict,
    for ``trainer.devices`` ranks; no rank starts and nothing is allocated (the model
    is built on the meta device with the recording-only ``plan`` backend)."""
    world = world_size or resolve_devices(cfg.trainer.devices)
    stages: dict[str, Any] = {}
    if pipeline_stages(cfg) > 1:  # each stage planned, never the whole model
        estimates = pipeline_estimates(cfg, resolved, world)
        plan, est = worst_stage(estimates)
        # the worst rank's own blocks (alike ranks share one build)
        rank, plan = stage_plans(cfg, resolved, only=est.pp_rank).plans(
            resolved, world
        )[0]
        plan = replace(
            plan,
            layout=replace(plan.layout, world_size=world, pp=rank.pp),
            stages=rank.stages,
            num_stages=rank.n_stages,
        )
        log.info(plan.tree())
        log.info(pipeline_report(cfg, estimates))
        log.info(est.table())
        stages = {
            "worst_pp_rank": est.pp_rank,
            "stage_total_gib": [e.total / GIB for _, e in estimates],
        }
    else:
        model = build_meta_model(cfg, resolved)
        plan, est = estimate_cfg(cfg, resolved, world, model)
        log.info(plan.tree())
        log.info(est.table())
    if uneven_batch(cfg, resolved, world):
        log.warning(uneven_batch(cfg, resolved, world))
    if pipeline_stages(cfg) == 1:
        log.info(grad_sync_costs(cfg, resolved, world, model))
    verdict, info = fit_report(cfg, resolved, est, world)
    if verdict:
        log.info(verdict)
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
        }
    )
    logger.finish()
    return plan
