"""Device profiles for the step-time model (src/planner/step_time.py): how fast a rank
multiplies matrices, moves memory and talks to the other ranks.

A CPU's profile is measured by a short probe (:func:`probe_cpu`, about ten seconds:
matmuls and causal attention in fp32 and bf16 at one thread and at every core, a
copy's and GELU's bandwidth, a chain of tiny ops forward and backward for the per-op
dispatch time; then two processes of one thread each, src/planner/rank_probe.py, for
gloo's collectives between them and what FSDP2 and tensor parallelism add to a step
beyond their collectives) and cached as JSON under ``$SHARDWRAP_PROFILE_DIR``
(default ``$SHARDWRAP_CACHE/profiles``, else ``~/.cache/shardwrap/profiles``), keyed by
the machine's identity (CPU model, cores, torch version): a changed identity, or a file
that is not a profile, is measured again. A GPU's profile is its datasheet's
(:data:`GPU_LINKS`, matmul rates from src/observe/metrics.py), not calibrated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from src.observe.metrics import lookup_gpu_peak_tflops

log = logging.getLogger(__name__)

#: The collectives a profile times: name -> how many times the tensor's bytes one rank
#: moves over its link, per ``(n - 1) / n`` (ring algorithms), and ``p2p`` once.
COLLECTIVES = {
    "all_reduce": 2.0,
    "all_gather": 1.0,
    "reduce_scatter": 1.0,
    "all_to_all": 1.0,
    "p2p": 1.0,
}
_DTYPES = ("fp32", "bf16")
#: A figure measured at or below zero (noise) is stored as this: 0 means "not
#: measured".
MEASURED_FLOOR_S = 1e-7
#: The cached profile's format: a file of another is measured again.
PROFILE_FORMAT = 11
_DTYPE_OF = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Link:
    """One collective on a link: ``latency_s + factor * bytes / bandwidth``."""

    latency_s: float
    bandwidth: float  # bytes/s one rank moves (bus bandwidth)


@dataclass(frozen=True)
class DeviceProfile:
    """What the step-time model reads of a device.

    The rates are per thread count (CPU: ``{1: ..., cores: ...}``) or ``{1: ...}``
    for a GPU: matmuls and causal attention (forward and backward, FLOPs as the
    family formula counts them) per dtype, a copy's bandwidth and the activation
    function's (GELU forward and backward, 5 tensor-widths moved per element);
    ``links`` per collective within a node, ``inter_links`` across nodes (the CPU
    probe: the same); ``overlap``: whether a collective runs beside compute (a
    GPU's NCCL kernels do; a CPU's gloo threads take the cores the ranks compute
    on); ``fsdp_unit_s`` and ``dtensor_op_s``: the framework's own time per FSDP
    unit and per op DTensor dispatches under tensor parallelism
    (src/planner/rank_probe.py)."""

    name: str
    source: str  # "probe ..." or "datasheet, not calibrated"
    cores: int  # CPU cores (0 on a GPU)
    matmul: dict[str, dict[int, float]]  # dtype -> threads -> FLOP/s
    attention: dict[str, dict[int, float]]  # dtype -> threads -> FLOP/s (causal SDPA)
    memory_bw: dict[int, float]  # threads -> bytes/s (a copy)
    activation_bw: dict[int, float]  # threads -> bytes/s of GELU forward + backward
    op_s: float  # one op's dispatch time (framework overhead, not its work)
    links: dict[str, Link]
    inter_links: dict[str, Link]
    ranks_per_node: int
    overlap: bool
    #: per op of a traced step beyond the op's own replayed time (the autograd
    #: engine, modules' calls; src/planner/work.py; 0: not measured, as on a GPU)
    traced_op_s: float = 0.0
    #: per FSDP unit and micro-batch, beyond its collectives: hooks, copy-in and
    #: copy-out (0: not measured, a GPU's, whose Python runs ahead of its kernels)
    fsdp_unit_s: float = 0.0
    #: per op DTensor dispatches under tensor parallelism (src/planner/tp_census.py
    #: counts them), beyond the local op (0: not measured)
    dtensor_op_s: float = 0.0
    #: per collective DTensor sends (a redistribution), beyond its link's latency
    #: and bytes: the redistribution's own work, the functional collective's
    #: hand-off to gloo's thread and back, the ranks' waits at it (0: not measured)
    dtensor_comm_s: float = 0.0
    #: bytes/s of FSDP's all-gathers and reduce-scatters as a step meets them (its
    #: copies included; 0: the links' own)
    fsdp_bandwidth: float = 0.0
    #: the same while the ranks compute beside them (the next unit's gathers run
    #: as this unit computes: gloo's threads and the peer's wait for cores the
    #: compute holds; 0: ``fsdp_bandwidth``)
    fsdp_loaded_bandwidth: float = 0.0
    #: DDP per gradient bucket and its bytes/s, as a step meets them (its copies
    #: and its thread's share of the core in; 0: the all-reduce link's)
    ddp_bucket_s: float = 0.0
    ddp_bandwidth: float = 0.0
    #: per parameter tensor, what the clip and optimizer step add when parameters
    #: are DTensors (FSDP2, TP) (0: not measured)
    dtensor_param_s: float = 0.0
    #: per parameter tensor of plain tensors, the clip, a fused AdamW step and the
    #: zeroing beyond their bytes (0: not measured, a GPU's datasheet)
    param_s: float = 0.0
    #: per second of a rank's compute between synchronisations, the seconds ranks
    #: wait for each other at them beyond the collective's latency (the 2-rank
    #: probe's, src/planner/rank_probe.py; 0: not measured, a GPU's datasheet)
    sync_wait: float = 0.0
    #: how ``sync_wait`` changes with the compute between two synchronisations:
    #: the share at ``c`` seconds of it is ``sync_wait x (c / sync_burst_s) **
    #: exponent`` (in [-1, 0]; 0: the same share at any length), ``sync_burst_s``
    #: the compute between the probe's synchronisations that ``sync_wait`` is of
    sync_wait_exponent: float = 0.0
    sync_burst_s: float = 0.0

    def rate(self, table: dict[int, float], threads: int) -> float:
        """The figure at ``threads`` (between measured counts: linear, at most the
        largest count's), and never below a smaller count's: more threads can
        always run as fewer, so a count that measured slower (its threads held off
        their cores by other processes while the probe ran: fp32 matmuls at 2 threads
        once read 0.18 GFLOP/s against 80 at one) is a load artifact, not a rate."""
        counts = sorted(table)
        floor = max((table[c] for c in counts if c <= threads), default=0.0)
        if threads in table:
            return max(table[threads], floor)
        lo = max((c for c in counts if c <= threads), default=counts[0])
        hi = min((c for c in counts if c >= threads), default=counts[-1])
        if lo == hi:
            return max(table[lo], floor)
        w = (threads - lo) / (hi - lo)
        return max(table[lo] + w * (table[hi] - table[lo]), floor)


# ------------------------------------------------------------------- GPU datasheets

#: Per accelerator (substring of its name, first match wins): memory bandwidth (B/s),
#: NVLink bandwidth per direction (B/s) and the InfiniBand NIC per GPU (B/s), from
#: NVIDIA's datasheets; latencies assumed (NCCL's small-message latency, ~10 us in a
#: node, ~20 us across nodes). Not calibrated: no GPU run has measured them yet.
GPU_LINKS: list[tuple[str, float, float, float]] = [
    ("B200", 8.0e12, 900e9, 50e9),  # HBM3e 8 TB/s, NVLink 5 1.8 TB/s, CX-7 400 Gb/s
    ("H200", 4.8e12, 450e9, 50e9),  # HBM3e 4.8 TB/s, NVLink 4 900 GB/s, 400 Gb/s
    ("H100", 3.35e12, 450e9, 50e9),  # SXM HBM3 3.35 TB/s
    ("A100", 2.0e12, 300e9, 25e9),  # 80 GB SXM 2.0 TB/s, NVLink 3 600 GB/s, HDR
]
_GPU_LATENCY_S, _IB_LATENCY_S, _GPU_OP_S = 10e-6, 20e-6, 5e-6


def gpu_profile(accelerator: str) -> DeviceProfile | None:
    """The datasheet profile of ``accelerator`` (a device name or a budget's name such
    as ``h100_80gb``); None for one not in :data:`GPU_LINKS`."""
    name = accelerator.upper().replace("_", " ")
    for key, memory, nvlink, ib in GPU_LINKS:
        if key in name:
            matmul = {}
            for dtype in _DTYPES:
                tflops = lookup_gpu_peak_tflops(name, _DTYPE_OF[dtype])
                matmul[dtype] = {1: (tflops or 0.0) * 1e12}
            link = {c: Link(_GPU_LATENCY_S, nvlink) for c in COLLECTIVES}
            inter = {c: Link(_IB_LATENCY_S, ib) for c in COLLECTIVES}
            return DeviceProfile(
                name=key,
                source="datasheet, not calibrated",
                cores=0,
                matmul=matmul,
                attention=matmul,  # flash kernels: a share of it, not calibrated
                memory_bw={1: memory},
                activation_bw={1: memory},
                op_s=_GPU_OP_S,
                links=link,
                inter_links=inter,
                ranks_per_node=8,
                overlap=True,
            )
    return None


# ------------------------------------------------------------------------ CPU probe


def cpu_identity() -> dict[str, str | int]:
    """What a CPU profile is valid for: the CPU model, its cores, torch's version
    (and the file's format)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.partition(":")[2].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": available_cores(),
        "torch": torch.__version__,
        "format": PROFILE_FORMAT,
    }


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads(local_world: int, cores: int | None = None) -> int:
    """Intra-op threads of a CPU rank: ``OMP_NUM_THREADS`` when set (the user's
    choice: on a machine other processes share, one thread per rank runs far faster
    than threads that wait for each other; docs/benchmarks.md), else ``cores // local
    ranks``, so the ranks on a machine do not oversubscribe it (``cores``: this
    machine's unless given)."""
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0:
        return int(wanted)
    return max(1, (cores or available_cores()) // local_world)


def _best(fn, repeats: int, clock=time.perf_counter) -> float:
    """The shortest of ``repeats`` runs of ``fn`` by ``clock`` (the compute figures:
    CPU time, which other processes' load on a shared machine does not stretch)."""
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def _matmul_rate(dtype: torch.dtype, clock) -> float:
    """Best FLOP/s of square matmuls: 512 wide, or 128 where the dtype is emulated
    (a 128 matmul above 1 ms), so the probe stays short."""
    gen = torch.Generator().manual_seed(0)
    n = 128
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    if _best(lambda: torch.mm(a, b), 2, clock) < 1e-3:
        n = 512
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    return 2.0 * n**3 / _best(lambda: torch.mm(a, b), 3, clock)


def _memory_bw(clock, elements: int = 1 << 23) -> float:
    src, dst = torch.ones(elements), torch.empty(elements)
    return 2.0 * 4 * elements / _best(lambda: dst.copy_(src), 5, clock)


def _attention_rate(dtype: torch.dtype, clock) -> float:
    """Causal SDPA forward and backward (2 x 4 heads of 256 x 64) in FLOP/s as the
    family formula counts them (3 x 4 B H T^2 d: the full score matrix)."""
    b, h, t, d = 2, 4, 256, 64
    q = torch.randn(b, h, t, d).to(dtype).requires_grad_()

    def step() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()

    return 12.0 * b * h * t * t * d / _best(step, 3, clock)


def _activation_bw(clock, elements: int = 1 << 20) -> float:
    """GELU forward and backward over fp32 elements: 5 x 4 bytes each (read x, write
    y; read x and the gradient, write the input's)."""
    x = torch.randn(elements, requires_grad=True)
    grad = torch.ones(elements)

    def step() -> None:
        torch.nn.functional.gelu(x).backward(grad)

    return 20.0 * elements / _best(step, 3, clock)


def _tiny_chain(blocks: int = 10):
    """A step of tiny blocks (a 16-wide linear, GELU, a residual add: 3 forward ops
    each), forward and backward: a step that is all dispatch."""
    layer = torch.nn.Linear(16, 16)
    x = torch.ones(1, 16, requires_grad=True)

    def step() -> None:
        h = x
        for _ in range(blocks):
            h = h + torch.nn.functional.gelu(layer(h))
        h.sum().backward()

    return step


def _op_seconds(blocks: int = 10) -> float:
    """One op's dispatch time, its backward included: :func:`_tiny_chain` over its
    forward ops."""
    return _best(_tiny_chain(blocks), 3, time.thread_time) / (3 * blocks)


def _traced_op_seconds() -> float:
    """What a step costs per op beyond its ops' own time: :func:`_tiny_chain` timed
    (the median, as the replays take theirs), less each of its ops replayed alone
    (src/planner/work.py), over its ops, views included."""
    from src.planner import work

    step = _tiny_chain()
    step()
    runs = []
    for _ in range(7):
        t0 = time.thread_time()
        step()
        runs.append(time.thread_time() - t0)
    recorder = work.Recorder()
    with recorder:
        step()
    ops = recorder.out.regions[work.HEAD]
    times = work.OpTimes(None, 1)
    replayed = sum(
        n * times(recorder.out.calls[k], lambda call: 0.0) for k, n in ops.items()
    )
    count = sum(ops.values()) + recorder.out.views.get(work.HEAD, 0)
    # measured, if below what the replays resolve: never 0, which means not
    # measured (a GPU's) and would send a probed CPU's steps to the formula
    return max((statistics.median(runs) - replayed) / count, MEASURED_FLOOR_S)


def _param_seconds(tensors: int = 64) -> float:
    """Seconds per parameter tensor of the clip, a fused AdamW step and the zeroing,
    as the trainer's step runs them (src/trainer/step.py), on tensors too small for
    their bytes to count: the median of 7, by the thread's CPU time."""
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(tensors)]
    opt = torch.optim.AdamW(params, fused=True)
    runs = []
    for _ in range(9):
        for p in params:
            p.grad = torch.ones_like(p)
        t0 = time.thread_time()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        runs.append(time.thread_time() - t0)
    return statistics.median(runs[2:]) / tensors


def _cpu_clock(threads: int):
    """One thread's figures by its CPU time (``time.thread_time``: other processes'
    load does not stretch it, so they are the machine's alone); several threads'
    by wall time (their CPU time is not read reliably at this scale), which holds
    the load the probe met."""
    return time.thread_time if threads == 1 else time.perf_counter


def _compute_figures(cores: int) -> dict[str, dict]:
    """The compute rates (:class:`DeviceProfile`) at one thread and at ``cores``,
    timed by the CPU time they get (:func:`_cpu_clock`)."""
    threads = torch.get_num_threads()
    out: dict[str, dict] = {
        "matmul": {d: {} for d in _DTYPES},
        "attention": {d: {} for d in _DTYPES},
        "memory_bw": {},
        "activation_bw": {},
    }
    try:
        for count in sorted({1, cores}):
            torch.set_num_threads(count)
            clock = _cpu_clock(count)
            for name in _DTYPES:
                dtype = _DTYPE_OF[name]
                out["matmul"][name][count] = _matmul_rate(dtype, clock)
                out["attention"][name][count] = _attention_rate(dtype, clock)
            out["memory_bw"][count] = _memory_bw(clock)
            out["activation_bw"][count] = _activation_bw(clock)
    finally:
        torch.set_num_threads(threads)
    return out


def collective(link: Link, kind: str, ranks: int, nbytes: float) -> float:
    """Seconds of one collective over ``ranks`` on ``link`` with a full tensor of
    ``nbytes``: latency + factor (n - 1) / n bytes / bandwidth (a ring's)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    share = 1.0 if kind == "p2p" else (ranks - 1) / ranks
    return link.latency_s + COLLECTIVES[kind] * share * nbytes / link.bandwidth


def _links(times: dict[str, list[float]], large: int) -> dict[str, Link]:
    """Each collective's link from its seconds on 2 and on ``large`` fp32 elements:
    latency from the small, bandwidth from the difference."""
    out: dict[str, Link] = {}
    for name in COLLECTIVES:
        t_small, t_large = times[name]
        full = 4 * large * (2 if name == "all_gather" else 1)  # gathered: the output
        moved = COLLECTIVES[name] * (1.0 if name == "p2p" else 0.5) * full
        out[name] = Link(t_small, moved / max(t_large - t_small, 1e-9))
    return out


def _overheads(links: dict[str, Link], measured: dict) -> dict[str, float]:
    """From the probe chains' extra seconds (src/planner/rank_probe.py): FSDP's time
    per unit beyond its collectives' latencies and bytes, and its bandwidth (a
    unit's two all-gathers and reduce-scatter moving half its bytes each, fitted on
    the two widths); under TP, what the chain adds beyond its collectives' links
    and DTensor's dispatch per op (measured apart), per collective it sent; DDP's
    per bucket and its bandwidth (the gradients' bytes, fitted on the two
    widths)."""
    from src.planner import rank_probe as rp

    small, wide = (4 * rp.unit_numel(w) for w in (rp.WIDTH, rp.WIDE))
    per_unit = [measured[k] / rp.BLOCKS for k in ("fsdp_extra_s", "fsdp_wide_extra_s")]
    latency = 2 * links["all_gather"].latency_s + links["reduce_scatter"].latency_s
    per_byte = max((per_unit[1] - per_unit[0]) / (wide - small), 1e-12)
    # the wide chain again with compute beside its collectives: what its units
    # took beyond the free chain's, per byte
    loaded = measured["fsdp_loaded_extra_s"] / rp.BLOCKS
    per_byte_loaded = per_byte + max(0.0, loaded - per_unit[1]) / wide
    tp_census = measured["tp_census"]
    tp_comm = tp_census.comm_s(links, 2)
    op_s = max(0.0, measured["dtensor_op_s"])
    tp_ops = tp_census.dtensor_ops * op_s
    tp = (measured["tp_extra_s"] - tp_comm - tp_ops) / max(1, tp_census.sent)
    ddp = [measured[k] for k in ("ddp_extra_s", "ddp_wide_extra_s")]
    ddp_per_byte = max((ddp[1] - ddp[0]) / (wide - small) / rp.BLOCKS, 1e-12)
    return {
        "fsdp_unit_s": max(0.0, per_unit[0] - latency - per_byte * small),
        "fsdp_bandwidth": 1.5 / per_byte,
        "fsdp_loaded_bandwidth": 1.5 / per_byte_loaded,
        "dtensor_op_s": op_s,
        "dtensor_comm_s": max(0.0, tp),
        "ddp_bucket_s": max(0.0, ddp[0] - ddp_per_byte * small * rp.BLOCKS),
        "ddp_bandwidth": 1.0 / ddp_per_byte,
        "dtensor_param_s": max(0.0, measured["dtensor_param_s"]),
        "sync_wait": max(0.0, measured["sync_wait"]),
        "sync_wait_exponent": _wait_exponent(
            (measured["sync_burst_s"], measured["sync_wait"]),
            (measured["sync_short_burst_s"], measured["sync_wait_short"]),
        ),
        "sync_burst_s": max(0.0, measured["sync_burst_s"]),
    }


def _wait_exponent(long: tuple[float, float], short: tuple[float, float]) -> float:
    """The exponent of the share of compute ranks wait (:attr:`DeviceProfile.
    sync_wait_exponent`) through the probe's two (compute between
    synchronisations, share) points, in [-1, 0]: at most the same wait per
    synchronisation at any compute (-1), at least the same share (0, also where
    either reads no wait or the two computes do not differ)."""
    (burst, share), (short_burst, short_share) = long, short
    if min(share, short_share) <= 0 or min(burst, short_burst) <= 0:
        return 0.0
    if abs(math.log(burst / short_burst)) < 0.1:
        return 0.0
    slope = math.log(short_share / share) / math.log(short_burst / burst)
    return min(0.0, max(-1.0, slope))


def probe_cpu() -> DeviceProfile:
    """Measure this CPU's profile (about ten seconds on an idle 2-core machine: the
    rank probe starts two interpreters)."""
    from src.planner import rank_probe

    identity = cpu_identity()
    cores = int(identity["cores"])
    rates = _compute_figures(cores)
    measured = rank_probe.measure()
    links = _links(measured["collectives"], rank_probe.LARGE)
    return DeviceProfile(
        name=f"cpu: {identity['cpu']}, {cores} cores",
        source="probe",
        cores=cores,
        **rates,
        op_s=_op_seconds(),
        traced_op_s=_traced_op_seconds(),
        param_s=_param_seconds(),
        links=links,
        inter_links=links,
        ranks_per_node=cores,
        overlap=False,
        **_overheads(links, measured),
    )


# ---------------------------------------------------------------------------- cache


def profile_dir() -> Path:
    """Where CPU profiles are cached (module docstring)."""
    own = os.environ.get("SHARDWRAP_PROFILE_DIR")
    if own:
        return Path(own).expanduser()
    base = os.environ.get("SHARDWRAP_CACHE") or "~/.cache/shardwrap"
    return Path(base).expanduser() / "profiles"


def _cache_path(identity: dict) -> Path:
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return profile_dir() / f"cpu-{key[:16]}.json"


def work_cache(identity: dict, threads: int = 1, neighbours: int = 0) -> Path:
    """Where the op times of the CPU of ``identity`` at ``threads`` threads, beside
    ``neighbours`` other ranks, are cached (beside its profile; src/planner/work.py)."""
    path = _cache_path(identity)
    return path.with_name(f"{path.stem}-ops-{threads}t{neighbours}n.json")


def cpu_profile(probe=probe_cpu) -> DeviceProfile:
    """This CPU's profile: cached for its identity, else measured (``probe``) and
    cached; a cache file that is not a valid profile is said in one line and
    measured again."""
    identity = cpu_identity()
    path = _cache_path(identity)
    if path.exists():
        try:
            found = _from_json(json.loads(path.read_text()), identity)
            return replace(found, source=f"probe, cached in {path}")
        except (ValueError, TypeError, KeyError, OSError) as err:
            log.warning("device profile %s refused (%s): measured again", path, err)
    profile = probe()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": identity, **asdict(profile)}))
        tmp.replace(path)
    except OSError as err:
        log.warning("device profile not cached in %s (%s)", path, err)
    return replace(profile, source=f"probe, measured now, cached in {path}")


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} is not a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} is not a positive number")
    return float(value)


def _at_least_zero(value, what: str) -> float:
    return 0.0 if value == 0 and not isinstance(value, bool) else _number(value, what)


def _table(raw, what: str) -> dict[int, float]:
    if not isinstance(raw, dict) or not raw:
        raise TypeError(f"{what} is not a table")
    return {int(k): _number(v, f"{what}[{k}]") for k, v in raw.items()}


def _read_links(raw, what: str) -> dict[str, Link]:
    if not isinstance(raw, dict) or set(raw) != set(COLLECTIVES):
        raise ValueError(f"{what} does not name each collective")
    return {
        c: Link(
            _number(raw[c]["latency_s"], f"{what}.{c}"),
            _number(raw[c]["bandwidth"], f"{what}.{c}"),
        )
        for c in COLLECTIVES
    }


def _from_json(raw, identity: dict) -> DeviceProfile:
    """A profile read back from disk, every field's type checked."""
    if not isinstance(raw, dict) or raw.get("identity") != identity:
        raise ValueError("not this machine's profile")
    for key in ("matmul", "attention"):
        if not isinstance(raw[key], dict) or set(raw[key]) != set(_DTYPES):
            raise ValueError(f"{key} does not name fp32 and bf16")
    if not isinstance(raw["name"], str) or not isinstance(raw["overlap"], bool):
        raise TypeError("name or overlap has the wrong type")
    return DeviceProfile(
        name=raw["name"],
        source="probe",
        cores=int(_number(raw["cores"], "cores")),
        matmul={d: _table(raw["matmul"][d], f"matmul.{d}") for d in _DTYPES},
        attention={d: _table(raw["attention"][d], f"attention.{d}") for d in _DTYPES},
        memory_bw=_table(raw["memory_bw"], "memory_bw"),
        activation_bw=_table(raw["activation_bw"], "activation_bw"),
        op_s=_number(raw["op_s"], "op_s"),
        links=_read_links(raw["links"], "links"),
        inter_links=_read_links(raw["inter_links"], "inter_links"),
        ranks_per_node=int(_number(raw["ranks_per_node"], "ranks_per_node")),
        overlap=raw["overlap"],
        traced_op_s=_at_least_zero(raw["traced_op_s"], "traced_op_s"),
        fsdp_unit_s=_at_least_zero(raw["fsdp_unit_s"], "fsdp_unit_s"),
        dtensor_op_s=_at_least_zero(raw["dtensor_op_s"], "dtensor_op_s"),
        dtensor_comm_s=_at_least_zero(raw["dtensor_comm_s"], "dtensor_comm_s"),
        fsdp_bandwidth=_at_least_zero(raw["fsdp_bandwidth"], "fsdp_bandwidth"),
        fsdp_loaded_bandwidth=_at_least_zero(
            raw["fsdp_loaded_bandwidth"], "fsdp_loaded_bandwidth"
        ),
        ddp_bucket_s=_at_least_zero(raw["ddp_bucket_s"], "ddp_bucket_s"),
        ddp_bandwidth=_at_least_zero(raw["ddp_bandwidth"], "ddp_bandwidth"),
        dtensor_param_s=_at_least_zero(raw["dtensor_param_s"], "dtensor_param_s"),
        param_s=_at_least_zero(raw["param_s"], "param_s"),
        sync_wait=_at_least_zero(raw["sync_wait"], "sync_wait"),
        sync_wait_exponent=_exponent(raw["sync_wait_exponent"]),
        sync_burst_s=_at_least_zero(raw["sync_burst_s"], "sync_burst_s"),
    )


def _exponent(value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("sync_wait_exponent is not a number")
    if not -1.0 <= value <= 0.0:
        raise ValueError("sync_wait_exponent is not in [-1, 0]")
    return float(value)


def profile_for(device: str, accelerator: str = "") -> DeviceProfile | None:
    """The profile a plan for ``device`` uses: the named accelerator's datasheet on
    CUDA (None when not in :data:`GPU_LINKS`), this CPU's probe otherwise."""
    if device == "cuda":
        return gpu_profile(accelerator)
    return cpu_profile()
