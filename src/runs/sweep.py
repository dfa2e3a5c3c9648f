"""Sweeps: a job's objective and failure record, and the summary of a multirun.

``python train.py -m sharding.min_params=1e5,1e6 precision=fp32,bf16_mixed`` runs one
Hydra job per point. Each job goes through :func:`run_job`, which

- returns the job's *objective* (what a sweeper such as Optuna optimises):
  ``sweep.objective`` of the run's summary (``val_loss`` by default, or ``loss``,
  ``tokens_per_s``) in ``sweep.direction`` (min for losses, max for tokens/s); a run
  whose peak memory is above ``sweep.mem_cap_gib`` or that failed scores worse than
  every other (see :func:`objective`);
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
``python -m src.runs.sweep <sweep dir>`` does the same for an existing sweep dir.
"""

from __future__ import annotations

import argparse
import csv
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

from src.checkpoint.folders import complete_checkpoints, run_checkpoints
from src.config.schema import objective_direction
from src.data.pinning import DATA_RECORD
from src.errors import ConfigError
from src.files import read_json, read_yaml, write_json_atomic
from src.observe.keys import (
    is_task_metric,
    source_of,
    source_val_key,
    source_val_losses,
)
from src.observe.metrics import CONTENDED, contended
from src.runs.evaluation import task_columns
from src.runs.resume import checkpoint_config, differences
from src.runs.sweep_plan import job_number, never_ran, plan_jobs, swept_keys
from src.text import markdown_table
from src.trainer.faults import late_stop, stop_before_start, stopped_by_signal

log = logging.getLogger(__name__)

STATUS_FILE = "job_status.json"
SUMMARY_STEM = "sweep_summary"  # .csv, .md, .png in the sweep dir
FAILED = float("-inf")
# The run's figures in the table, from its summary.json (see src/trainer/loop.py).
METRICS = (
    "tokens_seen",
    "tokens_per_s",
    "mfu",
    "peak_mem_gib",
    "init_peak_mem_gib",
    "loss",
    "val_loss",
    "wrap_units",
    "num_params",
    "wall_time_s",
    "cpu_wait_max",
    "probe_cpu_wait",
)
#: Figures that other processes' load on the machine moves (marked in the table).
SPEED = ("tokens_per_s", "mfu")
# Markdown header and format of each figure.
_MD_FORMAT = {
    "tokens_seen": ("tokens", "{:,}"),
    "tokens_per_s": ("tokens/s", "{:,.0f}"),
    "mfu": ("MFU", "{:.2%}"),
    "peak_mem_gib": ("peak GiB", "{:.3f}"),
    "init_peak_mem_gib": ("init GiB", "{:.3f}"),
    "loss": ("loss", "{:.4f}"),
    "val_loss": ("val_loss", "{:.4f}"),
    "wrap_units": ("wrap units", "{:d}"),
    "wall_time_s": ("time s", "{:.1f}"),
}


#: Under a table with marked rows.
CONTENDED_NOTE = (
    f"\\* measured while other processes held the machine's cores (a window or the "
    f"MFU probe waited for a core more than {CONTENDED:.0%} of the time: "
    "cpu_wait_max, probe_cpu_wait): tokens/s and MFU move with that load; compare "
    "them with runs measured under the same load"
)
MFU_NA_NOTE = (
    "MFU n/a: the run logged none (its achieved FLOP/s exceeded the peak its probe "
    "measured, a probe taken on a busy machine, or trainer.peak_tflops set too low; "
    "or no peak is known for its device)"
)

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
        elif notes:  # a config error's one line (src/config/cli.py)
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


def objective_of(cfg: DictConfig | None) -> tuple[str, str]:
    """``(sweep.objective, its direction)`` of a job's config (the defaults for none)."""
    name = OmegaConf.select(cfg, "sweep.objective", default=None) if cfg else None
    name = name or "val_loss"
    direction = OmegaConf.select(cfg, "sweep.direction", default=None) if cfg else None
    return name, direction or objective_direction(name)


