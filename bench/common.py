"""Shared helpers for the benchmarks: the machine line and docs/benchmarks.md."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from src.text import markdown_table

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    """One line naming the machine a figure was measured on."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU, {os.cpu_count()} cores"
    return f"{device}, {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"


def rounds_order(count: int, rounds: int) -> Iterator[tuple[int, int]]:
    """``(round, index)`` over ``count`` items ``rounds`` times, every other round in
    reverse order: a bench that keeps each item's best run meets this VM's drift
    (its speed moves by a third within minutes) at a different place in the list
    each round, so a slow minute reads as no one item's speed."""
    for r in range(rounds):
        order = range(count) if r % 2 == 0 else reversed(range(count))
        for i in order:
            yield r, i


def append_to_benchmarks(title: str, command: str, table: str, note: str = "") -> None:
    """Append a measured table, with the command that produced it, to docs/benchmarks.md."""
    DOCS.parent.mkdir(exist_ok=True)
    stamp = datetime.date.today().isoformat()
    block = [
        f"\n### {title} ({stamp})\n",
        f"Machine: {machine()}.\n",
        f"Command: `{command}`\n",
    ]
    if note:
        block.append(f"{note}\n")
    block.append("\n" + table + "\n")
    with DOCS.open("a") as f:
        f.write("".join(block))


def publish(
    rows: Sequence[Mapping[str, Any]],
    title: str,
    note: str = "",
    *,
    bench: str,
    argv: Sequence[str] | None = None,
    append: bool = False,
) -> str:
    """Print ``rows`` as a markdown table; with ``append``, add it to
    docs/benchmarks.md under ``title`` with ``note`` and the command that reproduces it
    (``python -m bench.<bench>`` and ``argv``, default the command line's, less
    ``--append-docs``). Returns the table."""
    table = markdown_table(rows)
    print(table)
    if append:
        args = sys.argv[1:] if argv is None else argv
        shown = [a for a in args if a != "--append-docs"]
        command = shlex.join(["python", "-m", f"bench.{bench}", *shown])
        append_to_benchmarks(title, command, table, note)
    return table
