"""Resuming a run on every rank: the checkpoint ``trainer.resume`` names (the newest
good one after an elastic restart or a SLURM requeue), restored, with what a changed
``trainer.max_steps`` does to the schedule (``trainer.resume_schedule``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig

from src.checkpoint.damage import CheckpointError
from src.checkpoint.dcp import Checkpointer
from src.checkpoint.folders import incomplete_checkpoints, resolve_resume
from src.checkpoint.values import checked_extra
from src.errors import ConfigError
from src.trainer.faults import RESTART_CAUSE_ENV
from src.trainer.optimizer import apply_hyperparameters

log = logging.getLogger(__name__)


def resume(
    cfg: DictConfig,
    ckpt: Checkpointer,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[int, dict[str, Any] | None, int | None]:
    """Restore the checkpoint named by ``trainer.resume``; returns its step (0 if none),
    when the schedule was extended what ``summary.json`` records about it, and the
    tokens trained on up to it (None: a checkpoint from before they were recorded).

    After an elastic restart (``trainer.max_restarts``) or a SLURM requeue the ranks
    resume from the newest good checkpoint by themselves, whatever ``trainer.resume``
    says. The optimizer's hyperparameters are this run's (:func:`apply_hyperparameters`:
    a resume that changed them applies them). The schedule depends on
    ``trainer.max_steps``: with ``trainer.resume_schedule=keep`` a checkpoint resumes
    only with the ``max_steps`` it was written with (ConfigError otherwise); with
    ``extend`` the learning rate follows the schedule of the new ``max_steps`` from
    the resumed step on.
    """
    restarted = restart_reason(cfg)
    wanted = "auto" if restarted else cfg.trainer.resume
    if wanted == "auto":
        for skipped, reason in incomplete_checkpoints(ckpt.directory):
            log.info("skipping checkpoint dir %s: %s", skipped, reason)
    try:
        path = resolve_resume(wanted, ckpt.directory, ckpt.verify, _report_skip(rank))
    except CheckpointError as err:  # not resume=null: the dir holds a run
        raise CheckpointError(f"{err}; start over in another hydra.run.dir") from None
    if restarted:
        found = "resuming from the newest good checkpoint"
        log.info(f"{restarted}; {found if path else 'no checkpoint yet: from step 0'}")
    if path is None:
        if wanted == "auto" and not restarted:
            log.info(
                "trainer.resume=auto: no checkpoint in %s; starting at step 1",
                ckpt.directory,
            )
        return 0, None, None
    state = ckpt.load(path, model, optimizer, scheduler, verify=False)
    step = state["step"]
    saved_max = checked_extra(
        path, {"max_steps": cfg.trainer.max_steps, **state}, "max_steps", 1
    )
    if saved_max < 1:
        raise CheckpointError(
            f"checkpoint {path} is damaged: meta.json: extra.max_steps is "
            f"{saved_max}, not an integer >= 1"
        )
    if saved_max != cfg.trainer.max_steps and cfg.trainer.resume_schedule != "extend":
        raise schedule_refusal(cfg.trainer.max_steps, saved_max, path)
    before = scheduler.get_last_lr()[0]
    apply_hyperparameters(optimizer, scheduler, cfg)
    after = scheduler.get_last_lr()[0]
    extended = None
    if saved_max != cfg.trainer.max_steps:
        extended = _extended(cfg, path, step, saved_max, before, after)
    elif after != before:
        log.info(
            "from step %d the learning rate follows this run's trainer.lr, min_lr "
            "and warmup_steps (lr %.3g -> %.3g)",
            step,
            before,
            after,
        )
    if scaler is not None and state.get("scaler"):  # fp16 resume stays exact
        scaler.load_state_dict(
            checked_extra(path, state, "scaler", scaler.state_dict())
        )
    log.info("resumed from %s (step %d)", path, step)
    tokens = state.get("tokens_seen")
    if tokens is not None:
        tokens = checked_extra(path, state, "tokens_seen", 0)
    return step, extended, tokens


def schedule_refusal(max_steps: int, saved_max: int, path: Path | str) -> ConfigError:
    """A resume with another ``trainer.max_steps`` under ``resume_schedule=keep``."""
    return ConfigError(
        "trainer.max_steps",
        f"got {max_steps}, but {path} belongs to a run of {saved_max} steps and "
        f"the learning-rate schedule depends on it; resume with "
        f"trainer.max_steps={saved_max}, or add trainer.resume_schedule=extend to "
        f"continue on the schedule of {max_steps} steps",
    )


def _extended(
    cfg: DictConfig, path: Path, step: int, saved_max: int, before: float, after: float
) -> dict[str, Any]:
    """``trainer.max_steps`` changed on resume with ``resume_schedule=extend``: the
    learning rate follows the schedule of the new ``max_steps`` (the scheduler is
    built with it); said, and recorded in the summary."""
    t = cfg.trainer
    log.info(
        f"trainer.resume_schedule=extend: max_steps {saved_max} -> {t.max_steps}; "
        f"from step {step} the learning rate follows the schedule of "
        f"{t.max_steps} steps (lr {before:.3g} -> {after:.3g})"
    )
    return {
        "schedule": "extend",
        "from_step": step,
        "checkpoint": str(path),
        "max_steps_before": saved_max,
        "max_steps": t.max_steps,
        "lr_before": before,
        "lr_after": after,
    }


def restart_reason(cfg: DictConfig) -> str | None:
    """An elastic restart or a SLURM requeue, in words (None otherwise): the ranks
    then resume from the newest good checkpoint, whatever ``trainer.resume`` says."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart:
        # The launcher names the failure (torchrun does not: "a rank failed").
        cause = os.environ.get(RESTART_CAUSE_ENV, "a rank failed").removeprefix(
            "error: "
        )
        return f"elastic restart {restart} of {cfg.trainer.max_restarts} after {cause}"
    requeue = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    if requeue:
        job = os.environ.get("SLURM_JOB_ID", "?")
        return f"SLURM job {job} requeued ({requeue}x)"
    return None


def _report_skip(rank: int):
    def report(path: Path, reason: str) -> None:
        log.info("skipping checkpoint %s: %s", path, reason)

    return report
