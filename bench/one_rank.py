"""One rank against two on the same CPUs: is ``trainer.devices=1`` slower, and why?

Each arm is README's ``python train.py model=tiny ... trainer.max_steps=N`` in a
subprocess (synthetic data, no logger, no MFU probe), repeated with the arms in turn
so machine load hits them alike:

- ``1 rank``: ``trainer.devices=1 sharding=none``, in the launching process, with
  ``cores`` intra-op threads (the launcher gives each rank ``cores / ranks``);
- ``1 rank, OMP_NUM_THREADS=1``: the same with one thread (the launcher honours
  ``OMP_NUM_THREADS``);
- ``2 ranks``: ``trainer.devices=2`` (FSDP2), one thread each.

Per arm: the median step time over the timed windows (metrics.jsonl's
``step_time_s``, the warm-up window left out), tokens/s, the share of the ranks'
thread time spent waiting for a core (``cpu_wait``: other processes' load), the wall
time of the whole command and the CPU time of its process tree per step.

    python -m bench.one_rank [--steps 50] [--repeats 2] [--append-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import publish

ROOT = Path(__file__).resolve().parent.parent
COMMON = [
    "model=tiny",
    "data=synthetic",
    "logger=none",
    "trainer.progress=false",
    "trainer.val_every=0",
    "trainer.peak_tflops=1",  # no probe: the same start-up in every arm
    "trainer.log_every=5",
]
ONE = ["trainer.devices=1", "sharding=none"]
#: arm -> (environment, overrides)
ARMS = {
    "1 rank": ({}, ONE),
    "1 rank, OMP_NUM_THREADS=1": ({"OMP_NUM_THREADS": "1"}, ONE),
    "2 ranks": ({}, ["trainer.devices=2"]),
}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_arm(name: str, steps: int, run_dir: Path) -> dict:
    """One run of an arm: its figures from metrics.jsonl, wall and CPU time."""
    env, overrides = ARMS[name]
    argv = [sys.executable, "train.py", *COMMON, *overrides]
    argv += [f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, **env}
    cpu, wall = children_cpu(), time.perf_counter()
    subprocess.run(
        argv, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800
    )
    wall, cpu = time.perf_counter() - wall, children_cpu() - cpu
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "step_time_s" in r]
    waits = [r["cpu_wait"] for r in timed if "cpu_wait" in r]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "cpu_wait": statistics.mean(waits) if waits else float("nan"),
        "wall_s": wall,
        "cpu_per_step": cpu / steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in ARMS}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            names = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
            for name in names:
                run_dir = Path(tmp) / f"{len(os.listdir(tmp))}"
                results[name].append(run_arm(name, args.steps, run_dir))
                load.append(os.getloadavg()[0])
    two = statistics.median(r["step_s"] for r in results["2 ranks"])
    rows = []
    for name, runs in results.items():
        step = statistics.median(r["step_s"] for r in runs)

        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        rows.append(
            {
                "arm": name,
                "step ms (median)": f"{step * 1e3:.1f}",
                "step / 2 ranks": f"{step / two:.2f}",
                "tokens/s": f"{med('tokens_per_s'):,.0f}",
                "cpu_wait": f"{med('cpu_wait'):.0%}",
                "command wall s": f"{med('wall_s'):.1f}",
                "CPU s/step (all processes)": f"{med('cpu_per_step'):.3f}",
            }
        )
    note = (
        f"{args.repeats} repeats, arms in turn; `model=tiny` "
        f"{' '.join(COMMON[1:])} trainer.max_steps={args.steps}. Load average "
        f"(1 min) during the runs: {min(load):.1f}-{max(load):.1f} on "
        f"{os.cpu_count()} cores."
    )
    publish(
        rows,
        "One rank against two, model=tiny, same CPUs",
        note,
        bench="one_rank",
        append=args.append_docs,
    )


if __name__ == "__main__":
    main()
