"""The part of a CPU's profile (src/planner/profiles.py) that only ranks in separate
processes can measure: gloo's collectives between two processes, and what FSDP2 and
tensor parallelism add to a step beyond their collectives.

Two threads of one process (the probe's first way) share the interpreter and a
store in memory: their collectives read 2-3x faster than the ranks' (the step-time
model under-predicted 2-rank runs by 24-277%, docs/benchmarks.md), and FSDP's hooks
and copies or DTensor's per-op dispatch, which dominate a small model's step, were
not measured at all. :func:`measure` starts two processes (``python -m
src.planner.rank_probe RANK DIR``, one thread each, a gloo group over a file store
in DIR); each writes its figures as JSON, read back as numbers, and the slower
rank's figure is the profile's.

Per rank, all timed by wall clock after a barrier (a collective waits for its peer):

- each collective (:data:`~src.planner.profiles.COLLECTIVES`) on a 2-element and a
  1M-element fp32 tensor: its latency and its bandwidth;
- a chain of small MLP blocks trained plain, then with FSDP2 on every block and the
  root: the extra time per unit, less the collectives' latencies the step-time
  model counts for it (two all-gathers and one reduce-scatter), is
  ``fsdp_unit_s``; the same chain 8x wider, less that, over the bytes of its
  collectives, is FSDP's bandwidth (``fsdp_bandwidth``);
- a norm, a scale and a residual add on a sequence shard as DTensors, against the
  same on plain tensors: DTensor's dispatch per op (``dtensor_op_s``);
- a chain of pre-norm MLP blocks under tensor and sequence parallelism (as a
  model's plan splits a block): its extra time, less its collectives at the links'
  figures and its ops at ``dtensor_op_s``, per collective it sent
  (``dtensor_comm_s``; ops and collectives counted on one more step by
  src/planner/tp_census.py, as the planner counts a model's);
- the chain under DDP at both widths (one gradient bucket each): its time per
  bucket (``ddp_bucket_s``) and its bandwidth (``ddp_bandwidth``), all-reduce,
  bucket copies and the gloo thread's share of the rank's core in (the 2-rank
  default GPT under DDP measured 0-48 ms a step above its one-rank step, its 1.6
  MiB all-reduce probed alone 2 ms);
- the clip and a fused AdamW step over the chain's parameters, plain and under
  FSDP2: the extra per parameter tensor is ``dtensor_param_s`` (each dispatched
  through DTensor: 270-490 us against ~20 us plain, which the default GPT's 52
  tensors make 15-25 ms a step);
- the chain's forward and backward for about :data:`SYNC_BURST_S`, then a small
  all-reduce, :data:`SYNC_ROUNDS` times: what a round takes beyond the rank's own
  compute and the all-reduce's latency, over that compute, is ``sync_wait``; the
  same with :data:`SYNC_SHORT_S` of compute a round is ``sync_wait_short`` (the wait
  grows slower than the compute before it: the profile's ``sync_wait_exponent``). Two
  processes running the same work do not finish it together (the kernel, the
  hypervisor, the other rank's gloo threads take a core from one for a while), and
  at each synchronisation the first waits for the second: the trainer's 2-rank
  steps of small models spent 10-20% of the step blocked in collectives that their
  latencies and bytes put at a third of that.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from src.planner.tp_census import TPCensus, count

#: The chain the overheads are measured on: blocks of width x 4*width, a batch of
#: BATCH rows; small, so that the step is its overheads. FSDP's bytes are timed on
#: the same chain at WIDE (8.4 MB a unit): gloo between processes moving tensors of
#: a real model's size, with FSDP's copies, which a 4 MiB collective alone reads
#: at twice the speed.
WIDTH, BLOCKS, BATCH, WIDE = 64, 6, 8, 512
SMALL, LARGE = 2, 1 << 20
#: The wide chain's rows when its collectives run beside compute: each block's
#: forward and backward about its unit's gathers and scatter (~35 ms here), as a
#: model's units do where FSDP prefetches the next unit's parameters.
LOADED_ROWS = 192
#: The chains' extra seconds each rank reports.
EXTRAS = ("fsdp_extra_s", "fsdp_wide_extra_s", "fsdp_loaded_extra_s",
          "tp_extra_s", "ddp_extra_s", "ddp_wide_extra_s", "dtensor_param_s",
          "dtensor_op_s", "sync_wait", "sync_burst_s", "sync_wait_short",
          "sync_short_burst_s")  # fmt: skip
#: :func:`_sync_wait`'s compute between two all-reduces (a small model's forward
#: and backward) and its rounds; the short one's (a tensor- or expert-parallel
#: block's compute between two collectives).
SYNC_BURST_S, SYNC_ROUNDS = 0.01, 80
SYNC_SHORT_S, SYNC_SHORT_ROUNDS = 0.001, 300
#: The figures the profile takes as the two ranks' mean, not the slower's.
_MEANS = ("sync_wait", "sync_burst_s", "sync_wait_short", "sync_short_burst_s")
_TIMEOUT_S = 120


def _timed(fn, repeats: int = 7, warmup: int = 2, agg=statistics.median) -> float:
    """Median (or ``agg``) wall seconds of ``fn`` over ``repeats`` (after ``warmup``),
    each after a barrier so both ranks start it together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return agg(times)


