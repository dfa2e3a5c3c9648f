"""The directories a command writes to, checked before it writes there: the run (or
sweep) dir and those outside it (the token cache, wandb's, torch.compile's, the
remote-code cache). One that cannot be written is a ConfigError naming the key (or
environment variable) to change; :class:`WritableDirs` checks them as Hydra starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.checkpoint.folders import META, is_complete, run_checkpoints
from src.config.cli import exit_on_config_error
from src.data.tokenizer import cache_path
from src.errors import ConfigError, not_writable
from src.files import planted_file, unwritable
from src.models.hf import remote_code_dir
from src.observe.loggers import logs_to_wandb, wandb_dirs
from src.runs.branches import BRANCHES
from src.runs.resume import RECORD
from src.runs.sweep import job_dirs
from src.sharding.transforms import compile_cache_dir
from src.text import plural
from src.trainer.faults import LOCK_FILE, RANK_REPORTS


def written_dirs(cfg: DictConfig, wandb: bool = True) -> list[tuple[str, str, str]]:
    """Every directory outside its run dir a training run of ``cfg`` writes to: (the
    key or environment variable that moves it, the directory, what writes there);
    wandb's only with ``wandb`` (a command that logs as the run did). The token cache
    only where it does not exist yet: an existing one (perhaps shared, read-only) is
    written only when an entry must be built, and checked there (``build_lock``)."""
    if OmegaConf.select(cfg, "trainer.plan_only", default=False):
        return []  # reads no data, starts no rank
    dirs = []
    if OmegaConf.select(cfg, "data.cache_dir", default=None) is not None:
        cache = cache_path(cfg.data)
        if not os.path.isdir(os.path.expanduser(cache)):
            dirs.append(("data.cache_dir", cache, "the token cache"))
    if wandb and logs_to_wandb(cfg):
        dirs += [(var, path, "wandb") for var, path in wandb_dirs()]
    if OmegaConf.select(cfg, "sharding.compile", default=False):
        dirs.append((*compile_cache_dir(), "torch.compile (sharding.compile=true)"))
    if OmegaConf.select(cfg, "model.trust_remote_code", default=False):
        what = "transformers (model.trust_remote_code=true)"
        dirs.append((*remote_code_dir(), what))
    return dirs


#: What marks a directory as a run dir (one of them is enough).
_RUN_FILES = (LOCK_FILE, f"{RECORD}/config.yaml", "metrics.jsonl")


def _is_run(directory: Path) -> bool:
    return any(os.path.lexists(directory / name) for name in _RUN_FILES)


def inside_a_run(directory: str) -> str | None:
    """Why ``directory`` (a run or sweep dir to be) lies inside another run's own
    files, or None: in a run's ``checkpoints/`` (any ``step_N`` in it), its record
    ``.hydra/``, its ``ranks/`` or its ``branches/`` (timelines set aside), or inside a checkpoint anywhere (a ``step_N``
    dir holding a checkpoint's files). A run written there would be written into
    that run (a checkpoint holding other files is damaged). Links are followed: a
    link into a run is inside it. A directory merely below a run dir is not."""
    path = Path(os.path.realpath(os.path.expanduser(directory)))
    for above in [path, *path.parents]:
        run = above.parent
        own = above.name in (run_checkpoints(run).name, RECORD, RANK_REPORTS, BRANCHES)
        if own and _is_run(run):
            inner = path.relative_to(run)
            return f"{directory} is inside the run {run} (its {inner})"
        if is_complete(above) or (
            above.name.startswith("step_") and (above / META).exists()
        ):
            return f"{directory} is inside the checkpoint {above}"
    return None


def check_writable(
    cfg: DictConfig,
    first: tuple[str, str, str] | None = None,
    others: bool = True,
    wandb: bool = True,
) -> None:
    """ConfigError naming the key (or environment variable) to change, if a
    directory the command writes to cannot be written: ``first`` (the key, the
    directory, what writes there: the run dir) and, with ``others``, the
    :func:`written_dirs` of ``cfg`` (wandb's with ``wandb``)."""
    dirs = ([first] if first else []) + (written_dirs(cfg, wandb) if others else [])
    home = os.path.expanduser("~")
    for key, path, what in dirs:
        problem = unwritable(os.path.expanduser(path))
        if problem is None and first is not None and key == first[0]:
            # its own files: the top level, Hydra's record and the ranks' reports
            # (checkpoints/ is verified file by file; wandb/ is wandb's own links)
            planted = planted_file(os.path.expanduser(path), (RECORD, RANK_REPORTS))
            if planted:
                # eval.py's run= names the run it reads: no other directory will do
                elsewhere = (
                    "" if key == "run" else f" (or set {key} to another directory)"
                )
                raise ConfigError(
                    key,
                    f"{what} writes to {path}: {planted}; it writes only to its own "
                    f"regular files there: remove it{elsewhere}",
                )
        if problem is None:
            continue
        err = not_writable(key, path, what, problem)
        if key not in os.environ and "." not in key and path.startswith(home + os.sep):
            err = ConfigError(
                key, f"{err.message} (or HOME, {home}: it is there by default)"
            )
        raise err


#: In a sweep dir: held by the multirun that writes there (:func:`own_sweep_dir`).
SWEEP_LOCK = "sweep.lock"


@contextlib.contextmanager
def own_sweep_dir(sweep_dir: str, resume: Any) -> Iterator[None]:
    """Hold ``sweep_dir`` for a multirun: a second multirun there while one runs is
    refused naming the holder's PID; one into a dir that holds a sweep's jobs is
    refused unless it resumes them (``trainer.resume`` set: each job continues its
    own run dir), since its jobs would fail on their used run dirs, recording the
    completed ones as failed, and its summary would replace the sweep's. A
    ConfigError naming hydra.sweep.dir; checked before any job starts."""
    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, SWEEP_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(
                "hydra.sweep.dir",
                f"{sweep_dir} is in use by another sweep (PID {holder}); wait for "
                "it or stop it, or sweep into another hydra.sweep.dir",
            ) from None
        jobs = job_dirs(sweep_dir)
        if jobs and resume in (None, "none"):
            raise ConfigError(
                "hydra.sweep.dir",
                f"{sweep_dir} holds a sweep ({plural(len(jobs), 'job')}); another "
                "there would record its completed jobs as failed and replace its "
                "summary: sweep into another hydra.sweep.dir, or resume its jobs "
                "with trainer.resume=auto",
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)


class WritableDirs(Callback):
    """Hydra callback (conf/config.yaml): before Hydra creates the run dir and starts
    its job logging (which writes ``train.log`` there), a run (or sweep) dir inside
    another run's own files is refused (:func:`inside_a_run`), and the run dir and
    the other directories the run writes to are checked (:func:`check_writable`);
    one that cannot be written ends the command in one line naming the key (exit 2)
    instead of Hydra's logging set-up failing over 50 lines. A resume's own dirs are
    its recorded config's: :func:`continue_run` checks them."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")
        sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
        resume = OmegaConf.select(config, "trainer.resume", default=None)
        self._sweep = contextlib.ExitStack()
        with exit_on_config_error():  # one line: Hydra would only warn
            self._sweep.enter_context(own_sweep_dir(sweep_dir, resume))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._sweep.close()

    def _check(self, config: DictConfig, key: str) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra, before = HydraConfig.instance(), HydraConfig.instance().cfg
        hydra.set_config(config)  # for ${hydra:...} in the dir, as Hydra's run_job
        try:
            what = "the sweep" if key == "hydra.sweep.dir" else "the run"
            first = (key, str(OmegaConf.select(config, key)), what)
            resume = OmegaConf.select(config, "trainer.resume", default=None)
            # sys.exit inside: Hydra turns a callback's exception into a warning
            with exit_on_config_error():
                nested = inside_a_run(first[1])
                if nested:
                    raise ConfigError(
                        key,
                        f"{nested}; {what} writes only into a directory of its "
                        f"own: set {key} to one outside it",
                    )
                check_writable(config, first, others=resume in (None, "none"))
        finally:
            hydra.cfg = before
