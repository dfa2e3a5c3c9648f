"""Training-speed and memory metrics: throughput, MFU, peak memory, cross-rank reduce.

Conventions (see docs/metrics.md):

- ``tokens_per_s`` is global (all ranks) and measured from wall time between two log
  points; the first window (compilation, allocator and cache warm-up) is never reported.
- MFU = achieved model FLOP/s per rank / peak FLOP/s per rank. Model FLOPs per token are
  the caller's (forward + backward of the model, no recomputation); the peak comes from a
  table of known accelerators, a user override, or on CPU a short matmul probe.
- ``peak_mem_gib`` is the CUDA caching allocator's peak allocated bytes on GPU; on CPU
  the peak memory in use, the resident set less glibc's free heap, sampled at a step's
  moments once a trainer watches its model (src/observe/live_memory.py), else the
  peak resident set (VmHWM), which ``peak_rss_gib`` reports beside it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from src.observe import live_memory
from src.sharding import GIB
from src.sharding.layout import collective_device

log = logging.getLogger(__name__)

# Dense (no structured sparsity) peak tensor-core TFLOP/s per device from the vendors'
# datasheets. Ordered: the first row whose every substring occurs in the device name
# wins, so specific variants come before their family ("A100" before "A10").
# Columns: bf16, fp16, tf32 (fp32 matmuls on tensor cores), fp32 (plain FMA units).
_GPU_PEAK_TFLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("B200",), {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    (("H200", "NVL"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H200",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H100", "NVL"), {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H100", "PCIE"), {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    # Any other H100 (e.g. "NVIDIA H100 80GB HBM3") is the SXM part.
    (("H100",), {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("A100",), {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.1, "fp16": 362.1, "tf32": 183.2, "fp32": 91.6}),
    (("L40",), {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (("L4",), {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (("A10G",), {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    (("A10",), {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("4090",), {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    # Pre-Ampere parts have no bf16 or tf32 tensor cores: those run at the fp32 rate.
    (("V100",), {"bf16": 15.7, "fp16": 125.0, "tf32": 15.7, "fp32": 15.7}),
    (("T4",), {"bf16": 8.1, "fp16": 65.0, "tf32": 8.1, "fp32": 8.1}),
    (("MI300X",), {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (("MI325X",), {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
]


def _dtype_column(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32:
        # fp32 matmuls use tensor cores (tf32) unless the user asked for full precision.
        high = torch.get_float32_matmul_precision() != "highest"
        return "tf32" if high or torch.backends.cuda.matmul.allow_tf32 else "fp32"
    raise ValueError(f"no peak FLOP/s figure for dtype {dtype}")


def lookup_gpu_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """Dense peak TFLOP/s of a known accelerator for ``dtype``; None if not in the table."""
    name = device_name.upper()
    for keys, figures in _GPU_PEAK_TFLOPS:
        if all(k.upper() in name for k in keys):
            return figures[_dtype_column(dtype)]
    return None


def _time_matmul(
    a: torch.Tensor, b: torch.Tensor, clock: Callable[[], float] = time.perf_counter
) -> float:
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    sync()
    t0 = clock()
    torch.mm(a, b)
    sync()
    return clock() - t0


def measure_matmul_flops(
    device: torch.device,
    dtype: torch.dtype,
    seconds: float = 0.3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best achieved FLOP/s of square ``dtype`` matmuls on ``device`` within ``seconds``.

    The size doubles (from 256) until one matmul takes a noticeable slice of the budget,
    so a slow dtype (bf16 on a CPU without bf16 units) still finishes in time and a fast
    one is measured on a size big enough to reach its peak. Best-of-repeats keeps the
    figure an upper bound, as a datasheet peak is. Uses the threads torch already has.
    ``clock``: wall time; ``time.thread_time`` (one intra-op thread on CPU) times the
    matmuls by the CPU time they got, which other processes' load does not stretch.
    The operands come from a private generator: the probe runs after a resume restored
    the training RNG, and drawing from it would change every later dropout mask.
    """
    n, max_n = 256, 4096 if device.type != "cpu" else 2048
    gen = torch.Generator(device=device).manual_seed(0)
    while True:
        a = torch.randn(n, n, device=device, generator=gen).to(dtype)
        b = torch.randn(n, n, device=device, generator=gen).to(dtype)
        # Two tries per size: the very first matmul also starts the thread pool.
        best = min(_time_matmul(a, b, clock), _time_matmul(a, b, clock))
        if best > seconds / 16 or n >= max_n:
            break
        n *= 2
    deadline = clock() + seconds
    for repeat in range(64):
        if repeat >= 3 and clock() > deadline:
            break
        best = min(best, _time_matmul(a, b, clock))
    return 2.0 * n**3 / best


