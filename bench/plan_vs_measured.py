"""The planner's training-peak estimate against the measured peak, config by config.

For each configuration the planner (src/trainer/planner.py) predicts the per-rank peak
above the process baseline (``Estimate.training``: every part but ``process``), and
``world`` real ranks run the trainer's own code (``build_model``, ``build_optimizer``,
``train_step`` from src/trainer/loop.py) for a few steps on synthetic tokens:

- CPU: each rank's baseline is its resident set after the imports, the gloo process
  group, the FSDP mesh and the data, just before the model is built; the peak is VmHWM
  (reset at that point) after the steps. Ranks start with glibc's mmap threshold fixed
  at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``), so a freed tensor leaves the resident
  set at once: the figure is memory in use, not what glibc keeps after frees (the
  retention docs/benchmarks.md measured).
- CUDA (run unchanged on a GPU machine): ``torch.cuda.max_memory_allocated`` above
  ``memory_allocated`` at the same point, NCCL.

measured = the max over ranks of (peak - baseline); error = estimate / measured - 1.

    python -m bench.plan_vs_measured [--steps 3] [--configs NAME ...] [--append-docs]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from bench.common import append_to_benchmarks
from src.harness import compose_config, run_distributed
from src.sharding import MIB
from src.trainer.loggers import markdown_table

TARGET = 0.15  # |error| on every configuration

# name -> overrides. Global batch B over grad_accum A and W ranks: B / A / W sequences
# per rank per micro-step.
_BASE = ["data=synthetic", "logger=none", "model.vocab_size=256", "model.n_head=4"]
CONFIGS: dict[str, list[str]] = {
    "base": ["model.n_layer=4", "model.n_embd=256", "model.block_size=256",
             "trainer.batch_size=8", "trainer.devices=2"],
    "wide": ["model.n_layer=2", "model.n_embd=768", "model.block_size=128",
             "trainer.batch_size=8", "trainer.devices=2"],
    "deep": ["model.n_layer=12", "model.n_embd=128", "model.block_size=256",
             "trainer.batch_size=8", "trainer.devices=2"],
    "long seq": ["model.n_layer=4", "model.n_embd=256", "model.block_size=1024",
                 "trainer.batch_size=4", "trainer.devices=2"],
    "big vocab": ["model.n_layer=2", "model.n_embd=256", "model.block_size=256",
                  "model.vocab_size=8192", "trainer.batch_size=8", "trainer.devices=2"],
    "accum 4, sync last": ["model.n_layer=4", "model.n_embd=512",
                           "model.block_size=128", "trainer.batch_size=16",
                           "trainer.grad_accum=4", "trainer.grad_sync=last",
                           "trainer.devices=2"],
    "accum 4, sync every": ["model.n_layer=4", "model.n_embd=512",
                            "model.block_size=128", "trainer.batch_size=16",
                            "trainer.grad_accum=4", "trainer.grad_sync=every",
                            "trainer.devices=2"],
    "AC full": ["sharding.activation_checkpointing=full", "model.n_layer=4",
                "model.n_embd=256", "model.block_size=512", "trainer.batch_size=8",
                "trainer.devices=2"],
    "AC full, every 2nd": ["sharding.activation_checkpointing=full",
                           "sharding.activation_checkpointing_every=2",
                           "model.n_layer=4", "model.n_embd=256",
                           "model.block_size=512", "trainer.batch_size=8",
                           "trainer.devices=2"],
    "AC selective": ["sharding.activation_checkpointing=selective",
                     "sharding.policy=block",
                     "model.n_layer=4", "model.n_embd=256", "model.block_size=512",
                     "trainer.batch_size=8", "trainer.devices=2"],
    "1 rank": ["model.n_layer=4", "model.n_embd=256", "model.block_size=256",
               "trainer.batch_size=4", "trainer.devices=1"],
    "fsdp1": ["sharding=fsdp1", "model.n_layer=4", "model.n_embd=256",
              "model.block_size=256", "trainer.batch_size=8", "trainer.devices=2"],
    "bf16": ["precision=bf16_mixed", "model.n_layer=4", "model.n_embd=256",
             "model.block_size=256", "trainer.batch_size=8", "trainer.devices=2"],
    "bf16 long seq": ["precision=bf16_mixed", "model.n_layer=4", "model.n_embd=256",
                      "model.block_size=1024", "trainer.batch_size=4",
                      "trainer.devices=2"],
    "bf16 wide": ["precision=bf16_mixed", "model.n_layer=2", "model.n_embd=768",
                  "model.block_size=128", "trainer.batch_size=8", "trainer.devices=2"],
    "fsdp1 bf16": ["sharding=fsdp1", "precision=bf16_mixed", "model.n_layer=4",
                   "model.n_embd=256", "model.block_size=256",
                   "trainer.batch_size=8", "trainer.devices=2"],
}  # fmt: skip


def make_cfg(overrides: list[str]):
    return compose_config(*_BASE, *overrides)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith(field + ":"))


def _set_device(rank: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)


def _rank(rank: int, world: int, cfg, steps: int) -> dict:
    from src.sharding import build_backend
    from src.trainer.data import GlobalBatches, load_splits
    from src.trainer.loop import build_model, build_optimizer, train_step
    from src.trainer.metrics import _reset_cpu_peak_rss
    from src.trainer.resolved import resolve

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    t = cfg.trainer
    backend = build_backend(
        cfg.sharding.backend,
        cfg.precision.name,
        device,
        cfg.sharding.reshard_after_forward,
        cfg.sharding.replicate,
    )
    train_split, _ = load_splits(cfg.data, cfg.model.vocab_size, t.seed)
    batches = GlobalBatches(
        train_split, t.batch_size // t.grad_accum, cfg.model.block_size, t.seed
    )
    batches.get(0, 0, rank, world)
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_kib("VmRSS") * 1024
        _reset_cpu_peak_rss()
    resolved = resolve(cfg)
    model = build_model(cfg, backend, resolved)
    optimizer = build_optimizer(model, cfg, resolved)
    scaler = backend.grad_scaler()
    for step in range(steps):
        train_step(model, batches, step, backend, optimizer, scaler, cfg)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    return {"base": base, "peak": peak}


def measure(cfg, world: int, steps: int) -> int:
    """Max over ranks of the training peak above the rank's baseline (bytes)."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    pg = "nccl" if torch.cuda.is_available() else "gloo"
    rows = run_distributed(_rank, world, cfg, steps, pg_backend=pg, setup=_set_device)
    return max(r["peak"] - r["base"] for r in rows)


