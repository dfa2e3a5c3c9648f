"""A run dir holds one timeline of its run (docs/reliability.md).

A resume starts at a point of the run: the step of its checkpoint (0 without one).
What the run dir holds past that point is one of:

- the steps of the attempt that was interrupted, when the resume starts at the
  newest checkpoint of a run that did not complete: they are trained again, and the
  ranks drop their rows (``Logger.drop_rows_after``);
- another timeline, when the resume starts before the run's newest checkpoint, or
  before the end of a completed run it trains further (``trainer.max_steps`` raised):
  the resume is a branch. What came after the point (the newer checkpoints, the
  metrics rows past it, summary.json, the export) is moved to
  ``branches/<time>_after_step_N/`` before any rank starts, and said in one line, so
  ``trainer.keep_last`` and ``trainer.resume=auto`` see the branch alone
  (:func:`branch_point`, :func:`set_aside`). A set-aside cut short (a kill) is
  finished by the next command in the run dir (:func:`finish_set_asides`);
- nothing to train, when a completed run's newest checkpoint is before its end
  (``trainer.ckpt_final=false``) and the resume asks no more steps (:class:`Completed`).

A checkpoint of another run resumed into a run dir that holds a run is refused
(:func:`refuse_foreign`): its steps would be mixed with the run's.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from omegaconf import DictConfig

from src.checkpoint.export import CONSOLIDATED_FILE, HF_EXPORT_DIR
from src.checkpoint.folders import (
    complete_checkpoints,
    run_checkpoints,
    run_exports,
    step_of,
)
from src.errors import ConfigError
from src.files import read_json, write_json_atomic
from src.observe.loggers import SUMMARY_FILE, build_logger
from src.text import plural

BRANCHES = "branches"
BRANCH_RECORD = "branch.json"  # in each branch dir: where it starts, and when
_EXPORTS = (HF_EXPORT_DIR, CONSOLIDATED_FILE)


class Completed(Exception):
    """The run completed and the resume asks nothing more of it (the line to say)."""


def completed_steps(run_dir: str | Path) -> int | None:
    """The steps of the run's training, if it completed (its summary.json records
    them and no stop); None otherwise (a plan-only summary records no steps)."""
    try:
        summary = read_json(Path(run_dir) / SUMMARY_FILE)
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or "stopped" in summary:
        return None
    steps = summary.get("steps")
    return steps if type(steps) is int and steps >= 1 else None


def is_own(run_dir: str | Path, checkpoint: Path) -> bool:
    """``checkpoint`` is in this run dir's checkpoints/ (links followed)."""
    here = run_checkpoints(run_dir)
    parent = Path(os.path.abspath(checkpoint)).parent
    try:
        return os.path.samefile(parent, here)
    except OSError:
        return False


def refuse_foreign(
    run_dir: str, checkpoint: Path, holds: str | None, origin: Path | None
) -> None:
    """ConfigError if ``checkpoint`` is another run's and ``run_dir`` holds a run
    (``holds``: what, in words), unless that run is this checkpoint's own resume
    that has written no checkpoint yet (``origin``: the checkpoint its record
    resumed, when it has none of its own)."""
    if holds is None or is_own(run_dir, checkpoint):
        return
    if origin is not None and os.path.exists(origin):
        if os.path.samefile(origin, checkpoint):
            return  # an earlier attempt of this same resume, cut short
    raise ConfigError(
        "trainer.resume",
        f"{checkpoint} is not a checkpoint of this run ({run_checkpoints(run_dir)}) "
        f"but another's, and {run_dir} holds a run ({holds}) that its steps would "
        "be mixed with; resume it into a new dir "
        f"(python train.py hydra.run.dir=<new dir> trainer.resume={checkpoint}), "
        f"or resume this run with trainer.resume=auto",
    )


