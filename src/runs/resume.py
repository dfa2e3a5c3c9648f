"""A run dir is a run: ``python train.py hydra.run.dir=DIR trainer.resume=auto``.

- The run's record of itself is Hydra's output of its first attempt, ``.hydra/``
  (config.yaml, overrides.yaml, hydra.yaml). Every later attempt's Hydra output goes
  to ``.hydra/attempts/<time>/`` (:func:`attempt_subdir`, conf/config.yaml's
  ``hydra.output_subdir``), so no attempt, failed or refused, rewrites the record; a
  record whose run never trained (its start was refused) gives way to the first
  attempt that trains (:func:`adopt_attempt`).
- Each checkpoint records the config it was saved with (``meta.json``'s
  ``extra.config``, :func:`checkpoint_config`). A resume starts from that config (or,
  before a checkpoint exists, from the record), and the command line's overrides are
  changes to it (:func:`requested_changes`): each is said, or refused in one line
  naming the key and the recorded value (:func:`refusal`).
- A run dir that holds a run (:func:`run_progress`: checkpoints or logged rows) is
  not started over by a fresh start (``trainer.resume=null``).
"""

from __future__ import annotations

import copy
import datetime
import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from src.checkpoint.folders import META, complete_checkpoints, run_checkpoints
from src.files import read_json, read_yaml
from src.observe.loggers import METRICS_FILE
from src.trainer.faults import LOCK_FILE, holds, live_ranks

RECORD = ".hydra"
ATTEMPTS = f"{RECORD}/attempts"
_RECORD_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")


def attempt_subdir(output_dir: str) -> str:
    """Where Hydra writes this attempt's config files under ``output_dir`` (the run
    dir): ``.hydra`` for the first attempt, ``.hydra/attempts/<time>`` after it."""
    if not (Path(output_dir) / RECORD / "config.yaml").is_file():
        return RECORD
    now = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")
    return f"{ATTEMPTS}/{now}"


if not OmegaConf.has_resolver("shardwrap_attempt"):
    # conf/config.yaml: hydra.output_subdir; cached, so every read gives Hydra's dir.
    OmegaConf.register_new_resolver("shardwrap_attempt", attempt_subdir, use_cache=True)


@dataclass
class RunRecord:
    """The run's own ``.hydra/`` files: its composed config, its command line, and
    the option of each config group it picked (``hydra.runtime.choices``)."""

    config: DictConfig
    overrides: list[str]
    choices: dict[str, str]


def recorded_config(run_dir: str | Path) -> tuple[DictConfig, list[str]]:
    """The record's composed config and its command line's overrides (none if
    ``overrides.yaml`` is absent); ValueError naming a file of it that is missing or
    damaged (:func:`read_yaml`)."""
    hydra_dir = Path(run_dir) / RECORD
    overrides = hydra_dir / "overrides.yaml"
    return (
        read_yaml(hydra_dir / "config.yaml"),
        list(read_yaml(overrides, "list")) if os.path.lexists(overrides) else [],
    )


def run_record(run_dir: str | Path) -> RunRecord | None:
    """The record in ``run_dir`` (None if there is none); ValueError naming a file
    of it that is damaged (:func:`read_yaml`)."""
    hydra_dir = Path(run_dir) / RECORD
    if not os.path.lexists(hydra_dir / "config.yaml"):
        return None
    choices: dict[str, str] = {}
    if os.path.lexists(hydra_dir / "hydra.yaml"):
        saved = read_yaml(hydra_dir / "hydra.yaml")
        found = OmegaConf.select(saved, "hydra.runtime.choices", default=None)
        if not isinstance(found, DictConfig | None):
            raise ValueError(f"{hydra_dir / 'hydra.yaml'} is damaged (its choices)")
        choices = {str(k): str(v) for k, v in (found or {}).items()}
    return RunRecord(*recorded_config(run_dir), choices)


def adopt_attempt(run_dir: str | Path, attempt: str) -> None:
    """This attempt's Hydra files become the run's record (the record there belonged
    to an attempt that never trained)."""
    source, target = Path(run_dir) / attempt, Path(run_dir) / RECORD
    for name in _RECORD_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


@dataclass
class RunProgress:
    """What a run dir holds of a run: its complete checkpoints (oldest first) and
    the last step of its metrics.jsonl (None: no row)."""

    checkpoints: list[Path]
    last_row: int | None

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            newest = self.checkpoints[-1]
            parts.append(f"checkpoint {newest.name}")
        if self.last_row is not None:
            parts.append(f"{METRICS_FILE} up to step {self.last_row}")
        return " and ".join(parts)