def check_objective(cfg: DictConfig) -> None:
    """A sweep job that cannot have its objective is refused before it runs (a
    ``ConfigError`` naming the key that removes it): ``val_loss`` needs a validation
    split and validations (else every job would score the worst value)."""
    name, _ = objective_of(cfg)
    if name != "val_loss" or cfg.trainer.plan_only:  # a plan-only sweep trains none
        return
    fraction = OmegaConf.select(cfg, "data.val_fraction", default=None)
    for key, value in (
        ("data.val_fraction", fraction),
        ("trainer.val_every", cfg.trainer.val_every),
        ("trainer.val_batches", cfg.trainer.val_batches),
    ):
        if value == 0:
            raise ConfigError(
                key,
                "0 gives no val_loss, the sweep's objective (sweep.objective="
                f"val_loss): set {key} > 0, or sweep.objective=loss",
            )


def worst(direction: str) -> float:
    """The score of a failed job: below (max) or above (min) every real one."""
    return FAILED if direction == "max" else -FAILED


def objective(
    summary: dict,
    mem_cap_gib: float | None = None,
    name: str = "val_loss",
    direction: str | None = None,
) -> float:
    """The value a sweeper optimises: ``summary[name]`` (``sweep.objective``), to be
    minimised or maximised (``direction``, default the objective's own). A run
    without that figure (failed, plan-only, no validation) scores the worst value,
    ``-inf`` when maximising and ``+inf`` when minimising. A run above the memory cap
    scores below every run within it: ``-(peak - cap)`` when maximising a figure that
    is never negative (tokens/s; better the closer it came), ``+inf`` when minimising.
    """
    direction = direction or objective_direction(name)
    value = summary.get(name)
    if not isinstance(value, int | float) or not math.isfinite(value):
        return worst(direction)
    peak = summary.get("peak_mem_gib")
    if mem_cap_gib is not None and isinstance(peak, int | float) and peak > mem_cap_gib:
        return -(peak - mem_cap_gib) if direction == "max" else worst(direction)
    return float(value)


def _read_json(path: Path) -> dict:
    """The JSON object in ``path`` ({} if there is none); a damaged one is left out
    with a line naming it."""
    if not path.exists():
        return {}
    try:
        data = read_json(path)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        log.warning("%s is damaged (%s): left out", path, exc)
        return {}
    return data


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
    name, direction = objective_of(cfg)
    if multirun and late_stop():  # it came as the last job completed
        log.warning("%s", never_ran(late_stop(), job_number()))
        raise SystemExit(128 + late_stop())
    if multirun:
        stop_before_start()  # the last job's run had its own handler
    try:
        over = precheck() if precheck is not None and multirun else None
        if over is not None:
            needs, budget = over
            line = skipped_line(needs, budget)
            log.warning("job %s", line)
            record = {"status": "skipped", "error": line, "needs_gib": needs}
            write_json_atomic(status_file, {**record, "budget_gib": budget})
            return -(needs - budget) if direction == "max" else worst(direction)
        summary = fn()
    except (Exception, SystemExit) as err:
        summary = None
        if isinstance(err, SystemExit) and err.code in (None, 0):
            pass  # a clean exit is a finished job
        elif not multirun:
            raise
        elif stopped_by_signal(err):  # it ends the whole sweep, not just this job
            log.warning("%s", never_ran(err.code - 128, job_number() + 1))
            raise
        else:
            line = error_line(err)
            if isinstance(err, SystemExit):  # a failed rank's report, or a config error
                log.error(
                    "job failed: %s", err.code if isinstance(err.code, str) else line
                )
            else:
                log.error("job failed: %s", line, exc_info=err)
            write_json_atomic(status_file, {"status": "failed", "error": line})
            return worst(direction)
    cap = OmegaConf.select(cfg, "sweep.mem_cap_gib", default=None)
    if not summary:  # plan-only, nothing left to train, or no summary returned
        summary = _read_json(Path(run_dir) / "summary.json")
    value = objective(summary, cap, name, direction)
    if multirun:
        record = {"status": "completed", "objective": value, "mem_cap_gib": cap}
        record.update(objective_name=name, direction=direction)
        write_json_atomic(status_file, record)
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
    """The job's command-line overrides; ValueError naming the file if damaged."""
    items = read_yaml(job_dir / ".hydra" / "overrides.yaml", "list")
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        out[key] = value if sep else ""
    return out


