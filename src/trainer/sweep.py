"""Sweeps: a job's objective and failure record, and the summary of a multirun.

``python train.py -m sharding.min_params=1e5,1e6 precision=fp32,bf16_mixed`` runs one
Hydra job per point. Each job goes through :func:`run_job`, which

- returns the job's *objective* (what a sweeper such as Optuna maximises): the run's
  ``tokens_per_s``; ``-(peak_mem_gib - cap)`` (negative) when the run's peak memory is
  above ``sweep.mem_cap_gib``; ``-inf`` when it failed;
- in a multirun, turns a failure (an exception, or the ``sys.exit`` with which the
  launcher reports a failed rank or a config error) into a ``failed`` record
  (``job_status.json`` in the job dir, with the error's first line) and returns
  ``-inf``, so the other jobs still run. Hydra's sweepers stop at a job that raises,
  and a ``SystemExit`` even ends the multirun process at once. A single run
  (``python train.py``) still exits non-zero as before.

At the end of a multirun the :class:`SweepSummary` callback (``hydra.callbacks`` in
``conf/hydra/callbacks/sweep_summary.yaml``) reads every job dir of the sweep and writes
``sweep_summary.csv``, ``sweep_summary.md`` and ``sweep_summary.png`` into the sweep
dir, and logs them to a wandb run of ``job_type="sweep-summary"`` in the sweep's group.
``python -m src.trainer.sweep <sweep dir>`` does the same for an existing sweep dir.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.trainer.faults import stopped_by_signal
from src.trainer.loggers import markdown_table, write_json_atomic

log = logging.getLogger(__name__)

STATUS_FILE = "job_status.json"
SUMMARY_STEM = "sweep_summary"  # .csv, .md, .png in the sweep dir
FAILED = float("-inf")
# The run's figures in the table, from its summary.json (see src/trainer/loop.py).
METRICS = (
    "tokens_per_s",
    "mfu",
    "peak_mem_gib",
    "init_peak_mem_gib",
    "loss",
    "val_loss",
    "wrap_units",
    "num_params",
    "wall_time_s",
)
# Markdown header and format of each figure.
_MD_FORMAT = {
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "mfu": ("MFU", "{:.2%}"),
    "peak_mem_gib": ("peak GiB", "{:.3f}"),
    "init_peak_mem_gib": ("init GiB", "{:.3f}"),
    "loss": ("loss", "{:.4f}"),
    "val_loss": ("val_loss", "{:.4f}"),
    "wrap_units": ("wrap units", "{:d}"),
    "wall_time_s": ("time s", "{:.1f}"),
}


# ---------------------------------------------------------------- one job


def is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def error_line(err: BaseException) -> str:
    """One line for the table: the error's first line or, for a traceback (a failed
    rank's report), its header and the exception's own line."""
    if isinstance(err, SystemExit):
        notes = getattr(err, "__notes__", None)
        if isinstance(err.code, str):
            text = err.code
        elif notes:  # a config error's one line (src/config.py exit_on_config_error)
            text = notes[0]
        elif err.__context__ is not None:  # sys.exit(n) inside an ``except``
            ctx = err.__context__
            text = f"{type(ctx).__name__}: {ctx}"
        else:
            text = f"exit status {err.code}"
    else:
        text = f"{type(err).__name__}: {err}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        return f"{lines[0].rstrip(':')}: {lines[-1]}"
    return lines[0]


def objective(summary: dict, mem_cap_gib: float | None = None) -> float:
    """The value a sweeper maximises: tokens/s; a run above the memory cap scores
    ``-(peak - cap)`` (below every run within it, better the closer it came); a run
    without a throughput figure (failed, plan-only) scores ``-inf``."""
    tps = summary.get("tokens_per_s")
    if not isinstance(tps, int | float) or not math.isfinite(tps):
        return FAILED
    peak = summary.get("peak_mem_gib")
    if mem_cap_gib is not None and isinstance(peak, int | float) and peak > mem_cap_gib:
        return -(peak - mem_cap_gib)
    return float(tps)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def skipped_line(needs_gib: float, budget_gib: float) -> str:
    return f"skipped: needs {needs_gib:.2f} GiB > budget {budget_gib:.2f} GiB"


def run_job(
    cfg: DictConfig,
    run_dir: str,
    fn: Callable[[], Any],
    precheck: Callable[[], tuple[float, float] | None] | None = None,
) -> float:
    """Run one Hydra job (``fn``: validate, launch the ranks, return the run's
    summary) and return its objective (from ``summary.json`` if ``fn`` returned none).

    In a multirun a failure is recorded in ``<run_dir>/job_status.json`` and scored
    ``-inf`` instead of stopping the sweep; outside one it propagates unchanged. A
    point that ``precheck`` (the planner's budget check) says cannot fit is not
    launched: it is recorded as ``skipped`` and scored ``-(needed - budget)``.
    """
    multirun = is_multirun()
    status_file = Path(run_dir) / STATUS_FILE
    try:
        over = precheck() if precheck is not None and multirun else None
        if over is not None:
            needs, budget = over
            line = skipped_line(needs, budget)
            log.warning("job %s", line)
            record = {"status": "skipped", "error": line, "needs_gib": needs}
            write_json_atomic(status_file, {**record, "budget_gib": budget})
            return -(needs - budget)
        summary = fn()
    except (Exception, SystemExit) as err:
        summary = None
        if isinstance(err, SystemExit) and err.code in (None, 0):
            pass  # a clean exit is a finished job
        elif not multirun or stopped_by_signal(err):
            raise  # a stop signal ends the whole sweep, not just this job
        else:
            line = error_line(err)
            if isinstance(err, SystemExit):  # a failed rank's report, or a config error
                log.error(
                    "job failed: %s", err.code if isinstance(err.code, str) else line
                )
            else:
                log.error("job failed: %s", line, exc_info=err)
            write_json_atomic(status_file, {"status": "failed", "error": line})
            return FAILED
    cap = OmegaConf.select(cfg, "sweep.mem_cap_gib", default=None)
    if summary is None:  # plan-only, or a job function that returns nothing
        summary = _read_json(Path(run_dir) / "summary.json")
    value = objective(summary, cap)
    if multirun:
        write_json_atomic(
            status_file, {"status": "completed", "objective": value, "mem_cap_gib": cap}
        )
    return value


# ------------------------------------------------------------ the summary


def _job_num(job_dir: Path) -> float:
    try:
        num = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra.job.num
        return int(num)
    except Exception:
        return int(job_dir.name) if job_dir.name.isdigit() else math.inf


def job_dirs(sweep_dir: str | os.PathLike) -> list[Path]:
    """The sweep's job dirs (each holds ``.hydra/overrides.yaml``), by job number."""
    sweep_dir = Path(sweep_dir)
    found = {
        p.parent.parent
        for p in sweep_dir.glob("**/.hydra/overrides.yaml")
        if p.parent.parent != sweep_dir
    }
    return sorted(found, key=lambda d: (_job_num(d), str(d)))


def _overrides(job_dir: Path) -> dict[str, str]:
    items = OmegaConf.to_container(
        OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
    )
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        out[key] = value if sep else ""
    return out


def swept_keys(overrides: Sequence[dict[str, str]]) -> list[str]:
    """The override keys whose value differs between jobs (all of one job's keys if
    there is a single job or none differ)."""
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    varied = [k for k in keys if len({o.get(k) for o in overrides}) > 1]
    return varied or keys


def _job_config(job_dir: Path) -> DictConfig:
    try:
        return OmegaConf.load(job_dir / ".hydra" / "config.yaml")
    except OSError:
        return OmegaConf.create()


def collect(sweep_dir: str | os.PathLike) -> tuple[list[str], list[dict]]:
    """The swept keys and one row per job: its swept values, status, figures, error.

    Status: ``completed``; ``over_mem_cap`` (completed, peak memory above
    ``sweep.mem_cap_gib``); ``failed`` (with ``error``); ``skipped`` (the planner
    said it cannot fit the budget; ``error`` says by how much); ``unknown`` (no
    record and no summary: still running, or killed). The best row (``best``) is the completed
    one with the highest tokens/s.
    """
    dirs = job_dirs(sweep_dir)
    overrides = [_overrides(d) for d in dirs]
    keys = swept_keys(overrides)
    rows = []
    for job_dir, ovr in zip(dirs, overrides, strict=True):
        summary = _read_json(job_dir / "summary.json")
        record = _read_json(job_dir / STATUS_FILE)
        status = record.get("status") or ("completed" if summary else "unknown")
        if status in ("failed", "skipped"):
            summary = {}  # figures of a failed run are partial
        cap = OmegaConf.select(_job_config(job_dir), "sweep.mem_cap_gib", default=None)
        peak = summary.get("peak_mem_gib")
        if status == "completed" and cap is not None and peak is not None:
            status = "over_mem_cap" if peak > cap else status
        num = _job_num(job_dir)
        row = {
            "job": num if num != math.inf else job_dir.name,
            **{k: ovr.get(k, "") for k in keys},
            "status": status,
            **{m: summary.get(m) for m in METRICS},
            "best": False,
            "error": record.get("error", ""),
            "job_dir": str(job_dir),
        }
        rows.append(row)
    ok = [r for r in rows if r["status"] == "completed" and r["tokens_per_s"]]
    if ok:
        max(ok, key=lambda r: r["tokens_per_s"])["best"] = True
    return keys, rows


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _cell(metric: str, value: Any) -> str:
    if value is None:
        return ""
    fmt = _MD_FORMAT[metric][1]
    try:
        return fmt.format(int(value) if fmt == "{:d}" else value)
    except (TypeError, ValueError):
        return str(value)


def summary_table(keys: list[str], rows: list[dict]) -> str:
    """The summary as a Markdown table; the best row's tokens/s is in bold."""
    with_error = any(r["error"] for r in rows)
    table = []
    for r in rows:
        cells = {"job": r["job"], **{k: r[k] for k in keys}, "status": r["status"]}
        for m, (header, _) in _MD_FORMAT.items():
            text = _cell(m, r[m])
            cells[header] = f"**{text}**" if m == "tokens_per_s" and r["best"] else text
        if with_error:
            cells["error"] = r["error"]
        table.append(cells)
    return markdown_table(table) + "\n"


def _short(value: str) -> str:
    try:
        return f"{float(value):g}"
    except ValueError:
        return value


def plot(path: Path, keys: list[str], rows: list[dict], mem_cap: float | None) -> None:
    """Throughput (top) and peak / init memory (bottom) of every job against its swept
    values; the best job is a star, a failed one a red cross at zero."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    numeric = len(keys) == 1
    if numeric:
        try:
            xs = [float(r[keys[0]]) for r in rows]
        except ValueError:
            numeric = False
    if not numeric:
        xs = list(range(len(rows)))
    labels = [
        "\n".join(f"{k.rpartition('.')[2]}={_short(r[k])}" for k in keys) for r in rows
    ]
    fig = Figure(figsize=(max(6.4, 1.2 * len(rows) + 2), 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tps, ax_mem = fig.subplots(2, 1, sharex=True)
    ok = [i for i, r in enumerate(rows) if r["tokens_per_s"] is not None]

    def series(metric: str) -> tuple[list, list]:
        idx = [i for i in ok if rows[i][metric] is not None]
        order = sorted(idx, key=lambda i: xs[i])
        return [xs[i] for i in order], [rows[i][metric] for i in order]

    style = {"marker": "o", "linestyle": "-" if numeric else "none"}
    ax_tps.plot(*series("tokens_per_s"), **style, label="tokens/s")
    ax_mem.plot(*series("peak_mem_gib"), **style, label="peak memory")
    ax_mem.plot(
        *series("init_peak_mem_gib"), **{**style, "marker": "s"}, label="init peak"
    )
    for i, r in enumerate(rows):
        if r["status"] in ("failed", "skipped", "unknown"):
            for ax in (ax_tps, ax_mem):
                ax.plot(xs[i], 0, "x", color="tab:red", ms=10, mew=2, clip_on=False)
            ax_tps.annotate(
                r["status"], (xs[i], 0), textcoords="offset points", xytext=(0, 8),
                ha="center", color="tab:red",
            )  # fmt: skip
        if r["best"]:
            star = {"marker": "*", "ms": 18, "color": "gold", "mec": "k", "zorder": 5}
            ax_tps.plot(
                xs[i], r["tokens_per_s"], **star, linestyle="none", label="best"
            )
            if r["peak_mem_gib"] is not None:
                ax_mem.plot(xs[i], r["peak_mem_gib"], **star)
            ax_tps.annotate(
                f"best: {r['tokens_per_s']:,.0f} tok/s", (xs[i], r["tokens_per_s"]),
                textcoords="offset points", xytext=(0, -18), ha="center",
            )  # fmt: skip
    if mem_cap is not None:
        ax_mem.axhline(mem_cap, color="tab:red", linestyle="--", label="mem cap")
    ax_tps.set_ylabel("tokens/s (global)")
    ax_mem.set_ylabel("GiB (max over ranks)")
    if numeric:
        positive = [x for x in xs if x > 0]
        if len(positive) == len(xs) and max(xs) / min(xs) >= 100:
            ax_mem.set_xscale("log")
        ax_mem.set_xlabel(keys[0])
    else:
        ax_mem.set_xticks(xs, labels, fontsize=8)
        ax_mem.set_xlabel(", ".join(keys))
    for ax in (ax_tps, ax_mem):
        ax.margins(x=0.1, y=0.15)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"sweep: {path.parent.name} ({len(rows)} jobs)")
    fig.savefig(path, dpi=110)


def _log_to_wandb(
    sweep_dir: Path, rows: list[dict], png: Path | None, first_job: Path
) -> str | None:
    """A ``sweep-summary`` run in the sweep's wandb group (the group of its jobs'
    runs); nothing if the jobs log with ``logger=none``. Returns the run's dir."""
    from src.trainer.loggers import init_wandb, run_identity

    cfg = _job_config(first_job)
    if str(OmegaConf.select(cfg, "logger.backend", default="wandb")) != "wandb":
        return None
    if OmegaConf.select(cfg, "logger.mode", default=None) == "disabled":
        return None
    import wandb

    group = run_identity(cfg, first_job)["group"]
    run = init_wandb(
        OmegaConf.merge(cfg, {"logger": {"system_stats": False}}),
        sweep_dir,
        identity_dir=first_job,
        name=f"{group}:summary",
        job_type="sweep-summary",
        config={"sweep_dir": str(sweep_dir), "jobs": len(rows)},
    )
    columns = [c for c in rows[0] if c != "job_dir"]
    data = [
        [r[c] if r[c] is None or isinstance(r[c], bool | int | float | str) else str(r[c])
         for c in columns]
        for r in rows
    ]  # fmt: skip
    payload: dict[str, Any] = {"sweep_summary": wandb.Table(columns=columns, data=data)}
    if png is not None:
        payload["sweep_plot"] = wandb.Image(str(png))
    run.log(payload)
    best = next((r for r in rows if r["best"]), None)
    run.summary.update(
        {
            "jobs": len(rows),
            "failed": sum(r["status"] == "failed" for r in rows),
            "skipped": sum(r["status"] == "skipped" for r in rows),
            **({f"best/{m}": best[m] for m in METRICS} if best else {}),
            **({"best/job": best["job"]} if best else {}),
        }
    )
    run_dir = run.dir
    run.finish()
    return run_dir


