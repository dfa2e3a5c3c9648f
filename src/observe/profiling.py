"""Where a step goes: a torch.profiler window, memory timelines and OOM snapshots.

``trainer.profile=true`` profiles steps ``profile_start .. profile_start +
profile_steps - 1`` on every rank and writes into ``<run dir>/profile/``:

- ``rank<N>.pt.trace.json``: the Chrome trace of rank N (Perfetto, chrome://tracing,
  TensorBoard's profiler plugin). Each unit of the wrap plan and each model block
  shows as ``unit:<path>:forward`` and ``unit:<path>:backward`` ranges beside the
  backend's own events (FSDP2's ``FSDP::all_gather``, the collectives).
- the memory over time: on CUDA ``rank<N>.memory_snapshot.pickle``
  (``torch.cuda.memory._record_memory_history`` over the window; drag it onto
  https://pytorch.org/memory_viz); on CPU ``rank<N>.memory_timeline.json`` (the
  profiler's memory timeline: times and bytes per category).
- ``summary.md``: rank 0's table (also logged to the console and ``train.log``):
  time per unit in forward and backward, in each collective and outside them, in the
  optimizer step, each with its share of the step. The folder goes to wandb as an
  artifact of type ``profile``.

On CUDA every rank also watches for an out-of-memory error: the allocator's state at
that moment is dumped to ``profile/rank<N>.oom_snapshot.pickle`` and the run stops
with one line naming it (:class:`CudaOutOfMemory`).

When ``trainer.profile`` is off nothing here runs during the steps (no hook, no
profiler, no range), so it costs nothing (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.profiler import record_function

from src.errors import RunError
from src.files import write_json_atomic
from src.text import markdown_table

log = logging.getLogger(__name__)
# libkineto's own start/stop lines on stderr (read when the profiler first starts; the
# ranks inherit it from the launcher).
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

PROFILE_DIR = "profile"
TABLE_FILE = "summary.md"
# Name patterns of the collectives in a trace (FSDP's ranges, c10d ops, gloo and NCCL
# kernels), per kind.
COLLECTIVES = {
    "all-gather": re.compile(r"all_?gather", re.I),
    "reduce-scatter": re.compile(r"reduce_?scatter|post_backward_reduce", re.I),
    "all-reduce": re.compile(r"all_?reduce", re.I),
}
OPTIMIZER = re.compile(r"^Optimizer\.step#")
UNIT_RANGE = re.compile(r"^unit:(.*):(forward|backward)$")


def profile_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / PROFILE_DIR


class CudaOutOfMemory(RunError):
    """A rank ran out of CUDA memory; the allocator's snapshot names what held it."""


# ------------------------------------------------------------- per-unit ranges


class _Mark(torch.autograd.Function):
    """Identity in forward; in backward calls ``hook`` (once per unit and pass).
    An output no gradient reaches passes on None, not zeros: autograd's zeros are
    plain tensors, and a DTensor's graph (tensor parallelism's vocabulary-sharded
    logits beside the loss) fails on them."""

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, list | tuple):
        return [t for v in value for t in _grad_tensors(v)]
    return []


