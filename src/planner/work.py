"""The model's own ops, timed on this CPU: the step-time model's compute where the
profile was probed here (src/planner/step_time.py).

FLOPs at one matmul rate (a 512-wide square) miss what a small model's step is made
of: its matmuls run at 50-90% of that rate by shape, its attention at the head
width and sequence it has, a MoE's experts as one small matmul each, a transformers
model's hundred small ops per block at their dispatch cost. So, on a probed CPU:

- :func:`traced_ops` runs one micro-batch forward and backward of the model on fake
  tensors (as src/planner/trace.py does: the first block of each class runs, the
  later ones hand on its output; checkpointing wraps it as the run would, so its
  recompute is among the backward's ops) and records every op with its arguments'
  shapes, strides and dtypes, per region: each block class, and the rest
  (embeddings, head, loss: :data:`~src.planner.trace.HEAD`);
- :class:`OpTimes` runs each distinct op once on real tensors of those shapes, in
  the thread count a rank gets, beside threads that compute as the run's other
  ranks on this machine would (random floats, zero indices, a grouped matmul's
  groups even), and keeps the median of a few runs by the thread's CPU time, each
  after 1 MiB of other data was written (past a core's L2):
  cached on disk beside the profile (``cpu-<machine>-ops-<threads>t<neighbours>n.json``: op
  and shapes -> seconds, and each micro-batch's totals by model config and shape,
  each checked to be a number when read: a later plan traces nothing). An op
  past :data:`REPLAY_BYTES` or :data:`REPLAY_FLOPS`, or one that will not run on
  made-up inputs, is counted from the profile (FLOPs at its matmul rate, bytes at
  its copy bandwidth, plus its per-op time);
- what a replay does not run (the autograd engine, modules' ``__call__``, hooks)
  is the profile's ``traced_op_s`` per op, views included: fitted by the probe on
  its own chain (src/planner/profiles.py), its step timed against its ops replayed.

Written here rather than taken from a library: torch's profiler times a real run
(which is what the plan is for avoiding), and the simulators that replay operators
(e.g. those the step-time issue names) are for GPUs and not packaged.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from src.planner.trace import HEAD, _instrument_blocks, _run, on_fake_tensors

#: Ops that are matrix multiplications, and those that are attention.
MATMULS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm",
                     "aten._grouped_mm"})  # fmt: skip
ATTENTION = "scaled_dot_product"
#: Past these an op is counted, not run (a 70B layer's matmul on a CPU takes
#: seconds): the profile's matmul rate holds for a large matmul, its copy bandwidth
#: for a large elementwise op.
REPLAY_BYTES, REPLAY_FLOPS = 64 * 2**20, 4e9
_REPEATS = 5
#: Bytes written between an op's runs: past a core's L2 (512 KiB on this EPYC), not
#: its L3. With 16 MiB the small models' ops summed 22% above their steps; with
#: none, the default model's 40% below.
FLUSH_BYTES = 2**20


def _leaf(x: Any) -> Any:
    """What an op's argument is: a tensor's shape, strides and dtype, else itself."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), str(x.dtype).split(".")[-1])
    return x


@dataclass(frozen=True)
class OpCall:
    """One op with its arguments' metadata (its key: name and leaves, as text)."""

    name: str
    leaves: tuple
    spec: Any  # the pytree of (args, kwargs)
    func: Any

    @property
    def key(self) -> str:
        return f"{self.func}{self.leaves!r}"

    @property
    def kind(self) -> str:
        if self.name in MATMULS:
            return "matmul"
        return "attention" if ATTENTION in self.name else "other"

    def tensors(self) -> list[tuple]:
        return [x for x in self.leaves if isinstance(x, tuple) and x[:1] == ("T",)]

    def nbytes(self) -> int:
        return sum(
            math.prod(s) * getattr(torch, d).itemsize for _, s, _, d in self.tensors()
        )

    def flops(self) -> float:
        """A matmul's multiply-adds times 2 (0 for any other op)."""
        if self.kind != "matmul":
            return 0.0
        shapes = [s for _, s, _, _ in self.tensors()]
        a, b = (shapes[1], shapes[2]) if "addmm" in self.name else shapes[:2]
        if "_grouped_mm" in self.name and len(a) == 2 and len(b) == 3:
            return 2.0 * a[0] * a[1] * b[2]
        return 2.0 * math.prod(a) * b[-1]


@dataclass
class TracedOps:
    """One micro-batch's ops: per region (a block class, or HEAD), op key -> count;
    ``calls``: one example of each key; ``views``: per region, ops that only view."""

    regions: dict[Any, Counter]
    views: dict[Any, int]
    calls: dict[str, OpCall]