def _calls(rank: int, n: int) -> dict:
    """Each collective on ``n`` fp32 elements, as a call."""
    x, half, gathered, out = (torch.ones(n), torch.empty(n // 2),
                              torch.empty(2 * n), torch.empty(n))  # fmt: skip
    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, x),
        "all_to_all": lambda: dist.all_to_all_single(out, x),
        "p2p": lambda: dist.send(x, 1) if rank == 0 else dist.recv(x, 0),
    }


def _collectives(rank: int, rounds: int = 3) -> dict[str, list[float]]:
    """Each collective's seconds on a small and a large fp32 tensor: the least of
    ``rounds`` medians (a loopback collective between two busy cores reads 3-4 ms
    instead of 0.3 for a second or so at times: one round met it in 3 tries)."""
    out: dict[str, list[float]] = {}
    for n in (SMALL, LARGE):
        calls = _calls(rank, n)
        for name, call in calls.items():
            times = [_timed(call, repeats=5, warmup=2) for _ in range(rounds)]
            out.setdefault(name, []).append(min(times))
    return out


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def unit_numel(width: int) -> int:
    """Parameters of one chain block (a unit under FSDP)."""
    return sum(p.numel() for p in _Block(width).parameters())


def _chain(width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(width) for _ in range(BLOCKS)))


