"""Metric sinks: metrics.jsonl + summary.json in the run dir always, wandb optionally.

Only rank 0 writes; on other ranks every method is a no-op, so the loop can call the
logger unconditionally. wandb runs offline by default (nothing needs a network; sync
later with ``wandb sync <run_dir>/wandb/offline-run-*``), one run per Hydra job.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
DEFAULT_PROJECT = "shardwrap"


def _scalar(value: Any) -> Any:
    """Plain Python value for JSON and wandb (tensors and numpy scalars via .item())."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _plain(d: dict) -> dict:
    return {k: _scalar(v) for k, v in d.items()}


def _json_default(value: Any) -> Any:
    return str(value)  # dtypes, devices, paths: readable rather than an error


class Logger:
    """Writes metrics to the run dir (always) and to a wandb run (if given); rank 0 only."""

    def __init__(self, run_dir: str | os.PathLike | None, wandb_run=None) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.wandb_run = wandb_run
        self._summary: dict = {}
        self._last_step = 0
        self._jsonl = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Append: a resumed run continues the same file.
            self._jsonl = open(self.run_dir / METRICS_FILE, "a")

    @property
    def enabled(self) -> bool:
        return self.run_dir is not None

    def log(self, metrics: dict, step: int) -> None:
        """One row: ``{"step": step, **metrics}`` to metrics.jsonl and wandb history."""
        if not self.enabled:
            return
        row = _plain(metrics)
        self._jsonl.write(json.dumps({"step": step, **row}, default=_json_default))
        self._jsonl.write("\n")
        self._jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)
        self._last_step = max(self._last_step, step)

    def log_summary(self, d: dict) -> None:
        """Final figures (val_loss, totals): merged into summary.json and the run summary."""
        if not self.enabled:
            return
        self._summary.update(_plain(d))
        tmp = self.run_dir / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(self._summary, indent=2, default=_json_default))
        tmp.replace(self.run_dir / SUMMARY_FILE)
        if self.wandb_run is not None:
            self.wandb_run.summary.update(self._summary)

    def log_table(self, name: str, rows: list[dict]) -> None:
        """Rows of dicts (e.g. the wrap plan) as ``<name>.json`` and a wandb Table."""
        if not self.enabled:
            return
        rows = [_plain(r) for r in rows]
        safe = re.sub(r"[^\w.-]+", "_", name)
        (self.run_dir / f"{safe}.json").write_text(
            json.dumps(rows, indent=2, default=_json_default)
        )
        if self.wandb_run is not None:
            import wandb

            columns = list(dict.fromkeys(k for r in rows for k in r))
            data = [[_table_cell(r.get(c)) for c in columns] for r in rows]
            # At the last logged step, so it never moves wandb's step counter past
            # the loop's next step (wandb drops rows logged with a smaller step).
            table = wandb.Table(columns=columns, data=data)
            self.wandb_run.log({name: table}, step=self._last_step)

    def finish(self, exit_code: int = 0) -> None:
        """Close the files and finish the wandb run (once; safe to call again);
        a non-zero ``exit_code`` marks the wandb run as failed."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None
        self.run_dir = None

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


def _table_cell(value: Any) -> Any:
    return (
        value if value is None or isinstance(value, int | float | str) else str(value)
    )


def _hydra_job(run_dir: Path) -> DictConfig | None:
    """The Hydra config of this job: live in the Hydra process, else from the
    ``.hydra/hydra.yaml`` it saved (ranks started by the launcher are new processes)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return HydraConfig.get()
    except ImportError:
        return None
    saved = run_dir / ".hydra" / "hydra.yaml"
    if saved.is_file():
        return OmegaConf.select(OmegaConf.load(saved), "hydra")
    return None


def _safe_select(cfg, key: str) -> Any:
    try:  # saved hydra.yaml may hold interpolations (${now:...}) we cannot resolve
        return OmegaConf.select(cfg, key, default=None)
    except Exception:
        return None