class Recorder(TorchDispatchMode):
    """Every op, by region (the attributes trace.py's block instrumentation sets)."""

    def __init__(self) -> None:
        super().__init__()
        self.region: Any = HEAD
        self.selective = False
        self.hidden: dict = {}
        self.window: Any = HEAD
        self.backward = False
        self.out = TracedOps({}, {}, {})

    def enter(self, region: Any) -> None:
        self.window = region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        region = (self.window or HEAD) if self.backward else self.region
        if func.namespace == "prim":  # metadata fake tensors dispatch, eager does not
            return _run(func, args, kwargs)
        if func.is_view:
            self.out.views[region] = self.out.views.get(region, 0) + 1
        else:
            flat, spec = tree_flatten((args, kwargs))
            call = OpCall(str(func.overloadpacket), tuple(map(_leaf, flat)), spec, func)
            self.out.calls.setdefault(call.key, call)
            self.out.regions.setdefault(region, Counter())[call.key] += 1
        return _run(func, args, kwargs)


def traced_ops(
    model: nn.Module,
    block_classes: Sequence[type[nn.Module]],
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    checkpointing: str = "none",
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> TracedOps:
    """The ops of one training micro-batch of ``model`` (a meta-device model; a copy
    is traced), its parameters in ``dtype``, in ``checkpointing`` mode."""
    rec = Recorder()
    with on_fake_tensors(model, dtype) as model:
        _instrument_blocks(model, tuple(block_classes), rec, checkpointing)
        idx = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        with context() if context else contextlib.nullcontext(), rec:
            _, loss = model(idx, torch.zeros_like(idx))
            rec.backward = True
            loss.backward()
    return rec.out


# ------------------------------------------------------------------------ timing


def _real(leaf: Any) -> Any:
    if not (isinstance(leaf, tuple) and leaf[:1] == ("T",)):
        return leaf
    _, shape, stride, dtype = leaf
    t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype))
    return t.normal_() if t.is_floating_point() else t.zero_()