def _job_config(job_dir: Path) -> DictConfig:
    try:
        return read_yaml(job_dir / ".hydra" / "config.yaml")
    except ValueError:  # missing or damaged: the job's row says what it can
        return OmegaConf.create()


def effective_config(run_dir: Path) -> DictConfig:
    """The config a run ended with: its latest checkpoint's (a resume may change
    ``trainer.max_steps``, the batch, ...), else its record's."""
    for checkpoint in reversed(complete_checkpoints(run_checkpoints(run_dir))):
        config = checkpoint_config(checkpoint)
        if config is not None:
            return OmegaConf.create(config)
    return _job_config(run_dir)


def resumed_changes(run_dir: Path, config: DictConfig) -> dict[str, str]:
    """``{key: value}`` of what the run's resumes changed: ``config`` (its
    :func:`effective_config`) against its record, as overrides are written."""
    return {
        key: override_text(after)
        for key, _, after in differences(_job_config(run_dir), config)
    }


def override_text(value: Any) -> str:
    """``value`` as a command line writes it (``true``, ``null``, ``0.1``)."""
    if isinstance(value, bool) or value is None:
        return OmegaConf.to_yaml({"v": value}).split(": ", 1)[1].strip()
    return str(value)


def collect(
    sweep_dir: str | os.PathLike,
) -> tuple[list[str], list[dict], tuple[str, str]]:
    """The swept keys and one row per job: its swept values, status, figures, error.

    Status: ``completed``; ``over_mem_cap`` (completed, peak memory above
    ``sweep.mem_cap_gib``); ``failed`` (with ``error``); ``skipped`` (the planner
    said it cannot fit the budget; ``error`` says by how much); ``unknown`` (no
    record and no summary: still running, or killed). The best row (``best``) is the
    completed one with the best ``sweep.objective`` in ``sweep.direction`` (of the
    first job's config), returned as the third item ``(objective, direction)``.
    """
    return collect_dirs(job_dirs(sweep_dir))


def collect_dirs(
    dirs: Sequence[Path],
    names: Sequence[str] | None = None,
    goal: tuple[str, str] | None = None,
) -> tuple[list[str], list[dict], tuple[str, str]]:
    """:func:`collect` of the run dirs ``dirs`` (one sweep's jobs, or runs compared by
    src/runs/compare.py); ``names``: each row's ``job`` (default: the job number);
    ``goal``: the ``(figure, direction)`` the best row has (default: the first run's
    objective). Each run is described as it ended: its overrides with what its
    resumes changed (:func:`resumed_changes`), and a run that did not set a key of
    the table shows the value it ran with (:func:`effective_config`). Runs of
    different tokenizers are not ranked (no ``best``; a warning says why) and get a
    ``tokenizer`` column."""
    overrides, configs, damaged = [], [], {}
    for d in dirs:
        configs.append(effective_config(d))
        try:
            overrides.append(_overrides(d))
        except ValueError as err:  # the row says so; the other rows stand
            overrides.append({})
            damaged[d] = str(err)
        overrides[-1].update(resumed_changes(d, configs[-1]))
    keys = swept_keys(overrides)
    tokenizers = [tokenizer_label(d) for d in dirs]
    if len(set(tokenizers)) > 1:
        keys.append("tokenizer")
    rows = []
    for i, (job_dir, ovr) in enumerate(zip(dirs, overrides, strict=True)):
        summary = _read_json(job_dir / "summary.json")
        record = _read_json(job_dir / STATUS_FILE)
        status = record.get("status") or ("completed" if summary else "unknown")
        if status in ("failed", "skipped"):
            summary = {}  # figures of a failed run are partial
        config = configs[i]
        cap = OmegaConf.select(config, "sweep.mem_cap_gib", default=None)
        peak = summary.get("peak_mem_gib")
        if status == "completed" and cap is not None and peak is not None:
            status = "over_mem_cap" if peak > cap else status
        num = _job_num(job_dir)
        if names is not None:
            num = names[i]
        ovr = {**ovr, "tokenizer": tokenizers[i]}
        row = {
            "job": num if num != math.inf else job_dir.name,
            **{k: ovr[k] if k in ovr else _ran_with(job_dir, config, k) for k in keys},
            "status": status,
            **{m: summary.get(m) for m in METRICS},
            **{source_val_key(n): v for n, v in source_val_losses(summary).items()},
            **task_columns(job_dir, summary),
            "best": False,
            "error": damaged.get(job_dir) or record.get("error", ""),
            "job_dir": str(job_dir),
        }
        rows.append(row)
    rows = _same_columns(rows)
    goal = goal or objective_of(configs[0] if dirs else None)
    best = best_row(rows, *goal) if len(set(tokenizers)) <= 1 else None
    if best is not None:
        best["best"] = True
    if len(set(tokenizers)) > 1:
        counts = {t: tokenizers.count(t) for t in dict.fromkeys(tokenizers)}
        log.warning(
            "no best run marked: the runs use different tokenizers (%s), so their "
            "losses and tokens/s do not compare",
            "; ".join(f"{t}: {n} run(s)" for t, n in counts.items()),
        )
    return keys, rows, goal


