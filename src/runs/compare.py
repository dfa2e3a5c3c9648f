"""Compare runs: ``python compare.py RUN_DIR_OR_SWEEP_DIR...`` (from any directory).

The table is the sweep summary's (src/runs/sweep.py ``collect_dirs`` and
``summary_table``: each run's final figures from its ``summary.json``, the overrides
that differ between the runs as columns (with what a resume changed), the value a run ran with where it did not
set one, the best run by ``--metric`` or the first run's ``sweep.objective`` unless the runs'
tokenizers differ); the plot shows loss (and val_loss, dashed), tokens/s and peak
memory per rank over steps or tokens seen (``--x``), one line per run, from each run's ``metrics.jsonl``.
Both are written to ``--out`` (``compare.{md,csv,png}``) and the table is logged.
A sweep dir (Hydra's ``multirun.yaml`` in it) stands for its job dirs; what a shell
glob of one adds besides them (``multirun.yaml``, the summary's files, its wandb
dir) is left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from src.config.schema import OBJECTIVES, objective_direction
from src.observe.keys import is_task_metric
from src.observe.loggers import METRICS_FILE
from src.runs.sweep import collect_dirs, job_dirs, summary_table, write_csv

log = logging.getLogger(__name__)

STEM = "compare"
SWEEP_RECORD = "multirun.yaml"  # Hydra's, in every sweep dir
#: The plot's panels: (metrics.jsonl key, y label).
PANELS = (
    ("loss", "loss (val_loss dashed)"),
    ("tokens_per_s", "tokens/s (global)"),
    ("peak_mem_gib", "peak GiB per rank"),
)
#: What the plot's x-axis may be: every metrics.jsonl row has both.
X_AXES = ("step", "tokens_seen")


def run_names(dirs: Sequence[Path]) -> list[str]:
    """Short distinct labels: each run dir's path below the dirs' common parent."""
    dirs = [d.resolve() for d in dirs]
    if len(dirs) == 1:
        return [dirs[0].name]
    common = Path(os.path.commonpath(dirs))
    return [str(d.relative_to(common)) or d.name for d in dirs]


def series(run_dir: Path, key: str, x: str = "step") -> tuple[list[int], list[float]]:
    """``(x values, values)`` of ``key`` in the run's metrics.jsonl, over ``x``
    (``step`` or ``tokens_seen``)."""
    steps, values = [], []
    path = run_dir / METRICS_FILE
    lines = path.read_bytes().splitlines() if path.is_file() else []
    for line in lines:
        try:
            row = json.loads(line.decode())
        except ValueError:
            continue  # a row cut short by a crash, or damaged (not UTF-8 JSON)
        if not isinstance(row, dict):
            continue
        if isinstance(row.get(key), int | float) and x in row:
            steps.append(row[x])
            values.append(row[key])
    return steps, values


def is_run_dir(path: Path) -> bool:
    return (path / ".hydra" / "overrides.yaml").is_file()


def expand(args: Sequence[str | os.PathLike]) -> list[Path]:
    """The run dirs that ``args`` name: a run dir itself, a sweep dir's jobs (in job
    order); a file or a dir beside a sweep's jobs that is no run (``multirun.yaml``,
    ``sweep_summary.csv``, ``wandb/``: what ``runs/sweep/*`` matches) is left out,
    said in a line. SystemExit naming the rest, which are neither."""
    dirs, unknown = [], []
    for arg in args:
        path = Path(arg).expanduser()
        if is_run_dir(path):
            dirs.append(path)
        elif (path / SWEEP_RECORD).is_file() and job_dirs(path):
            dirs.extend(job_dirs(path))
        elif path.is_file() or (path.parent / SWEEP_RECORD).is_file():
            log.info("%s: not a run dir, left out", path)
        else:
            unknown.append(str(path))
    if unknown or not dirs:
        raise SystemExit(
            "error: not a run dir of train.py (no .hydra/overrides.yaml) nor a sweep "
            f"dir ({SWEEP_RECORD} and job dirs): {', '.join(unknown) or 'no run given'}"
        )
    return list(dict.fromkeys(dirs))


def labels(
    names: Sequence[str], keys: Sequence[str], rows: Sequence[dict]
) -> list[str]:
    """Each run's line label: its name and its values of the table's keys."""
    return [
        f"{name}: " + ", ".join(f"{k.rpartition('.')[2]}={r[k]}" for k in keys)
        if keys
        else name
        for name, r in zip(names, rows, strict=True)
    ]


def plot(
    path: Path, dirs: Sequence[Path], names: Sequence[str], x: str = "step"
) -> None:
    """One figure: a panel per :data:`PANELS` entry, one line per run over ``x``
    (:data:`X_AXES`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for i, (run_dir, name) in enumerate(zip(dirs, names, strict=True)):
        color = f"C{i % 10}"
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            ax.plot(*series(run_dir, key, x), marker=".", color=color, label=name)
        axes[0].plot(*series(run_dir, "val_loss", x), linestyle="--", color=color)
    for ax, (_, label) in zip(axes, PANELS, strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    axes[-1].set_xlabel(x)
    fig.suptitle(f"{len(dirs)} runs")
    fig.savefig(path, dpi=110)


def compare(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    make_plot: bool = True,
    metric: str | None = None,
    x: str = "step",
) -> list[dict]:
    """Write ``compare.{md,csv,png}`` into ``out`` for ``run_dirs`` (run dirs or
    sweep dirs, :func:`expand`); returns the rows. ``metric``: the figure the best
    run has (default: the first run's ``sweep.objective``); ``x``: the plot's x-axis."""
    dirs = expand(run_dirs)
    names = run_names(dirs)
    goal = (metric, objective_direction(metric)) if metric else None
    keys, rows, goal = collect_dirs(dirs, names, goal)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / STEM
    write_csv(stem.with_suffix(".csv"), rows)
    table = summary_table(keys, rows, goal[0])
    stem.with_suffix(".md").write_text(table)
    if make_plot:
        plot(stem.with_suffix(".png"), dirs, labels(names, keys, rows), x)
    log.info("%d runs compared (%s.{md,csv,png}):\n%s", len(rows), stem, table)
    return rows


def _metric(name: str) -> str:
    """``--metric``: an objective or a downstream task's metric."""
    if name in OBJECTIVES or is_task_metric(name):
        return name
    raise argparse.ArgumentTypeError(
        f"{name!r}: expected one of {', '.join(OBJECTIVES)} or eval/<task>/<metric>"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A table and a plot (loss, tokens/s, peak memory over steps) of "
        "several runs of train.py."
    )
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs or sweep dirs"
    )
    parser.add_argument("--out", default=".", help="where compare.{md,csv,png} go")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--metric",
        type=_metric,
        help=f"the figure the best run has: {', '.join(OBJECTIVES)} or a task's "
        "eval/<task>/<metric> (default: the first run's sweep.objective)",
    )
    parser.add_argument("--x", choices=X_AXES, default="step", help="plot x-axis")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    compare(args.run_dirs, args.out, not args.no_plot, args.metric, args.x)


if __name__ == "__main__":
    main()
