"""Step time around a checkpoint: synchronous vs asynchronous writes (``trainer.ckpt_async``).

2 gloo ranks (1 thread each) train with the trainer's own pieces (``build_model``,
``build_optimizer``, ``train_step``: src/build.py, src/trainer/optimizer.py and
step.py; FSDP2, synthetic tokens) and save with the trainer's ``Checkpointer``. Every
``--every``-th step ends with a checkpoint, alternately synchronous and asynchronous
(one checkpointer per mode, each in its own dir), so both modes are measured in the
same run, under the same machine load. Before a synchronous checkpoint the
asynchronous one in flight (if any) is waited for, untimed, so the two never overlap.

Per checkpoint, on rank 0: the saving step (compute + ``save``), the ``save`` call alone,
and the ``--after`` steps that follow (which share the CPU with a background write).
Reported per mode, as medians over its checkpoints: a plain step (steps with no
checkpoint near them), the stall (saving step + the steps after, minus as many plain
steps) and, for async, the time from ``save`` until the checkpoint was published.

    python -m bench.ckpt_async [--n-layer 4] [--n-embd 512] [--checkpoints 6]
        [--every 4] [--after 3] [--append-docs]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import publish
from src.harness import compose_config, run_distributed

WORLD = 2


def compose_cfg(args: argparse.Namespace):
    overrides = [
        "model=small",
        f"model.n_layer={args.n_layer}",
        f"model.n_embd={args.n_embd}",
        f"model.block_size={args.block_size}",
        "data=synthetic",
        f"trainer.batch_size={args.batch_size}",
        "sharding.policy=block",
        "trainer.warmup_steps=2",
    ]
    return compose_config(*overrides)


def _rank(rank: int, world: int, args: argparse.Namespace, cfg, out_dir: str) -> dict:
    return measure(args, cfg, out_dir)


def measure(args: argparse.Namespace, cfg, out_dir: str) -> dict:
    from src.build import build_model
    from src.checkpoint.dcp import Checkpointer
    from src.config.validate import validate
    from src.data.sources import GlobalBatches, load_splits
    from src.sharding import build_backend
    from src.trainer.optimizer import build_optimizer, lr_lambda
    from src.trainer.step import train_step

    resolved = validate(cfg)
    backend = build_backend("fsdp2", "fp32", "cpu")
    model = build_model(resolved, backend)
    optimizer = build_optimizer(model, cfg, resolved.spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    spec, mcfg = resolved.spec, resolved.model_config
    train_split, _ = load_splits(cfg.data, spec.vocab_size(mcfg), 0)
    batches = GlobalBatches(train_split, args.batch_size, spec.seq_len(mcfg), 0)
    ckpts = {
        mode: Checkpointer(
            Path(out_dir) / mode, keep_last=1, async_save=mode == "async"
        )
        for mode in ("sync", "async")
    }
    step = 0

    def timed_step(save: Checkpointer | None = None) -> tuple[float, float, float]:
        """(step seconds, save-call seconds, when the save started)."""
        nonlocal step
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, batches, step, backend, optimizer, None, cfg)
        scheduler.step()
        t1 = time.perf_counter()
        if save is not None:
            save.save(step, model, optimizer, scheduler)
        step += 1
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1, t1

    for _ in range(args.warmup):
        timed_step()
    plain: list[float] = []
    events = {"sync": [], "async": []}
    for i in range(args.checkpoints):
        mode = ("sync", "async")[i % 2]
        if mode == "sync":
            ckpts["async"].wait()  # untimed: the modes never overlap
        for _ in range(args.every - 1 - args.after):
            plain.append(timed_step()[0])
        saving, call, started = timed_step(ckpts[mode])
        after = [timed_step()[0] for _ in range(args.after)]
        event = {"saving": saving, "call": call, "after": after}
        if mode == "async":
            ckpts["async"].wait()
            event["published_s"] = time.perf_counter() - started
        events[mode].append(event)
    ckpts["async"].wait()
    size = sum(
        f.stat().st_size for f in (Path(out_dir) / "sync").rglob("*") if f.is_file()
    )
    return {"plain": plain, "events": events, "ckpt_bytes": size}


def summarize(result: dict, args: argparse.Namespace) -> list[dict]:
    plain = statistics.median(result["plain"])
    rows = []
    for mode, events in result["events"].items():
        stalls = [
            e["saving"] + sum(e["after"]) - (1 + args.after) * plain for e in events
        ]
        row = {
            "mode": mode,
            "checkpoints": len(events),
            "plain step (s)": f"{plain:.3f}",
            "saving step (s)": f"{statistics.median(e['saving'] for e in events):.3f}",
            "save call (s)": f"{statistics.median(e['call'] for e in events):.3f}",
            f"next {args.after} steps (s)": f"{statistics.median(sum(e['after']) for e in events):.3f}",
            "stall (s)": f"{statistics.median(stalls):.3f}",
            "published after (s)": (
                f"{statistics.median(e['published_s'] for e in events):.3f}"
                if mode == "async"
                else "(in the call)"
            ),
        }
        rows.append(row)
    sync_stall = float(rows[0]["stall (s)"])
    for row in rows:
        row["stall / sync stall"] = f"{float(row['stall (s)']) / sync_stall:.2f}"
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="global, in sequences")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpoints", type=int, default=6, help="half of each mode")
    p.add_argument("--every", type=int, default=6, help="steps between checkpoints")
    p.add_argument("--after", type=int, default=3, help="steps timed after a save")
    p.add_argument("--append-docs", action="store_true")
    args = p.parse_args(argv)
    if args.every < args.after + 1:
        p.error("--every must be > --after")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cfg = compose_cfg(args)
    with tempfile.TemporaryDirectory() as out_dir:
        result = run_distributed(_rank, WORLD, args, cfg, out_dir, timeout=600)[0]
    rows = summarize(result, args)
    mib = result["ckpt_bytes"] / 2**20
    print(f"checkpoint size: {mib:.0f} MiB (model + AdamW states, all ranks)")
    publish(
        rows,
        "Step time around a checkpoint: sync vs async writes",
        f"GPT n_layer={args.n_layer} n_embd={args.n_embd}, FSDP2 on 2 gloo CPU "
        f"ranks of 1 thread, checkpoint {mib:.0f} MiB. Both modes alternate "
        "in the same run; medians over each mode's checkpoints. The machine "
        "is shared with other jobs: read the ratios, not the seconds.",
        bench="ckpt_async",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