def summarise(
    sweep_dir: str | os.PathLike, *, log_wandb: bool = True, make_plot: bool = True
) -> list[dict]:
    """Write ``sweep_summary.{csv,md,png}`` into ``sweep_dir`` from its job dirs, log
    them to wandb (unless ``log_wandb`` is false or the jobs used ``logger=none``) and
    return the rows."""
    sweep_dir = Path(sweep_dir)
    keys, rows = collect(sweep_dir)
    if not rows:
        log.warning("sweep summary: no job dirs under %s", sweep_dir)
        return rows
    stem = sweep_dir / SUMMARY_STEM
    write_csv(stem.with_suffix(".csv"), rows)
    table = summary_table(keys, rows)
    stem.with_suffix(".md").write_text(table)
    png = None
    if make_plot:
        png = stem.with_suffix(".png")
        caps = {
            OmegaConf.select(_job_config(Path(r["job_dir"])), "sweep.mem_cap_gib")
            for r in rows
        } - {None}
        plot(png, keys, rows, min(caps) if caps else None)
    log.info("sweep summary (%s.{csv,md,png}):\n%s", stem, table)
    if log_wandb:
        _log_to_wandb(sweep_dir, rows, png, Path(rows[0]["job_dir"]))
    return rows


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, :func:`summarise` its sweep dir.

    ``on_job_end`` also records a job whose exception reached Hydra (a task function
    that does not use :func:`run_job`) as failed, so the summary shows it.
    """

    def __init__(self, wandb: bool = True, plot: bool = True) -> None:
        self.wandb = wandb
        self.plot = plot

    def on_job_end(
        self, config: DictConfig, job_return: JobReturn, **kwargs: Any
    ) -> None:
        mode = OmegaConf.select(config, "hydra.mode", default=None)
        if job_return.status != JobStatus.FAILED or mode != RunMode.MULTIRUN:
            return
        run_dir = OmegaConf.select(config, "hydra.runtime.output_dir", default=None)
        if run_dir and Path(run_dir).is_dir():
            err = job_return._return_value
            line = error_line(err) if isinstance(err, BaseException) else str(err)
            write_json_atomic(
                Path(run_dir) / STATUS_FILE, {"status": "failed", "error": line}
            )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summarise(config.hydra.sweep.dir, log_wandb=self.wandb, make_plot=self.plot)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write (again) the summary table, plot and wandb run of a sweep dir."
    )
    parser.add_argument("sweep_dir")
    parser.add_argument("--no-wandb", action="store_true", help="files only")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    summarise(args.sweep_dir, log_wandb=not args.no_wandb, make_plot=not args.no_plot)


if __name__ == "__main__":
    main()
