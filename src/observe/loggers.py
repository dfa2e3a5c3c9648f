"""Metric sinks behind one :class:`Logger`: files, console and wandb.

Every sink takes the same calls (a metrics row, the summary, a table, the end of the
run), so a new destination is one small class. Only rank 0 has sinks; on other ranks
the logger holds none and every call is a no-op, so the loop can call it
unconditionally.

- :class:`FileSink`: ``metrics.jsonl`` (one row per logged step), ``summary.json``
  and ``<table>.json`` in the run dir.
- :class:`ConsoleSink`: the closing summary of a finished run (final loss and
  val_loss, throughput, MFU, memory, where the outputs are, how to upload), logged
  (console and ``train.log``, see src/observe/logs.py).
- :class:`WandbSink`: a wandb run, offline by default (nothing needs a network; sync
  later with ``wandb sync <run_dir>/wandb/offline-run-*``), one run per Hydra job.
  :func:`init_wandb` is the one wandb setup, for training runs and sweep summaries.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.errors import ConfigError
from src.files import atomic_path, json_default, keep_aside, write_json_atomic
from src.observe.keys import (
    TRAINING_SECTIONS,
    val_line,
    wandb_key,
)
from src.observe.metrics import contended
from src.registry import Registry, described, no_check, or_list
from src.text import plural

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _scalar(value: Any) -> Any:
    """Plain Python value for JSON and wandb (tensors and numpy scalars via .item())."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _plain(d: dict) -> dict:
    return {k: _scalar(v) for k, v in d.items()}


