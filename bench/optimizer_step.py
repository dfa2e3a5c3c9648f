"""AdamW's step on one CPU thread: torch's per-tensor loop (its CPU default),
foreach (the trainer's before), fused (the trainer's now), over one rank's half of
each ``bench.overhead`` shape's parameters (2 ranks' FSDP shards, as plain tensors).

Each implementation steps the same parameters and gradients; the figure is CPU time
per step after warm-up steps, the median of ``--repeats`` alternations.

    python -m bench.optimizer_step [--steps 15] [--repeats 3] [--append-docs]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import publish
from bench.overhead import SHAPES, WORLD
from src.config.run_plan import resolve
from src.harness import compose_config

IMPLEMENTATIONS = {
    "per-tensor": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def shard_sizes(shape: str) -> list[int]:
    """Elements of one rank's shard of each parameter of ``shape``'s model."""
    model, sets, _ = SHAPES[shape]
    r = resolve(compose_config(f"model={model}", *(f"model.{s}" for s in sets)))
    with torch.device("meta"):
        built = r.spec.build(r.model_config, 0)
    return [-(-p.numel() // WORLD) for p in built.parameters()]


def cpu_ms_per_step(sizes: list[int], kwargs: dict, steps: int) -> float:
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)
    for _ in range(3):  # the states' allocation out of the timing
        optimizer.step()
    start = time.process_time()
    for _ in range(steps):
        optimizer.step()
    return (time.process_time() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for shape in SHAPES:
        sizes = shard_sizes(shape)
        ms: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
        for _ in range(args.repeats):
            for name, kwargs in IMPLEMENTATIONS.items():
                ms[name].append(cpu_ms_per_step(sizes, kwargs, args.steps))
        best = {name: statistics.median(v) for name, v in ms.items()}
        rows.append({
            "shape": shape,
            "local parameters": f"{sum(sizes) / 1e6:.2f}M",
            **{f"{name} ms": f"{v:.1f}" for name, v in best.items()},
            "fused / foreach": f"{best['fused'] / best['foreach']:.2f}",
        })  # fmt: skip
        print(rows[-1], flush=True)
    publish(
        rows,
        "AdamW's step, one CPU thread: per-tensor, foreach, fused",
        "CPU ms per step over one of 2 ranks' shards (plain tensors), the median of "
        f"{args.repeats} alternations of {args.steps} steps.",
        bench="optimizer_step",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
