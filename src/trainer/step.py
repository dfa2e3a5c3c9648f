"""One optimizer step and the validation loss, on every rank: :func:`train_step`
(micro-batches, gradient sync, clipping), :func:`evaluate` (and a mixture's
:func:`evaluate_sources`), :func:`global_mean` (a
scalar's mean over ranks) and :func:`check_finite` (a NaN/inf loss stops the run)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from src.checkpoint.dcp import Checkpointer
from src.data.mixture import ValBatches
from src.data.packing import Documents
from src.data.sources import GlobalBatches
from src.errors import RunError
from src.models.attention import document_positions
from src.sharding import Backend


def global_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks (each rank holds an equal share)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def forward_kwargs(
    backend: Backend, x: torch.Tensor, docs: torch.Tensor | None = None
) -> dict:
    """The model's forward arguments beside the tokens ``x`` (this rank's share):
    with context parallelism, their global positions and the backend's
    ``ContextParallel`` (src/sharding/context_parallel.py); with
    ``data.packing=documents``, the document ids ``docs`` of the whole rows (under
    context parallelism the ``ContextParallel`` keeps them for its mask, and the
    positions are this rank's share of those within documents); none without
    either."""
    if backend.cp is None:
        return {} if docs is None else {"docs": docs}
    kwargs = backend.cp.forward_kwargs(x, docs)
    if docs is not None:
        kwargs["positions"] = backend.cp.shard(document_positions(docs))
    return kwargs


def on_rank(
    backend: Backend,
    x: torch.Tensor,
    y: torch.Tensor,
    documents: Documents | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A micro-batch on this rank's device, its share of each sequence (context
    parallelism), and the whole rows' document ids (None: stream packing)."""
    x, y = x.to(backend.device), y.to(backend.device)
    docs = None if documents is None else documents.ids(x)
    return (*backend.shard_sequence(x, y), docs)


def counted_weights(
    batch: list[tuple[torch.Tensor, torch.Tensor]], backend: Backend
) -> list[float]:
    """What each micro-batch's mean loss is multiplied by so that the step's loss
    (and gradient) is the mean over the targets that count (not -1) of the whole
    global batch, however they fall on micro-batches and ranks: this rank's
    counted targets (its share of each sequence under context parallelism) x the
    ranks FSDP averages gradients over (data-parallel x cp) / the global count
    (one all-reduce; the ranks of a tp group read the same rows, so the world's
    sum counts them that often)."""
    counts = counted(batch, backend)
    per_target = per_counted_target(sum(counts), backend)
    return [n * per_target for n in counts]


def counted(
    batch: list[tuple[torch.Tensor, torch.Tensor]], backend: Backend
) -> list[int]:
    """This rank's counted targets (not -1) of each micro-batch: its share of each
    sequence under context parallelism."""
    return [int((backend.shard_sequence(y)[0] != -1).sum()) for _, y in batch]


def per_counted_target(count: int, backend: Backend) -> float:
    """What one of this rank's ``count`` counted targets weighs in the step's mean
    (:func:`counted_weights`; a collective over all ranks)."""
    total = torch.tensor(count, dtype=torch.int64, device=backend.device)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    averaged = backend.dp_size * backend.layout.cp  # ranks with their own targets
    total = int(total) // (backend.world_size // averaged)  # tp and pp replicas
    return averaged / max(total, 1)


def within_documents(
    batch: list[tuple[torch.Tensor, torch.Tensor]],
    documents: Documents,
    backend: Backend,
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[float]]:
    """The micro-batches with their document-boundary targets dropped, and their
    :func:`counted_weights`. One without a counted target gets every target (id 0)
    at weight 0: its mean over none would be NaN, and so would NaN x 0 (its own
    targets may all be -1: a conversation's prompt)."""
    counted = [(x, documents.targets(x, y)) for x, y in batch]
    weights = counted_weights(counted, backend)
    kept = [
        (x, y if w else torch.zeros_like(y))
        for (x, y), w in zip(counted, weights, strict=True)
    ]
    return kept, weights


def train_step(
    model: nn.Module,
    batches: GlobalBatches,
    step: int,
    backend: Backend,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    cfg: DictConfig,
    documents: Documents | None = None,
    inspect: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches; returns this rank's share
    of the loss and the global gradient norm (before clipping). ``documents``:
    ``data.packing=documents`` (src/data/packing.py); ``inspect``: called with the
    gradients reduced and clipped, before the optimizer step (per-block health)."""
    t = cfg.trainer
    # Read once: each DictConfig lookup costs ~20 us of CPU, and the loop is per step.
    accum, every, clip = t.grad_accum, t.grad_sync == "every", t.grad_clip
    # The ranks of a tensor-parallel (or context-parallel) group read the same rows.
    rank, world = backend.dp_rank, backend.dp_size
    if not model.training:  # after evaluation; train() walks every module (~130 us)
        model.train()
    loss_sum = torch.zeros((), device=backend.device)
    batch = [batches.get(step, micro, rank, world) for micro in range(accum)]
    if documents is not None:  # no loss at a document's first token
        batch, weights = within_documents(batch, documents, backend)
    for micro, (x, y) in enumerate(batch):
        # context parallelism: this rank's 1/C of each sequence (the cp ranks of a
        # group read the same rows)
        x, y, docs = on_rank(backend, x, y, documents)
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
                loss = model(x, y, **forward_kwargs(backend, x, docs))[1]
            if documents is not None:  # the mean over the global batch's targets
                loss = loss * weights[micro]
            elif accum > 1:  # x / 1 == x: no autograd node for nothing
                loss = loss / accum
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = backend.clip_grad_norm_(model, clip or math.inf)
    if inspect is not None:
        inspect()
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    backend.after_optimizer_step(model)  # float8 all-gather's scales
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list,
    backend: Backend,
    documents: Documents | None = None,
) -> float:
    """Mean loss over the fixed validation batches (the same in every run); with
    ``documents``, over their counted targets (as :func:`train_step`)."""
    model.eval()
    total = torch.zeros((), device=backend.device)
    if documents is not None:
        batches, weights = within_documents(batches, documents, backend)
    for i, (x, y) in enumerate(batches):
        loss = _eval_loss(model, backend, x, y, documents)
        total += loss * (1 if documents is None else weights[i])
    n = len(batches) if documents is None else 1
    return global_mean(total / max(1, n))


def _eval_loss(
    model: nn.Module,
    backend: Backend,
    x: torch.Tensor,
    y: torch.Tensor,
    documents: Documents | None,
) -> torch.Tensor:
    """One validation batch's mean loss on this rank, in fp32."""
    x, y, docs = on_rank(backend, x, y, documents)
    with backend.autocast(), backend.loss_context():
        _, loss = model(x, y, **forward_kwargs(backend, x, docs))
    return loss.float()


@torch.no_grad()
def evaluate_sources(
    model: nn.Module,
    batches: ValBatches,
    backend: Backend,
    documents: Documents | None = None,
) -> tuple[float, dict[str, float]]:
    """A mixture's validation loss and each source's (``val/<source>/loss``): the
    mean over each source's counted targets, one forward per batch and source in
    it (batches are grouped by source, src/data/mixture.py); the mixed loss is the
    mean over all of them, each source's weighed by its global count of targets.
    A rank without a target of the source in a batch still runs the forward (the
    collectives) at weight 0, on targets of id 0 (no NaN)."""
    model.eval()
    losses, inverse = {}, []
    for i, name in enumerate(batches.names):
        items = batches.of_source(i)
        if not items:  # no window of it in the split's share (a tiny weight)
            continue
        masked = [(x, y) for _, x, y in items]
        if documents is not None:
            masked = [(x, documents.targets(x, y)) for x, y in masked]
        counts = counted(masked, backend)
        per_target = per_counted_target(sum(counts), backend)
        total = torch.zeros((), device=backend.device)
        for (x, y), n in zip(masked, counts, strict=True):
            loss = _eval_loss(
                model, backend, x, y if n else torch.zeros_like(y), documents
            )
            total += loss * (n * per_target)
        losses[name] = global_mean(total)
        inverse.append(1 / per_target)  # the source's targets, up to a constant
    mixed = sum(v * w for v, w in zip(losses.values(), inverse, strict=True))
    return mixed / sum(inverse), losses


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
