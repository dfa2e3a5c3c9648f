"""The training step and validation of a pipeline-parallel run
(``sharding.pipeline_parallel > 1``): what ``step.train_step`` and ``step.evaluate``
do, through the pipeline's schedule (src/sharding/pipeline.py).

The loss is the same as without pipelining: each of the ``trainer.grad_accum``
micro-steps runs the schedule over its micro-batch (split into
``sharding.pp_microbatches`` pipeline micro-batches), each pipeline micro-batch's mean
loss scaled by ``1 / (pp_microbatches * grad_accum)``, so the gradients sum to those
of the global batch's mean loss (packed by documents: each pipeline micro-batch's
summed loss weighed per counted target of the global batch, every stage given its
micro-batch's document ids); tied parameters' gradients are then summed over the
stages holding them, and clipping uses the norm over all stages.

What needs the model whole (``trainer.sample_every``'s decoding, ``trainer.export``)
gets :func:`unpipelined_model`, the model built without stages over the same ranks,
with the stages' weights gathered into it (``Pipeline.gather_into``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from omegaconf import DictConfig

from src.build import build_model, make_backend
from src.config.run_plan import RunPlan
from src.data.packing import Documents
from src.data.sources import GlobalBatches
from src.sharding import Backend
from src.sharding.pipeline import Pipeline
from src.trainer.sampling import sampling_plan
from src.trainer.step import per_counted_target


def pipeline_train_step(
    pipeline: Pipeline,
    batches: GlobalBatches,
    step: int,
    backend: Backend,
    optimizer: torch.optim.Optimizer,
    cfg: DictConfig,
    documents: Documents | None = None,
    inspect: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns this rank's data-parallel share of the loss (the
    same on every stage) and the global gradient norm (before clipping).
    ``inspect``: as :func:`src.trainer.step.train_step`'s."""
    t = cfg.trainer
    rank, world = backend.dp_rank, backend.dp_size
    mean = 1.0 / (cfg.sharding.pp_microbatches * t.grad_accum)
    for m in pipeline.modules:
        m.train()
    batch = [batches.get(step, micro, rank, world) for micro in range(t.grad_accum)]
    loss_sum = torch.zeros((), device=backend.device)
    for x, y, scale, inputs in on_stages(batch, backend, documents, mean):
        with backend.loss_context():
            loss_sum += pipeline.step(x, y, scale, **inputs)
    pipeline.sync_shared_grads()
    grad_norm = pipeline.clip_grad_norm_(t.grad_clip or math.inf)
    if inspect is not None:
        inspect()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for m in pipeline.modules:
        backend.after_optimizer_step(m)  # float8 all-gather's scales
    return pipeline.share(loss_sum), grad_norm


def on_stages(
    batch: list[tuple[torch.Tensor, torch.Tensor]],
    backend: Backend,
    documents: Documents | None,
    scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor, float, dict]]:
    """Each batch on the device with what multiplies the loss of each of its
    pipeline micro-batches and the keyword inputs of every stage: ``scale`` (of
    the mean loss) and none; with ``documents``, the loss is summed
    (``build_pipeline``) and weighed per counted target, so the step's loss is
    the mean over the global batch's (src/trainer/step.py), and the stages get
    the document ids."""
    batch = [(x.to(backend.device), y.to(backend.device)) for x, y in batch]
    if documents is None:
        return [(x, y, scale, {}) for x, y in batch]
    counted = [(x, documents.targets(x, y)) for x, y in batch]
    per_target = per_counted_target(
        sum(int((y != -1).sum()) for _, y in counted), backend
    )
    return [(x, y, per_target, {"docs": documents.ids(x)}) for x, y in counted]


@torch.no_grad()
def pipeline_evaluate(
    pipeline: Pipeline,
    batches: list,
    backend: Backend,
    documents: Documents | None = None,
) -> torch.Tensor:
    """Mean loss over the fixed validation batches (with ``documents``, over their
    counted targets), through the pipeline (forward only), on every stage; its
    ``step.global_mean`` is the loss without pipelining."""
    for m in pipeline.modules:
        m.eval()
    total = torch.zeros((), device=backend.device)
    mean = 1 / (pipeline.microbatches * max(1, len(batches)))
    for x, y, scale, inputs in on_stages(batches, backend, documents, mean):
        with backend.loss_context():
            total += pipeline.step(x, y, scale, train=False, **inputs)
    return pipeline.share(total)


def unpipelined_model(resolved: RunPlan, device: torch.device) -> nn.Module:
    """The run's model without pipeline stages (nor tensor parallelism: sampling's
    changes), sharded over all of the run's ranks, on the meta device filled by
    the family's init; ``Pipeline.gather_into`` gives it the trained weights."""
    whole = sampling_plan(resolved)
    model = build_model(whole, make_backend(whole, device), "meta")
    return model.eval()
