"""Resuming a run on every rank: the checkpoint ``trainer.resume`` names (the newest
good one after an elastic restart or a SLURM requeue), restored, with what a changed
``trainer.max_steps`` does to the schedule (``trainer.resume_schedule``); and a new
run's start from another run's weights (``trainer.init_from``: :func:`init_weights`,
checked before any rank starts by :func:`check_init_from`)."""

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
from src.checkpoint.folders import (
    complete_checkpoints,
    incomplete_checkpoints,
    resolve_resume,
    run_checkpoints,
)
from src.checkpoint.values import checked_extra
from src.data.mixture import MIX_STATE
from src.errors import ConfigError
from src.models import ModelSpec
from src.sharding import is_adapter
from src.trainer.best import EARLY_STOP
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
) -> tuple[int, dict[str, Any] | None, int | None, dict[str, Any] | None, dict | None]:
    """Restore the checkpoint named by ``trainer.resume``; returns its step (0 if none),
    when the schedule was extended what ``summary.json`` records about it, the
    tokens trained on up to it (None: a checkpoint from before they were recorded),
    where its run's step-0 weights came from (``trainer.init_from``; None: a
    fresh start) and the state of the trainer's parts it holds, checked:
    ``{EARLY_STOP: early stopping's (src/trainer/best.py), MIX_STATE: a data
    mixture's tokens per source (src/data/mixture.py)}`` (None each: none).

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
        return 0, None, None, None, {EARLY_STOP: None, MIX_STATE: None}
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
    return step, extended, tokens, resumed_origin(path, state), _parts(path, state)


def _parts(path: Path, state: dict) -> dict:
    """The checkpoint's early-stopping state and a mixture's tokens per source,
    each checked (None: none)."""
    parts: dict[str, Any] = {EARLY_STOP: None, MIX_STATE: None}
    if state.get(EARLY_STOP) is not None:
        like = {"best": 0.0, "best_step": 0, "since": 0}
        parts[EARLY_STOP] = checked_extra(path, state, EARLY_STOP, like)
    saved = state.get(MIX_STATE)
    if saved is not None:
        like = {str(k): 0 for k in saved} if isinstance(saved, dict) else {}
        parts[MIX_STATE] = checked_extra(path, state, MIX_STATE, like)
        if any(v < 0 for v in parts[MIX_STATE].values()):
            raise CheckpointError(
                f"checkpoint {path} is damaged: meta.json: extra.{MIX_STATE} holds a "
                "negative count"
            )
    return parts


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


# ------------------------------------------------------------- trainer.init_from
INIT_KEY = "trainer.init_from"
#: What a checkpoint whose tensors are not the model's advises.
INIT_HINT = (
    f"{INIT_KEY} takes a checkpoint of the same model: its names and shapes; "
    "precision and layout may differ"
)
#: ``summary.json``'s and the checkpoints' record of where step 0's weights came from.
ORIGIN = "init_from"


def init_applies(cfg: DictConfig, run_dir: str | Path) -> bool:
    """``trainer.init_from`` is set and this run starts at step 0: its run dir holds
    no checkpoint to resume (a resumed run continues its own, whatever it started
    from)."""
    return cfg.trainer.init_from is not None and not complete_checkpoints(
        run_checkpoints(run_dir)
    )


def init_checkpoint(init_from: str, verify: Any, on_skip: Any = None) -> Path:
    """The checkpoint ``trainer.init_from`` names: that ``step_N`` dir, or the newest
    good one of a run dir or its ``checkpoints/`` (verified as a resume verifies:
    :func:`resolve_resume` with ``verify``, a damaged one skipped for the next
    newest). ConfigError naming the key if there is none; CheckpointError if every
    one there is damaged."""
    where = Path(init_from).expanduser()
    try:
        path = resolve_resume(str(where), where, verify, on_skip)
    except FileNotFoundError as err:
        raise ConfigError(INIT_KEY, str(err).partition(": ")[2]) from None
    except CheckpointError as err:
        raise ConfigError(INIT_KEY, str(err)) from None
    if path is None:  # "none" or "auto" as a path: no checkpoint named
        raise ConfigError(INIT_KEY, f"{init_from!r}: not a checkpoint or run dir")
    return path


def check_init_from(
    cfg: DictConfig, spec: ModelSpec, model_config: Any, run_dir: str | Path
) -> None:
    """Before any rank starts: the checkpoint ``trainer.init_from`` names exists, is
    intact (:meth:`Checkpointer.verify`) and holds the run's model's tensors (names
    and shapes, against a meta-device build); a ConfigError naming the key (and the
    first tensor that differs) otherwise. Nothing when it does not apply
    (:func:`init_applies`). ``cfg`` and the run plan's model (``spec``,
    ``model_config``): as ``launch.prepare`` returns them (the vocabulary following
    the tokenizer)."""
    if not init_applies(cfg, run_dir):
        return
    with torch.device("meta"):
        model = spec.build(model_config, 0)
    path = init_checkpoint(cfg.trainer.init_from, Checkpointer(run_dir).verify)
    try:
        Checkpointer(path.parent).check_model(path, model, INIT_HINT)
    except CheckpointError as err:
        raise ConfigError(INIT_KEY, str(err)) from None


def init_weights(
    cfg: DictConfig, ckpt: Checkpointer, model: nn.Module, rank: int
) -> dict[str, Any]:
    """On every rank: ``model``'s weights from the checkpoint ``trainer.init_from``
    names (verified by the ranks together, as a resume's; DCP reshards it onto this
    run's layout, its precision whatever the source's); optimizer, schedule, RNG and
    step stay this run's fresh ones. Returns what summary.json records."""
    path = init_checkpoint(cfg.trainer.init_from, ckpt.verify, _report_skip(rank))
    # a LoRA run from a trained model: its new adapters keep their init
    state = ckpt.load_model(path, model, verify=False, hint=INIT_HINT, fresh=is_adapter)
    log.info(
        "%s: the model's weights from %s (step %d); optimizer, schedule and step "
        "start fresh",
        INIT_KEY,
        path,
        state["step"],
    )
    return {"checkpoint": str(path), "step": state["step"]}


def resumed_origin(path: Path, state: dict[str, Any]) -> dict[str, Any] | None:
    """The ``init_from`` record of a resumed checkpoint (None: its run started
    fresh), checked as data."""
    if state.get(ORIGIN) is None:
        return None
    return checked_extra(path, state, ORIGIN, {"checkpoint": "", "step": 0})
