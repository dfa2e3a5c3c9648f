"""The training step and validation of a pipeline-parallel run
(``sharding.pipeline_parallel > 1``): what ``step.train_step`` and ``step.evaluate``
do, through the pipeline's schedule (src/sharding/pipeline.py).

The loss is the same as without pipelining: each of the ``trainer.grad_accum``
micro-steps runs the schedule over its micro-batch (split into
``sharding.pp_microbatches`` pipeline micro-batches), each pipeline micro-batch's mean
loss scaled by ``1 / (pp_microbatches * grad_accum)``, so the gradients sum to those
of the global batch's mean loss; tied parameters' gradients are then summed over the
stages holding them, and clipping uses the norm over all stages.

What needs the model whole (``trainer.sample_every``'s decoding, ``trainer.export``)
gets :func:`unpipelined_model`, the model built without stages over the same ranks,
with the stages' weights gathered into it (``Pipeline.gather_into``).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from omegaconf import DictConfig

from src.build import build_model, make_backend
from src.config.run_plan import RunPlan
from src.data.sources import GlobalBatches
from src.sharding import Backend
from src.sharding.pipeline import Pipeline
from src.trainer.sampling import sampling_plan


def pipeline_train_step(
    pipeline: Pipeline,
    batches: GlobalBatches,
    step: int,
    backend: Backend,
    optimizer: torch.optim.Optimizer,
    cfg: DictConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns this rank's data-parallel share of the loss (the
    same on every stage) and the global gradient norm (before clipping)."""
    t = cfg.trainer
    rank, world = backend.dp_rank, backend.dp_size
    scale = 1.0 / (cfg.sharding.pp_microbatches * t.grad_accum)
    for m in pipeline.modules:
        m.train()
    loss_sum = torch.zeros((), device=backend.device)
    for micro in range(t.grad_accum):
        x, y = batches.get(step, micro, rank, world)
        with backend.loss_context():
            loss_sum += pipeline.step(x.to(backend.device), y.to(backend.device), scale)
    pipeline.sync_shared_grads()
    grad_norm = pipeline.clip_grad_norm_(t.grad_clip or math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for m in pipeline.modules:
        backend.after_optimizer_step(m)  # float8 all-gather's scales
    return pipeline.share(loss_sum), grad_norm


@torch.no_grad()
def pipeline_evaluate(
    pipeline: Pipeline, batches: list, backend: Backend
) -> torch.Tensor:
    """Mean loss over the fixed validation batches, through the pipeline (forward
    only), on every stage; its ``step.global_mean`` is the loss without pipelining."""
    for m in pipeline.modules:
        m.eval()
    total = torch.zeros((), device=backend.device)
    for x, y in batches:
        with backend.loss_context():
            total += pipeline.step(
                x.to(backend.device),
                y.to(backend.device),
                1 / pipeline.microbatches,
                train=False,
            )
    return pipeline.share(total / max(1, len(batches)))


def unpipelined_model(resolved: RunPlan, device: torch.device) -> nn.Module:
    """The run's model without pipeline stages (nor tensor parallelism: sampling's
    changes), sharded over all of the run's ranks, on the meta device filled by
    the family's init; ``Pipeline.gather_into`` gives it the trained weights."""
    whole = sampling_plan(resolved)
    model = build_model(whole, make_backend(whole, device), "meta")
    return model.eval()