def _replace(value: Any, marked: Iterable[torch.Tensor]) -> Any:
    """``value`` with its grad-requiring tensors replaced, in order, by ``marked``."""
    marked = iter(marked)

    def swap(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return next(marked) if v.requires_grad else v
        if isinstance(v, list | tuple):
            out = [swap(x) for x in v]
            return type(v)(out) if isinstance(v, list) else tuple(out)
        return v

    return swap(value)


def _mark(value: Any, hook: Callable[[], None]) -> Any:
    tensors = _grad_tensors(value)
    if not tensors:
        return value
    out = _Mark.apply(hook, *tensors)
    return _replace(value, out if isinstance(out, tuple) else (out,))


class UnitRanges:
    """``unit:<path>:forward`` / ``unit:<path>:backward`` profiler ranges around each
    of ``modules`` (path -> module), from forward hooks and identity autograd nodes;
    :meth:`remove` takes them all away. Backward of a unit runs from the gradient of
    its outputs arriving to the gradient of its inputs leaving (or the end of the
    backward pass when its inputs need none, e.g. token ids)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.handles = []
        self.open: dict[str, record_function] = {}
        for path, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(path)))
            self.handles.append(module.register_forward_hook(self._post(path)))

    def _enter(self, name: str) -> None:
        if name not in self.open:
            self.open[name] = rf = record_function(name)
            rf.__enter__()

    def _exit(self, name: str) -> None:
        rf = self.open.pop(name, None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def _pre(self, path: str):
        fwd, bwd = f"unit:{path}:forward", f"unit:{path}:backward"

        def hook(module, args):
            self._enter(fwd)
            if torch.is_grad_enabled() and _grad_tensors(args):
                return _mark(args, lambda: self._exit(bwd))
            return None

        return hook

    def _post(self, path: str):
        fwd, bwd = f"unit:{path}:forward", f"unit:{path}:backward"

        def hook(module, args, output):
            self._exit(fwd)
            if not torch.is_grad_enabled():
                return None
            ends_itself = bool(_grad_tensors(args))

            def start() -> None:
                self._enter(bwd)
                if not ends_itself:  # close when the whole backward pass ends
                    torch.autograd.Variable._execution_engine.queue_callback(
                        lambda: self._exit(bwd)
                    )

            return _mark(output, start)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for name in list(self.open):
            self._exit(name)


# ------------------------------------------------------------------ the table


@dataclass
class _Span:
    name: str
    start: float  # microseconds
    end: float
    device: bool  # a kernel / GPU-side range
    kernel: bool  # a kernel (not a GPU-side copy of a CPU range)


def _spans(trace: dict) -> list[_Span]:
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", ""))
        device = cat in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
        start = float(e["ts"])
        out.append(
            _Span(
                str(e.get("name", "")),
                start,
                start + float(e["dur"]),
                device,
                cat == "kernel",
            )
        )
    return out


def _union(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_table(trace: dict, steps: int, step_s: float, cuda: bool) -> list[dict]:
    """Rank ``trace``'s window as rows ``{part, ms_per_step, share}``: each unit's
    forward and backward (inclusive of the units inside it), each collective kind
    (the union of its events; on CUDA its kernels), compute outside collectives and
    the optimizer step. Shares are of the mean step (``step_s``); units overlap the
    collectives they wait for, so the shares do not add up to 100%."""
    spans = _spans(trace)
    step_us = step_s * 1e6

    def row(part: str, total_us: float) -> dict:
        per = total_us / steps
        return {
            "part": part,
            "ms_per_step": round(per / 1e3, 3),
            "share": f"{per / step_us:.1%}" if step_us else "-",
        }

    rows = []
    units: dict[tuple[str, str], float] = {}
    for s in spans:
        m = UNIT_RANGE.match(s.name)
        if m and s.device == cuda:  # GPU time on CUDA where the ranges have it
            units[m.groups()] = units.get(m.groups(), 0.0) + s.end - s.start
    if cuda and not units:
        for s in spans:
            m = UNIT_RANGE.match(s.name)
            if m:
                units[m.groups()] = units.get(m.groups(), 0.0) + s.end - s.start
    paths = list(dict.fromkeys(p for p, _ in units))
    for path in paths:
        for phase in ("forward", "backward"):
            if (path, phase) in units:
                rows.append(row(f"{phase} {path}", units[(path, phase)]))
    # Collectives: on CUDA the kernels, on CPU the host-side events.
    pool = [
        s
        for s in spans
        if (s.kernel if cuda else not s.device) and not UNIT_RANGE.match(s.name)
    ]
    comm_all = []
    for kind, pattern in COLLECTIVES.items():
        ivs = [(s.start, s.end) for s in pool if pattern.search(s.name)]
        comm_all += ivs
        rows.append(row(kind, _union(ivs)))
    comm = _union(comm_all)
    rows.append(row("collectives (any)", comm))
    if cuda:
        compute = _union([(s.start, s.end) for s in pool] + comm_all) - comm
        rows.append(row("compute kernels (outside collectives)", compute))
    else:
        rows.append(row("outside collectives", max(0.0, steps * step_us - comm)))
    opt = [(s.start, s.end) for s in spans if not s.device and OPTIMIZER.match(s.name)]
    rows.append(row("optimizer step", _union(opt)))
    return rows


def memory_timeline(trace: dict) -> dict:
    """The CPU allocator's bytes in use over the window, from the trace's
    ``[memory]`` events (the profiler's allocation records, ``profile_memory``):
    ``times_us`` from the window's start, ``allocated_bytes`` after each event."""
    events = sorted(
        (e["ts"], e["args"]["Total Allocated"])
        for e in trace.get("traceEvents", [])
        if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
    )
    t0 = events[0][0] if events else 0.0
    return {
        "device": "cpu",
        "times_us": [round(t - t0, 3) for t, _ in events],
        "allocated_bytes": [b for _, b in events],
        "peak_bytes": max((b for _, b in events), default=0),
    }


# ------------------------------------------------------------------ the window


@dataclass(frozen=True)
class ProfileOptions:
    """What ``trainer.profile*`` asks for (``profile_memory`` None: on on CPU, where
    the memory timeline is made of the profiler's allocation events)."""

    start: int
    steps: int
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool | None = None


class StepProfiler:
    """The profiler window of one rank: call :meth:`before_step` and
    :meth:`after_step` around every step; outside the window they return at once."""

    def __init__(
        self,
        options: ProfileOptions,
        run_dir: str | os.PathLike,
        rank: int,
        device: torch.device,
        modules: dict[str, nn.Module],
        max_steps: int,
        on_done: Callable[[Path, list[dict]], None] | None = None,
    ) -> None:
        self.options, self.rank, self.device = options, rank, device
        self.dir = profile_dir(run_dir)
        self.modules = modules
        self.first = options.start
        self.last = min(max_steps, options.start + options.steps - 1)
        self.on_done = on_done
        self.cuda = device.type == "cuda"
        self._prof = None
        self._ranges: UnitRanges | None = None
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        if step != self.first or self._prof is not None:
            return
        from torch.profiler import ProfilerActivity, profile

        o = self.options
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._prof = profile(
            activities=activities,
            record_shapes=o.record_shapes,
            profile_memory=(not self.cuda)
            if o.profile_memory is None
            else o.profile_memory,
            with_stack=o.with_stack,
        )
        self._ranges = UnitRanges(self.modules)
        self._prof.__enter__()  # the first start (CUPTI) can take a while: not timed
        self._sync()
        self._t0 = time.perf_counter()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._prof.step()
        if step < self.last:
            return
        self._sync()
        step_s = (time.perf_counter() - self._t0) / (self.last - self.first + 1)
        self._ranges.remove()
        self._prof.__exit__(None, None, None)
        prof, self._prof = self._prof, None
        self.finish(prof, step_s)

    def finish(self, prof, step_s: float) -> None:
        """Write this rank's trace and memory timeline; rank 0 reports the table and
        how long writing the files took (the window's steps do not include it)."""
        start = time.perf_counter()
        trace_path = self.dir / f"rank{self.rank}.pt.trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        if self.cuda:
            memory = self.dir / f"rank{self.rank}.memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(memory))
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            timeline = memory_timeline(trace)
            if timeline["times_us"]:
                write_json_atomic(
                    self.dir / f"rank{self.rank}.memory_timeline.json", timeline
                )
            else:
                log.warning(
                    "no memory timeline: trainer.profile_memory=false recorded no "
                    "allocations"
                )
        steps = self.last - self.first + 1
        rows = step_table(trace, steps, step_s, self.cuda)
        if self.rank == 0:
            head = (
                f"profile of steps {self.first}-{self.last} (rank 0, "
                f"{step_s * 1e3:.1f} ms/step): {self.dir}"
            )
            table = markdown_table(rows)
            (self.dir / TABLE_FILE).write_text(f"{head}\n\n{table}\n")
        if self.on_done is not None:
            self.on_done(self.dir, rows)
        if self.rank == 0:
            took = time.perf_counter() - start
            log.info("%s (files written in %.1f s)\n%s", head, took, table)


# ------------------------------------------------------------------ CUDA OOM


def watch_cuda_oom(run_dir: str | os.PathLike, rank: int) -> Path | None:
    """On CUDA, dump the allocator's snapshot to ``profile/rank<N>.oom_snapshot.pickle``
    when this rank runs out of memory (the observer costs nothing until then);
    returns that path (None on CPU)."""
    if not torch.cuda.is_available():
        return None
    path = profile_dir(run_dir) / f"rank{rank}.oom_snapshot.pickle"

    def observer(device, alloc, device_alloc, device_free) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)

    torch._C._cuda_attach_out_of_memory_observer(observer)
    return path


def oom_error(err: BaseException, snapshot: Path | None, rank: int, step: int):
    """The one-line error of a CUDA OOM at ``step`` (names the snapshot)."""
    where = (
        f"memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)"
        if snapshot is not None and snapshot.exists()
        else "no memory snapshot"
    )
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return CudaOutOfMemory(
        f"rank {rank} ran out of CUDA memory at step {step} ({first[:160]}); {where}"
    )