def run_progress(run_dir: str | Path) -> RunProgress | None:
    """The run ``run_dir`` holds (None: nothing was trained there)."""
    checkpoints = complete_checkpoints(run_checkpoints(run_dir))
    last_row = None
    metrics = Path(run_dir) / METRICS_FILE
    if metrics.is_file():
        for line in metrics.read_bytes().splitlines():
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError, RecursionError):
                continue  # a row cut short by a crash, or damaged (not UTF-8 JSON)
            if type(step) is int:
                last_row = step if last_row is None else max(last_row, step)
    if not checkpoints and last_row is None:
        return None
    return RunProgress(checkpoints, last_row)


def in_use(run_dir: str | Path) -> bool:
    """A live run holds ``run_dir`` (its lock, or ranks of a run whose launcher
    died: src/trainer/faults.py), and not this process; the launcher refuses this
    one, naming it."""
    if holds(run_dir):
        return False
    if live_ranks(run_dir):
        return True
    try:
        # not through a link; a FIFO would block an open for reading
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(Path(run_dir) / LOCK_FILE, flags)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases a shared lock taken
    return False


def checkpoint_config(checkpoint: Path) -> dict[str, Any] | None:
    """The config ``checkpoint`` was saved with (None for a checkpoint that predates
    it, or a damaged meta.json: the ranks' verification reports that one). Read as
    data (:func:`read_json`): a regular file, not a link, of bounded size, strict
    JSON (a FIFO there blocked the resume before any rank started; NaN passed, and
    nesting past the parser was a traceback)."""
    file = checkpoint / META
    if file.is_symlink():
        return None
    try:
        meta = read_json(file)
    except (OSError, ValueError):
        return None
    extra = meta.get("extra") if isinstance(meta, dict) else None
    config = extra.get("config") if isinstance(extra, dict) else None
    return config if isinstance(config, dict) else None


def requested_changes(
    cfg: DictConfig,
    overrides: list[str],
    choices: dict[str, str],
    recorded_choices: dict[str, str],
) -> dict[str, Any]:
    """What this command line asks of a resumed run: ``{key: value}`` for each of its
    overrides (``value`` as ``cfg``, composed from them, holds it). A group option
    (``model=tiny``) the run already picked asks nothing; another one asks for the
    whole group node (typed by its schema). Group nodes come first, so a key inside
    one is applied after it (:func:`with_changes`)."""
    nodes: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.") or key == "hydra":
            continue
        if key in choices:  # a config group
            if recorded_choices.get(key) != choices[key]:
                nodes[key] = copy.deepcopy(cfg[key])
            continue
        value = OmegaConf.select(cfg, key)
        values[key] = (
            OmegaConf.to_container(value, resolve=True)
            if isinstance(value, DictConfig | ListConfig)
            else value
        )
    return {**nodes, **values}


def with_changes(cfg: DictConfig, changes: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with each of ``changes`` put in place (a group node replaces
    the run's, whatever its schema)."""
    cfg = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg


def leaves(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of every leaf (lists are values)."""
    if isinstance(cfg, DictConfig):
        try:
            cfg = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # an interpolation only Hydra's job can resolve
            cfg = OmegaConf.to_container(cfg, resolve=False)
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(before: DictConfig, after: DictConfig) -> list[tuple[str, Any, Any]]:
    """``(key, before, after)`` for each leaf that differs (a key only one of them has
    counts, with None on the other side); ``trainer.resume`` is not a difference."""
    old, new = leaves(before), leaves(after)
    out = []
    for key in [*old, *(k for k in new if k not in old)]:
        if key != "trainer.resume" and old.get(key) != new.get(key):
            out.append((key, old.get(key), new.get(key)))
    return out


# A resume continues the checkpoint's training: what it trained (the model's shape,
# the data and its tokenizer, the order of the batches) and how its numbers were
# computed stay. Keys inside a refused group that change none of that:
_FREE = {"model.init_device", "model.pretrained", "data.cache_dir"}
_FIXED = {
    "model.": "a resume keeps the checkpoint's model shape",
    "data.": "a resume keeps the checkpoint's data and tokenizer",
    "trainer.seed": "it orders the batches; a resume keeps the checkpoint's data stream",
    "precision.": "another precision changes the checkpoint's numerics",
    "trainer.optimizer": "the checkpoint holds that optimizer's state (trainer.init_"
    "from=CHECKPOINT starts from its weights with a fresh optimizer)",
}


def refusal(key: str) -> str | None:
    """Why a resume cannot change ``key`` (None: it can; it is applied and said)."""
    if key in _FREE:
        return None
    for prefix, reason in _FIXED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return reason
    return None
