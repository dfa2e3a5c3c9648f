"""Context parallelism on CPU: per-rank activation memory and tokens/s at a long
sequence, 1 rank against CP2 (2 ranks) and CP4 (4 ranks), in one run.

The same model, global batch and steps: one rank holds every sequence whole; CP2 and
CP4 split each sequence over 2 and 4 gloo ranks (1 thread each; FSDP2 shards the
parameters over the cp ranks, which read the same rows). The trainer's own pieces
run (``Trainer.build`` / ``Trainer.step``, bench/tensor_parallel.py's timed steps);
each rank sets glibc's allocator as train.py's ranks do, so its resident set follows
the memory in use. Reported per layout: the per-rank activation memory (peak resident
set of the timed steps above the resident set when they start: what a step adds,
max over ranks), the per-rank peak resident set, the planner's activation estimate
for the same run (src/planner/, ``Estimate.activations``), tokens/s (global tokens
per second, median step) and the final loss. The model is narrow and the sequence
long, so activations dominate; they should fall about as 1/C.

    python -m bench.context_parallel [--seq 4096] [--layers 8] [--steps 3] [--append-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from bench.common import publish
from bench.init_memory import rss_bytes
from bench.tensor_parallel import timed_steps
from src.harness import compose_config, run_distributed

#: (ranks, cp degree) of each layout: one rank, then CP2 and CP4
LAYOUTS = ((1, 1), (2, 2), (4, 4))


def compose_cfg(args: argparse.Namespace, ranks: int, cp: int):
    return compose_config(
        "model=llama_tiny",
        "model.dim=64",
        f"model.n_layers={args.layers}",
        "model.n_heads=4",
        f"model.max_seq_len={args.seq}",
        "logger=none",
        "data=synthetic",
        "data.num_tokens=200000",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.devices={ranks}",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.val_every=0",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        "trainer.peak_tflops=1",  # no MFU probe
        "sharding.policy=block",
        f"sharding.context_parallel={cp}",
        *args.override,
    )


def measure_rank(rank: int, world: int, args, cfg, resolved, out: str) -> dict:
    """One rank's timed steps of ``cfg``: their times, the peak resident set and
    the activations (``acts``: the peak above the resident set as they start)."""
    from src.observe.metrics import cpu_peak_rss_bytes, set_malloc_mmap_threshold
    from src.trainer.loop import Trainer

    set_malloc_mmap_threshold(64)  # freed activations leave the resident set
    trainer = Trainer(cfg, os.path.join(out, "run"), torch.device("cpu"), resolved)
    trainer.build()
    start: list[int] = []
    times = timed_steps(trainer, args, lambda: start.append(rss_bytes()))
    peak = cpu_peak_rss_bytes()
    return {"times": times, "peak": peak, "acts": peak - start[0], "loss": trainer.loss}


def planned_activations(cfg, resolved, ranks: int) -> int:
    """The planner's activation bytes per rank for the run: the peak of one
    micro-batch's forward and backward (``ActivationBytes.peak``)."""
    from src.planner.activations import run_activations
    from src.planner.inputs import build_meta_model, run_shape

    shape = run_shape(resolved, ranks)
    return run_activations(resolved, shape, build_meta_model(resolved)).peak


def measure(args: argparse.Namespace, ranks: int, cp: int) -> dict:
    from src.config.run_plan import resolve

    cfg = compose_cfg(args, ranks, cp)
    resolved = resolve(cfg)
    with tempfile.TemporaryDirectory() as out:
        per_rank = run_distributed(
            measure_rank, ranks, args, cfg, resolved, out, timeout=1800
        )
    step = statistics.median(
        max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)
    )
    return {
        "step_s": step,
        "tokens_per_s": args.batch_size * args.seq / step,
        "acts": max(r["acts"] for r in per_rank),
        "peak": max(r["peak"] for r in per_rank),
        "planned": planned_activations(cfg, resolved, ranks),
        "loss": per_rank[0]["loss"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--override", nargs="*", default=[], help="more Hydra overrides")
    p.add_argument("--append-docs", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results = [(ranks, cp, measure(args, ranks, cp)) for ranks, cp in LAYOUTS]
    one = results[0][2]
    rows = []
    for ranks, cp, r in results:
        rows.append(
            {
                "layout": "1 rank" if cp == 1 else f"CP{cp} ({ranks} ranks)",
                "activations/rank (MiB)": f"{r['acts'] / 2**20:.1f}",
                "vs 1 rank": f"{r['acts'] / one['acts']:.2f}",
                "planned (MiB)": f"{r['planned'] / 2**20:.1f}",
                "plan error": f"{r['planned'] / r['acts'] - 1:+.0%}",
                "peak RSS/rank (GiB)": f"{r['peak'] / 2**30:.3f}",
                "tokens/s": f"{r['tokens_per_s']:,.0f}",
                "final loss": f"{r['loss']:.5f}",
            }
        )
    publish(
        rows,
        f"Context parallelism at {args.seq} tokens, CPU",
        f"Same model (Llama, dim 64, {args.layers} layers), global batch and steps; 1 thread per "
        "rank, gloo. Activations/rank: peak resident set of the timed steps above "
        "the resident set as they start (max over ranks). The machine was shared "
        "with other jobs (tokens/s is noisy; CPU ranks on 2 cores share them, so "
        "CP does not speed up here). The final losses agree: every layout trains "
        "the same model.",
        bench="context_parallel",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
