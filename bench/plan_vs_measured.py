"""The plan-only per-rank memory estimate against a real run's measured peak (CPU).

For each config: ``python train.py trainer.plan_only=true ...`` gives the estimate
(sharded fp32 params + grads + 2 AdamW states + the 2 largest units all-gathered),
then a real 2-rank run of the same config (synthetic tokens, a few steps) gives
``peak_mem_gib`` (max over ranks of VmHWM, model construction included). The process
baseline is the resident set of a rank that has done what a trainer rank does before
building the model (imports of src.trainer.loop, gloo process group, FSDP2 mesh,
synthetic data), measured on 2 spawned ranks. ``measured - baseline - estimate`` is
what the estimate leaves out: activations (and the autograd graph), the loss's fp32
logits, gloo and allocator buffers, and runtime state first touched while training.
Each real run is done twice: with glibc's default malloc, and with its mmap threshold
fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``), which separates the memory glibc
keeps after tensors are freed (counted by VmHWM) from memory really in use.

    python -m bench.plan_vs_measured [--steps 5] [--append-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import append_to_benchmarks
from src.sharding import GIB, MIB
from src.trainer.loggers import markdown_table

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
CONFIGS = {
    # The default run's model.
    "small": ["model=small"],
    # ~57M parameters, so parameters and optimizer states dominate the estimate.
    "small, 8 x 768": [
        "model=small",
        "model.n_layer=8",
        "model.n_embd=768",
        "model.n_head=12",
        "trainer.batch_size=4",
    ],
}
# Peak RSS with glibc's defaults, and with its mmap threshold fixed at 64 KiB: by
# default the threshold rises to the largest freed mmapped block (up to 32 MiB), after
# which freed tensors stay in the heap and count in VmHWM.
ALLOCATORS = {"": {}, " (mmap 64K)": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
COMMON = ["data=synthetic", "logger=none", f"trainer.devices={WORLD}"]


def train_py(overrides: list[str], run_dir: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def _baseline_worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    import src.trainer.loop  # noqa: F401  (what a trainer rank imports)
    from src.sharding import build_backend
    from src.trainer.data import GlobalBatches, load_splits

    store = dist.FileStore(os.path.join(out_dir, "store"), WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    try:
        build_backend("fsdp2", "fp32", "cpu")
        train, _ = load_splits(
            SimpleNamespace(name="synthetic", num_tokens=1_000_000), 256, 0
        )
        GlobalBatches(train, 16, 128, 0).get(0, 0, rank, WORLD)
        dist.barrier()
        with open("/proc/self/status") as f:
            rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        with open(os.path.join(out_dir, f"rss_{rank}"), "w") as f:
            f.write(str(rss * 1024))
    finally:
        dist.destroy_process_group()


def process_baseline() -> int:
    """Max over 2 ranks of the RSS just before a trainer rank would build the model."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _baseline_worker, args=(out_dir,), nprocs=WORLD, start_method="spawn"
        )
        return max(int(Path(out_dir, f"rss_{r}").read_text()) for r in range(WORLD))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--append-docs", action="store_true")
    args = p.parse_args(argv)

    baseline = process_baseline()
    print(f"process baseline (max over ranks): {baseline / MIB:.0f} MiB", flush=True)
    rows = []
    for name in args.configs:
        overrides = CONFIGS[name] + COMMON
        with tempfile.TemporaryDirectory() as plan_dir:
            est = train_py(overrides + ["trainer.plan_only=true"], plan_dir)
        peaks = {}
        for label, env in ALLOCATORS.items():
            with tempfile.TemporaryDirectory() as run_dir:
                run = train_py(
                    overrides
                    + [
                        f"trainer.max_steps={args.steps}",
                        "trainer.log_every=1",
                        "trainer.val_every=0",
                        "trainer.progress=false",
                    ],
                    run_dir,
                    env,
                )
            peaks[label] = run["peak_mem_gib"] * GIB
        row = {
            "config": name,
            "params (M)": f"{run['num_params'] / 1e6:.2f}",
            "units": est["wrap_units"],
            "est. params": f"{est['params_gib'] * GIB / MIB:.1f}",
            "est. grads": f"{est['grads_gib'] * GIB / MIB:.1f}",
            "est. optimizer": f"{est['optimizer_gib'] * GIB / MIB:.1f}",
            "est. unsharded units": f"{est['unsharded_units_gib'] * GIB / MIB:.1f}",
            "est. total": f"{est['total_gib'] * GIB / MIB:.1f}",
            "baseline": f"{baseline / MIB:.0f}",
        }
        for label, peak in peaks.items():
            rest = peak - baseline - est["total_gib"] * GIB
            row[f"peak{label}"] = f"{peak / MIB:.0f}"
            row[f"peak - baseline{label}"] = f"{(peak - baseline) / MIB:.0f}"
            row[f"left out{label}"] = f"{rest / MIB:.0f}"
        rows.append(row)
        print(rows[-1], flush=True)
    table = markdown_table(rows)
    print(table)
    if args.append_docs:
        shown = " ".join(argv if argv is not None else sys.argv[1:])
        append_to_benchmarks(
            "Plan-only memory estimate against a measured 2-rank peak",
            f"python -m bench.plan_vs_measured {shown}",
            table,
            note=(
                "All figures MiB per rank. Estimate: `python train.py "
                "trainer.plan_only=true <config> "
                + " ".join(COMMON)
                + "` (summary.json). Measured: the same config trained for "
                f"{args.steps} steps (fsdp2, size policy, min_params=1.5e5, fp32, "
                "synthetic data), `peak_mem_gib` = max over ranks of VmHWM since just "
                "before model construction. Baseline: RSS of a rank after the "
                "trainer's imports, gloo process group, FSDP2 mesh and synthetic data, "
                "before the model. `(mmap 64K)`: the same run with "
                "MALLOC_MMAP_THRESHOLD_=65536 (glibc then returns every freed block "
                "above 64 KiB to the OS; by default the threshold grows to 32 MiB and "
                "freed tensors stay in the heap, so VmHWM also counts freed memory). "
                "left out = peak - baseline - est. total. The estimate leaves out activations and the "
                "autograd graph (with the fp32 logits of the loss), gloo and allocator "
                "buffers, and runtime state first touched during training."
            ),
        )
    return rows


if __name__ == "__main__":
    main()
