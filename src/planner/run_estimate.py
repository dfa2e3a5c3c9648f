"""The estimate of a run plan: the whole run's, or a pipeline's worst stage."""

from __future__ import annotations

import torch

from src.config.run_plan import RunPlan
from src.models.memory import ActivationBytes
from src.planner.activations import (
    documents_activations,
    ep_dispatch,
    has_formula,
    run_activations,
)
from src.planner.estimate import Estimate, estimate
from src.planner.inputs import (
    build_meta_model,
    family_process_bytes,
    lower_bound_reason,
    plan_of,
    run_shape,
)
from src.planner.pipeline import pipeline_estimates, worst_stage
from src.sharding import MIB, WrapPlan


def estimate_plan(
    resolved: RunPlan,
    world: int,
    model: torch.nn.Module | None = None,
) -> tuple[WrapPlan, Estimate]:
    """The wrap plan and the estimate of the run plan ``resolved`` on ``world`` ranks
    (``model``: its meta model already built, reused across rank counts). A
    pipeline-parallel run: its worst stage's (:func:`worst_stage`)."""
    if resolved.layout.pp > 1:
        plan, est = worst_stage(pipeline_estimates(resolved, world))
    else:
        model = model if model is not None else build_meta_model(resolved)
        plan = plan_of(resolved, model, world)
        shape = run_shape(resolved, world)
        acts = run_activations(resolved, shape, model)
        process = family_process_bytes(resolved, shape.device)
        dispatch = ep_dispatch(resolved, shape)
        est = estimate(plan, shape, acts, process, dispatch=dispatch)
        if not has_formula(resolved):
            est.notes["activations"] = "traced: one block per block class, fake tensors"
        if resolved.batch.documents:  # the mask's own term, said beside its part
            zero = ActivationBytes(0, 0, 0, 0)
            mask = documents_activations(resolved, shape, zero, model).saved
            est.notes["activations"] = (
                f"documents' mask and positions {mask / MIB:.1f} MiB"
            )
        if resolved.layout.ep > 1:
            _expert_parallel_notes(est, resolved.layout.ep)
    est.caveat = lower_bound_reason(resolved, est.shape.device, resolved.precision.name)
    return plan, est


def _expert_parallel_notes(est: Estimate, ep: int) -> None:
    """What the estimate assumes of expert parallelism, said beside its parts."""
    est.notes["gathered_units"] = (
        est.notes.get("gathered_units", "") + f"; each MoE block's experts 1/{ep}"
    )
