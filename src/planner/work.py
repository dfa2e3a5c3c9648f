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
- what a replay does not run (the autograd engine, modules' ``__call__``, hooks,
  the family's own Python: a transformers model's masks, a MoE's routing) is
  :func:`model_overhead` per op, views included: the model itself run for real at
  a tiny shape (:data:`OVERHEAD_SHAPE`; the head and the first block of each class
  materialized from the family's init, the later blocks handing on its output),
  timed against its ops replayed at that shape. Where the model cannot be run so
  (no ``init_tensor``, or past :data:`OVERHEAD_NUMEL`), it is the profile's
  ``traced_op_s``, fitted the same way by the probe on its own chain
  (src/planner/profiles.py). On this VM that chain's 2 us an op left a
  transformers model's step 40% and the MoE's 30% above its prediction; their own
  runs measure the per-op time their Python adds.

Written here rather than taken from a library: torch's profiler times a real run
(which is what the plan is for avoiding), and the simulators that replay operators
(e.g. those the step-time issue names) are for GPUs and not packaged.
"""

from __future__ import annotations

import contextlib
import gc
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

from src.planner.trace import (
    HEAD,
    _instrument_blocks,
    _run,
    on_fake_tensors,
    outer_blocks,
)

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
#: The cache file's format: a file of another is measured again (2: grouped
#: matmuls split their tokens evenly, where 1 left every group empty; 3: the
#: logged steps' memory sampling per op; 4: the ops outside the blocks apart).
TIMES_FORMAT = 4
#: (micro-batch, sequence) of :func:`model_overhead`'s real run: its ops take
#: microseconds, so what the step adds to them stands out.
OVERHEAD_SHAPE = (1, 16)
#: Past this many elements (the head's and the first block of each class's) the
#: model is not materialized for :func:`model_overhead`: the profile's figure holds.
OVERHEAD_NUMEL = 64 * 2**20
OVERHEAD_REPEATS = 15


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
        if "_grouped_mm" in self.name and len(a) == 3 and len(b) == 2:
            return 2.0 * a[1] * a[2] * b[1]
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
    """Real tensors for ``call``; a grouped matmul's ``offs`` (its third argument,
    positional at dispatch: zeros made every group empty, and the MoE's experts
    replayed at a tenth of their time) split its tokens evenly."""
    flat = [_real(x) for x in call.leaves]
    args, kwargs = tree_unflatten(flat, call.spec)
    if call.name == "aten._grouped_mm":
        args = list(args)
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        if offs is not None:
            groups, rows = offs.shape[0], _grouped_rows(*args[:2])
            even = torch.full((groups,), rows // groups, dtype=torch.int32)
            even = torch.cumsum(even, 0).to(torch.int32)
            if len(args) > 2:
                args[2] = even
            else:
                kwargs["offs"] = even
        args = tuple(args)
    return args, kwargs


def _grouped_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length a grouped matmul's ``offs`` split: the shared dimension of two 2-D
    operands (a weight's gradient), else the 2-D one's tokens (its rows for ``a``,
    its columns for ``b``). Split on another (``a``'s rows of a weight gradient
    are the hidden width) the replay ran a fraction of the tokens: the MoE's expert
    backward replayed at 0.6 ms where its step spent 8."""
    if a.dim() == 2 and b.dim() == 2:
        return a.shape[1]
    return a.shape[0] if a.dim() == 2 else b.shape[1]


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
            tmp.write_text(json.dumps(
                {"format": TIMES_FORMAT, "ops": self.times, "runs": self.runs}))  # fmt: skip
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
        if raw.get("format") != TIMES_FORMAT:  # measured by an older replay
            return {}, {}
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

#: What one micro-batch's totals hold: seconds by kind, ops, distinct ops, the
#: model's own seconds per op beyond its replay (0: not measured, the profile's),
#: what a logged step's memory sampling adds per op (0: not measured), and the
#: seconds of its ops outside the blocks (embeddings, head, loss: HEAD's).
KINDS = ("matmul", "attention", "other", "ops", "distinct", "per_op",
         "sampled_per_op", "head")  # fmt: skip
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
        if HEAD in parts:
            total["head"] = (
                parts[HEAD].matmul + parts[HEAD].attention + parts[HEAD].other
            )
        total["distinct"] = float(len(ops.calls))
        own = model_overhead(resolved, seq_len, mode, times.threads)
        total["per_op"], total["sampled_per_op"] = own or (0.0, 0.0)
        times.runs[key] = total
        times.dirty = True
    return times.runs[key]


# ------------------------------------------------------------ the model's overhead


class _Untracked:
    """What trace.py's block instrumentation reports to, where nothing records."""

    def __init__(self) -> None:
        self.region, self.selective, self.hidden = HEAD, False, {}

    def enter(self, region: Any) -> None:
        pass


def _materialize(
    model: nn.Module, classes: tuple[type, ...], init_tensor: Callable, config: Any
) -> bool:
    """Give the head's and the first block of each class's parameters and buffers
    of ``model`` (meta) their initial values on CPU, in place (tied ones stay tied);
    the later blocks stay on meta. False (nothing done) past :data:`OVERHEAD_NUMEL`."""
    later: set[int] = set()
    seen: set[type] = set()
    for m in outer_blocks(model, classes):
        if type(m) in seen:
            later.update(id(c) for c in m.modules())
        seen.add(type(m))
    kept = [(n, m) for n, m in model.named_modules() if id(m) not in later]
    held = {id(t): t for _, m in kept for t in [*m._parameters.values(),
                                                *m._buffers.values()] if t is not None}  # fmt: skip
    if sum(t.numel() for t in held.values()) > OVERHEAD_NUMEL:
        return False
    new: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for prefix, m in kept:
            for table in (m._parameters, m._buffers):
                for local, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in new:
                        name = f"{prefix}.{local}" if prefix else local
                        value = init_tensor(name, t.shape, config, 0).to(t.dtype)
                        if isinstance(t, nn.Parameter):
                            value = nn.Parameter(value, t.requires_grad)
                        new[id(t)] = value
                    table[local] = new[id(t)]
    return True


class _OpClock(TorchDispatchMode):
    """The seconds a real run's ops take inside themselves (views not timed: a
    replay runs none), and how many it dispatched, views included."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds, self.ops = 0.0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.is_view:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - t0
        return out


_OVERHEAD: dict[tuple, tuple[float, float] | None] = {}


def model_overhead(
    resolved: Any, seq_len: int, mode: str, threads: int
) -> tuple[float, float] | None:
    """Seconds per op (views included) that ``resolved``'s model spends in a forward
    and backward outside its ops, in checkpointing ``mode``, and what a logged
    step's memory sampling (src/observe/live_memory.py: hooks at the step's
    moments, CPU ranks) adds per op: one micro-batch of :data:`OVERHEAD_SHAPE` (its
    sequence at most ``seq_len``) run for real, fp32, the head and the first block
    of each class materialized from the family's init and the later blocks handing
    on its output; its time less its ops' own (timed inside the run, so what the
    ops cost in it does not leak into the figure), over its ops, and a sampled
    run's time less a plain one's, over its ops; the medians of a few. None where
    the family has no ``init_tensor`` or the materialized part is past
    :data:`OVERHEAD_NUMEL`."""
    spec, config = resolved.spec, resolved.model_config
    key = (spec.name, repr(config), mode, threads)
    if key in _OVERHEAD:
        return _OVERHEAD[key]
    _OVERHEAD[key] = None
    if spec.init_tensor is None:
        return None
    try:  # a model that will not run so keeps the profile's figure, not the formula
        walls, inside, sampled, ops = _overhead_runs(resolved, seq_len, mode, threads)
    except Exception:
        return None
    finally:
        # The model and its blocks' instrumented forwards hold one another: freed
        # now, not by a collection in some step of the run this process goes on
        # to train (one rank trains in the launcher's process).
        gc.collect()
    if not walls:
        return None
    outside = statistics.median(w - i for w, i in zip(walls, inside, strict=True))
    sampling = statistics.median(s - w for s, w in zip(sampled, walls, strict=True))
    ops = max(1, ops)
    _OVERHEAD[key] = (max(0.0, outside) / ops, max(0.0, sampling) / ops)
    return _OVERHEAD[key]


def _overhead_runs(
    resolved: Any, seq_len: int, mode: str, threads: int
) -> tuple[list[float], list[float], list[float], int]:
    """:func:`model_overhead`'s runs: each real step's wall seconds, its ops' own
    seconds in the next, a sampled step's wall seconds, and the ops one dispatches
    (none: not materialized)."""
    from src.observe.live_memory import LiveMemory

    spec, config = resolved.spec, resolved.model_config
    classes = tuple(spec.block_classes(config))
    with torch.device("meta"):
        model = spec.build(config, 0)
    if not _materialize(model, classes, spec.init_tensor, config):
        return [], [], [], 0
    handed: dict = {}
    _instrument_blocks(model, classes, _Untracked(), mode, handed)
    params = [p for p in model.parameters() if p.device.type != "meta"]
    micro_batch, seq = OVERHEAD_SHAPE[0], min(OVERHEAD_SHAPE[1], seq_len)
    idx = torch.zeros(micro_batch, seq, dtype=torch.long)

    def step() -> float:
        t0 = time.perf_counter()
        _, loss = model(idx, torch.zeros_like(idx))
        loss.backward()
        for p in params:
            p.grad = None
        handed.clear()
        return time.perf_counter() - t0

    sampler = LiveMemory()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        step()  # warm-up: first calls' allocations and lazy set-up
        walls, inside, sampled = [], [], []
        for _ in range(OVERHEAD_REPEATS):  # in turn: a drift meets them alike
            walls.append(step())
            with _OpClock() as clock:
                step()
            inside.append(clock.seconds)
            if sampler.available:  # a logged step's hooks, as the trainer's
                sampler.attach(model)
                try:
                    sampled.append(step())
                finally:
                    sampler.detach()
    finally:
        torch.set_num_threads(before)
        sampler.close()
    return walls, inside, sampled or walls, clock.ops