def tokenizer_label(run_dir: Path) -> str:
    """What the run's tokens are, as one label: its ``data.json`` (the tokenizer and
    its vocabulary; a trained BPE also by its file) or, without one, its recorded
    ``data`` config (``data.tokenizer``, or the source for tokens without one)."""
    record = _read_json(run_dir / DATA_RECORD)
    config = _job_config(run_dir)
    name = record.get("tokenizer") or _select(config, "data.tokenizer")
    if name is None:
        return str(_select(config, "data.name") or "unknown")
    vocab = record.get("vocab_size")
    if vocab is None and name == "bpe":
        vocab = _select(config, "data.bpe_vocab_size")
    label = f"{name} ({vocab} tokens)" if vocab is not None else str(name)
    file = record.get("tokenizer_file")
    return f"{label} {Path(file).name}" if name == "bpe" and file else label


def _select(config: DictConfig, key: str) -> Any:
    """``key`` of a recorded config (None if it has none, or it is not a value)."""
    value = OmegaConf.select(config, key, default=None, throw_on_missing=False)
    return None if OmegaConf.is_config(value) else value


def _ran_with(job_dir: Path, config: DictConfig, key: str) -> str:
    """The value a run that did not set ``key`` ran with: a group's option (the
    run's ``hydra.runtime.choices``) or the key's value in its recorded config ("" if
    it has no such key, as a GPT run has no ``model.n_layers``)."""
    key = key.lstrip("+~")
    if "." not in key:
        try:
            hydra = read_yaml(job_dir / ".hydra" / "hydra.yaml")
        except ValueError:
            hydra = OmegaConf.create()
        choice = OmegaConf.select(hydra, f"hydra.runtime.choices.{key}", default=None)
        if isinstance(choice, str):
            return choice
    value = _select(config, key)
    return "" if value is None else override_text(value)


def best_row(rows: list[dict], name: str, direction: str) -> dict | None:
    """The completed row with the best finite ``name`` in ``direction`` (None if no
    completed row has that figure)."""
    ok = [
        r
        for r in rows
        if r["status"] == "completed"
        and isinstance(r.get(name), int | float)
        and math.isfinite(r[name])
    ]
    if not ok:
        return None
    pick = max if direction == "max" else min
    return pick(ok, key=lambda r: r[name])


def _same_columns(rows: list[dict]) -> list[dict]:
    """The rows with every per-source validation loss any of them has (a mixture's,
    ``val/<source>/loss``) and every task metric (``eval/<task>/<metric>``), None
    where a run has none, after ``val_loss``."""
    sources = list(
        dict.fromkeys(k for r in rows for k in r if source_of(k) or is_task_metric(k))
    )
    out = []
    for r in rows:
        base = {k: v for k, v in r.items() if k not in sources}
        at = list(base).index("val_loss") + 1
        items = list(base.items())
        out.append(dict(items[:at] + [(k, r.get(k)) for k in sources] + items[at:]))
    return out


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


