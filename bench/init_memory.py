"""Peak host memory per rank while building a multi-GB GPT, with and without the wrap
context, on N gloo ranks (CPU).

Four modes, each run on a fresh set of ranks, one mode after another:

- ``none``: every rank builds the whole model unsharded (no wrapping);
- ``after``: every rank builds the whole model, then wraps it (FSDP2 per block + root);
- ``cpu``: built inside the wrap context (``build_sharded_model(..., "cpu")``): each
  block is sharded the moment it exists;
- ``meta``: built on meta inside the wrap context, then only the local shards are
  allocated and filled (``init_device="meta"`` + ``init_fn``).

Per rank: ``baseline`` is the resident set (VmRSS) after imports, process-group and
mesh init; VmHWM is reset (``/proc/self/clear_refs``) right before the build and read
right after it (``peak``). ``P/N`` is the fp32 parameter bytes over the ranks. The
issue's targets: ``peak / (P/N + baseline)`` at most 1.3 for ``cpu`` and 1.15 for
``meta``; ``(peak - baseline) / (P/N)`` near N for ``none``.

    python -m bench.init_memory --model-params-gb 3.5 --ranks 2 [--append-docs]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import os
import time

import torch

from bench.common import publish
from src.harness import run_distributed
from src.observe.metrics import set_malloc_mmap_threshold
from src.sharding import GIB

MODES = ("none", "after", "cpu", "meta")
# Target for peak / (P/N + baseline), from the issue.
TARGETS = {"cpu": 1.3, "meta": 1.15}


# ------------------------------------------------------------------ process memory


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """Current resident set of this process."""
    return _status_kib("VmRSS") * 1024


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def malloc_trim() -> bool:
    """Give glibc's free heap memory back to the OS (no-op without glibc)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if hasattr(libc, "malloc_trim") else False


# Allocator variants (glibc malloc settings in the ranks).
ALLOCATORS = {
    "default": "glibc defaults",
    "arena2": "MALLOC_ARENA_MAX=2 in the ranks' environment",
    "mmap1m": "mallopt(M_MMAP_THRESHOLD, 1 MiB) at rank start (fixed threshold)",
    "trim-per-unit": "malloc_trim(0) after each unit is wrapped",
}


# ------------------------------------------------------------------ model and modes


