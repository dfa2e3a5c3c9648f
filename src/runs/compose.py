"""A run's config, composed for the command that continues or reads its run dir:
train.py's resume (:func:`continue_run`, :func:`resume_config`) and the start of
sample.py and eval.py (:func:`open_run`), typed by today's schema
(:func:`compose_run`). The code a recorded config names runs only on the command
line's word (:func:`refuse_recorded_code`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from src.checkpoint.folders import META, resolve_resume, run_checkpoints
from src.config.cli_help import CONF_DIR
from src.config.run_plan import RunPlan
from src.config.validate import validate
from src.data.pinning import pinned_data, read_pin
from src.errors import ConfigError, keyed
from src.runs.branches import (
    Completed,
    branch_point,
    finish_set_asides,
    is_own,
    refuse_foreign,
    set_aside,
)
from src.runs.from_run import RUN_CONFIG, find_run, run_config, with_changes
from src.runs.resume import (
    RECORD,
    adopt_attempt,
    checkpoint_config,
    differences,
    in_use,
    refusal,
    requested_changes,
    run_progress,
    run_record,
)
from src.runs.resume import (
    with_changes as resumed_with,
)
from src.runs.writable import check_writable
from src.trainer.launch import override_keys, prepare
from src.trainer.resume import restart_reason, schedule_refusal

log = logging.getLogger(__name__)


def refuse_recorded_code(cfg: DictConfig, where: str, key: str, given: bool) -> None:
    """A recorded config (a checkpoint's meta.json, a run's ``.hydra/config.yaml``)
    is data: code it names in a directory (``model.trust_remote_code=true``: the HF
    config dir's own classes) runs only when this command line says so (``given``:
    ``key``=true on it). ConfigError naming ``key``, and the directory, otherwise;
    checked before anything reads the model's config, which would run that code."""
    if given or not OmegaConf.select(cfg, "model.trust_remote_code", default=False):
        return
    directory = OmegaConf.select(cfg, "model.config", default=None)
    raise ConfigError(
        key,
        f"{where} records model.trust_remote_code=true, which runs the Python code "
        f"in {directory}; a recorded config is data and runs no code on its own "
        f"word: give {key}=true on the command line to run it",
    )


@contextlib.contextmanager
def read_as_recorded(source: Path, given: set[str], key: str) -> Iterator[None]:
    """Checks of a config read from ``source`` (a checkpoint's meta.json, a run's
    record: data, maybe forged): a ConfigError on a key the command line did not set
    (``given``) names ``source``, whose value it is; any other error there (a value
    of a kind the schema cannot take) is a ConfigError on ``key`` naming it."""
    try:
        yield
    except ConfigError as err:
        if err.key in given or str(source.parent) in err.message:
            raise
        raise ConfigError(err.key, f"{err.message} (as {source} records it)") from None
    except (TypeError, ValueError, AttributeError, KeyError, OmegaConfBaseException):
        raise ConfigError(
            key,
            f"{source} records a config that does not have the schema's kinds of "
            "value (a damaged or forged record); "
            + (
                "train another in a new hydra.run.dir"
                if key.startswith("trainer.")
                else "give a run whose record is its own"
            ),
        ) from None


