"""Activation checkpointing and per-block compile: memory and speed, measured.

``memory``: GPT at a long sequence (activations dominate), FSDP2, one unit per block,
2 gloo ranks, 1 thread each; one fresh pair of ranks per mode (none, full, selective),
in the same run. Per rank: the training peak (VmHWM, reset after a warm-up step) above
the baseline (RSS after that step, the model, gradients freed, AdamW state), with
glibc's retention removed (``mallopt(M_MMAP_THRESHOLD, 64 KiB)`` at rank start: freed
tensors go back to the OS, so VmHWM follows live memory; the "mmap 64K" method of
docs/benchmarks.md), next to the planner's estimate of the activations
(``ModelSpec.activation_bytes``); and the median step time.

``compile``: one process, GPT with a small width (elementwise work is a visible share),
eager against ``sharding.compile`` (each block's forward compiled; cold inductor cache
in a fresh temporary directory), built from the same init; steps alternate between the
two so load changes hit both. Compile time = the first compiled step minus the median
compiled step; and the same at two depths, to show it does not grow with depth.

    python -m bench.unit_transforms memory [--append-docs]
    python -m bench.unit_transforms compile [--append-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from bench.common import append_to_benchmarks
from bench.init_memory import malloc_trim, rss_bytes
from src.harness import run_distributed
from src.observe.metrics import set_malloc_mmap_threshold
from src.text import markdown_table

MIB = 2**20
MODES = ("none", "full", "selective")


def gpt(n_layer: int, n_embd: int, n_head: int, seq_len: int, vocab: int = 256):
    from src.models import get_spec

    spec = get_spec("gpt")
    config = spec.config_cls(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        vocab_size=vocab,
        block_size=seq_len,
    )
    return spec, config


def build(spec, config, backend_name: str, mode: str = "none", compile: bool = False):
    from src.sharding import (
        UnitTransform,
        build_backend,
        build_policy,
        build_sharded_model,
    )

    blocks = spec.block_classes(config)
    backend = build_backend(backend_name, "fp32", "cpu")
    return build_sharded_model(
        lambda: spec.build(config, 0),
        backend,
        build_policy("block", block_cls=blocks),
        transform=UnitTransform(mode, 1, compile, targets=blocks),
    )


def step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------- memory


def _memory_rank(rank: int, args: argparse.Namespace, mode: str) -> dict:
    from src.observe.metrics import cpu_peak_rss_bytes, reset_peak_memory

    spec, config = gpt(args.n_layer, args.n_embd, args.n_head, args.seq_len)
    model = build(spec, config, "fsdp2", mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(
        0, config.vocab_size, (args.micro_batch, args.seq_len), generator=gen
    )
    y = torch.roll(x, -1, 1)
    step(model, opt, x, y)  # warm-up: optimizer state, lazy init, first-use buffers
    malloc_trim()
    baseline = rss_bytes()
    reset_peak_memory(torch.device("cpu"))
    for _ in range(args.steps):
        step(model, opt, x, y)
    est = spec.activation_bytes(config, args.micro_batch, args.seq_len, 4, mode, 1)
    return {
        "baseline": baseline,
        "peak": cpu_peak_rss_bytes(),
        "est_saved": est.saved,
        "est_peak": est.peak,
    }


def _speed_rank(rank: int, args: argparse.Namespace) -> dict:
    """Step times of the three modes in the same ranks, steps rotating between them
    (so load changes on a shared machine hit every mode alike)."""
    spec, config = gpt(args.n_layer, args.n_embd, args.n_head, args.seq_len)
    models = {mode: build(spec, config, "fsdp2", mode) for mode in MODES}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(
        0, config.vocab_size, (args.micro_batch, args.seq_len), generator=gen
    )
    y = torch.roll(x, -1, 1)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(args.speed_steps + 1):
        for mode in MODES[i % 3 :] + MODES[: i % 3]:
            dist.barrier()
            times[mode].append(step(models[mode], opts[mode], x, y))
    return {mode: statistics.median(t[1:]) for mode, t in times.items()}


def _mmap_64k(rank: int) -> None:
    set_malloc_mmap_threshold(64)


def _call(rank: int, world: int, fn, args, *extra):
    return fn(rank, args, *extra)


def spawn(fn, world: int, args, *extra) -> list[dict]:
    """``fn(rank, args, *extra)`` on ``world`` fresh gloo ranks; per-rank results."""
    return run_distributed(_call, world, fn, args, *extra, timeout=600, setup=_mmap_64k)


def memory(args: argparse.Namespace) -> list[dict]:
    results = {mode: spawn(_memory_rank, args.world, args, mode) for mode in MODES}
    speed = spawn(_speed_rank, args.world, args)
    step_s = {mode: max(r[mode] for r in speed) for mode in MODES}
    base_act = max(r["peak"] - r["baseline"] for r in results["none"])
    tokens = args.micro_batch * args.seq_len * args.world
    rows = []
    for mode, ranks in results.items():
        worst = max(ranks, key=lambda r: r["peak"] - r["baseline"])
        above = worst["peak"] - worst["baseline"]
        rows.append(
            {
                "activation_checkpointing": mode,
                "baseline (MiB)": f"{worst['baseline'] / MIB:.0f}",
                "peak/rank (MiB)": f"{worst['peak'] / MIB:.0f}",
                "peak - baseline (MiB)": f"{above / MIB:.0f}",
                "vs none": f"{above / base_act:.2f}",
                "planner: activations kept / peak (MiB)": (
                    f"{worst['est_saved'] / MIB:.0f} / {worst['est_peak'] / MIB:.0f}"
                ),
                "step (s, median)": f"{step_s[mode]:.2f}",
                "tokens/s": f"{tokens / step_s[mode]:.0f}",
                "tokens/s vs none": f"{step_s['none'] / step_s[mode]:.2f}",
            }
        )
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------------ compile


def _compile_run(args: argparse.Namespace, n_layer: int) -> dict:
    """Eager and compiled models from the same init, steps alternating."""
    torch.set_num_threads(args.threads)
    spec, config = gpt(n_layer, args.c_embd, args.c_head, args.c_seq_len)
    models = {
        "eager": build(spec, config, "none"),
        "compiled": build(spec, config, "none", compile=True),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(
        0, config.vocab_size, (args.c_batch, args.c_seq_len), generator=gen
    )
    y = torch.roll(x, -1, 1)
    times = {k: [] for k in models}
    losses = {}
    for _ in range(args.c_steps + 1):
        for name, model in models.items():
            times[name].append(step(model, opts[name], x, y))
        for name, model in models.items():
            with torch.no_grad():
                losses[name] = model(x, y)[1].item()
    first = times["compiled"][0]
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {
        "n_layer": n_layer,
        "compile_s": first - med["compiled"],
        "eager_s": med["eager"],
        "compiled_s": med["compiled"],
        "loss_diff": abs(losses["eager"] - losses["compiled"]),
        "tokens": args.c_batch * args.c_seq_len,
    }


def _compile_child(args_json: str, n_layer: int) -> None:
    """One fresh process per depth, with its own cold inductor cache."""
    args = argparse.Namespace(**json.loads(args_json))
    print("RESULT " + json.dumps(_compile_run(args, n_layer)), flush=True)


def compile_bench(args: argparse.Namespace) -> list[dict]:
    import subprocess

    rows = []
    for n_layer in args.c_layers:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            code = (
                "import sys; from bench.unit_transforms import _compile_child; "
                "_compile_child(sys.argv[1], int(sys.argv[2]))"
            )
            out = subprocess.run(
                [sys.executable, "-c", code, json.dumps(vars(args)), str(n_layer)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
        line = next(s for s in out.stdout.splitlines() if s.startswith("RESULT "))
        r = json.loads(line[len("RESULT ") :])
        rows.append(
            {
                "n_layer": r["n_layer"],
                "compile time (s)": f"{r['compile_s']:.1f}",
                "eager step (ms)": f"{r['eager_s'] * 1e3:.0f}",
                "compiled step (ms)": f"{r['compiled_s'] * 1e3:.0f}",
                "eager tokens/s": f"{r['tokens'] / r['eager_s']:.0f}",
                "compiled tokens/s": f"{r['tokens'] / r['compiled_s']:.0f}",
                "compiled / eager tokens/s": f"{r['eager_s'] / r['compiled_s']:.2f}",
                "|loss diff| after the run": f"{r['loss_diff']:.1e}",
            }
        )
        print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("memory", "compile"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--steps", type=int, default=2, help="measured steps per mode")
    p.add_argument("--speed-steps", type=int, default=6, help="timed steps per mode")
    p.add_argument("--c-layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--c-embd", type=int, default=64)
    p.add_argument("--c-head", type=int, default=2)
    p.add_argument("--c-seq-len", type=int, default=256)
    p.add_argument("--c-batch", type=int, default=8)
    p.add_argument("--c-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--append-docs", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cmd = "python -m bench.unit_transforms " + " ".join(argv or sys.argv[1:])
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start"
    if args.part == "memory":
        rows = memory(args)
        title = (
            f"Activation checkpointing: training peak and speed, GPT n_layer="
            f"{args.n_layer} n_embd={args.n_embd} seq {args.seq_len}, "
            f"{args.world} gloo ranks"
        )
        note = (
            f"FSDP2, one unit per block, fp32, {args.micro_batch} sequences per rank, "
            "1 thread per rank; one fresh pair of ranks per mode. Baseline: RSS after "
            "a warm-up step (model, AdamW state; gradients freed); peak: VmHWM over "
            f"{args.steps} steps after it, glibc retention removed (M_MMAP_THRESHOLD "
            "64 KiB). Worst rank. Step times: a separate pair of ranks holding the three "
            f"models, {args.speed_steps} steps each, rotating between modes; "
            "median, slower rank. `vs none`: peak - baseline over none's. Planner: "
            "the GPT spec's activation_bytes (kept for backward / its peak with the "
            "head, loss and one block's backward). Shared, loaded machine "
            f"({load}): step times are noisy, ratios are from the same run."
        )
    else:
        rows = compile_bench(args)
        title = (
            f"Per-block compile against eager, GPT n_embd={args.c_embd} seq "
            f"{args.c_seq_len} batch {args.c_batch}, one process"
        )
        note = (
            f"sharding=none, fp32, {args.threads} thread(s); eager and compiled models "
            "from the same init, steps alternating; compile time = first compiled step "
            "- median compiled step, cold inductor cache (one fresh process and cache "
            "per depth). Width 64: LayerNorm, GELU, adds and the softmax are a large "
            f"share of the work, which inductor fuses. Shared, loaded machine ({load})."
        )
    table = markdown_table(rows)
    print(table)
    if args.append_docs:
        append_to_benchmarks(title, cmd, table, note)
    return rows


if __name__ == "__main__":
    main()