def branch_point(
    run_dir: str, checkpoint: Path | None, max_steps: int
) -> tuple[int, str] | None:
    """``(step, why)`` when a resume of this run's ``checkpoint`` (None: from step 0)
    is a branch; None when it continues the run. :class:`Completed` when the run
    completed and the resume of its newest checkpoint asks no more steps."""
    start = (step_of(checkpoint) or 0) if checkpoint is not None else 0
    own = complete_checkpoints(run_checkpoints(run_dir))
    if own and step_of(own[-1]) > start:
        return start, f"the run's newest checkpoint is {own[-1].name}"
    steps = completed_steps(run_dir)
    if steps is None or start >= steps:
        return None
    newest = own[-1].name if own else "none"
    if max_steps <= steps:
        raise Completed(
            f"nothing to train: {run_dir} completed its {steps} steps (summary.json; "
            f"its newest checkpoint: {newest}, trainer.ckpt_final=false); its "
            f"records are kept (train on with trainer.max_steps=N "
            f"trainer.resume_schedule=extend: a branch from step {start})"
        )
    return start, f"the run completed {steps} steps"


def set_aside(cfg: DictConfig, run_dir: str, step: int, origin: str) -> str:
    """Move what the run dir holds past ``step`` to a new branch dir (see the
    module's doc); returns the line that says so. ``origin``: what the resume
    starts from, in words. ``cfg``: the config the run goes on with (its logger's
    files are the rows moved)."""
    now = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    directory = Path(run_dir) / BRANCHES / f"{now}_after_step_{step}"
    n = 1
    while os.path.lexists(directory):
        directory = directory.with_name(f"{now}_after_step_{step}.{n}")
        n += 1
    directory.mkdir(parents=True)
    record = {"after_step": step, "from": origin, "time": now, "complete": False}
    write_json_atomic(directory / BRANCH_RECORD, record)
    moved = _move_after(cfg, run_dir, step, directory)
    write_json_atomic(directory / BRANCH_RECORD, {**record, "complete": True})
    return (
        f"a branch from step {step} ({origin}): what the run dir held after it "
        f"({', '.join(moved) or 'nothing'}) is moved to {directory}; "
        "trainer.keep_last and trainer.resume=auto see only this branch"
    )


def finish_set_asides(cfg: DictConfig, run_dir: str) -> None:
    """Finish each set-aside a kill cut short (its record not complete): the rest of
    what lies past its step moves there too, as it was to."""
    root = Path(run_dir) / BRANCHES
    for directory in sorted(root.iterdir()) if root.is_dir() else ():
        try:
            record = read_json(directory / BRANCH_RECORD)
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or record.get("complete") is not False:
            continue
        step = record.get("after_step")
        if type(step) is int and step >= 0:
            _move_after(cfg, run_dir, step, directory)
            write_json_atomic(directory / BRANCH_RECORD, {**record, "complete": True})


def _move_steps_after(steps: Path, step: int, directory: Path, what: str) -> list[str]:
    """Move the ``step_N`` dirs of ``steps`` (a run's checkpoints or exports) past
    ``step`` into ``directory``; what moved, in words."""
    later = (
        sorted((p for p in steps.iterdir() if (step_of(p) or 0) > step), key=step_of)
        if steps.is_dir()
        else []
    )
    if not later:
        return []
    (directory / steps.name).mkdir(exist_ok=True)
    for path in later:
        os.rename(path, directory / steps.name / path.name)
    names = later[0].name + (f"..{later[-1].name}" if len(later) > 1 else "")
    return [f"{plural(len(later), what)} {names}"]


def _move_after(cfg: DictConfig, run_dir: str, step: int, directory: Path) -> list[str]:
    """The moves of :func:`set_aside` (each a rename: none lost if a kill cuts the
    set-aside short; doing them again moves only what is still in place)."""
    moved = _move_steps_after(run_checkpoints(run_dir), step, directory, "checkpoint")
    moved += _move_steps_after(run_exports(run_dir), step, directory, "export")
    logger = build_logger(cfg, run_dir, 0, begin=False)
    try:
        moved += logger.set_aside_after(step, directory)
    finally:
        logger.finish(0)
    for name in _EXPORTS:
        if os.path.lexists(Path(run_dir) / name):
            os.rename(Path(run_dir) / name, directory / name)
            moved.append(name)
    return moved