def _optimizer_time(model: nn.Module) -> float:
    """Median seconds of the clip and a fused AdamW step (and zeroing) after a
    backward, as the trainer's step runs them."""
    x = torch.randn(BATCH, WIDTH)
    opt = torch.optim.AdamW(model.parameters(), fused=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    def backward() -> None:
        model(x).sum().backward()

    times = []
    for _ in range(9):
        backward()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def _dtensor_optimizer_extra() -> float:
    """Seconds per parameter tensor FSDP2's DTensors add to the clip and the
    optimizer step (each tensor dispatched through DTensor)."""
    from torch.distributed.fsdp import fully_shard

    plain = _optimizer_time(_chain())
    model = _chain()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    tensors = sum(1 for _ in model.parameters())
    return (_optimizer_time(model) - plain) / tensors


def _sync_wait(
    latency_s: float, burst_s: float = SYNC_BURST_S, rounds: int = SYNC_ROUNDS
) -> tuple[float, float]:
    """Seconds the ranks lose waiting for each other per second of compute between
    two synchronisations, with about ``burst_s`` of compute between them (module
    docstring): the mean round less this rank's mean compute and the all-reduce's
    ``latency_s`` (the profile's, which the step-time model counts already), over
    its mean compute; and that mean compute (whole passes of the chain: at least
    one, ~1-2.5 ms here, where ``burst_s`` is shorter)."""
    model, x, small = _chain(), torch.randn(BATCH, WIDTH), torch.zeros(SMALL)

    def once() -> None:
        model(x).sum().backward()

    once()
    t0 = time.perf_counter()
    for _ in range(5):
        once()
    # both ranks run the same number of passes: the slower rank's count
    n = torch.tensor([max(1, round(burst_s * 5 / (time.perf_counter() - t0)))])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    spent, computes = [], []
    dist.barrier()
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(int(n)):
            once()
        t1 = time.perf_counter()
        dist.all_reduce(small)
        spent.append(time.perf_counter() - t0)
        computes.append(t1 - t0)
    compute = statistics.mean(computes)
    return max(0.0, statistics.mean(spent) - compute - latency_s) / compute, compute


def _step_time(
    model: nn.Module,
    width: int = WIDTH,
    x: torch.Tensor | None = None,
    repeats: int = 9,
) -> float:
    """The chain's forward and backward on ``x`` (default ``BATCH`` rows of
    ``width``): the least of ``repeats`` runs. A framework figure is the difference
    of two of these, and with medians FSDP's time per unit read 2.3 ms, 2.7 and 6.1
    in three probes of one hour."""
    x = torch.randn(BATCH, width) if x is None else x

    def step() -> None:
        model(x).sum().backward()

    return _timed(step, repeats=repeats, agg=min)


def _fsdp_extra(width: int = WIDTH, rows: int = BATCH, repeats: int = 9) -> float:
    """Seconds FSDP2 adds to the chain's forward and backward (every block a unit)
    on ``rows`` rows."""
    from torch.distributed.fsdp import fully_shard

    x = torch.randn(rows, width)
    plain = _step_time(_chain(width), x=x, repeats=repeats)
    model = _chain(width)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return _step_time(model, x=x, repeats=repeats) - plain


def _ddp_extra(width: int = WIDTH) -> float:
    """Seconds DDP adds to the chain's forward and backward (its gradients in one
    bucket at either width)."""
    from torch.nn.parallel import DistributedDataParallel

    plain = _step_time(_chain(width), width)
    return _step_time(DistributedDataParallel(_chain(width)), width) - plain


def _dtensor_op_extra() -> float:
    """Seconds DTensor's dispatch adds per op it dispatches, no collective among
    them: a block's norm, scale and residual, forward and backward, on a sequence
    shard (sequence parallelism's) against the same on plain tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from src.sharding.layout import flat_mesh

    mesh = flat_mesh("cpu", 2)
    x = torch.randn(BATCH, 2 * WIDTH, WIDTH)
    weight, bias = torch.ones(WIDTH), torch.zeros(WIDTH)

    def norm_residual(x, weight, bias) -> None:
        y = nn.functional.layer_norm(x, (WIDTH,), weight, bias)
        (y * 2.0 + x).sum().backward()

    plain_args = [t.clone().requires_grad_() for t in (x, weight, bias)]
    shard = distribute_tensor(x, mesh, [Shard(1)])
    dt_args = [shard] + [
        distribute_tensor(t, mesh, [Replicate()]) for t in (weight, bias)
    ]
    dt_args = [t.detach().requires_grad_() for t in dt_args]
    plain = _timed(lambda: norm_residual(*plain_args), repeats=15)
    dtensor = _timed(lambda: norm_residual(*dt_args), repeats=15)
    ops = count(None, lambda _: norm_residual(*dt_args)).dtensor_ops
    return max(0.0, dtensor - plain) / max(1, ops)


class _NormBlock(nn.Module):
    """A pre-norm MLP block with its residual: what sequence parallelism splits."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = _Block(width).mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _tp_extra() -> tuple[float, TPCensus]:
    """Seconds tensor and sequence parallelism add to a chain of pre-norm MLP blocks
    (as a model's plan splits them: the norm on a sequence shard, the sequence
    gathered before the MLP, column- then row-wise, its output reduce-scattered
    back), and what they dispatched and sent (counted on one more step, untimed).
    The plain chain runs a rank's share of the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from src.sharding.layout import flat_mesh

    def chain() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(_NormBlock(WIDTH) for _ in range(BLOCKS)))

    x = torch.randn(BATCH // 2, 8, WIDTH)  # a rank's shard of 16 positions
    plain_model = chain()
    mesh, model = flat_mesh("cpu", 2), chain()
    plan = {
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model:
        parallelize_module(block, mesh, plan)
    # the median of 5 rounds' differences: one round's moved by a third between
    # two probes a minute apart
    extra = statistics.median(
        _step_time(model, x=x) - _step_time(plain_model, x=x) for _ in range(5)
    )
    return extra, count(model, lambda m: m(x).sum().backward())


def rank_main(rank: int, where: str) -> None:
    """One of the two probe ranks: measure, write ``rank<R>.json`` in ``where``."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(where, "store"), 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        collectives = _collectives(rank)
        latency = collectives["all_reduce"][0]
        tp_extra, tp = _tp_extra()
        figures = {
            "collectives": collectives,
            "fsdp_extra_s": _fsdp_extra(),
            "fsdp_wide_extra_s": _fsdp_extra(WIDE),
            "fsdp_loaded_extra_s": _fsdp_extra(WIDE, LOADED_ROWS, repeats=3),
            "tp_extra_s": tp_extra,
            "tp_dtensor_ops": tp.dtensor_ops,
            "tp_collectives": {k: list(v) for k, v in tp.collectives.items()},
            "ddp_extra_s": _ddp_extra(),
            "ddp_wide_extra_s": _ddp_extra(WIDE),
            "dtensor_param_s": _dtensor_optimizer_extra(),
            "dtensor_op_s": _dtensor_op_extra(),
        }
        wait, burst = _sync_wait(latency)
        short, short_burst = _sync_wait(latency, SYNC_SHORT_S, SYNC_SHORT_ROUNDS)
        figures |= {"sync_wait": wait, "sync_burst_s": burst,
                    "sync_wait_short": short, "sync_short_burst_s": short_burst}  # fmt: skip
    finally:
        dist.destroy_process_group()
    Path(where, f"rank{rank}.json").write_text(json.dumps(figures))


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"rank probe: {what} is not a number")
    return float(value)