def summary_table(keys: list[str], rows: list[dict], goal: str = "val_loss") -> str:
    """The summary as a Markdown table; the best row's ``goal`` (the objective) is in
    bold."""
    with_error = any(r["error"] for r in rows)
    table, marked, no_mfu = [], False, False
    for r in rows:
        cells = {"job": r["job"], **{k: r[k] for k in keys}, "status": r["status"]}
        for m, (header, _) in _MD_FORMAT.items():
            text = _cell(m, r[m])
            if m == "mfu" and not text and r.get("tokens_per_s") is not None:
                text, no_mfu = "n/a", True  # measured speed, no MFU: say why below
            cells[header] = f"**{text}**" if m == goal and r["best"] and text else text
            if m in SPEED and text and contended(r):
                cells[header], marked = f"{cells[header]} \\*", True
        for key in filter(source_of, r):  # a mixture's (None: a run without it)
            cells[f"val {source_of(key)}"] = _cell("val_loss", r[key])
        if with_error:
            cells["error"] = r["error"]
        table.append(cells)
    notes = [CONTENDED_NOTE] * marked + [MFU_NA_NOTE] * no_mfu
    return markdown_table(table) + "".join(f"\n\n{n}" for n in notes) + "\n"


def _short(value: str) -> str:
    try:
        return f"{float(value):g}"
    except ValueError:
        return value


def _positions(values: list[str]) -> tuple[list[float], bool]:
    """x of each value: the numbers themselves when all are numeric, else the index
    of each distinct value in order of appearance; and whether they are numeric."""
    try:
        return [float(v) for v in values], True
    except ValueError:
        order = list(dict.fromkeys(values))
        return [float(order.index(v)) for v in values], False


# The plot's panels: (row figures, y label); the objective's panel gets the star label.
_PANELS = (
    ((("val_loss", "o"), ("loss", "^")), "loss"),
    ((("tokens_per_s", "o"),), "tokens/s (global)"),
    ((("peak_mem_gib", "o"), ("init_peak_mem_gib", "s")), "GiB (max over ranks)"),
)


def plot(
    path: Path,
    keys: list[str],
    rows: list[dict],
    mem_cap: float | None,
    goal: tuple[str, str] = ("val_loss", "min"),
):
    """Loss (val_loss and the last step's loss), throughput and peak / init memory of
    every job. x is the first swept key (a numeric, log when wide, axis if its values
    are numbers); the points are coloured by the other swept keys (by the first when
    it is the only one), one line per colour. The best job by the objective
    (``goal``) is a gold star on every panel; a failed one a red cross at zero.
    Returns the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    xkey = keys[0] if keys else "job"
    xs, numeric = _positions([str(r.get(xkey, r["job"])) for r in rows])
    colour_keys = keys[1:] or keys[:1]
    groups = [
        ", ".join(f"{k.rpartition('.')[2]}={_short(str(r[k]))}" for k in colour_keys)
        for r in rows
    ]
    colours = {g: f"C{n % 10}" for n, g in enumerate(dict.fromkeys(groups))}
    fig = Figure(figsize=(max(6.4, 0.8 * len(rows) + 3), 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(_PANELS), 1, sharex=True)
    _plot_series(axes, rows, xs, groups, colours)
    name, direction = goal
    _mark_failed_and_best(axes, rows, xs, name, direction)
    if mem_cap is not None:
        axes[-1].axhline(mem_cap, color="tab:red", linestyle="--", label="mem cap")
    if numeric:
        positive = [x for x in xs if x > 0]
        if len(positive) == len(xs) and max(xs) / min(xs) >= 100:
            axes[-1].set_xscale("log")
    else:
        ticks = dict(zip(xs, (str(r.get(xkey, r["job"])) for r in rows), strict=True))
        axes[-1].set_xticks(list(ticks), [_short(v) for v in ticks.values()])
    axes[-1].set_xlabel(xkey)
    for ax in axes:
        ax.margins(x=0.1, y=0.15)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(
        f"sweep: {path.parent.name} ({len(rows)} jobs; objective {direction} {name})"
    )
    fig.savefig(path, dpi=110)
    return fig


def _plot_series(
    axes, rows: list[dict], xs: list[float], groups: list[str], colours: dict
) -> None:
    """Each panel's figures, one line per colour group, in x order."""
    for ax, (figures, ylabel) in zip(axes, _PANELS, strict=True):
        for group, colour in colours.items():
            for metric, marker in figures:
                idx = sorted(
                    (i for i, r in enumerate(rows) if groups[i] == group),
                    key=lambda i: xs[i],
                )
                idx = [i for i in idx if isinstance(rows[i][metric], int | float)]
                if not idx:
                    continue
                label = group if len(figures) == 1 else f"{metric}: {group}"
                ax.plot(
                    [xs[i] for i in idx], [rows[i][metric] for i in idx],
                    marker=marker, color=colour, label=label,
                    linestyle="-" if marker == "o" else ":",
                )  # fmt: skip
        ax.set_ylabel(ylabel)