#: CPU flags (``/proc/cpuinfo`` "flags" on x86, "Features" on Arm) that mean the
#: cores run matmuls of that dtype natively; without one, oneDNN emulates them (it
#: converts to fp32 and runs fp32 FMAs, slower than plain fp32).
CPU_NATIVE_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "fphp"),
}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first CPU's feature flags, None where they cannot be read (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Peak:
    """The MFU denominator of a run: ``flops`` per rank, the dtype its matmuls really
    run in (``matmul_dtype``), where the figure comes from, and ``warning``: one line
    when the hardware does not accelerate the run's precision (None otherwise)."""

    flops: float
    matmul_dtype: torch.dtype
    source: str  # "trainer.peak_tflops", "datasheet" or "probe"
    warning: str | None = None
    cpu_wait: float | None = None  # the probe's share of time waiting for a core


def precision_support(
    device: torch.device, dtype: torch.dtype, flags: frozenset[str] | None = None
) -> tuple[torch.dtype, str | None]:
    """``(dtype the matmuls run in, warning)`` for a run computing in ``dtype``.

    On a CPU without native bf16/fp16 (``flags``: :func:`cpu_flags` unless given; no
    flag of :data:`CPU_NATIVE_FLAGS`) the low-precision matmuls are emulated in fp32:
    the fp32 peak bounds them, and the run gets a warning line. A CUDA GPU before
    Ampere has no bf16 tensor cores (its datasheet row is the fp32 rate) and warns too.
    """
    device = torch.device(device)
    name = _DTYPE_NAMES.get(dtype, str(dtype))
    if device.type == "cpu" and dtype in CPU_NATIVE_FLAGS:
        flags = cpu_flags() if flags is None else flags
        wanted = CPU_NATIVE_FLAGS[dtype]
        if flags is not None and not flags & set(wanted):
            return torch.float32, (
                f"this CPU has no native {name} matmuls (none of {', '.join(wanted)} "
                f"in /proc/cpuinfo): they are emulated and run slower than fp32; "
                f"MFU is against the fp32 peak (precision=fp32 is faster here)"
            )
    if device.type == "cuda" and dtype == torch.bfloat16:
        major, _ = torch.cuda.get_device_capability(device)
        if major < 8:
            return torch.float32, (
                f"{torch.cuda.get_device_name(device)} has no bf16 tensor cores (before "
                "Ampere): bf16 runs at the fp32 rate; precision=fp16_mixed is faster"
            )
    return dtype, None


def peak_flops_per_rank(
    device: torch.device,
    dtype: torch.dtype,
    override_tflops: float | None = None,
    flags: frozenset[str] | None = None,
) -> Peak:
    """Peak FLOP/s one rank can reach in ``dtype``: the MFU denominator.

    ``override_tflops`` (``trainer.peak_tflops``) wins; then the datasheet table for a
    known GPU; otherwise (CPU, or an unknown GPU) a short matmul probe on the device,
    in the dtype the matmuls really run in (:func:`precision_support`: fp32 for a
    precision the CPU emulates, whose probe would otherwise measure the slow emulation
    and put MFU above 100%).
    """
    device = torch.device(device)
    matmul_dtype, warning = precision_support(device, dtype, flags)
    if override_tflops:
        return Peak(
            float(override_tflops) * 1e12, matmul_dtype, "trainer.peak_tflops", warning
        )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = lookup_gpu_peak_tflops(name, dtype)
        if tflops is not None:
            return Peak(tflops * 1e12, matmul_dtype, "datasheet", warning)
        warnings.warn(
            f"no peak FLOP/s figure for {name!r}; measuring a matmul probe instead "
            "(set trainer.peak_tflops to use the datasheet figure)",
            stacklevel=2,
        )
    before = thread_times()
    flops = measure_matmul_flops(device, matmul_dtype)
    waited = cpu_wait(before, thread_times())
    return Peak(flops, matmul_dtype, "probe", warning, waited)


#: A share of a window's thread time spent waiting for a core above which the run's
#: speed figures (and a probe's peak) are said to depend on other processes' load.
CONTENDED = 0.10
_TASKS = "/proc/self/task"