def compose_run(saved: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """A saved run's config (``<run dir>/.hydra/config.yaml``) typed by today's
    schema: conf/ composed with the run's command-line ``overrides``, the saved values
    merged over it, so keys the run predates get today's defaults. If that fails (an
    option removed since), the saved config as it is."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        if GlobalHydra.instance().is_initialized():  # inside sample.py's, eval.py's
            base = compose("config", overrides=list(overrides))
        else:
            with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
                base = compose("config", overrides=list(overrides))
        return OmegaConf.merge(base, saved)
    except (HydraException, OmegaConfBaseException, ValueError):
        return saved


def continue_run(cfg: DictConfig, run_dir: str) -> tuple[DictConfig, set[str] | None]:
    """train.py's config in ``run_dir`` (this Hydra job's) and the keys its user set
    (None: this command line's), decided before any rank starts; see
    :func:`resume_config`. The directories that config writes to are checked
    (:func:`check_writable`: a resume's are those of the config it resumes, a
    sweep job's its own)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hydra = HydraConfig.get()
    except ValueError:  # not a Hydra job: the config is the run's as it is
        cfg, user_keys = cfg, None
    else:
        cfg, user_keys = resume_config(
            cfg,
            run_dir,
            [str(o) for o in hydra.overrides.task],
            dict(hydra.runtime.choices),
            hydra.output_subdir,
        )
    check_writable(cfg)
    return cfg, user_keys


def resume_config(
    cfg: DictConfig,
    run_dir: str,
    overrides: Sequence[str],
    choices: Mapping[str, str],
    attempt: str | None,
) -> tuple[DictConfig, set[str] | None]:
    """A run dir is a run (src/runs/resume.py). A fresh start (``trainer.resume=null``)
    in a dir that holds a run is refused. A resume starts from the config its
    checkpoint was saved with (before there is one, the run's record): the command
    line's ``overrides`` (``cfg`` composed from them, ``choices`` its groups' options)
    are changes to it, each said in one line; one the checkpoint cannot take is
    refused naming the key and the recorded value. ``attempt``: where Hydra wrote
    this attempt's files (``.hydra`` for the run's first); :func:`refuse_init_with_resume`
    first. Returns the config and the keys its user set (None: the command line's)."""
    if _rank0() and in_use(run_dir):
        return cfg, None  # the launcher refuses it, naming the live run
    refuse_init_with_resume(cfg)
    if _rank0():
        finish_set_asides(cfg, run_dir)  # of a branch whose start was killed
    progress = run_progress(run_dir)
    wanted = "auto" if restart_reason(cfg) else cfg.trainer.resume
    if wanted is None:
        if progress is not None:
            raise ConfigError(
                "trainer.resume",
                f"null, but {run_dir} holds a run ({progress.describe()}); resume it "
                f"with `python train.py hydra.run.dir={run_dir} trainer.resume=auto` "
                "(changes after it), or start over in another hydra.run.dir (or "
                "after deleting this one)",
            )
        _adopt(run_dir, attempt)  # the record's attempt never trained
        return cfg, None
    try:
        checkpoint = resolve_resume(wanted, run_checkpoints(run_dir))
    except FileNotFoundError as err:
        raise ConfigError("trainer.resume", str(err).partition(": ")[2]) from None
    record = None if attempt == RECORD else keyed("hydra.run.dir", run_record, run_dir)
    if checkpoint is not None:
        held = progress.describe() if progress else None
        refuse_foreign(run_dir, checkpoint, held, _origin(record, progress, run_dir))
    saved = checkpoint_config(checkpoint) if checkpoint is not None else None
    if saved is None and (record is None or progress is None):
        # Nothing recorded to continue from: this command line is the run's config.
        _adopt(run_dir, attempt)
        return cfg, None
    base = OmegaConf.create(saved) if saved is not None else record.config
    base_overrides = record.overrides if record is not None else list(overrides)
    base = compose_run(base, base_overrides)
    changes = requested_changes(
        cfg, list(overrides), dict(choices), record.choices if record else {}
    )
    changes["trainer.resume"] = cfg.trainer.resume
    where = f"checkpoint {checkpoint}" if saved is not None else f"{run_dir}/{RECORD}"
    source = checkpoint / META if saved is not None else Path(run_dir) / RUN_CONFIG
    with read_as_recorded(source, set(changes), "trainer.resume"):
        refuse_recorded_code(
            base,
            where,
            "model.trust_remote_code",
            changes.get("model.trust_remote_code") is True,
        )
        new = resumed_with(base, changes)
        changed = differences(base, new)
        validate(new)  # before the ranks, which would fail on a forged value
    if checkpoint is not None:
        _refuse_changes(changed, new, checkpoint, where)
    _timeline(new, run_dir, checkpoint)  # Completed: nothing to train
    if changed:
        n, whose = len(changed), "checkpoint's" if saved is not None else "recorded"
        log.info("resuming %s with %d change(s) to its %s config:", run_dir, n, whose)
    for key, before, after in changed:
        log.info("  %s: %r -> %r", key, before, after)
    if attempt == RECORD:  # this attempt's own record: the config it trains with
        OmegaConf.save(new, Path(run_dir) / RECORD / "config.yaml")
    return new, override_keys(base_overrides) | set(changes)


def _refuse_changes(
    changed: list[tuple[str, Any, Any]], new: DictConfig, checkpoint: Path, where: str
) -> None:
    """ConfigError for the first of ``changed`` that ``checkpoint`` cannot take."""
    for key, before, after in changed:
        reason = refusal(key)
        if reason:
            raise ConfigError(
                key,
                f"{before!r} was recorded by {where}, got {after!r}: {reason} "
                "(train another in a new hydra.run.dir)",
            )
        if key == "trainer.max_steps" and new.trainer.resume_schedule != "extend":
            raise schedule_refusal(after, before, checkpoint)


def _origin(record, progress, run_dir: str) -> Path | None:
    """The checkpoint this run's record resumed (None: none, or the run has
    checkpoints of its own): an attempt cut short before it saved one is retried."""
    if record is None or (progress is not None and progress.checkpoints):
        return None
    value = OmegaConf.select(record.config, "trainer.resume", default=None)
    if not isinstance(value, str):
        return None
    try:
        return resolve_resume(value, run_checkpoints(run_dir))
    except (OSError, ValueError):
        return None


def _timeline(
    cfg: DictConfig, run_dir: str, checkpoint: Path | None
) -> tuple[int, str] | None:
    """Where a resume of ``checkpoint`` starts in this run's timeline: ``(step, why)``
    when it is a branch (src/runs/branches.py), None when it continues the run or
    the checkpoint is another run's (:func:`refuse_foreign` let it in: the dir holds
    no run). Completed, said, when the run completed and no step is asked of it."""
    if checkpoint is not None and not is_own(run_dir, checkpoint):
        return None
    try:
        return branch_point(run_dir, checkpoint, cfg.trainer.max_steps)
    except Completed as done:
        log.info("%s", done)  # the caller ends the command (exit 0)
        raise


def take_branch(cfg: DictConfig, run_dir: str) -> None:
    """Once the resume's config is accepted (train.py, after every check, before
    any rank starts): a resume from before the run's newest point sets what came
    after it aside, said in one line (src/runs/branches.py). A refused command has
    moved nothing."""
    wanted = "auto" if restart_reason(cfg) else cfg.trainer.resume
    if wanted is None or not _rank0():
        return
    checkpoint = resolve_resume(wanted, run_checkpoints(run_dir))
    point = _timeline(cfg, run_dir, checkpoint)
    if point is not None:
        step, why = point
        origin = f"{checkpoint.name}, while {why}" if checkpoint else why
        log.info("trainer.resume: %s", set_aside(cfg, run_dir, step, origin))


def refuse_init_with_resume(cfg: DictConfig) -> None:
    """``trainer.init_from`` and ``trainer.resume`` on one command line (``cfg``
    composed from it): ConfigError naming init_from."""
    t = cfg.trainer
    if t.init_from is not None and t.resume is not None:
        raise ConfigError(
            "trainer.init_from",
            f"{t.init_from!r} with trainer.resume={t.resume}: init_from starts a new "
            "run at step 0 from another run's weights, resume continues this run "
            "dir's own checkpoint; give one of them",
        )


def _adopt(run_dir: str, attempt: str | None) -> None:
    """This attempt's Hydra files become the record of a run dir whose record's
    attempt never trained (by rank 0 alone under torchrun)."""
    if attempt not in (None, RECORD) and _rank0():
        adopt_attempt(run_dir, attempt)


def _rank0() -> bool:
    """This process is rank 0 (under torchrun every rank runs train.py; the others
    read the same run dir and never hold its lock)."""
    return int(os.environ.get("RANK", 0)) == 0


def open_run(
    run: str,
    changes: Callable[[DictConfig], Mapping[str, Any]],
    record: str | None = None,
    trust_remote_code: bool = False,
    splits: tuple[str, ...] = (),
    ckpt: str = "latest",
) -> tuple[Path, Path, DictConfig, RunPlan]:
    """The start of sample.py and eval.py: the run dir and checkpoint of ``run=``, and
    the config the checkpoint was saved with (else the run's record) typed by today's
    schema (:func:`compose_run`), changed by
    ``changes(config)``, validated and prepared as train.py prepares it (the keys its
    user set stay theirs). Before anything is prepared, the dirs the command writes
    to are checked (:func:`check_writable`): with ``record`` (a file it writes in the
    run dir, and logs to wandb as the run did: eval.py) the run dir and wandb's too.
    The code the run's config names runs only with ``trust_remote_code`` (the
    command's own key: :func:`refuse_recorded_code`). ``splits``: the data's splits
    the command reads (each must hold a window). A problem is a ConfigError naming
    the key. ``ckpt``: ``latest`` or ``best`` (:func:`find_run`)."""
    run_dir, checkpoint = find_run(run, ckpt=ckpt)
    cfg, overrides = run_config(run_dir)
    saved = checkpoint_config(checkpoint)  # a resume may have changed the record's
    cfg = compose_run(cfg if saved is None else OmegaConf.create(saved), overrides)
    where = f"checkpoint {checkpoint}" if saved else f"{run_dir}/{RUN_CONFIG}"
    source = checkpoint / META if saved else run_dir / RUN_CONFIG
    with read_as_recorded(source, {"trust_remote_code"}, "run"):
        refuse_recorded_code(cfg, where, "trust_remote_code", trust_remote_code)
        # the run's own tokenizer file (a BPE never trained again, no corpus needed)
        cfg.data = pinned_data(cfg.data, keyed("run", read_pin, run_dir))
        given = changes(cfg)
    cfg = with_changes(cfg, given)
    with read_as_recorded(source, set(given), "run"):
        validate(cfg)
    first = ("run", str(run_dir), record) if record else None
    check_writable(cfg, first, wandb=record is not None)
    cfg, resolved = prepare(cfg, override_keys(overrides), splits=splits)
    return run_dir, checkpoint, cfg, resolved
