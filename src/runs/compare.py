"""Compare runs that were not one multirun: ``python -m src.runs.compare RUN_DIR...``.

The table is the sweep summary's (src/trainer/sweep.py ``collect_dirs`` and
``summary_table``: each run's final figures from its ``summary.json``, the overrides
that differ between the runs as columns, the best run by the first run's
``sweep.objective``); the plot shows loss (and val_loss, dashed), tokens/s and peak
memory per rank over steps, one line per run, from each run's ``metrics.jsonl``.
Both are written to ``--out`` (``compare.{md,csv,png}``) and the table is logged.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from src.observe.loggers import METRICS_FILE
from src.trainer.sweep import collect_dirs, summary_table, write_csv

log = logging.getLogger(__name__)

STEM = "compare"
#: The plot's panels: (metrics.jsonl key, y label).
PANELS = (
    ("loss", "loss (val_loss dashed)"),
    ("tokens_per_s", "tokens/s (global)"),
    ("peak_mem_gib", "peak GiB per rank"),
)


def run_names(dirs: Sequence[Path]) -> list[str]:
    """Short distinct labels: each run dir's path below the dirs' common parent."""
    dirs = [d.resolve() for d in dirs]
    if len(dirs) == 1:
        return [dirs[0].name]
    common = Path(os.path.commonpath(dirs))
    return [str(d.relative_to(common)) or d.name for d in dirs]


def series(run_dir: Path, key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` in the run's metrics.jsonl."""
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
        if isinstance(row.get(key), int | float) and "step" in row:
            steps.append(row["step"])
            values.append(row[key])
    return steps, values


def plot(path: Path, dirs: Sequence[Path], names: Sequence[str]) -> None:
    """One figure: a panel per :data:`PANELS` entry, one line per run over steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for i, (run_dir, name) in enumerate(zip(dirs, names, strict=True)):
        color = f"C{i % 10}"
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            ax.plot(*series(run_dir, key), marker=".", color=color, label=name)
        axes[0].plot(*series(run_dir, "val_loss"), linestyle="--", color=color)
    for ax, (_, label) in zip(axes, PANELS, strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("step")
    fig.suptitle(f"{len(dirs)} runs")
    fig.savefig(path, dpi=110)


def compare(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    make_plot: bool = True,
) -> list[dict]:
    """Write ``compare.{md,csv,png}`` into ``out`` for ``run_dirs``; returns the rows."""
    dirs = [Path(d).expanduser() for d in run_dirs]
    missing = [str(d) for d in dirs if not (d / ".hydra" / "overrides.yaml").is_file()]
    if missing:
        raise SystemExit(
            f"error: not a run dir of train.py (no .hydra/overrides.yaml): "
            f"{', '.join(missing)}"
        )
    names = run_names(dirs)
    keys, rows, goal = collect_dirs(dirs, names)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / STEM
    write_csv(stem.with_suffix(".csv"), rows)
    table = summary_table(keys, rows, goal[0])
    stem.with_suffix(".md").write_text(table)
    if make_plot:
        plot(stem.with_suffix(".png"), dirs, names)
    log.info("%d runs compared (%s.{md,csv,png}):\n%s", len(rows), stem, table)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A table and a plot (loss, tokens/s, peak memory over steps) of "
        "several runs of train.py."
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default=".", help="where compare.{md,csv,png} go")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    compare(args.run_dirs, args.out, make_plot=not args.no_plot)


if __name__ == "__main__":
    main()