def _schedstat(task: str) -> tuple[int, int] | None:
    """(ns on a core, ns runnable but waiting for one) of the thread whose /proc task
    dir is ``task``; None when it ended meanwhile (or the kernel does not say)."""
    try:
        with open(f"{task}/schedstat") as f:
            ran, waited = f.read().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def _summed_deltas(
    since: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]
) -> tuple[int, int]:
    """The (ran, waited) ns the threads of ``now`` added since ``since``."""
    ran = waited = 0
    for tid, (r, w) in now.items():
        r0, w0 = since.get(tid, (0, 0))
        ran, waited = ran + r - r0, waited + w - w0
    return ran, waited


def thread_times() -> dict[str, tuple[int, int]] | None:
    """Per thread of this process: (ns on a core, ns runnable but waiting for one),
    from ``/proc/self/task/*/schedstat``; None where the kernel does not say (not
    Linux)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    times = {tid: _schedstat(f"{_TASKS}/{tid}") for tid in tids}
    return {tid: t for tid, t in times.items() if t is not None} or None


def cpu_wait(
    since: dict[str, tuple[int, int]] | None, now: dict[str, tuple[int, int]] | None
) -> float | None:
    """The share of this process's thread time between two :func:`thread_times`
    spent waiting for a core: 0 on an idle machine, about 1 - cores / runnable
    threads when other processes hold the cores. None without the figures."""
    if since is None or now is None:
        return None
    ran, waited = _summed_deltas(since, now)
    return waited / (ran + waited) if ran + waited > 0 else None


#: Set by the launcher for its ranks: its pid. The run's processes are that process
#: and its descendants (ranks, the rank server, data-loader workers).
RUN_ROOT_ENV = "SHARDWRAP_RUN_PID"
_PROC = "/proc"


def run_root() -> int:
    """The pid whose process tree is this run: the launcher's (:data:`RUN_ROOT_ENV`),
    else this process's parent (torchrun's agent), else this process."""
    value = os.environ.get(RUN_ROOT_ENV, "")
    return int(value) if value.isdigit() else os.getppid() or os.getpid()


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CoreReading:
    """What the cores did up to one moment: ``busy_s``, the core-seconds any process
    ran on this process's cores (``/proc/stat``); ``run``, per thread of the run's
    processes (:func:`run_root` and its descendants), (ns on a core, ns runnable but
    waiting), from ``schedstat`` as :func:`thread_times`; ``wall_s``, a monotonic
    clock; ``cores``, how many cores."""

    wall_s: float
    cores: int
    busy_s: float
    run: dict[str, tuple[int, int]]


def _busy_seconds(cores: list[int]) -> float | None:
    # /proc/stat cpuN: user nice system idle iowait irq softirq steal ... (ticks)
    wanted, busy = {f"cpu{c}" for c in cores}, 0
    try:
        with open(f"{_PROC}/stat") as f:
            for line in f:
                name, *ticks = line.split()
                if name in wanted:
                    t = [int(x) for x in ticks[:8]]
                    busy += t[0] + t[1] + t[2] + t[5] + t[6] + t[7]
    except (OSError, ValueError, IndexError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


def _run_threads(root: int) -> dict[str, tuple[int, int]]:
    out, todo, seen = {}, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            tids = os.listdir(f"{_PROC}/{pid}/task")
        except OSError:
            continue  # it ended meanwhile
        for tid in tids:
            task = f"{_PROC}/{pid}/task/{tid}"
            times = _schedstat(task)
            if times is None:
                continue  # it ended meanwhile
            out[tid] = times
            try:
                with open(f"{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except (OSError, ValueError):
                continue
    return out


def core_reading(root: int | None) -> CoreReading | None:
    """A :class:`CoreReading` of the run under ``root``; None without the figures
    (not Linux, or no ``root``)."""
    if root is None:
        return None
    cores = _cores()
    busy = _busy_seconds(cores)
    run = _run_threads(root)
    if busy is None or not run:
        return None
    return CoreReading(time.monotonic(), len(cores), busy, run)


def split_cpu_wait(
    waited: float,
    wall_s: float,
    cores: int,
    busy_s: float,
    run_ran_s: float,
    run_waited_s: float,
) -> tuple[float, float]:
    """``(own, others)``: a rank's share of thread time spent waiting for a core
    (``waited``, :func:`cpu_wait`) split by whose threads held the cores over a
    window of ``wall_s`` seconds on ``cores`` cores, in which every process on them
    ran ``busy_s`` core-seconds and the run's own threads (all its processes) ran
    ``run_ran_s`` and waited ``run_waited_s`` thread-seconds.

    The run's own: the thread-seconds its threads wanted beyond what the cores give
    (``run_ran + run_waited - cores x wall``), which it waits whatever else runs,
    and the wait while other processes held no core (waking up, handing a core
    between the run's threads). Others': the rest of the run's waiting, at most the
    core-seconds other processes ran (``busy - run_ran``): each of those could have
    run one of the run's waiting threads. The rank's ``waited`` is split in the run's
    proportion."""
    if run_waited_s <= 0 or waited <= 0:
        return max(waited, 0.0), 0.0
    beyond = max(0.0, run_ran_s + run_waited_s - cores * wall_s)
    others_ran = max(0.0, busy_s - run_ran_s)
    by_others = min(max(0.0, run_waited_s - beyond), others_ran)
    share = by_others / run_waited_s
    return waited * (1 - share), waited * share


def split_between(
    waited: float | None, since: CoreReading | None, now: CoreReading | None
) -> tuple[float, float] | None:
    """:func:`split_cpu_wait` of ``waited`` between two :func:`core_reading`;
    None without them."""
    if waited is None or since is None or now is None or now.wall_s <= since.wall_s:
        return None
    ran, wait = _summed_deltas(since.run, now.run)
    return split_cpu_wait(
        waited,
        now.wall_s - since.wall_s,
        now.cores,
        now.busy_s - since.busy_s,
        max(0, ran) / 1e9,
        max(0, wait) / 1e9,
    )


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def model_flops_utilization(achieved: float, peak: float) -> float | None:
    """MFU: ``achieved`` FLOP/s over the ``peak``; None above 1, where the peak is
    wrong (a probe measured while the machine was busy, a wrong
    ``trainer.peak_tflops``): no figure rather than a false one."""
    mfu = achieved / peak
    return mfu if mfu <= 1.0 else None


class ThroughputMeter:
    """Tokens/s, step time and MFU over the window between two log points.

    ``tokens_per_step`` is global: tokens consumed by all ranks in one optimizer step
    (batch x seq_len x grad-accum x data-parallel ranks). The first window, from the
    start to the first log point, holds warm-up and is never reported.
    ``peak_flops_per_rank=None`` (ranks that do not report) leaves MFU out.
    """

    def __init__(
        self,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops_per_rank: float | None,
        world_size: int,
        clock: Callable[[], float] = time.perf_counter,
        probe_cpu_wait: float | None = None,
        probe_cpu_wait_others: float | None = None,
        run_root: int | None = None,
        compute_threads: int | None = None,
        peak_source: str | None = None,
    ) -> None:
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak_flops_per_rank, self.world_size = peak_flops_per_rank, world_size
        self.clock = clock
        self._mark: tuple[int, float] | None = None
        self._threads = thread_times()  # the window's start, for cpu_wait
        # Whose threads held the cores (split_cpu_wait): read where run_root is given
        # (rank 0); compute_threads: the run's ranks on this machine x threads each.
        self.run_root, self.compute_threads = run_root, compute_threads
        self._cores = core_reading(run_root)
        self._mfu_dropped = False  # the MFU-above-100% line is said once
        # A CPU probe's peak is one rank's alone: ranks whose threads outnumber the
        # cores share them, and MFU against it falls with each rank added: left out.
        cores, threads = len(_cores()), compute_threads or 0
        shared = peak_source == "probe" and 0 < cores < threads
        self.shared_cores = shared and f"{threads} threads of ranks on {cores} cores"
        if shared and peak_flops_per_rank is not None:
            log.warning(
                "MFU left out: %s share them, each rank reaching a fraction of the peak "
                "its probe measured alone (OMP_NUM_THREADS x trainer.devices <= the "
                "cores for an MFU figure)", self.shared_cores,
            )  # fmt: skip
            self.peak_flops_per_rank = None
        self._own_said = False  # the oversubscribed-run line is said once
        # the most contended window's cpu_wait; of it, others' and the run's own
        self.cpu_wait_max = self.cpu_wait_others_max = self.cpu_wait_own_max = None
        self.probe_cpu_wait = probe_cpu_wait  # the peak probe's (Peak.cpu_wait)
        self.probe_cpu_wait_others = probe_cpu_wait_others  # of it, others'
        self.measured_steps, self.measured_s = 0, 0.0  # every reported window's

    def _now(self) -> float:
        _synchronize()  # GPU work is asynchronous: time it when it has finished
        return self.clock()

    def restart(self, step: int) -> None:
        """Start a new window at ``step`` (e.g. after eval or a checkpoint, so their
        time is not counted as training time). Before the first log point this does
        nothing: the warm-up window stays open and is still left out."""
        if self._mark is not None:
            self._mark = (step, self._now())
            self._threads = thread_times()
            self._cores = core_reading(self.run_root)

    def step(self, step: int, log: bool) -> dict | None:
        """Call after every optimizer step; at log points returns the window's figures
        (None at the first log point, which closes the warm-up window)."""
        if not log:
            return None
        now = self._now()
        mark, self._mark = self._mark, (step, now)
        threads, self._threads = self._threads, thread_times()
        cores, self._cores = self._cores, core_reading(self.run_root)
        if mark is None or step <= mark[0] or now <= mark[1]:
            return None
        steps, seconds = step - mark[0], now - mark[1]
        self.measured_steps += steps
        self.measured_s += seconds
        tokens_per_s = self.tokens_per_step * steps / seconds
        per_rank = tokens_per_s / self.world_size
        row = {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": per_rank,
            "step_time_s": seconds / steps,
        }
        waited = cpu_wait(threads, self._threads)
        if waited is not None:
            row["cpu_wait"] = waited
            split = split_between(waited, cores, self._cores)
            if split is not None:
                row["cpu_wait_own"], row["cpu_wait_others"] = split
                self._oversubscribed(split[0], mark[0] + 1, step)
            # Rank 0 says whose threads held the cores (run_root given); without
            # /proc to split by, its whole wait is taken as others'. The other ranks
            # keep the figure and say nothing.
            if self.run_root is not None:
                others = waited if split is None else split[1]
                self._contended(waited, others, mark[0] + 1, step)
        if self.peak_flops_per_rank is None:
            return row
        mfu = model_flops_utilization(
            per_rank * self.flops_per_token, self.peak_flops_per_rank
        )
        if mfu is not None:
            row["mfu"] = mfu
        else:
            self._omit_mfu(per_rank * self.flops_per_token)
        return row

    def measured(self) -> dict[str, Any]:
        """This attempt's figures over all its reported windows (none before the first
        full window): steps and seconds measured, tokens/s, MFU (rank 0: not over
        100%), and whether the peak probe was contended."""
        if not self.measured_steps:
            return {}
        tokens_per_s = self.tokens_per_step * self.measured_steps / self.measured_s
        out = {
            "measured_steps": self.measured_steps,
            "measured_s": self.measured_s,
            "tokens_per_s": tokens_per_s,
            "world_size": self.world_size,
        }
        if self.peak_flops_per_rank is not None:
            achieved = tokens_per_s / self.world_size * self.flops_per_token
            mfu = model_flops_utilization(achieved, self.peak_flops_per_rank)
            out.update({} if mfu is None else {"mfu": mfu})
            if (self.probe_cpu_wait_others or 0.0) > CONTENDED:
                out["probe_contended"] = True
        return out

    def contention(self) -> dict[str, float]:
        """For the run's summary: the most contended window's ``cpu_wait`` and the
        peak probe's (where measured); :func:`contended` reads them back."""
        out = {
            "cpu_wait_max": self.cpu_wait_max,
            "cpu_wait_others_max": self.cpu_wait_others_max,
            "cpu_wait_own_max": self.cpu_wait_own_max,
            "probe_cpu_wait": self.probe_cpu_wait,
            "probe_cpu_wait_others": self.probe_cpu_wait_others,
        }
        return {k: v for k, v in out.items() if v is not None}

    def _contended(self, waited: float, others: float, first: int, last: int) -> None:
        # Said once, at the first window where other processes held the cores.
        said = (self.cpu_wait_others_max or 0.0) > CONTENDED
        self.cpu_wait_max = max(waited, self.cpu_wait_max or 0.0)
        self.cpu_wait_others_max = max(others, self.cpu_wait_others_max or 0.0)
        if others > CONTENDED and not said:
            threads = torch.get_num_threads()
            log.warning(
                "steps %d-%d: this rank's threads waited for a core %.0f%% of the "
                "time, %.0f%% of it while other processes held the machine's cores: "
                "tokens/s and MFU are below what this run gets alone and move with "
                "the load (cpu_wait, cpu_wait_others in metrics.jsonl); compare runs "
                "measured under the same load%s",
                first,
                last,
                100 * waited,
                100 * others / waited,
                f"; {threads} threads per rank wait for each other on a busy "
                "machine: OMP_NUM_THREADS=1 runs faster there"
                if threads > 1
                else "",
            )

    def _oversubscribed(self, own: float, first: int, last: int) -> None:
        # Said once: the run's own threads wanted more cores than there are, as
        # configured (ranks x threads per rank); a launcher's or loader's brief
        # wake-ups are in cpu_wait_own but say nothing a user can change.
        self.cpu_wait_own_max = max(own, self.cpu_wait_own_max or 0.0)
        cores = self._cores.cores if self._cores else len(_cores())
        threads = self.compute_threads
        if own <= CONTENDED or self._own_said or not threads or threads <= cores:
            return
        self._own_said = True
        per_rank = torch.get_num_threads()
        ranks = threads // per_rank
        fits = max(1, cores // max(1, ranks))  # threads per rank that fit the cores
        advice = (f"set OMP_NUM_THREADS={fits} (fewer threads per rank) or fewer ranks "
                  "(trainer.devices)" if fits < per_rank else "more ranks than cores: "
                  f"trainer.devices={max(1, cores // per_rank)} or fewer")  # fmt: skip
        log.warning(
            "steps %d-%d: this rank's threads waited for a core %.0f%% of the time "
            "for the run's own threads: %d ranks x %d thread%s per rank on %d cores "
            "(cpu_wait_own in metrics.jsonl); %s for a faster run",
            first, last, 100 * own, ranks, per_rank, "" if per_rank == 1 else "s",
            cores, advice,
        )  # fmt: skip

    def _omit_mfu(self, achieved: float) -> None:
        # Above 100% the denominator is wrong (a probe measured on a busy machine, a
        # wrong trainer.peak_tflops): no figure rather than a false one, said once.
        if not self._mfu_dropped:
            self._mfu_dropped = True
            log.warning(
                "MFU omitted: the achieved %.3g FLOP/s per rank exceed the peak of "
                "%.3g (a matmul probe measured while the machine was busy, or a wrong "
                "trainer.peak_tflops); set trainer.peak_tflops to the device's peak",
                achieved,
                self.peak_flops_per_rank,
            )


def contended(summary: dict) -> bool:
    """Whether a run's speed figures (tokens/s, MFU) were measured while other
    processes held its cores: a window or the peak probe waited for a core while
    they held them more than :data:`CONTENDED` of the time
    (:meth:`ThroughputMeter.contention`; a summary written before the wait was
    split: its whole ``cpu_wait_max``, ``probe_cpu_wait``)."""
    windows = summary.get("cpu_wait_others_max", summary.get("cpu_wait_max"))
    probe = summary.get("probe_cpu_wait_others", summary.get("probe_cpu_wait"))
    figures = (windows, probe)
    return any(isinstance(v, int | float) and v > CONTENDED for v in figures)


#: glibc's mallopt parameter numbers (malloc.h: M_TRIM_THRESHOLD, M_MMAP_THRESHOLD,
#: M_ARENA_MAX).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def set_malloc_mmap_threshold(kib: int | None) -> bool:
    """Serve every heap block of ``kib`` KiB or more with its own mmap, so freeing it
    returns its pages to the OS at once (glibc's ``mallopt(M_MMAP_THRESHOLD)``; fixing
    it also stops glibc's dynamic threshold, which otherwise rises after the first
    large frees and keeps later tensors on the heap), and keep one heap for all the
    rank's threads (``M_ARENA_MAX=1``: gloo's threads' blocks do not hold arenas of
    their own). A rank's peak resident set then follows the memory it uses, which the
    planner predicts (its constants measured so), rather than what glibc happened to
    keep: the big blocks leave the resident set when freed, the smaller ones reuse the
    heap without a page fault. The heap's free top is returned to the OS only past
    twice the threshold (``M_TRIM_THRESHOLD``, the ratio glibc's dynamic rule keeps):
    a fixed threshold leaves glibc's 128 KiB trim, which handed the top back at every
    free and page-faulted it in again at the next step (3,000+ faults a step for the
    small model, issue 47; docs/benchmarks.md). What the kept top adds to the peak is
    at most that much. ``None``: glibc's defaults. False when not applied (no
    glibc)."""
    if kib is None:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without it)
        return False
    mallopt(_M_ARENA_MAX, 1)
    mallopt(_M_TRIM_THRESHOLD, 2 * int(kib) * 1024)
    return bool(mallopt(_M_MMAP_THRESHOLD, int(kib) * 1024))


