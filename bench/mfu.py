"""CPU MFU of a small GPT training loop, independent of the trainer.

One process: GPT forward + backward + AdamW step on random tokens, timed per step.
Achieved FLOP/s = tokens/s x ``flops_per_token`` (model FLOPs: 6N + attention, no
recomputation, the GPT spec's ``flops_per_token``). The peak is
``measure_matmul_flops`` in the same dtype, measured in the same run before and
after the loop with the same thread count; MFU = achieved / max(peak before, after).
``fp32`` runs plain fp32; ``bf16`` runs the forward under ``torch.autocast`` (bf16
matmuls, fp32 master weights and optimizer) against the bf16 matmul peak.

    python -m bench.mfu [--threads 1] [--dtypes fp32 bf16] [--append-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from bench.common import publish

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_dtype(args: argparse.Namespace, dtype_name: str) -> dict:
    """Time the training loop in one dtype and return one table row."""
    from src.models import get_spec
    from src.observe.metrics import measure_matmul_flops, model_flops_utilization

    dtype = DTYPES[dtype_name]
    spec = get_spec("gpt")
    cfg = spec.config_cls(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
    )
    torch.manual_seed(0)
    model = spec.build(cfg, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(
        0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen
    )
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def autocast():
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=dtype)

    peak_before = measure_matmul_flops(torch.device("cpu"), dtype, args.peak_seconds)
    times = []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak_after = measure_matmul_flops(torch.device("cpu"), dtype, args.peak_seconds)

    tokens = args.batch_size * args.seq_len
    fpt = spec.flops_per_token(cfg, args.seq_len)
    peak = max(peak_before, peak_after)
    median, best = statistics.median(times), min(times)
    achieved = tokens / median * fpt
    return {
        "dtype": dtype_name,
        "threads": torch.get_num_threads(),
        "params (M)": f"{model.num_params() / 1e6:.1f}",
        "tokens/step": tokens,
        "MFLOP/token": f"{fpt / 1e6:.1f}",
        "step (ms, median)": f"{median * 1e3:.0f}",
        "tokens/s": f"{tokens / median:.0f}",
        "achieved GFLOP/s": f"{achieved / 1e9:.1f}",
        "matmul peak before / after (GFLOP/s)": (
            f"{peak_before / 1e9:.1f} / {peak_after / 1e9:.1f}"
        ),
        "MFU (median step)": _percent(model_flops_utilization(achieved, peak)),
        "MFU (best step)": _percent(model_flops_utilization(tokens / best * fpt, peak)),
        "loss": f"{loss.item():.3f}",
    }


def _percent(mfu: float | None) -> str:
    # None: above 100%, the probe read low (the machine was busy): no false figure
    return "n/a (above the probed peak)" if mfu is None else f"{mfu:.1%}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--peak-seconds", type=float, default=1.0, help="budget of each matmul probe"
    )
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--append-docs", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for dtype_name in args.dtypes:
        rows.append(run_dtype(args, dtype_name))
        print(rows[-1], flush=True)
    publish(
        rows,
        "CPU MFU, small GPT training loop (one process)",
        f"GPT n_layer={args.n_layer}, n_embd={args.n_embd}, "
        f"n_head={args.n_head}, vocab={args.vocab_size}, seq_len="
        f"{args.seq_len}, batch {args.batch_size}; forward + backward + "
        f"AdamW, {args.warmup} warm-up then {args.steps} timed steps. Model "
        "FLOPs (`flops_per_token`: 6N + 12 L d T, no recomputation). Peak = "
        "best square-matmul FLOP/s (`measure_matmul_flops`) in the same "
        "dtype and thread count, before and after the loop; MFU uses the "
        "higher. bf16 = autocast forward (bf16 matmuls) with fp32 weights "
        "and AdamW. Shared machine: timings are noisy.",
        bench="mfu",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
