"""What plan-only costs for a big model on many ranks, against building it on meta.

``trainer.plan_only=true`` builds the model on the meta device with the recording
``plan`` backend, estimates every part of the per-rank peak, and searches the changes
that fit a budget (min_params, checkpointing, micro-batch, ranks). Its floor is what
any tool pays to look at the model at all: constructing it on the meta device with
plain PyTorch (``with torch.device("meta"): spec.build(config)``). Both are timed in
the same process, as CPU time (less sensitive to other load than wall time).

    python -m bench.plan_time [--runs gpt_70b:64 llama3_70b:64] [--append-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

import torch

from bench.common import publish
from src.config.validate import validate
from src.harness import compose_config
from src.planner.report import plan_only


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure(preset: str, world: int) -> dict:
    cfg = compose_config(
        f"model={preset}",
        f"trainer.devices={world}",
        "trainer.mem_budget_gib=80",
        f"trainer.batch_size={world}",
        "logger=none",
    )
    resolved = validate(cfg)
    spec, config = resolved.spec, resolved.model_config

    def meta_build() -> None:
        with torch.device("meta"):
            spec.build(config, 0)

    def plan() -> None:
        with tempfile.TemporaryDirectory() as run_dir:
            with contextlib.redirect_stdout(io.StringIO()):
                plan_only(resolved, run_dir, world)

    meta_build()  # first-use costs (imports, class set-up) out of both figures
    baseline = cpu_seconds(meta_build)
    ours = cpu_seconds(plan)
    return {
        "model": preset,
        "ranks": world,
        "plan-only CPU (s)": f"{ours:.2f}",
        "meta build CPU (s)": f"{baseline:.2f}",
        "plan-only / meta build": f"{ours / baseline:.1f}x",
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["gpt_70b:64", "llama3_70b:64"])
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        preset, world = run.split(":")
        rows.append(measure(preset, int(world)))
        print(rows[-1], flush=True)
    publish(
        rows,
        "Plan-only cost of a big model on many ranks",
        "`trainer.plan_only=true` (wrap plan, per-part estimate, the search for the "
        "change that fits an 80 GiB budget) against constructing the same model on the "
        "meta device with plain PyTorch, in one process, CPU time.",
        bench="plan_time",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