_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _reset_cpu_peak_rss() -> bool:
    # "5" resets VmHWM to the current RSS (Linux >= 4.0, see proc(5)).
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_rss_bytes() -> int:
    """Peak resident set of this process: VmHWM, else getrusage's ru_maxrss."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory phase (so a phase such as model construction can be
    measured alone). On CPU without /proc/self/clear_refs the peak cannot be reset
    and stays the process's lifetime peak."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _reset_cpu_peak_rss()
        if live_memory.active() is not None:
            live_memory.active().reset()


def memory_metrics(device: torch.device, prefix: str = "") -> dict:
    """This rank's peak memory since the last reset_peak_memory, in GiB.

    GPU: the caching allocator's peak allocated (``peak_mem_gib``) and reserved bytes,
    allocation retries (cudaMalloc failed, cache flushed and retried: a sign of
    fragmentation near the limit) and OOMs. CPU: the peak memory in use where a
    sampler watches the model (:mod:`src.observe.live_memory`), with the peak resident
    set beside it (``peak_rss_gib``); else the peak resident set.
    """
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out = {
            "peak_mem_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
            "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GIB,
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "ooms": stats.get("num_ooms", 0),
        }
    else:
        rss, live = cpu_peak_rss_bytes() / GIB, live_memory.active()
        out = {"peak_mem_gib": live.peak / GIB if live else rss}
        if live:
            out["peak_rss_gib"] = rss
    return {prefix + k: v for k, v in out.items()}


def reduce_max_min(metrics: dict, group=None) -> dict:
    """``{k: max over ranks, k + "_min": min over ranks}`` with a single all_reduce.

    Max is what decides whether a run fits; the min beside it shows imbalance. Without a
    process group the local values are both. Every rank must pass the same keys.
    """
    keys = sorted(metrics)
    values = [float(metrics[k]) for k in keys]
    if dist.is_available() and dist.is_initialized() and keys:
        # max(-x) = -min(x): both reductions in one MAX all_reduce.
        t = torch.tensor(values + [-v for v in values], dtype=torch.float64)
        t = t.to(collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        t = t.cpu().tolist()
        maxs, mins = t[: len(keys)], [-v for v in t[len(keys) :]]
    else:
        maxs, mins = values, values
    out = {}
    for k, hi, lo in zip(keys, maxs, mins, strict=True):
        is_int = isinstance(metrics[k], int) and not isinstance(metrics[k], bool)
        cast = int if is_int and math.isfinite(hi) else float
        out[k], out[k + "_min"] = cast(hi), cast(lo)
    return out


def interval_line(step: int, row: dict) -> str:
    """nanoGPT's per-interval line from a logged row: step, loss, then the figures
    the row has (tokens/s, step time and MFU from the second log point on: ``mfu
    n/a`` when the window has none, the cores' wait when other processes held them;
    peak memory per rank, learning rate)."""
    parts = [f"step {step}: loss {row['loss']:.4f}"]
    if "tokens_per_s" in row:
        mfu = row.get("mfu")
        parts += [
            f"{row['tokens_per_s']:,.0f} tok/s",
            f"{row['step_time_s'] * 1e3:.1f} ms/step",
            "mfu n/a" if mfu is None else f"mfu {mfu:.2%}",
        ]
        if row.get("cpu_wait_others", row.get("cpu_wait", 0.0)) > CONTENDED:
            parts.append(f"cpu wait {row['cpu_wait']:.0%}")
    if "peak_mem_gib" in row:
        parts.append(f"mem {row['peak_mem_gib']:.3f} GiB")
    if "moe/load_max_over_mean" in row:  # a mixture of experts' routing
        moe = f"experts max/mean {row['moe/load_max_over_mean']:.2f}"
        if row.get("moe/dropped"):
            moe += f" dropped {row['moe/dropped']}"
        parts.append(moe)
    parts.append(f"lr {row['lr']:.2e}")
    return ", ".join(parts)
