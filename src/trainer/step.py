"""One optimizer step and the validation loss, on every rank: :func:`train_step`
(micro-batches, gradient sync, clipping), :func:`evaluate`, :func:`global_mean` (a
scalar's mean over ranks) and :func:`check_finite` (a NaN/inf loss stops the run)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from src.checkpoint.dcp import Checkpointer
from src.data.sources import GlobalBatches
from src.errors import RunError
from src.sharding import Backend


def global_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks (each rank holds an equal share)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def forward_kwargs(backend: Backend, x: torch.Tensor) -> dict:
    """The model's forward arguments beside the tokens ``x`` (this rank's share):
    with context parallelism, their global positions and the backend's
    ``ContextParallel`` (src/sharding/context_parallel.py); none without it."""
    return {} if backend.cp is None else backend.cp.forward_kwargs(x)


def train_step(
    model: nn.Module,
    batches: GlobalBatches,
    step: int,
    backend: Backend,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    cfg: DictConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches; returns this rank's share
    of the loss and the global gradient norm (before clipping)."""
    t = cfg.trainer
    # Read once: each DictConfig lookup costs ~20 us of CPU, and the loop is per step.
    accum, every, clip = t.grad_accum, t.grad_sync == "every", t.grad_clip
    # The ranks of a tensor-parallel (or context-parallel) group read the same rows.
    rank, world = backend.dp_rank, backend.dp_size
    if not model.training:  # after evaluation; train() walks every module (~130 us)
        model.train()
    loss_sum = torch.zeros((), device=backend.device)
    for micro in range(accum):
        x, y = batches.get(step, micro, rank, world)
        # context parallelism: this rank's 1/C of each sequence (the cp ranks of a
        # group read the same rows)
        x, y = backend.shard_sequence(x.to(backend.device), y.to(backend.device))
        # trainer.grad_sync=last: gradients are reduced across ranks only on the
        # last micro-step (unsharded ones are held until then); every: each time.
        sync = micro == accum - 1 or every
        # loss_context: tensor parallelism's loss_parallel, forward and backward.
        with (
            contextlib.nullcontext() if sync else backend.no_sync(model),
            backend.loss_context(),
        ):
            with backend.autocast():
                # the logits are not kept through backward
                loss = model(x, y, **forward_kwargs(backend, x))[1]
            if accum > 1:  # x / 1 == x: no autograd node for nothing
                loss = loss / accum
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = backend.clip_grad_norm_(model, clip or math.inf)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    backend.after_optimizer_step(model)  # float8 all-gather's scales
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, backend: Backend) -> float:
    """Mean loss over the fixed validation batches (the same in every run)."""
    model.eval()
    total = torch.zeros((), device=backend.device)
    for x, y in batches:
        x, y = backend.shard_sequence(x.to(backend.device), y.to(backend.device))
        with backend.autocast(), backend.loss_context():
            _, loss = model(x, y, **forward_kwargs(backend, x))
        total += loss.float()
    return global_mean(total / max(1, len(batches)))


class NonFiniteLossError(RunError):
    """The loss or the gradient norm became NaN or inf."""


def check_finite(
    loss: float,
    grad_norm: torch.Tensor,
    step: int,
    scaler: torch.amp.GradScaler | None,
    ckpt: Checkpointer,
) -> int:
    """Stop on a NaN/inf loss, naming the step; with the fp16 scaler, overflowing
    gradients only skip the step (the scaler did not apply it). Returns 1 if skipped.

    The run stops before any later checkpoint is written, so the last good checkpoint
    stays intact and ``trainer.resume=auto`` continues from it.
    """
    norm = float(grad_norm)
    if math.isfinite(loss) and math.isfinite(norm):
        return 0
    if scaler is not None and math.isfinite(loss):
        return 1
    last = ckpt.latest()
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    raise NonFiniteLossError(
        f"non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; "
        f"stopping ({where})"
    )
