"""Planning cost of auto_wrap against module count, next to torch's FSDP1 recursion.

Both plan the same models on the meta device (nothing is allocated, nothing sharded):

- ours: ``src.sharding.choose_auto_wrap_units`` (one post-order pass, subtree sizes cached);
- torch: ``torch.distributed.fsdp.wrap._recursive_wrap`` with
  ``size_based_auto_wrap_policy`` and a wrapper that returns the module unchanged: the
  recursion FSDP1's ``auto_wrap_policy`` runs, which re-sums ``parameters()`` at every
  level.

Two shapes: ``stack`` (a transformer-like stack: blocks of 4 Linears in 2 Sequentials)
and ``deep`` (Sequentials nested ``depth`` levels, each holding a Linear), where
re-summing costs O(modules x depth).

    python -m bench.plan_cost --modules 1000 10000 100000 [--append-docs]
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import torch
import torch.nn as nn
from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

from bench.common import publish
from src.sharding import choose_auto_wrap_units

MIN_PARAMS = 10_000


def stack_model(n_modules: int) -> nn.Module:
    """~n_modules modules: blocks of (Sequential(Linear, Linear), Sequential(Linear, Linear))."""
    n_blocks = max(1, n_modules // 7)
    with torch.device("meta"):
        return nn.Sequential(
            *[
                nn.Sequential(
                    nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)),
                    nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)),
                )
                for _ in range(n_blocks)
            ]
        )


def deep_model(n_modules: int, depth: int = 100) -> nn.Module:
    """Chains of Sequentials nested ``depth`` deep, each level holding one Linear."""
    chains = []
    with torch.device("meta"):
        for _ in range(max(1, n_modules // (2 * depth))):
            inner: nn.Module = nn.Linear(16, 16)
            for _ in range(depth - 1):
                inner = nn.Sequential(nn.Linear(16, 16), inner)
            chains.append(inner)
        return nn.Sequential(*chains)


def time_ours(model: nn.Module) -> float:
    t0 = time.perf_counter()
    choose_auto_wrap_units(model, min_num_params=MIN_PARAMS)
    return time.perf_counter() - t0


def time_torch(model: nn.Module) -> float:
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=MIN_PARAMS)
    t0 = time.perf_counter()
    _recursive_wrap(
        model,
        auto_wrap_policy=policy,
        wrapper_cls=lambda m, **_: m,
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    return time.perf_counter() - t0


def best_of(fn, model, repeats: int) -> float:
    return min(fn(model) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args()

    rows = []
    for shape, build in (("stack", stack_model), ("deep", deep_model)):
        for n in args.modules:
            model = build(n)
            modules = sum(1 for _ in model.modules())
            ours = best_of(time_ours, model, args.repeats)
            theirs = best_of(time_torch, model, args.repeats)
            rows.append(
                {
                    "shape": shape,
                    "modules": modules,
                    "auto_wrap plan (ms)": f"{ours * 1e3:.1f}",
                    "us / module": f"{ours / modules * 1e6:.2f}",
                    "torch _recursive_wrap (ms)": f"{theirs * 1e3:.1f}",
                    "torch / ours": f"{theirs / ours:.1f}x",
                }
            )
            print(rows[-1], flush=True)
    publish(
        rows,
        "auto_wrap planning cost",
        f"min_num_params={MIN_PARAMS}, best of {args.repeats}, "
        f"on {platform.processor() or platform.machine()}, torch {torch.__version__}",
        bench="plan_cost",
        argv=None,
        append=args.append_docs,
    )


if __name__ == "__main__":
    main()