class Sink:
    """One destination of a run's figures; every method may be left as a no-op."""

    def log(self, row: dict, step: int) -> None:
        """A row of plain scalars logged at ``step``."""

    def log_summary(self, summary: dict) -> None:
        """The whole summary so far (later calls extend earlier ones)."""

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows of dicts, e.g. the wrap plan; ``step`` is the last logged step."""

    def begin(self, resumed: bool = False) -> None:
        """The run really trains (a resume was accepted, steps are left): a sink that
        starts something outside the run dir (a wandb run) starts it now;
        ``resumed``: it continues from a checkpoint of this run dir."""

    def log_artifact(self, name: str, kind: str, directory: Path) -> None:
        """A folder of files (e.g. the profiler's traces) kept with the run."""

    def finish(self, exit_code: int) -> None:
        """The run ended (``exit_code`` != 0: it failed)."""

    def drop_rows_after(self, step: int) -> dict[str, int]:
        """Forget rows logged past ``step``, if the sink can; returns how many, by
        the name of the file they were in."""
        return {}

    def set_aside_after(self, step: int, directory: Path) -> list[str]:
        """Move what this sink keeps in the run dir of the steps past ``step`` (rows,
        the summary of their end) to files of the same names in ``directory``: a
        resume that branches at ``step`` (src/runs/branches.py). Returns what moved,
        in words (``metrics.jsonl: 4 rows``)."""
        return []


def rows_past(step: int, steps: list[float]) -> int:
    """How many of a file's rows (their ``steps``, in order; a row with none is
    ``inf``) an interrupted run logged past ``step``: those past it, and a last row
    cut short (a damaged row elsewhere is not the run's, and is said apart)."""
    past = sum(step < s < math.inf for s in steps)
    return past + (bool(steps) and steps[-1] == math.inf)


def set_aside_damaged(path: Path, damaged: int, what: str) -> None:
    """Keep a copy of the rows file ``path`` as it was when ``damaged`` of its rows
    (not the last: a row cut short) are not ``what`` a row is, and say so: they are
    dropped."""
    if damaged:
        aside = keep_aside(path, copy=True)
        log.warning(
            "%s: %d damaged row(s) (not %s) dropped; the file as it was is kept as %s",
            path,
            damaged,
            what,
            aside.name,
        )


class FileSink(Sink):
    """metrics.jsonl, summary.json and tables as JSON in the run dir. One row per
    step: a row logged at the step of the last one (validation, samples) is merged
    into it, which is rewritten in place."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run continues the same file.
        self._jsonl = open(self.run_dir / METRICS_FILE, "a")
        self._last: tuple[int, dict, int] | None = None  # step, row, its offset

    def log(self, row: dict, step: int) -> None:
        if self._last is not None and self._last[0] == step:
            row = {**self._last[1], **row}
            self._jsonl.truncate(self._last[2])
        self._jsonl.seek(0, os.SEEK_END)
        offset = self._jsonl.tell()
        self._jsonl.write(json.dumps({"step": step, **row}, default=json_default))
        self._jsonl.write("\n")
        self._jsonl.flush()
        self._last = (step, row, offset)

    def log_summary(self, summary: dict) -> None:
        write_json_atomic(self.run_dir / SUMMARY_FILE, summary)

    def drop_rows_after(self, step: int) -> dict[str, int]:
        # Rows cut short by a crash (no step) go too; rows of one step are merged
        # (files written before rows were), and a row logged next at the last kept
        # step is merged into it.
        path = self.run_dir / METRICS_FILE
        if not path.is_file():  # a device or a link to one (/dev/full): no rows to read
            return {}
        self._jsonl.close()
        lines = path.read_bytes().splitlines(keepends=True)
        damaged = sum(_row_step(r) == math.inf for r in lines[:-1])
        past = rows_past(step, [_row_step(r) for r in lines])
        # not a row cut short at the end
        set_aside_damaged(path, damaged, "UTF-8 JSON with a step")
        rows: dict[Any, dict] = {}
        for line in lines:
            if _row_step(line) <= step:
                row = json.loads(line.decode())
                rows.setdefault(row["step"], {}).update(row)
        kept = [
            (json.dumps(r, default=json_default) + "\n").encode() for r in rows.values()
        ]
        if kept != lines:
            with atomic_path(path) as tmp:
                tmp.write_bytes(b"".join(kept))
        self._jsonl = open(path, "a")
        self._last = None
        if rows:
            last = list(rows.values())[-1]
            self._jsonl.seek(0, os.SEEK_END)
            offset = self._jsonl.tell() - len(kept[-1])
            self._last = (
                last["step"],
                {k: v for k, v in last.items() if k != "step"},
                offset,
            )
        return {METRICS_FILE: past} if past else {}

    def set_aside_after(self, step: int, directory: Path) -> list[str]:
        # The branch's copy first: a kill before the rewrite leaves the rows in both
        # places (the next set-aside writes the same copy again), never in neither.
        path, moved = self.run_dir / METRICS_FILE, []
        lines = path.read_bytes().splitlines(keepends=True) if path.is_file() else []
        later = [line for line in lines if _row_step(line) > step]
        if later:
            with atomic_path(directory / METRICS_FILE) as tmp:
                tmp.write_bytes(b"".join(later))
            self._jsonl.close()
            with atomic_path(path) as tmp:
                tmp.write_bytes(b"".join(x for x in lines if _row_step(x) <= step))
            self._jsonl, self._last = open(path, "a"), None
            moved.append(f"{METRICS_FILE}: {plural(len(later), 'row')}")
        summary = self.run_dir / SUMMARY_FILE
        if summary.is_file():
            os.replace(summary, directory / SUMMARY_FILE)
            moved.append(SUMMARY_FILE)
        return moved

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        safe = re.sub(r"[^\w.-]+", "_", name)
        write_json_atomic(self.run_dir / f"{safe}.json", rows)

    def finish(self, exit_code: int) -> None:
        self._jsonl.close()


RUN_ID_FILE = "run_id.json"  # in <run dir>/wandb/: the run's wandb id and name
#: run_id.json's record of the run dir it was written in (its inode): a copy of the
#: run dir has another, a move on the same file system the same.
DIR_INODE = "run_dir_inode"


def recorded_wandb_run(run_dir: str | os.PathLike) -> dict | None:
    """The wandb run ``<run_dir>/wandb/run_id.json`` records (``id``, ``name``), or
    None: none, damaged, or written in another directory (a copy of the run dir,
    whose resume starts a wandb run of its own rather than logging into the
    original's; a line says so)."""
    path = Path(run_dir) / "wandb" / RUN_ID_FILE
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise ValueError("no wandb run id")
    except (OSError, ValueError):
        return None
    inode = record.get(DIR_INODE)
    if inode is not None and inode != os.stat(run_dir).st_ino:
        log.info(
            "wandb: %s is a copy of the run dir that started wandb run %s (%s "
            "records another directory): this run logs to a new wandb run",
            run_dir,
            record["id"],
            path,
        )
        return None
    return record


class WandbSink(Sink):
    """History, summary and tables of one wandb run, metrics in the ``train/`` and
    ``val/`` sections (:func:`wandb_key`).

    The run starts at :meth:`begin` (``start(resume)`` makes it), so a start that is
    refused (a resume that does not fit) or has nothing to train makes none; calls
    before it are kept and replayed. Its id and name are kept in
    ``<run dir>/wandb/run_id.json``: a resume from a checkpoint of the same run dir
    continues the same wandb run (``id`` + ``resume="allow"``) rather than starting
    another; a fresh start there is a new run (and its id replaces the file's).
    """

    def __init__(
        self, start: Callable[[dict | None], Any], run_dir: Path, x_axis: str = "step"
    ) -> None:
        self._start = start
        self.x_axis = x_axis  # logger.x_axis
        self.id_file = Path(run_dir) / "wandb" / RUN_ID_FILE
        self.run = None
        self._pending: list[tuple[str, tuple]] = []

    def begin(self, resumed: bool = False) -> None:
        if self.run is not None:
            return
        # a fresh start in a used run dir is a new wandb run, and so is a copy's
        resume = recorded_wandb_run(self.id_file.parent.parent) if resumed else None
        self.run = self._start(resume)
        if self.x_axis != "step":  # the training sections' charts over tokens seen
            axis = wandb_key(self.x_axis)
            self.run.define_metric(axis)
            for section in TRAINING_SECTIONS:
                self.run.define_metric(f"{section}*", step_metric=axis)
        if resume is None:
            self.id_file.parent.mkdir(parents=True, exist_ok=True)
            record = {"id": self.run.id, "name": self.run.name, "group": self.run.group}
            record[DIR_INODE] = os.stat(self.id_file.parent.parent).st_ino
            write_json_atomic(self.id_file, record)
        pending, self._pending = self._pending, []
        for method, args in pending:
            getattr(self, method)(*args)

    def _later(self, method: str, *args: Any) -> bool:
        if self.run is None:
            self._pending.append((method, args))
            return True
        return False

    def log(self, row: dict, step: int) -> None:
        if not self._later("log", row, step):
            self.run.log({wandb_key(k): v for k, v in row.items()}, step=step)

    def log_summary(self, summary: dict) -> None:
        """The run's summary is ours: wandb's own keeps each logged number's last
        value (a resumed run's from before the resume too), so a figure of the
        training sections that our summary leaves out (an omitted MFU: the last
        window had none) is removed rather than shown from an older window; texts
        (samples) and other sections (eval.py's) stay."""
        if self._later("log_summary", summary):
            return
        summary = {wandb_key(k): v for k, v in summary.items()}
        self.run.summary.update(summary)
        for key in sorted(set(self.run.summary.keys()) - summary.keys()):
            value = self.run.summary.get(key)
            if key.startswith(TRAINING_SECTIONS) and isinstance(value, int | float):
                del self.run.summary[key]

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        if self._later("log_table", name, rows, step):
            return
        import wandb

        columns = list(dict.fromkeys(k for r in rows for k in r))
        data = [[_table_cell(r.get(c)) for c in columns] for r in rows]
        # At the last logged step, so it never moves wandb's step counter past the
        # loop's next step (wandb drops rows logged with a smaller step).
        self.run.log({name: wandb.Table(columns=columns, data=data)}, step=step)

    def log_artifact(self, name: str, kind: str, directory: Path) -> None:
        if self._later("log_artifact", name, kind, directory):
            return
        import wandb

        # One per run (run-<id>-profile, as wandb names a run's tables); immutable:
        # the files are referenced where they are, not copied to a staging dir.
        artifact = wandb.Artifact(f"run-{self.run.id}-{name}", type=kind)
        for path in sorted(directory.iterdir()):  # add_dir would print a line
            if path.is_file():
                artifact.add_file(str(path), policy="immutable")
        self.run.log_artifact(artifact)

    def finish(self, exit_code: int) -> None:
        if self.run is not None:  # never begun: no run to end
            self.run.finish(exit_code=exit_code)


#: A measured peak this far (relative) from the planned one is warned about.
PLAN_DRIFT = 0.15

# The closing summary's figures: (summary key, label, format).
_CLOSING_FIGURES = (
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("tokens_seen", "tokens seen", "{:,}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("peak_mem_gib", "peak memory/rank", "{:.3f} GiB"),
)


def _this_attempts_speed(s: dict) -> tuple[dict, str]:
    """A resumed run's closing line gives this attempt's tokens/s and MFU, not the
    run's over earlier attempts (summary.json keeps those): where this attempt
    measured none (too few steps for a window past warm-up), they are left out and
    said so."""
    attempts = s.get("attempts") or []
    if len(attempts) < 2 or not isinstance(attempts[-1], dict):
        return s, ""
    this = attempts[-1]
    out = {k: v for k, v in s.items() if k not in ("tokens_per_s", "mfu")}
    if isinstance(this.get("tokens_per_s"), int | float):
        out["tokens_per_s"] = this["tokens_per_s"]
        if isinstance(this.get("mfu"), int | float):
            out["mfu"] = this["mfu"]
        return out, ""
    steps = this.get("end_step", 0) - this.get("start_step", 0)
    return out, (
        f", tokens/s not measured since the resume ({steps} steps, within warm-up; "
        "the earlier attempts' in summary.json)"
        if "tokens_per_s" in s
        else ""
    )


def _predicted_step(s: dict) -> str:
    """The planner's predicted step time against the measured one, for the closing
    line ('' where either is missing)."""
    predicted, measured = s.get("predicted_step_time_s"), s.get("step_time_s")
    if not isinstance(predicted, int | float) or not isinstance(measured, int | float):
        return ""
    return (
        f", step time predicted {predicted * 1e3:,.1f} ms, measured "
        f"{measured * 1e3:,.1f} ms ({measured / predicted - 1:+.0%})"
    )


class ConsoleSink(Sink):
    """At the end of a successful training run, the summary a user reads first."""

    def __init__(self, run_dir: str | os.PathLike, wandb_sync: str | None = None):
        self.run_dir = Path(run_dir)
        self.wandb_sync = wandb_sync  # an offline wandb run's files, to upload
        self._summary: dict = {}

    def log_summary(self, summary: dict) -> None:
        self._summary = summary

    def finish(self, exit_code: int) -> None:
        s = self._summary
        if exit_code != 0 or "loss" not in s:
            return  # failed, or not a training run (plan-only prints its own)
        # Other processes held the cores: tokens/s and MFU move with their load.
        busy = " (a busy machine: cpu_wait_max)" if contended(s) else ""
        s, speed_note = _this_attempts_speed(s)
        figures = ", ".join(
            (val_line(s) if key == "val_loss" else f"{label} {fmt.format(s[key])}")
            + (busy if key == "tokens_per_s" else "")
            for key, label, fmt in _CLOSING_FIGURES
            if isinstance(s.get(key), int | float)
            and not (key == "peak_mem_gib" and s.get("planned_peak_gib"))
        )
        figures += speed_note
        if isinstance(s.get("validation"), str):  # e.g. no validation split
            figures += f", validation {s['validation']}"
        early = s.get("early_stop")
        if isinstance(early, dict):  # trainer.early_stop_patience
            metric = early.get("metric", "val_loss")
            figures += (
                f", stopped early (best {metric} {early[f'best_{metric}']:.4f} at "
                f"step {early['best_step']})"
            )
        planned, measured = s.get("planned_peak_gib"), s.get("peak_mem_gib")
        drift = None
        if planned and isinstance(measured, int | float):
            drift = measured / planned - 1
            # the quantity both figures are: CUDA summaries carry the reserved peak
            of = (
                "CUDA max allocated"
                if "peak_reserved_gib" in s
                else "in use"
                if "peak_rss_gib" in s
                else "RSS high-water"
            )
            stage = s.get("planned_peak_pp_rank")
            worst = "" if stage is None else f" (worst stage: pp rank {stage})"
            figures += (
                f", peak memory/rank ({of}) planned {planned:.3f} GiB{worst}, "
                f"measured {measured:.3f} GiB ({drift:+.0%})"
            )
        figures += _predicted_step(s)
        took = f" in {s['wall_time_s']:.0f} s" if "wall_time_s" in s else ""
        attempts = s.get("attempts") or []
        if len(attempts) > 1:  # a resumed run: the whole run, then each attempt
            each = " + ".join(f"{a['wall_time_s']:.0f}" for a in attempts)
            took += f" ({len(attempts)} attempts: {each} s)"
        lines = [
            f"finished {s.get('steps', '?')} steps{took}: {figures}",
            f"outputs: {self.run_dir}",
        ]
        if self.wandb_sync:
            lines.append(f"upload to wandb: wandb sync {self.wandb_sync}")
        log.info("\n".join(lines))
        if drift is not None and abs(drift) > PLAN_DRIFT:
            log.warning(
                "the measured peak memory is %+.0f%% off the planner's estimate "
                "(more than %.0f%%): the planner misjudges this run (docs/planner.md)",
                100 * drift,
                100 * PLAN_DRIFT,
            )


class Logger:
    """Fans each call out to its sinks (none on ranks other than 0)."""

    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self.sinks = list(sinks)
        self._summary: dict = {}
        self._last_step = 0

    @classmethod
    def files(cls, run_dir: str | os.PathLike | None) -> Logger:
        """A logger of the run-dir files only (no sink at all if ``run_dir`` is None)."""
        return cls([FileSink(run_dir)] if run_dir is not None else [])

    def log(self, metrics: dict, step: int) -> None:
        """One row: ``{"step": step, **metrics}`` to every sink."""
        row = _plain(metrics)
        for sink in self.sinks:
            sink.log(row, step)
        self._last_step = max(self._last_step, step)

    def begin(self, resumed: bool = False) -> None:
        """The run trains: start what the sinks start late (the wandb run; the same
        one again when ``resumed`` from a checkpoint of this run dir). A logger built
        with ``begin=False`` keeps its calls until then (see WandbSink)."""
        for sink in self.sinks:
            sink.begin(resumed)

    def drop_rows_after(self, step: int) -> dict[str, int]:
        """Before a resume from ``step``: drop the rows the interrupted run logged
        past it, where a sink can (metrics.jsonl, metrics.csv); returns how many in
        each file (rows set aside as damaged are said apart, and not counted)."""
        dropped: dict[str, int] = {}
        for sink in self.sinks:
            dropped.update(sink.drop_rows_after(step))
        return dropped

    def set_aside_after(self, step: int, directory: str | os.PathLike) -> list[str]:
        """A resume branches at ``step``: each sink's rows past it (and the summary)
        move to ``directory`` (:meth:`Sink.set_aside_after`); returns what moved."""
        return [m for s in self.sinks for m in s.set_aside_after(step, Path(directory))]

    def log_summary(self, d: dict) -> None:
        """Final figures (val_loss, totals), merged into the run's summary."""
        self._summary.update(_plain(d))
        for sink in self.sinks:
            sink.log_summary(self._summary)

    def log_table(self, name: str, rows: list[dict]) -> None:
        """Rows of dicts (e.g. the wrap plan) as ``<name>.json`` and a wandb Table."""
        rows = [_plain(r) for r in rows]
        for sink in self.sinks:
            sink.log_table(name, rows, self._last_step)

    def log_artifact(self, name: str, kind: str, directory: str | os.PathLike) -> None:
        """The files of ``directory`` as one artifact (wandb; the files sink has
        them in the run dir already)."""
        for sink in self.sinks:
            sink.log_artifact(name, kind, Path(directory))

    def finish(self, exit_code: int = 0) -> None:
        """End every sink once (safe to call again); a non-zero ``exit_code`` marks
        the run failed (the wandb run too)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.finish(exit_code)

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)


def _row_step(line: bytes) -> float:
    try:
        step = json.loads(line.decode())["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf  # a torn last line (or a damaged one): dropped
    return (
        step
        if isinstance(step, int | float) and not isinstance(step, bool)
        else math.inf
    )


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
        "project": OmegaConf.select(cfg, "logger.project", default=None),
        "group": group,
        "name": name,
        "tags": list(tags) if tags else None,
    }


def wandb_dirs() -> list[tuple[str, str]]:
    """The directories outside the run dir that wandb writes to (even offline: its
    artifact staging and its core's logs), each with the environment variable that
    moves it; by default they are under HOME."""
    import platformdirs  # what wandb's own defaults are made with

    return [
        (var, os.environ.get(var) or default)
        for var, default in (
            ("WANDB_DATA_DIR", platformdirs.user_data_dir("wandb")),
            ("WANDB_CACHE_DIR", platformdirs.user_cache_dir("wandb")),
        )
    ]


def init_wandb(
    cfg: DictConfig,
    wandb_dir: str | os.PathLike,
    identity_dir: str | os.PathLike | None = None,
    **init_kwargs: Any,
):
    """Start a wandb run from the config's ``logger.*`` keys, its files in ``wandb_dir``.

    The one wandb setup: training runs and sweep summaries both start theirs here.
    Project, group, tags and name come from :func:`run_identity` of ``identity_dir``
    (default ``wandb_dir``); ``init_kwargs`` (name, job_type, config, ...) beat them.
    """
    mode = cfg.logger.mode
    if mode == "offline":
        os.environ["WANDB_MODE"] = "offline"
    # No crash reports to sentry, and wandb's files stay in the run dir.
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    os.environ["WANDB_DIR"] = str(wandb_dir)
    import wandb

    system_stats = bool(cfg.logger.system_stats)
    settings = wandb.Settings(
        # System metrics sampling also probes cloud metadata endpoints over HTTP.
        x_disable_stats=not system_stats,
        x_disable_machine_info=not system_stats,
        disable_git=True,
        save_code=False,
        silent=True,
    )
    kwargs = {
        **run_identity(cfg, identity_dir or wandb_dir),
        "config": OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False),
        **init_kwargs,
    }
    start = time.perf_counter()
    run = wandb.init(
        dir=str(wandb_dir),
        mode=mode,
        settings=settings,
        reinit="finish_previous",  # one run per Hydra job, also in a multirun process
        **kwargs,
    )
    log.debug("wandb.init (%s) took %.2fs", mode, time.perf_counter() - start)
    return run


def _wandb_sinks(cfg: DictConfig, run_dir: Path) -> list[Sink]:
    offline = cfg.logger.mode == "offline"
    sync = str(run_dir / "wandb" / "offline-run-*") if offline else None

    def start(resume: dict | None):
        if resume is None:
            return init_wandb(cfg, run_dir)
        # The same wandb run again: offline, a new offline-run-* dir with the same id
        # (`wandb sync` uploads them in order into one run); online, it continues.
        return init_wandb(
            cfg,
            run_dir,
            id=resume["id"],
            name=resume.get("name"),
            resume="allow",
            allow_val_change=True,  # trainer.resume, max_steps... may differ
        )

    # (a config recorded before the key: wandb's step)
    x_axis = OmegaConf.select(cfg, "logger.x_axis", default="step")
    return [ConsoleSink(run_dir, sync), WandbSink(start, run_dir, x_axis)]


# ------------------------------------------------------------- the logger options


#: ``logger.mode`` of the wandb logger (wandb's own modes).
WANDB_MODES = ("offline", "online", "disabled")
#: ``logger.x_axis``: the wandb charts' x-axis, wandb's step (the optimizer step) or
#: the ``tokens_seen`` figure (tokens trained on, across resumes).
WANDB_X_AXES = ("step", "tokens_seen")


@dataclass
class LoggerConfig:
    """The key every logger has; each option of the ``logger`` group picks its own
    schema (``schema/<logger>@_here_``), so a key of another logger is unknown."""

    backend: str = described(lambda: f"{or_list(LOGGERS)} (pick with logger=...)")


@dataclass
class WandbLoggerConfig(LoggerConfig):
    mode: str = described(f"wandb: {or_list(WANDB_MODES)}")
    project: str = described("wandb project")
    group: str | None = described("wandb group (null = none)")
    tags: list[str] = described("wandb tags ([a,b])")
    name: str | None = described("wandb run name (null = wandb's default)")
    system_stats: bool = described("wandb's CPU/GPU sampling (probes cloud metadata)")
    x_axis: str = described(f"wandb charts' x-axis: {or_list(WANDB_X_AXES)}")


def _check_wandb(logger: DictConfig) -> None:
    if logger.mode not in WANDB_MODES:
        raise ConfigError(
            "logger.mode",
            f"got {logger.mode!r}, expected one of: {', '.join(WANDB_MODES)}",
        )
    if logger.x_axis not in WANDB_X_AXES:
        raise ConfigError(
            "logger.x_axis",
            f"got {logger.x_axis!r}, expected one of: {', '.join(WANDB_X_AXES)}",
        )


@dataclass(frozen=True)
class LoggerOption:
    """One ``logger.backend``: its schema (the group's keys), the checks its types
    cannot say (``ConfigError`` naming the key, run by ``validate()``), and the sinks
    it adds to the run-dir files (console included)."""

    schema: type[LoggerConfig]
    sinks: Callable[[DictConfig, Path], list[Sink]]
    check: Callable[[DictConfig], None] = no_check
    #: Modules its sinks keep resident in rank 0's process (the planner's process
    #: baseline grows by their size: planner.IMPORT_BYTES).
    imports: tuple[str, ...] = ()


#: ``logger.backend`` -> its :class:`LoggerOption`. A new logger is one file that
#: calls ``LOGGERS.add`` (listed in src/trainer/__init__.py, which imports it) plus
#: its conf/logger/<name>.yaml; docs/architecture.md shows it step by step.
LOGGERS: Registry[LoggerOption] = Registry("logger")
LOGGERS.add(
    "wandb",
    LoggerOption(WandbLoggerConfig, _wandb_sinks, _check_wandb, imports=("wandb",)),
)
LOGGERS.add(
    "none", LoggerOption(LoggerConfig, lambda cfg, run_dir: [ConsoleSink(run_dir)])
)


def logger_kind(cfg: DictConfig) -> str:
    """``logger.backend`` (wandb where the config has no logger group)."""
    return str(OmegaConf.select(cfg, "logger.backend", default=None) or "wandb")


def logs_to_wandb(cfg: DictConfig) -> bool:
    """Whether a run of ``cfg`` logs to wandb (its logger is wandb, not disabled)."""
    mode = OmegaConf.select(cfg, "logger.mode", default=None)
    return logger_kind(cfg) == "wandb" and mode != "disabled"


def build_logger(
    cfg: DictConfig, run_dir: str | os.PathLike, rank: int, begin: bool = True
) -> Logger:
    """The run's logger: the run-dir files, and the sinks of ``logger.backend``
    (:data:`LOGGERS`). Ranks other than 0 get one without sinks. ``begin=False``:
    the wandb run starts only at ``Logger.begin()`` (the trainer calls it once a
    resume was accepted and there are steps to train)."""
    if rank != 0:
        return Logger()
    run_dir = Path(run_dir)
    kind = logger_kind(cfg)
    if kind not in LOGGERS:
        raise ValueError(
            f"unknown logger {kind!r}, expected one of: {', '.join(LOGGERS)}"
        )
    logger = Logger([FileSink(run_dir), *LOGGERS[kind].sinks(cfg, run_dir)])
    if begin:
        logger.begin()
    return logger