def main(argv: list[str] | None = None) -> list[dict]:
    from src.trainer.planner import estimate_cfg, resolve_auto

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--append-docs", action="store_true")
    args = p.parse_args(argv)

    rows = []
    for name in args.configs:
        cfg, _ = resolve_auto(make_cfg(CONFIGS[name]))
        world = int(cfg.trainer.devices)
        _, est = estimate_cfg(cfg, world)
        measured = measure(cfg, world, args.steps)
        parts = est.parts
        m, s = cfg.model, est.shape
        error = est.training / measured - 1
        rows.append(
            {
                "config": name,
                "backend": f"{s.backend}, {cfg.precision.name}, {world} rank(s)",
                "L x d, V": f"{m.n_layer} x {m.n_embd}, {m.vocab_size}",
                "tokens/rank (micro x T)": f"{s.micro_batch} x {s.seq_len}",
                "accum (sync)": f"{s.grad_accum} ({s.grad_sync})",
                "AC": s.checkpointing
                + (
                    f" /{s.ac_every}"
                    if s.checkpointing == "full" and s.ac_every > 1
                    else ""
                ),
                "params + optim": f"{(parts['params'] + parts['optimizer']) / MIB:.1f}",
                "gathered": f"{parts['gathered_units'] / MIB:.1f}",
                "grads": f"{parts['grads'] / MIB:.1f}",
                "activations + loss": f"{(parts['activations'] + parts['loss']) / MIB:.1f}",
                "working set": f"{parts['transient'] / MIB:.1f}",
                "runtime": f"{parts['runtime'] / MIB:.0f}",
                "peak at": est.phase,
                "estimate": f"{est.training / MIB:.1f}",
                "measured": f"{measured / MIB:.1f}",
                "error": f"{error:+.1%}",
                "within 15%": "yes" if abs(error) <= TARGET else "NO",
            }
        )
        print(rows[-1], flush=True)
    table = markdown_table(rows)
    print(table)
    if args.append_docs:
        shown = " ".join(argv if argv is not None else sys.argv[1:])
        append_to_benchmarks(
            "Planner: estimated against measured training peak per rank",
            f"python -m bench.plan_vs_measured {shown}".strip(),
            table,
            note=(
                "All figures MiB per rank, above the process baseline. Estimate: "
                "`Estimate.training` of src/trainer/planner.py (every part but the "
                "process baseline; parts shown: sharded fp32 parameters + AdamW "
                "states, all-gathered units, gradients held at the peak, saved "
                "activations + head/loss, the backward or step working set, the "
                "calibrated runtime constant). Measured: the same config run by the "
                f"trainer's build_model / build_optimizer / train_step for {args.steps} "
                "steps on synthetic tokens, 1 thread per rank; max over ranks of VmHWM "
                "minus the rank's RSS just before the model is built, with "
                "MALLOC_MMAP_THRESHOLD_=65536 (glibc's retention of freed tensors "
                "removed). Common: fsdp2 (unless said), size policy with "
                "min_params=1.5e5 (each block a unit + the root), n_head=4. "
                "Shared 2-core machine: the figures are memory, not time, and "
                "repeat to within ~1 MiB."
            ),
        )
    return rows


if __name__ == "__main__":
    main()
