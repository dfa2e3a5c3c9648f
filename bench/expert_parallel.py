"""Expert parallelism vs FSDP2 on 2 CPU ranks: tokens/s, per-rank peak memory and
the bytes the all-to-alls move per step.

The same MoE model (>= 8 experts), global batch and steps on 2 gloo ranks (1 thread
each), once as FSDP2 (every expert sharded 2 ways, all-gathered whole for each block)
and once as EP2 (each rank holds half the experts whole; tokens travel to them and
back by all-to-all), each layout in its own pair of processes, with the trainer's own
pieces (bench/tensor_parallel.py's harness: ``Trainer.build`` / ``Trainer.step``, the
first ``--warmup`` steps untimed). The bytes moved are counted by the model as it
dispatches (rows sent to the other rank by the dispatch and the combine, forward),
times 2 for backward's reverse all-to-alls; the small all-to-all of the counts is
left out.

    python -m bench.expert_parallel [--model moe_tiny] [--steps 6] [--append-docs]
"""

from __future__ import annotations

import argparse

from bench.common import publish
from bench.tensor_parallel import arg_parser, layout_row, measure, speed_vs_first

LAYOUTS = {
    "FSDP2 (2-way sharding)": [],
    "EP2 (experts split 2 ways)": ["sharding.expert_parallel=2"],
}


class AllToAllBytes:
    """Bytes the model's expert all-to-alls sent from this rank over the timed
    steps, per step (see the module docstring)."""

    def __init__(self, trainer) -> None:
        from src.models.moe import moe_layers

        self.layers = moe_layers(trainer.model)
        self.start_bytes = 0

    def _sent(self) -> int:
        return sum(m.bytes_sent for m in self.layers)

    def start(self) -> None:
        self.start_bytes = self._sent()

    def result(self) -> dict:
        return {"a2a_bytes": 2 * (self._sent() - self.start_bytes)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arg_parser(__doc__)
    p.set_defaults(model="moe_tiny")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for name, layout in LAYOUTS.items():
        r = measure(args, layout, AllToAllBytes)
        sent = max(rank["a2a_bytes"] for rank in r["ranks"]) / args.steps
        a2a = {"all-to-all MiB/step/rank": f"{sent / 2**20:.3f}"}
        rows.append(layout_row(name, r, **a2a))
    speed_vs_first(rows)
    publish(
        rows,
        "Expert parallelism vs FSDP2, 2 CPU ranks",
        "Same MoE model, global batch and steps; 1 thread per rank, gloo. The "
        "machine was shared with other jobs while this ran (timings are noisy; "
        "compare the ratio, measured in the same run). The final losses agree: "
        "both layouts train the same model.",
        bench="expert_parallel",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
