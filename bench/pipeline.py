"""Pipeline parallelism vs FSDP2 on 2 CPU ranks: tokens/s, and each schedule's
measured bubble against the theory.

The same model, global batch and steps on 2 gloo ranks (1 thread each), once as FSDP2
(each rank half the batch, parameters sharded 2 ways) and once per pipeline schedule
as PP2 (``sharding.pipeline_parallel=2``: each rank one stage, or two for the
interleaved schedule, the whole batch split into ``--microbatches`` micro-batches).
The trainer's own pieces run (``Trainer.build`` / ``Trainer.step``); the first
``--warmup`` steps are not timed. tokens/s: global tokens per second of the timed
steps (median step time, max over ranks).

The bubble: on each rank, the time of the schedule's run (``schedule.step``, the
forward and backward of all micro-batches, not the optimizer) and, within it, the
time its stages compute (``PipelineStage.forward_one_chunk`` and
``backward_one_chunk``); the rest is idle: waiting for the other stage's activations
or gradients, and the sends. Reported per rank (stage), against the theoretical
(P-1)/(M+P-1) of GPipe and 1F1B and (P-1)/(vM+P-1) of the interleaved schedule with v
stages per rank, which assume equal stages and free communication (here the first
stage also embeds, the last one runs the head and the loss).

    python -m bench.pipeline [--model llama_tiny] [--microbatches 4] [--steps 6] [--append-docs]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

from bench import tensor_parallel as tp
from bench.common import publish
from src.sharding.pipeline import SCHEDULES, bubble_fraction

WORLD = 2
PP = 2


def layouts(microbatches: int) -> dict[str, list[str]]:
    """FSDP2, then PP2 with each schedule torch offers that runs on gloo."""
    pp = [
        f"sharding.pipeline_parallel={PP}",
        f"sharding.pp_microbatches={microbatches}",
    ]
    return {
        "FSDP2 (2-way sharding)": [],
        **{
            f"PP2 {name}": [*pp, f"sharding.pp_schedule={name}"]
            for name, schedule in SCHEDULES.items()
            if schedule.refused is None
        },
    }


def theoretical_bubble(schedule: str, microbatches: int) -> float:
    """The idle share of a rank's schedule time with equal stages and free sends."""
    return bubble_fraction(schedule, PP, microbatches)


def _timed(fn, into: list[float]):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    return run


class StageTimer:
    """On one rank of a pipelined run: the time of the schedule's runs and, within
    them, of its stages' forward and backward passes (from ``start()`` on)."""

    def __init__(self, trainer) -> None:
        self.busy: list[float] = []
        self.schedule: list[float] = []
        if trainer.pipeline is None:
            return
        for stage in trainer.pipeline.stages:
            stage.forward_one_chunk = _timed(stage.forward_one_chunk, self.busy)
            stage.backward_one_chunk = _timed(stage.backward_one_chunk, self.busy)
        run = trainer.pipeline.schedule
        run.step = _timed(run.step, self.schedule)

    def start(self) -> None:
        self.busy.clear()
        self.schedule.clear()

    def result(self) -> dict:
        """``idle``: the share of the schedule's time no stage of this rank computed."""
        if not self.schedule:
            return {"idle": None}
        return {"idle": 1 - sum(self.busy) / sum(self.schedule)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = tp.arg_parser(__doc__, batch_size=16)
    p.add_argument("--microbatches", type=int, default=4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    rows = []
    for name, layout in layouts(args.microbatches).items():
        r = tp.measure(args, layout, StageTimer)
        schedule = name.removeprefix("PP2 ")
        pipelined = schedule in SCHEDULES
        rows.append(
            {
                "layout": name,
                "step (s, median)": f"{r['step_s']:.3f}",
                "tokens/s": f"{r['tokens_per_s']:,.0f}",
                "bubble measured (stage 0, stage 1)": ", ".join(
                    f"{rank['idle']:.2f}" for rank in r["ranks"]
                )
                if pipelined
                else "-",
                "bubble theory": f"{theoretical_bubble(schedule, args.microbatches):.2f}"
                if pipelined
                else "-",
                "final loss": f"{r['loss']:.5f}",
            }
        )
    base = float(rows[0]["tokens/s"].replace(",", ""))
    for row in rows:
        row["vs FSDP2"] = f"{float(row['tokens/s'].replace(',', '')) / base:.2f}x"
    load_after = os.getloadavg()[0]
    publish(
        rows,
        "Pipeline parallelism (PP2, each schedule) vs FSDP2, 2 CPU ranks",
        "Same model, global batch and steps; 1 thread per rank, gloo; "
        f"{args.microbatches} pipeline micro-batches. Bubble: the idle share of each "
        "rank's schedule run (1 - its stages' forward and backward time / the run's "
        "time), against (P-1)/(M+P-1) (interleaved: (P-1)/(vM+P-1), v=2). The "
        "machine is shared: 1-minute load average "
        f"{load:.1f} before, {load_after:.1f} after (2 cores); compare within the "
        "table. The final losses agree: every layout trains the same model.",
        bench="pipeline",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
