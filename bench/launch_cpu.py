"""What one short launch of ranks costs in CPU: the whole machine's, so the launcher,
its rank server and the ranks all count (a process's own rusage misses children a
killed server never reaped).

Most of the test suite is such launches, on two busy workers, where CPU is the time.
Each run is ``python train.py`` of :data:`COMMAND` in a new run dir; the CPU is the
difference of ``/proc/stat``'s first line (user, nice, system, irq, softirq) across
it, so the machine should be otherwise idle. ``--other DIR`` alternates the runs with
another checkout's (an older commit in a git worktree: ``git worktree add DIR REV``).

    python -m bench.launch_cpu [--runs 4] [--other DIR] [--append-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import publish

ROOT = Path(__file__).resolve().parent.parent
#: A 2-rank run as short as a test's.
COMMAND = [
    "model=tiny", "data=synthetic", "logger=none", "trainer.devices=2",
    "trainer.val_every=0", "trainer.progress=false", "trainer.max_steps=2",
]  # fmt: skip


def machine_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent (``/proc/stat``)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def launch(checkout: Path) -> tuple[float, float]:
    """(CPU s, wall s) of one run of :data:`COMMAND` in ``checkout``."""
    with tempfile.TemporaryDirectory() as run_dir:
        cpu, wall = machine_cpu_s(), time.perf_counter()
        subprocess.run(
            [sys.executable, "train.py", *COMMAND, f"hydra.run.dir={run_dir}"],
            cwd=checkout, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return machine_cpu_s() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--other", type=Path, help="another checkout, alternated")
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    sides = {"this": ROOT} | ({"other": args.other.resolve()} if args.other else {})
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(args.runs):
        for name in reversed(sides):  # the other first: neither always warm
            got[name].append(launch(sides[name]))
            print(name, *(f"{v:.2f}" for v in got[name][-1]), flush=True)
    rows = [
        {
            "checkout": f"{name} ({sides[name]})",
            "CPU s per launch": ", ".join(f"{c:.2f}" for c, _ in runs),
            "median CPU s": f"{statistics.median(c for c, _ in runs):.2f}",
            "median wall s": f"{statistics.median(w for _, w in runs):.2f}",
        }
        for name, runs in got.items()
    ]
    publish(
        rows,
        "A short 2-rank launch's CPU",
        "`python train.py " + " ".join(COMMAND) + "`, the whole machine's CPU.",
        bench="launch_cpu",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
