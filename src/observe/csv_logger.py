"""``logger=csv``: every logged row also in a CSV file in the run dir, for
spreadsheets and pandas, next to metrics.jsonl and summary.json.

A whole logger option in one file (docs/architecture.md, "Where to add"): the schema
of its keys, the check its types cannot say, its sink, and the entry in ``LOGGERS``;
its values and their comments are in conf/logger/csv.yaml.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from src.errors import ConfigError
from src.files import atomic_path
from src.observe.loggers import (
    LOGGERS,
    ConsoleSink,
    LoggerConfig,
    LoggerOption,
    Sink,
    rows_past,
    set_aside_damaged,
)
from src.registry import described
from src.text import plural


@dataclass
class CsvLoggerConfig(LoggerConfig):
    file: str = described("csv: the CSV's file name in the run dir")


def check(logger: DictConfig) -> None:
    name = logger.file
    if not name or os.path.basename(name) != name or name in (".", ".."):
        raise ConfigError(
            "logger.file", f"got {name!r}, expected a file name (in the run dir)"
        )


class CsvSink(Sink):
    """One row per logged step under a header of every key seen so far: a row with
    a new key (the first ``val_loss``, say), or logged at the last row's step (merged
    into it), rewrites the file; other rows are appended. A resumed run continues the
    file."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.rows: list[dict] = []
        if self.path.is_file():
            with open(self.path, newline="") as f:
                self.rows = list(csv.DictReader(f))
        self.columns = list(dict.fromkeys(k for r in self.rows for k in r))

    def log(self, row: dict, step: int) -> None:
        row = {"step": step, **row}
        if self.rows and _step(self.rows[-1]) == step:  # one row per step
            self.rows[-1].update(row)
            self.columns += [k for k in row if k not in self.columns]
            self._rewrite()
            return
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def drop_rows_after(self, step: int) -> dict[str, int]:
        steps = [_step(r) for r in self.rows]
        damaged = sum(s == math.inf for s in steps[:-1])
        set_aside_damaged(self.path, damaged, "a row with a numeric step")
        past = rows_past(step, steps)
        kept = [r for r in self.rows if _step(r) <= step]
        if len(kept) != len(self.rows):
            self.rows = kept
            self._rewrite()
        return {self.path.name: past} if past else {}

    def set_aside_after(self, step: int, directory: Path) -> list[str]:
        later = [r for r in self.rows if _step(r) > step]
        if not later:
            return []
        aside = CsvSink(directory / self.path.name)  # the branch's copy first
        aside.rows, aside.columns = later, self.columns
        aside._rewrite()
        self.rows = [r for r in self.rows if _step(r) <= step]
        self._rewrite()
        return [f"{self.path.name}: {plural(len(later), 'row')}"]

    def _rewrite(self) -> None:
        with atomic_path(self.path) as tmp:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, self.columns)
                writer.writeheader()
                writer.writerows(self.rows)


def _step(row: dict) -> float:
    try:
        return float(row["step"])
    except (KeyError, TypeError, ValueError):
        return math.inf  # a torn row: dropped


def sinks(cfg: DictConfig, run_dir: Path) -> list[Sink]:
    return [ConsoleSink(run_dir), CsvSink(run_dir / cfg.logger.file)]


LOGGERS.add("csv", LoggerOption(CsvLoggerConfig, sinks, check))
