"""The estimate of a config: the whole run's, or a pipeline's worst stage."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from src.planner.activations import ep_dispatch, has_formula, run_activations
from src.planner.estimate import Estimate, estimate
from src.planner.inputs import (
    build_meta_model,
    family_process_bytes,
    lower_bound_reason,
    plan_of,
    run_shape,
)
from src.planner.pipeline import pipeline_estimates, worst_stage
from src.planner.settings import pipeline_stages
from src.resolved import RunPlan
from src.sharding import WrapPlan


def estimate_cfg(
    cfg: DictConfig,
    resolved: RunPlan,
    world: int,
    model: torch.nn.Module | None = None,
) -> tuple[WrapPlan, Estimate]:
    """The wrap plan and the estimate of ``cfg`` (its model: ``resolved``'s) on
    ``world`` ranks (``model``: a meta model of ``cfg`` already built, reused across
    rank counts). A pipeline-parallel run: its worst stage's (:func:`worst_stage`)."""
    if pipeline_stages(cfg) > 1:
        plan, est = worst_stage(pipeline_estimates(cfg, resolved, world))
    else:
        model = model if model is not None else build_meta_model(cfg, resolved)
        plan = plan_of(resolved, model, world)
        shape = run_shape(cfg, resolved, world)
        acts = run_activations(cfg, resolved, shape, model)
        process = family_process_bytes(cfg, resolved, shape.device)
        dispatch = ep_dispatch(resolved, shape)
        est = estimate(plan, shape, acts, process, dispatch=dispatch)
        if not has_formula(resolved):
            est.notes["activations"] = "traced: one block per block class, fake tensors"
        if resolved.layout.ep > 1:
            _expert_parallel_notes(est, resolved.layout.ep)
    est.caveat = lower_bound_reason(resolved, est.shape.device, str(cfg.precision.name))
    return plan, est


def _expert_parallel_notes(est: Estimate, ep: int) -> None:
    """What the estimate assumes of expert parallelism, said beside its parts."""
    est.notes["gathered_units"] = (
        est.notes.get("gathered_units", "") + f"; each MoE block's experts 1/{ep}"
    )