def _census(ops, collectives) -> TPCensus:
    """The TP chain's counts as a rank wrote them (kind -> [count, bytes]), checked."""
    from src.planner.profiles import COLLECTIVES

    if not isinstance(collectives, dict):
        raise ValueError("rank probe: tp_collectives is not a mapping")
    out = {}
    for kind, item in collectives.items():
        if kind not in COLLECTIVES or not (isinstance(item, list) and len(item) == 2):
            raise ValueError(f"rank probe: tp_collectives holds {kind!r}: {item!r}")
        n, nbytes = (int(_number(v, f"tp_collectives {kind}")) for v in item)
        out[kind] = (n, nbytes)
    return TPCensus(int(_number(ops, "tp_dtensor_ops")), out)


def _read(path: Path) -> dict:
    """One rank's figures, every one checked to be a number."""
    raw = json.loads(path.read_text())
    out = {
        "collectives": {
            name: [_number(t, name) for t in times]
            for name, times in raw["collectives"].items()
        },
        **{k: _number(raw[k], k) for k in EXTRAS},
        "tp_census": _census(raw["tp_dtensor_ops"], raw["tp_collectives"]),
    }
    for name, times in out["collectives"].items():
        if len(times) != 2:
            raise ValueError(f"rank probe: {name} has {len(times)} times, not 2")
    return out


def measure() -> dict:
    """Run the two probe ranks; the slower rank's figures: ``collectives`` (name ->
    [seconds on 2 elements, on LARGE]) and each of :data:`EXTRAS` (the waits: the
    two ranks' mean)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), env.get("PYTHONPATH", "")) if p
    )
    env.pop("RANK", None)
    env.pop("LOCAL_RANK", None)
    with tempfile.TemporaryDirectory(prefix="rank_probe_") as where:
        cmd = [sys.executable, "-m", "src.planner.rank_probe"]
        procs = [
            subprocess.Popen(
                [*cmd, str(rank), where],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        errors = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode:
                errors.append(err.strip().splitlines()[-1:] or ["(no output)"])
        if errors:
            raise RuntimeError(f"rank probe failed: {errors[0][0]}")
        ranks = [_read(Path(where, f"rank{r}.json")) for r in range(2)]
    return {
        "collectives": {
            name: [max(r["collectives"][name][i] for r in ranks) for i in range(2)]
            for name in ranks[0]["collectives"]
        },
        **{k: max(r[k] for r in ranks) for k in EXTRAS},
        # the faster rank waits, the slower does not: the step is their mean's
        **{k: statistics.mean(r[k] for r in ranks) for k in _MEANS},
        "tp_census": ranks[0]["tp_census"],  # the same chain on both
    }


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), sys.argv[2])