def _mark_failed_and_best(
    axes, rows: list[dict], xs: list[float], name: str, direction: str
) -> None:
    """A red cross at zero for each failed job, a gold star for the best one."""
    for i, r in enumerate(rows):
        if r["status"] in ("failed", "skipped", "unknown"):
            for ax in axes:
                ax.plot(xs[i], 0, "x", color="tab:red", ms=10, mew=2, clip_on=False)
            axes[0].annotate(
                r["status"], (xs[i], 0), textcoords="offset points", xytext=(0, 8),
                ha="center", color="tab:red",
            )  # fmt: skip
        if not r["best"]:
            continue
        star = {"marker": "*", "ms": 18, "color": "gold", "mec": "k", "zorder": 5}
        for ax, (figures, _) in zip(axes, _PANELS, strict=True):
            metric = next((m for m, _ in figures if m == name), figures[0][0])
            if isinstance(r[metric], int | float):
                label = f"best ({direction} {name})" if metric == name else None
                ax.plot(xs[i], r[metric], **star, linestyle="none", label=label)
                if metric == name:
                    ax.annotate(
                        f"best: {name} {r[name]:,.4g}", (xs[i], r[name]),
                        textcoords="offset points", xytext=(0, -18), ha="center",
                    )  # fmt: skip


def _log_to_wandb(
    sweep_dir: Path,
    rows: list[dict],
    png: Path | None,
    first_job: Path,
    goal: tuple[str, str] = ("val_loss", "min"),
) -> str | None:
    """A ``sweep-summary`` run in the sweep's wandb group (the group of its jobs'
    runs); nothing if the jobs log with ``logger=none``. Returns the run's dir."""
    from src.observe.loggers import init_wandb, logs_to_wandb, run_identity

    cfg = _job_config(first_job)
    if not logs_to_wandb(cfg):
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
    name, direction = goal
    run.summary.update(
        {
            "jobs": len(rows),
            "failed": sum(r["status"] == "failed" for r in rows),
            "skipped": sum(r["status"] == "skipped" for r in rows),
            **({f"best/{m}": best[m] for m in METRICS} if best else {}),
            **({"best/job": best["job"]} if best else {}),
            "objective": f"{direction} {name}",
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
    keys, rows, goal = collect(sweep_dir)
    if not rows:
        log.warning("sweep summary: no job dirs under %s", sweep_dir)
        return rows
    stem = sweep_dir / SUMMARY_STEM
    write_csv(stem.with_suffix(".csv"), rows)
    table = summary_table(keys, rows, goal[0])
    stem.with_suffix(".md").write_text(table)
    png = None
    if make_plot:
        png = stem.with_suffix(".png")
        caps = {
            OmegaConf.select(_job_config(Path(r["job_dir"])), "sweep.mem_cap_gib")
            for r in rows
        } - {None}
        plot(png, keys, rows, min(caps) if caps else None, goal)
    log.info("sweep summary (%s.{csv,md,png}):\n%s", stem, table)
    if log_wandb:
        _log_to_wandb(sweep_dir, rows, png, Path(rows[0]["job_dir"]), goal)
    return rows


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, :func:`summarise` its sweep dir.

    ``on_job_end`` also records a job whose exception reached Hydra (a task function
    that does not use :func:`run_job`) as failed, so the summary shows it.
    """

    def __init__(self, wandb: bool = True, plot: bool = True) -> None:
        self.wandb = wandb
        self.plot = plot

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        plan_jobs(config)

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
