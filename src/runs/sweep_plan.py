"""A multirun's plan of jobs, and the line that ends a sweep stopped by a signal:
which of its jobs never ran (src/runs/sweep.py ``run_job``)."""

from __future__ import annotations

import signal
from collections.abc import Sequence

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from src.text import plural

#: The multirun's jobs, each its overrides (None: one its sweeper draws as it goes,
#: as Optuna does), planned at its start (:class:`SweepSummary`).
_planned: list[list[str] | None] = []


def planned_jobs(config: DictConfig) -> list[list[str] | None]:
    """The jobs a multirun of ``config`` (as Hydra's multirun callbacks get it) will
    run: the basic sweeper's product of the sweep's values, the overrides of each;
    for a sweeper that draws its points, ``n_trials`` of None; [] if unknown."""
    sweeper = OmegaConf.select(config, "hydra.sweeper", default=None) or {}
    if "BasicSweeper" not in str(sweeper.get("_target_", "")):
        trials = sweeper.get("n_trials")
        return [None] * trials if isinstance(trials, int) else []
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    params += [str(o) for o in config.hydra.overrides.task]
    try:
        overrides = OverridesParser.create().parse_overrides(params)
        batches = BasicSweeper.split_arguments(overrides, None)
    except Exception:  # a sweep Hydra itself parses otherwise: not said
        return []
    return [list(job) for batch in batches for job in batch]


def never_ran(signum: int, first: int) -> str:
    """The line that ends a multirun stopped by ``signum`` before its job ``first``:
    which of the planned jobs never ran, and how to run them."""
    left = list(enumerate(_planned))[first:]
    if not left:
        return f"sweep stopped by {signal.Signals(signum).name}: no job was left"
    points = [dict(o.partition("=")[::2] for o in job or []) for job in _planned]
    keys = swept_keys(points)
    named = [
        f"#{n}" + (f" ({' '.join(f'{k}={points[n][k]}' for k in keys)})" if o else "")
        for n, o in left
    ]
    shown = ", ".join(named[:_SHOWN_JOBS]) + (
        f" and {len(named) - _SHOWN_JOBS} more" if len(named) > _SHOWN_JOBS else ""
    )
    return (
        f"sweep stopped by {signal.Signals(signum).name}: {len(left)} of its "
        f"{plural(len(_planned), 'job')} never ran: {shown}; run them with the same "
        "command and trainer.resume=auto (each job resumes its own run dir: a "
        "completed one has nothing to train)"
    )


_SHOWN_JOBS = 5


def job_number() -> int:
    """This multirun job's number (0 outside a Hydra job)."""
    try:
        return HydraConfig.get().job.num
    except ValueError:
        return 0


def plan_jobs(config: DictConfig) -> None:
    """At a multirun's start (``SweepSummary``): its :func:`planned_jobs`."""
    _planned[:] = planned_jobs(config)


def swept_keys(overrides: Sequence[dict[str, str]]) -> list[str]:
    """The override keys whose value differs between jobs (all of one job's keys if
    there is a single job or none differ)."""
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    varied = [k for k in keys if len({o.get(k) for o in overrides}) > 1]
    return varied or keys
