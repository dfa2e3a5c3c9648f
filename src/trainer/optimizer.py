"""The optimizer and the learning-rate schedule: AdamW in two weight-decay groups, the
warmup-then-cosine multiplier, and this run's hyperparameters put back into a restored
optimizer and scheduler."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig

from src.checkpoint.dcp import NO_DECAY
from src.config.schema import MIN_LR_RATIO
from src.models import ModelSpec, muon_matrices
from src.sharding import canonical_name
from src.trainer.optimizers import MUON, Lion, MuonAdamW


def build_optimizer(
    model: nn.Module,
    cfg: DictConfig,
    spec: ModelSpec,
    vocab: int | None = None,
    fused: bool = True,
) -> torch.optim.Optimizer:
    """``trainer.optimizer``: AdamW, or Muon for the weight matrices (AdamW for the
    embeddings, the output head, norms and biases), with weight decay except where the
    family's no-decay rule says (biases and normalisation gains), decided by canonical
    name (FSDP1 shards are flat 1-D views, so the live tensors cannot tell). ``vocab``:
    the model's vocabulary, which tells Muon the output head on any pipeline stage.
    ``fused``: AdamW's fused implementation, else foreach (fp16's gradient scaler
    hands fused AdamW a ``found_inf`` of another shape than a sharded step's)."""
    t = cfg.trainer
    muon = t.optimizer == "muon"
    matrices = muon_matrices(model, spec.no_decay, vocab) if muon else set()
    kinds: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            nd = spec.no_decay(canonical_name(name, model))
            kinds.setdefault((nd, id(p) in matrices), []).append(p)
    # An empty group (all of a LoRA run's trained weights decay) is left out: torch's
    # distributed optimizer state cannot name one.
    groups = [
        {"params": params, "weight_decay": _weight_decay(t, nd), NO_DECAY: nd}
        | ({MUON: is_muon, "momentum": t.muon_momentum} if muon else {})
        for (nd, is_muon), params in sorted(kinds.items())
    ]
    # fused: one kernel per tensor, in place (no group-sized temporaries: the planner's
    # src/planner/optimizer_step.py); on CPU 3-4x faster than foreach or torch's
    # per-tensor loop (docs/benchmarks.md, bench.optimizer_step); torchtitan's default.
    if t.optimizer == "lion":
        return Lion(groups, lr=t.lr, betas=tuple(t.betas))
    cls = MuonAdamW if muon else torch.optim.AdamW
    impl = {"fused": True} if fused else {"foreach": True}
    return cls(groups, lr=t.lr, betas=tuple(t.betas), **impl)


def _weight_decay(t: DictConfig, no_decay: bool) -> float:
    """The weight decay of one of :func:`build_optimizer`'s groups."""
    return 0.0 if no_decay else t.weight_decay


def final_lr(t: DictConfig) -> float:
    """Where the decay ends: ``trainer.min_lr``, or when null (the default)
    ``trainer.lr`` x :data:`MIN_LR_RATIO`, so it follows the learning rate."""
    return t.lr * MIN_LR_RATIO if t.min_lr is None else t.min_lr


def _cosine(q: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * q))


def _linear(q: float) -> float:
    return 1 - q


#: ``trainer.schedule`` (one of :data:`LR_SCHEDULES`) -> (the first step of its decay,
#: its shape from 1 to 0 over the decay's progress 0..1); constant never decays.
_DECAYS = {
    "cosine": (lambda t: t.warmup_steps, _cosine),
    "linear": (lambda t: t.warmup_steps, _linear),
    "wsd": (
        lambda t: max(
            t.warmup_steps, t.max_steps - round(t.decay_fraction * t.max_steps)
        ),
        _linear,
    ),
}


def lr_lambda(cfg: DictConfig):
    """LR multiplier per step: linear warmup to 1, then ``trainer.schedule`` down to
    :func:`final_lr` / lr (a pure function of the step and the config, so a resume,
    and a resume that extends ``max_steps``, gets the formula's learning rate)."""
    t = cfg.trainer
    floor = final_lr(t) / t.lr
    start, shape = _DECAYS.get(t.schedule, (None, None))
    first = None if start is None else start(t)

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if first is None or step < first:
            return 1.0
        progress = (step - first) / max(1, t.max_steps - first)
        return floor + (1 - floor) * shape(min(1.0, progress))

    return factor


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: Any, cfg: DictConfig
) -> None:
    """This run's learning rate, schedule, weight decay and betas in the restored
    optimizer and scheduler (a checkpoint brings back its own; a resume that changed
    them trains with the new ones). The learning rate of the resumed step is the
    scheduler's formula with this run's numbers, so an unchanged resume keeps it bit
    for bit."""
    t = cfg.trainer
    for i, group in enumerate(optimizer.param_groups):
        # a checkpoint from before the flag: its two groups, decay first
        no_decay = group.setdefault(NO_DECAY, i == 1)
        group.update(weight_decay=_weight_decay(t, no_decay), initial_lr=t.lr)
        group["betas"] = tuple(t.betas)
        if group.get(MUON):
            group["momentum"] = t.muon_momentum
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
