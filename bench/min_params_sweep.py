"""Throughput and peak memory against the auto-wrap threshold ``sharding.min_params``.

One ``python train.py`` run per value (size policy, FSDP2, 2 gloo ranks, synthetic
tokens, a short run), the same model and batch otherwise; the table comes from each
run's metrics.jsonl and summary.json:

- ``units``: FSDP units (``wrap_units``); ``tokens/s``: mean over the log windows
  after the warm-up steps (the meter leaves out the first window itself);
- ``peak_mem_gib`` / ``init_peak_mem_gib``: max over ranks of the peak resident set
  during training / during model construction (on CPU this includes the Python and
  torch runtime, about 0.3 GiB per rank);
- ``final loss``: the loss at the last step.

Smaller units mean more, smaller all-gathers (more per-collective overhead) and less
memory held unsharded at once; ``1e9`` makes the whole model one unit (the root).

    python -m bench.min_params_sweep [--values 1e3 1e4 3e4 1.5e5 1e9]
        [--set model.n_embd=256 ...] [--steps 30] [--append-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import publish

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VALUES = ["1e3", "1e4", "3e4", "1.5e5", "1e9"]
# model=small widened to 256 (3.2M parameters): a bit larger than the default run, so
# the unsharded units' memory shows beside the runtime's.
DEFAULT_SET = ["model.n_embd=256"]


def command(args: argparse.Namespace, value: str, run_dir: str) -> list[str]:
    return [
        sys.executable,
        "train.py",
        f"model={args.model}",
        *args.set,
        "data=synthetic",
        "sharding=fsdp2",
        "sharding.policy=size",
        f"sharding.min_params={value}",
        f"trainer.devices={args.ranks}",
        f"trainer.max_steps={args.steps}",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.log_every={args.log_every}",
        "trainer.val_every=0",
        "logger=none",
        "trainer.progress=false",
        f"hydra.run.dir={run_dir}",
    ]


def run_point(args: argparse.Namespace, value: str) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        proc = subprocess.run(
            command(args, value, run_dir), cwd=ROOT, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(
                f"min_params={value} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
    windows = [
        r["step_time_s"]
        for r in records
        if "step_time_s" in r and r["step"] > args.warmup
    ]
    tokens_per_step = summary["tokens_per_s"] * summary["step_time_s"]
    return {
        "min_params": value,
        "units": summary["wrap_units"],
        "tokens/s": tokens_per_step / statistics.fmean(windows),
        "peak_mem_gib": summary["peak_mem_gib"],
        "init_peak_mem_gib": summary["init_peak_mem_gib"],
        "final loss": summary["loss"],
        "run (s)": wall,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", nargs="+", default=DEFAULT_VALUES)
    p.add_argument("--model", default="small")
    p.add_argument(
        "--set",
        nargs="*",
        default=DEFAULT_SET,
        help="extra train.py overrides (default: %(default)s)",
    )
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    p.add_argument("--append-docs", action="store_true")
    args = p.parse_args(argv)
    if args.steps < args.warmup + args.log_every:
        p.error("--steps must leave at least one log window after --warmup")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for value in args.values:
        r = run_point(args, value)
        rows.append(
            {
                "min_params": r["min_params"],
                "units": r["units"],
                "tokens/s": f"{r['tokens/s']:,.0f}",
                "peak_mem_gib": f"{r['peak_mem_gib']:.3f}",
                "init_peak_mem_gib": f"{r['init_peak_mem_gib']:.3f}",
                "final loss": f"{r['final loss']:.4f}",
            }
        )
        print(rows[-1], f"({r['run (s)']:.0f} s)", flush=True)
    publish(
        rows,
        f"Throughput and memory against sharding.min_params, model={args.model} "
        f"{' '.join(args.set)}, {args.ranks} gloo ranks",
        "One `python train.py` run per value: "
        + " ".join(command(args, "<value>", "<tmp>")[2:-1])
        + f". tokens/s: mean over the log windows after step {args.warmup}. "
        "peak_mem_gib / init_peak_mem_gib: max over ranks of the peak resident "
        "set (VmHWM) while training (at the last step) / while building the "
        "model; it includes the Python + torch runtime (~0.3 GiB per rank). "
        "One run per value on a shared 2-core machine: differences of a few "
        "percent in tokens/s are noise.",
        bench="min_params_sweep",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
