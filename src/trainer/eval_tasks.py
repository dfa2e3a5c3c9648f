"""Downstream tasks by name, for lm-eval (lm-evaluation-harness): where a name is
found and the one-line errors when it is not.

A name is looked up in the shipped tasks (``conf/eval_tasks/``), then the user's
task dirs (``trainer.eval_tasks_dirs``, eval.py's ``tasks_dirs``), each a folder of
lm-eval task YAMLs (``task:`` the name), then among the tasks lm-eval itself knows
(its index of ~15,000 YAMLs takes ~15 s to read: only for a name not found before).
A relative ``data_files`` path in a task YAML is read beside the YAML. No machine
here reaches the internet: a task's data is loaded with the Hugging Face hub
offline, so a task whose dataset is not on disk fails at once, in one line.

lm-eval (which imports pandas, sklearn and datasets) is imported only here and in
src/trainer/lm_adapter.py, inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from src.errors import ConfigError

log = logging.getLogger(__name__)

#: The tasks the project ships: one lm-eval task YAML each, its data beside it.
SHIPPED_TASKS = Path(__file__).resolve().parents[2] / "conf" / "eval_tasks"


def _task_yamls(directory: Path) -> dict[str, Path]:
    """``{task name: YAML}`` of the lm-eval task YAMLs in ``directory`` (and below)."""
    import yaml

    found = {}
    for path in sorted(directory.rglob("*.yaml")):
        try:  # lm-eval's own tags (!function) are kept as text here
            text = yaml.load(path.read_text(), Loader=_tagless_loader())  # noqa: S506
        except (OSError, ValueError, yaml.YAMLError):  # not text, not YAML
            continue
        if isinstance(text, dict) and isinstance(text.get("task"), str):
            found.setdefault(text["task"], path)
    return found


@functools.cache
def _tagless_loader() -> Any:
    """A YAML loader that reads any tag (lm-eval's ``!function``) as null."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return Loader


def _local_config(path: Path) -> dict[str, Any]:
    """The task config of ``path`` as lm-eval reads it (includes, functions), its
    relative ``data_files`` made paths beside the YAML."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(path, resolve_func=True)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:

        def beside(value: Any) -> Any:
            if isinstance(value, list):
                return [beside(v) for v in value]
            return str(path.parent / value) if not Path(value).is_absolute() else value

        config["dataset_kwargs"] = {
            **config["dataset_kwargs"],
            "data_files": {k: beside(v) for k, v in files.items()}
            if isinstance(files, dict)
            else beside(files),
        }
    return config


@functools.cache
def _lm_eval_index() -> Any:
    """lm-eval's own tasks (its TaskManager, read once per process: ~15 s)."""
    from lm_eval.tasks import TaskManager

    log.info("looking the task up among lm-eval's own tasks (~15 s, once)")
    with offline():
        return TaskManager()


def task_specs(
    names: Sequence[str], dirs: Sequence[str], key: str, dirs_key: str
) -> list[Any]:
    """Each of ``names`` as lm-eval takes it: a shipped or user task's config (a
    dict), else the name of a task lm-eval knows. ``ConfigError`` naming ``key`` (an
    unknown name) or ``dirs_key`` (a dir holding no task)."""
    local = _task_yamls(SHIPPED_TASKS)
    for directory in dirs:
        where = Path(directory).expanduser()
        if not where.is_dir():
            raise ConfigError(dirs_key, f"{directory}: no such directory")
        found = _task_yamls(where)
        if not found:
            raise ConfigError(
                dirs_key,
                f"{directory} holds no lm-eval task (a YAML with a `task:` name); "
                f"see conf/eval_tasks/ for examples",
            )
        for name, path in found.items():
            local[name] = path  # a user's task of a shipped name is the user's
    specs = []
    for name in names:
        if name in local:
            specs.append(_local_config(local[name]))
        elif name in _lm_eval_index().all_tasks:
            specs.append(name)
        else:
            raise ConfigError(
                key,
                f"unknown task {name!r}: not in conf/eval_tasks/ ({', '.join(sorted(local))}), "
                f"{dirs_key}, nor lm-eval's own tasks",
            )
    return specs


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` for the duration (lm-eval's module-level names
    that it offers no setting for), restored after."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    """The environment variable ``name`` is ``value`` for the duration, then as it
    was (unset if it was)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """The Hugging Face hub offline for the duration (``datasets`` reads its flag at
    import: set on its config module, restored after): a dataset not on disk fails at
    once instead of retrying the network for ~25 s. lm-eval's and datasets' progress
    lines and bars are held back meanwhile (warnings pass)."""
    import datasets.config as hub
    import lm_eval.api.task as task_module
    from datasets.utils import logging as datasets_logging
    from tqdm import tqdm

    saved = hub.HF_HUB_OFFLINE, hub.HF_DATASETS_OFFLINE
    bars = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    hub.HF_HUB_OFFLINE = hub.HF_DATASETS_OFFLINE = True
    harness = logging.getLogger("lm_eval")
    level = harness.level
    harness.setLevel(logging.WARNING)
    try:  # each rank would draw lm-eval's bar of each task's requests
        with replaced(task_module, "tqdm", functools.partial(tqdm, disable=True)):
            yield
    finally:
        hub.HF_HUB_OFFLINE, hub.HF_DATASETS_OFFLINE = saved
        harness.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


def task_manager(specs: Sequence[Any]) -> Any:
    """The lm-eval TaskManager that loads ``specs``: lm-eval's own index only when
    one is a name of its tasks (configs need none)."""
    from lm_eval.tasks import TaskManager

    if any(isinstance(s, str) for s in specs):
        return _lm_eval_index()
    return TaskManager(include_defaults=False)


def build_tasks(names: Sequence[str], specs: Sequence[Any], key: str) -> dict:
    """lm-eval's task objects of ``specs`` (their data loaded, offline); a task
    whose data cannot be had: ``ConfigError`` naming ``key`` and the task."""
    from lm_eval.tasks import get_task_dict

    tasks, manager = {}, task_manager(specs)
    for name, spec in zip(names, specs, strict=True):
        try:
            with offline():
                tasks.update(get_task_dict([spec], manager))
        except Exception as exc:  # datasets' errors have no common type
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ConfigError(
                key,
                f"task {name!r}: its data could not be loaded offline "
                f"({type(exc).__name__}: {first[:200]}); a task needing a download "
                "runs where its dataset is in the Hugging Face cache, or give it "
                "local files (docs/evaluation.md)",
            ) from None
    return tasks


def check_tasks(
    names: Sequence[str], dirs: Sequence[str], key: str, dirs_key: str
) -> list[Any]:
    """Before any rank starts: every task of ``names`` found and its data loaded
    (one line naming the key and the task if not); returns :func:`task_specs`."""
    specs = task_specs(names, dirs, key, dirs_key)
    build_tasks(names, specs, key)
    return specs


def check_loop_tasks(trainer_cfg: Any) -> None:
    """``trainer.eval_tasks`` checked as :func:`check_tasks` does (nothing without)."""
    if trainer_cfg.eval_tasks:
        keys = ("trainer.eval_tasks", "trainer.eval_tasks_dirs")
        names, dirs = list(trainer_cfg.eval_tasks), list(trainer_cfg.eval_tasks_dirs)
        check_tasks(names, dirs, *keys)