def run_identity(cfg: DictConfig, run_dir: str | os.PathLike) -> dict:
    """wandb project, group, tags and run name: the config's, else from the Hydra job.

    Group: ``logger.group``, else ``<job name>-<sweep dir name>`` in a multirun (all jobs
    of one sweep together), else the job name. Name: ``logger.name``, else the job name
    plus its override dirname (``train:model=tiny,trainer.seed=1``), else the run dir's.
    """
    run_dir = Path(run_dir)
    hydra = _hydra_job(run_dir)
    job_name = _safe_select(hydra, "job.name") if hydra is not None else None
    overrides = (
        _safe_select(hydra, "job.override_dirname") if hydra is not None else None
    )
    mode = str(_safe_select(hydra, "mode")) if hydra is not None else ""
    group = OmegaConf.select(cfg, "logger.group", default=None)
    if group is None and job_name:
        # A multirun job's dir is <sweep dir>/<subdir>.
        group = f"{job_name}-{run_dir.parent.name}" if "MULTIRUN" in mode else job_name
    name = OmegaConf.select(cfg, "logger.name", default=None)
    if name is None:
        if job_name:
            name = f"{job_name}:{overrides}" if overrides else job_name
        else:
            name = run_dir.name
    tags = OmegaConf.select(cfg, "logger.tags", default=None)
    return {
        "project": OmegaConf.select(cfg, "logger.project", default=None)
        or DEFAULT_PROJECT,
        "group": group,
        "name": name,
        "tags": list(tags) if tags else None,
    }


def _init_wandb(cfg: DictConfig, run_dir: Path):
    mode = OmegaConf.select(cfg, "logger.mode", default=None) or "offline"
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    # No crash reports to sentry, and wandb's files stay in the run dir.
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    os.environ["WANDB_DIR"] = str(run_dir)
    import wandb

    system_stats = bool(OmegaConf.select(cfg, "logger.system_stats", default=False))
    settings = wandb.Settings(
        # System metrics sampling also probes cloud metadata endpoints over HTTP.
        x_disable_stats=not system_stats,
        x_disable_machine_info=not system_stats,
        disable_git=True,
        save_code=False,
        silent=True,
    )
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    start = time.perf_counter()
    run = wandb.init(
        dir=str(run_dir),
        mode=mode,
        config=config,
        settings=settings,
        reinit="finish_previous",  # one run per Hydra job, also in a multirun process
        **run_identity(cfg, run_dir),
    )
    log.info("wandb.init (%s) took %.2fs", mode, time.perf_counter() - start)
    return run


def build_logger(cfg: DictConfig, run_dir: str | os.PathLike, rank: int) -> Logger:
    """The run's logger. ``logger.backend``: ``wandb`` (default) or ``none`` (files only).

    Rank 0 gets the real logger; other ranks get one whose methods do nothing.
    """
    if rank != 0:
        return Logger(None)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    kind = str(OmegaConf.select(cfg, "logger.backend", default=None) or "wandb")
    if kind.lower() == "none":
        return Logger(run_dir)
    if kind != "wandb":
        raise ValueError(f"unknown logger {kind!r}; use logger=wandb or logger=none")
    return Logger(run_dir, _init_wandb(cfg, run_dir))


def _offline_run_file(run_dir: str | os.PathLike) -> Path:
    files = sorted(
        glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")),
        key=os.path.getmtime,
    )
    if not files:
        raise FileNotFoundError(f"no offline wandb run under {run_dir}/wandb")
    return Path(files[-1])


def read_wandb_offline_records(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of the latest offline run's .wandb transaction log, decoded by
    wandb's own reader (``wandb leet inspect --json``, a wandb-core command)."""
    from wandb.util import get_core_path

    run_file = _offline_run_file(run_dir)
    out = subprocess.run(
        [
            get_core_path(),
            "leet",
            "inspect",
            "--json",
            "--no-observability",
            "--run-file",
            str(run_file),
            str(run_file.parent.parent),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def read_wandb_offline_history(run_dir: str | os.PathLike) -> list[dict]:
    """The logged history rows (each with ``_step``) of the offline run in ``run_dir``,
    read from its own files: for tests, and for users who do not sync."""
    return [
        r["history"]["item"]
        for r in read_wandb_offline_records(run_dir)
        if r.get("type") == "history"
    ]


def read_wandb_offline_run(run_dir: str | os.PathLike) -> dict:
    """The offline run's identity and config (its ``run`` record) plus its summary."""
    run: dict = {}
    summary: dict = {}
    for r in read_wandb_offline_records(run_dir):
        if r.get("type") == "run":
            run = r["run"]
        elif r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    return {**run, "summary": summary}