def _inputs(call: OpCall) -> tuple[tuple, dict]:
    flat = [_real(x) for x in call.leaves]
    args, kwargs = tree_unflatten(flat, call.spec)
    if call.name == "aten._grouped_mm" and kwargs.get("offs") is not None:
        groups, rows = kwargs["offs"].shape[0], args[0].shape[0]
        even = torch.full((groups,), rows // groups, dtype=torch.int32)
        kwargs["offs"] = torch.cumsum(even, 0).to(torch.int32)
    return args, kwargs


def replay_seconds(call: OpCall, clock=time.thread_time) -> float:
    """The median of a few runs of ``call`` on real tensors of its shapes, each
    after :data:`FLUSH_BYTES` of other data were written (a step's op meets its
    inputs where the ops before it left them, not where its own last run did: the
    default model's block matmuls read 55 ms a step replayed warm, 88 after 16 MiB;
    its step's, the head's included, 77 under the profiler)."""
    args, kwargs = _inputs(call)
    flush = torch.empty(FLUSH_BYTES // 4)
    with torch.no_grad():
        call.func(*args, **kwargs)  # warm-up, and allocations out of the way
        runs = []
        for _ in range(_REPEATS):
            flush.fill_(1.0)
            t0 = clock()
            call.func(*args, **kwargs)
            runs.append(clock() - t0)
    return statistics.median(runs)


class OpTimes:
    """Seconds of each op at ``threads`` threads on this CPU, measured once per op
    and shapes, cached in ``path`` (module docstring), with ``neighbours`` other
    ranks computing beside it (:meth:`busy`)."""

    def __init__(self, path: Path | None, threads: int, neighbours: int = 0) -> None:
        self.path, self.threads, self.neighbours = path, threads, neighbours
        self.times, self.runs = _read_times(path) if path else ({}, {})
        self.dirty = False

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The other ranks of a run that fills the cores, as threads computing
        beside the replays (a matmul and a 16 MiB add in turn, each releasing the
        interpreter): an op shares its core's caches and the memory bus with them
        as in the run (the default GPT's ops replayed in two processes at once
        read 10-20% slower than alone)."""
        stop = threading.Event()

        def work() -> None:
            a, b = torch.randn(768, 768), torch.randn(768, 768)
            x, y = torch.randn(1 << 22), torch.randn(1 << 22)
            while not stop.is_set():
                torch.mm(a, b)
                x.add_(y)

        threads = [threading.Thread(target=work, daemon=True)
                   for _ in range(self.neighbours)]  # fmt: skip
        for t in threads:
            t.start()
        try:
            yield
        finally:
            stop.set()
            for t in threads:
                t.join()

    def __call__(self, call: OpCall, counted: Callable[[OpCall], float]) -> float:
        """``call``'s seconds: run here, or ``counted`` (from the profile's rates)
        where it is not run."""
        found = self.times.get(call.key)
        if found is not None:
            return found
        if call.nbytes() > REPLAY_BYTES or call.flops() > REPLAY_FLOPS:
            return counted(call)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            clock = time.thread_time if self.threads == 1 else time.perf_counter
            seconds = replay_seconds(call, clock)
        except Exception:  # an op made-up inputs cannot drive: counted
            return counted(call)
        finally:
            torch.set_num_threads(before)
        self.times[call.key] = seconds
        self.dirty = True
        return seconds

    def save(self) -> None:
        if not (self.path and self.dirty):
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"ops": self.times, "runs": self.runs}))
            tmp.replace(self.path)
            self.dirty = False


def _positive(v: Any) -> bool:
    return (
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        and v > 0
    )  # fmt: skip


def _read_times(path: Path) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """A cache file's op times and micro-batch totals (:data:`KINDS` each); a file
    that is not tables of positive numbers is ignored whole (measured again)."""
    try:
        raw = json.loads(path.read_text())
        ops, runs = raw["ops"], raw["runs"]
        ok = all(isinstance(k, str) and _positive(v) for k, v in ops.items()) and all(
            isinstance(k, str)
            and set(v) == set(KINDS)
            and all(_positive(x) or x == 0 for x in v.values())
            for k, v in runs.items()
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}, {}
    if not ok:
        return {}, {}
    return {k: float(v) for k, v in ops.items()}, {
        k: {x: float(y) for x, y in v.items()} for k, v in runs.items()
    }


@dataclass(frozen=True)
class RegionTime:
    """Seconds of one region's ops (one micro-batch), by kind, and its op count."""

    matmul: float
    attention: float
    other: float
    ops: int  # views included


def region_times(
    ops: TracedOps, times: OpTimes, counted: Callable[[OpCall], float]
) -> dict[Any, RegionTime]:
    """Each region's seconds by kind (``times`` of each op, times its count)."""
    out = {}
    for region, counts in ops.regions.items():
        by = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for key, n in counts.items():
            call = ops.calls[key]
            by[call.kind] += n * times(call, counted)
        n_ops = sum(counts.values()) + ops.views.get(region, 0)
        out[region] = RegionTime(by["matmul"], by["attention"], by["other"], n_ops)
    for region, n in ops.views.items():
        out.setdefault(region, RegionTime(0.0, 0.0, 0.0, n))
    return out


# ------------------------------------------------------------------ for a run plan

#: What one micro-batch's totals hold: seconds by kind, ops, distinct ops.
KINDS = ("matmul", "attention", "other", "ops", "distinct")
_OPS: dict[tuple, tuple[TracedOps, dict[Any, float]]] = {}
_TIMES: dict[tuple, OpTimes] = {}


def op_times(path: Path | None, threads: int, neighbours: int = 0) -> OpTimes:
    """The process's :class:`OpTimes` for ``path`` (one cache read)."""
    key = (path, threads, neighbours)
    if key not in _TIMES:
        _TIMES[key] = OpTimes(path, threads, neighbours)
    return _TIMES[key]


def run_ops(
    resolved: Any, micro_batch: int, seq_len: int, dtype: torch.dtype, mode: str
) -> tuple[TracedOps, dict[Any, float]]:
    """The traced ops of one micro-batch of ``resolved``'s model as one of its
    tensor-parallel ranks computes it, cached per model config and shape, and how
    many blocks of each region one rank runs (HEAD: 1)."""
    from src.config.run_plan import tensor_parallel_plan
    from src.planner.trace import block_order, tp_local

    spec, config, lay = resolved.spec, resolved.model_config, resolved.layout
    key = (spec.name, repr(config), lay.tp, lay.pp, micro_batch, seq_len, dtype, mode)
    if key not in _OPS:
        classes = spec.block_classes(config)
        with torch.device("meta"):
            model = spec.build(config, 0)
        if lay.tp > 1:
            model = tp_local(model, classes, tensor_parallel_plan(resolved), lay.tp)
        ops = traced_ops(
            model, classes, micro_batch, seq_len, dtype, mode, spec.trace_context
        )
        order = block_order(model, classes)
        counts = {cls: order.count(cls) / lay.pp for cls in set(order)}
        _OPS[key] = (ops, {HEAD: 1.0, **counts})
    return _OPS[key]


def micro_batch_work(
    resolved: Any,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    mode: str,
    times: OpTimes,
    counted: Callable[[OpCall], float],
) -> dict[str, float]:
    """One rank's micro-batch (:data:`KINDS`: its blocks' as many times as the rank
    runs them), cached in ``times`` beside its ops: a later plan of the same model
    and shape on this machine neither traces nor runs anything."""
    lay = resolved.layout
    ident = (resolved.spec.name, repr(resolved.model_config), lay.tp, lay.pp,
             micro_batch, seq_len, str(dtype), mode)  # fmt: skip
    key = hashlib.sha256(repr(ident).encode()).hexdigest()[:24]
    if key not in times.runs:
        ops, blocks = run_ops(resolved, micro_batch, seq_len, dtype, mode)
        total = dict.fromkeys(KINDS, 0.0)
        with times.busy():
            parts = region_times(ops, times, counted)
        for region, t in parts.items():
            for kind in KINDS[:4]:
                total[kind] += blocks.get(region, 0.0) * getattr(t, kind)
        total["distinct"] = float(len(ops.calls))
        times.runs[key] = total
        times.dirty = True
    return times.runs[key]