def gpt_config(args: argparse.Namespace):
    """GPTConfig from the shape args; n_layer derived from --model-params-gb if unset."""
    from src.models import get_spec

    spec = get_spec("gpt")
    GPTConfig, count_params = spec.config_cls, spec.num_params

    d = args.n_embd
    n_head = args.n_head or (d // 128 if d % 128 == 0 else 1)
    n_layer = args.n_layer
    if n_layer is None:
        shape = (n_head, d, args.vocab_size, args.block_size)
        per_block = count_params(GPTConfig(2, *shape)) - count_params(
            GPTConfig(1, *shape)
        )
        rest = count_params(GPTConfig(1, *shape)) - per_block
        target = args.model_params_gb * GIB / 4
        n_layer = max(1, round((target - rest) / per_block))
    return GPTConfig(
        n_layer=n_layer,
        n_head=n_head,
        n_embd=d,
        vocab_size=args.vocab_size,
        block_size=args.block_size,
    )


def _build(mode: str, cfg, backend, seed: int = 0):
    """A function that builds the model as ``mode`` says, with ``backend``."""
    from src.models import get_spec
    from src.sharding import build_policy, build_sharded_model

    spec = get_spec("gpt")

    policy = build_policy("block", block_cls=spec.block_classes(cfg))
    if mode == "none":
        return lambda: spec.build(cfg, seed)

    if mode == "after":

        def build():
            model = spec.build(cfg, seed)  # whole, unsharded
            with backend.wrap_context(policy):
                model = policy.finalize(model)  # FSDP2 per block
                return backend.wrap_root(model)  # then the root

        return build
    if mode == "cpu":
        return lambda: build_sharded_model(
            lambda: spec.build(cfg, seed), backend, policy, "cpu"
        )
    if mode == "meta":

        def init_fn(name: str, t: torch.Tensor) -> torch.Tensor:
            return spec.init_tensor(name, t.shape, cfg, seed)

        return lambda: build_sharded_model(
            lambda: spec.build(cfg, seed), backend, policy, "meta", init_fn
        )
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


def _local_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds (local shards for DTensors)."""
    seen, total = set(), 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _trim_after_each_unit(backend) -> None:
    """Make ``backend``'s wrapper call malloc_trim after each unit it wraps."""
    inner = backend.wrapper

    def wrapper():
        fn, defaults = inner()

        def trimmed(module, **kwargs):
            out = fn(module, **kwargs)
            malloc_trim()
            return out

        return trimmed, defaults

    backend.wrapper = wrapper


def _measure(
    mode: str, cfg, world: int, warmup: bool = True, allocator: str = "default"
) -> dict:
    """Runs in each rank: build the model in ``mode`` and measure its peak RSS.

    With ``warmup``, a 1-layer, 64-wide model is built the same way first and thrown
    away, so one-time costs (lazy imports, code pages, first-use allocations: about
    35 MiB) land in the baseline instead of in the measured build."""
    from src.observe.metrics import cpu_peak_rss_bytes, reset_peak_memory
    from src.sharding import build_backend, wrap_plan

    # The backend (FSDP2: its device mesh) is part of the baseline.
    backend = build_backend("none" if mode == "none" else "fsdp2", "fp32", "cpu")
    if allocator == "trim-per-unit" and backend.wraps_units:
        _trim_after_each_unit(backend)
    if warmup:
        tiny = dataclasses.replace(cfg, n_layer=1, n_embd=64, n_head=1, vocab_size=64)
        _build(mode, tiny, backend)()
    build = _build(mode, cfg, backend)
    gc.collect()
    malloc_trim()
    baseline = rss_bytes()
    reset_peak_memory(torch.device("cpu"))
    t0 = time.perf_counter()
    model = build()
    build_s = time.perf_counter() - t0
    peak = cpu_peak_rss_bytes()
    after = rss_bytes()
    malloc_trim()
    after_trim = rss_bytes()
    plan = wrap_plan(model, world)
    return {
        "baseline": baseline,
        "peak": peak,
        "after": after,
        "after_trim": after_trim,
        "local_param_bytes": _local_param_bytes(model),
        "plan_bytes_per_rank": plan.bytes_per_rank() if plan.units else None,
        "build_s": build_s,
    }


def _mmap_1m(rank: int) -> None:
    set_malloc_mmap_threshold(1024)


def _rank(rank: int, world: int, mode: str, cfg, warmup: bool, allocator: str) -> dict:
    return _measure(mode, cfg, world, warmup, allocator)


def run_mode(
    mode: str,
    cfg,
    world: int,
    allocator: str = "default",
    warmup: bool = True,
) -> list[dict]:
    """Spawn ``world`` fresh gloo ranks that build the model in ``mode``; per-rank
    results. ``allocator`` is one of ``ALLOCATORS``."""
    env = {"MALLOC_ARENA_MAX": "2"} if allocator == "arena2" else {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        setup = _mmap_1m if allocator == "mmap1m" else None
        return run_distributed(
            _rank, world, mode, cfg, warmup, allocator, timeout=600, setup=setup
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def summarize(
    mode: str, allocator: str, ranks: list[dict], world: int, param_bytes: int
) -> dict:
    """One table row: the worst rank's figures (the rank that decides whether it fits)
    over all ranks and repeats, and the lowest peak beside it."""
    ideal = param_bytes / world
    worst = max(ranks, key=lambda r: r["peak"])
    base, peak = worst["baseline"], worst["peak"]
    ratio = peak / (ideal + base)
    target = TARGETS.get(mode)
    plan = worst["plan_bytes_per_rank"]
    return {
        "mode": mode,
        "allocator": allocator,
        "baseline (GiB)": f"{base / GIB:.3f}",
        "peak/rank (GiB)": f"{peak / GIB:.3f}",
        "lowest peak (GiB)": f"{min(r['peak'] for r in ranks) / GIB:.3f}",
        "peak - baseline (GiB)": f"{(peak - base) / GIB:.3f}",
        "P/N (GiB)": f"{ideal / GIB:.3f}",
        "plan estimate/rank (GiB)": "-" if plan is None else f"{plan / GIB:.3f}",
        "local params (GiB)": f"{worst['local_param_bytes'] / GIB:.3f}",
        "peak / (P/N + baseline)": f"{ratio:.3f}",
        "(peak - baseline) / (P/N)": f"{(peak - base) / ideal:.3f}",
        "target": (
            "-"
            if target is None
            else f"<= {target} {'ok' if ratio <= target else 'MISSED'}"
        ),
        "RSS after build (GiB)": f"{worst['after'] / GIB:.3f}",
        "after malloc_trim (GiB)": f"{worst['after_trim'] / GIB:.3f}",
        "build (s)": f"{worst['build_s']:.1f}",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-params-gb",
        type=float,
        default=3.5,
        help="total fp32 parameter GiB; sets n_layer unless --n-layer is given",
    )
    parser.add_argument("--n-layer", type=int, default=None)
    parser.add_argument("--n-embd", type=int, default=1536)
    parser.add_argument("--n-head", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--allocators",
        nargs="+",
        choices=ALLOCATORS,
        default=["default"],
        help="glibc malloc variants to run each mode under: "
        + "; ".join(f"{k}: {v}" for k, v in ALLOCATORS.items()),
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh runs per mode and allocator"
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the tiny warm-up build before the baseline",
    )
    parser.add_argument("--append-docs", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    from src.models import get_spec

    cfg = gpt_config(args)
    n_params = get_spec("gpt").num_params(cfg)
    param_bytes = 4 * n_params
    block_bytes = 4 * (12 * cfg.n_embd**2 + 13 * cfg.n_embd)
    largest = 4 * max(4 * cfg.n_embd**2, cfg.vocab_size * cfg.n_embd)
    print(
        f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} n_head={cfg.n_head} "
        f"vocab={cfg.vocab_size}: {n_params / 1e6:.0f}M params, "
        f"{param_bytes / GIB:.2f} GiB fp32; one block {block_bytes / 2**20:.0f} MiB, "
        f"largest parameter {largest / 2**20:.0f} MiB; {args.ranks} ranks",
        flush=True,
    )
    rows = []
    for allocator in args.allocators:
        for mode in args.modes:
            ranks = []
            for repeat in range(args.repeats):
                results = run_mode(mode, cfg, args.ranks, allocator, args.warmup)
                for rank, r in enumerate(results):
                    print(
                        f"  {mode} {allocator} #{repeat} rank {rank}: "
                        + ", ".join(
                            f"{k}={v / GIB:.3f} GiB"
                            for k, v in r.items()
                            if k != "build_s" and v is not None
                        )
                        + f", build {r['build_s']:.1f} s",
                        flush=True,
                    )
                ranks += results
            rows.append(summarize(mode, allocator, ranks, args.ranks, param_bytes))
            print(rows[-1], flush=True)
    allocators = "; ".join(f"`{a}`: {ALLOCATORS[a]}" for a in args.allocators)
    publish(
        rows,
        f"Init memory per rank, {args.ranks} gloo ranks, "
        f"{param_bytes / GIB:.2f} GiB of fp32 parameters",
        f"GPT n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
        f"vocab={cfg.vocab_size} ({n_params / 1e6:.0f}M params; one block "
        f"{block_bytes / 2**20:.0f} MiB). FSDP2, one unit per block + root; "
        f"1 thread per rank. Figures are the worst rank's over {args.repeats} "
        "fresh run(s) (lowest peak: the best rank's); peak is VmHWM reset "
        "right before the build, baseline the RSS after imports, process group "
        "and mesh init. P/N = parameter bytes / ranks; plan estimate = "
        "`wrap_plan(model, N).bytes_per_rank()`. Before the baseline each rank "
        "builds a tiny model the same way (one-time lazy-import and code-page "
        "costs, ~35 MiB, go to the baseline). Expected excess over P/N: "
        "`none`/`after` hold the whole model (about N x P/N); `cpu` one "
        "unsharded block (plus the full embedding until the root is sharded); "
        "`meta` one full `init_fn` temporary of the largest parameter. "
        f"Allocators: {allocators}.",
        bench="init_memory",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
