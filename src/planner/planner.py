"""The planner: a run's training peak per rank, predicted before anything runs, and
the cheapest change of settings that makes it fit a memory budget.

The estimate is arithmetic on the wrap plan (units and their sizes, from a model built
on the meta device with the recording-only ``plan`` backend) and on the model family's
activation formula (``activation_bytes`` next to its FLOPs formula in src/models/), so
it allocates nothing and takes seconds even for a 70B model on hundreds of ranks. It
follows one training step through its moments (docs/planner.md lists them all) and
reports the largest; the main ones:

- ``loss backward``: every block's activations are saved, the loss's backward buffers
  are alive (the usual peak when activations dominate);
- ``block backward``: the head is freed, the last block's backward working set (and,
  with checkpointing, its recomputed activations) plus the unit's unsharded gradients
  on their way to the reduce-scatter;
- ``optimizer step``: parameters, gradients, AdamW's two states and the update's
  temporaries (the peak when parameters dominate).

With gradient accumulation the first two hold the gradients of earlier micro-batches:
sharded when they are reduce-scattered every micro-batch (``trainer.grad_sync=every``),
unsharded (the whole model's, per rank) when only the last one syncs (``last``).
The parts are documented in docs/planner.md, with how the runtime constant was
calibrated (bench/plan_vs_measured.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from src.errors import ConfigError
from src.models.memory import ActivationBytes
from src.observe.loggers import LOGGERS, Logger, logger_kind
from src.planner.trace import tp_local, traced_activation_bytes
from src.resolved import (
    Resolved,
    resolve_devices,
    resolve_policies,
    tensor_parallel_plan,
)
from src.sharding import (
    GIB,
    MIB,
    PRECISIONS,
    ParallelLayout,
    Unit,
    WrapPlan,
    backend_class,
    build_backend,
    get_precision,
    wrap_plan,
)
from src.sharding.pipeline import (
    SCHEDULES,
    bubble_fraction,
    local_stages,
    microbatches_problem,
    schedule_order,
)
from src.sharding.transforms import SplitBlockError

log = logging.getLogger(__name__)

#: Memory per device (GiB) of the accelerators ``trainer.mem_budget_gib`` can name: the
#: total the driver reports (nvidia-smi / rocm-smi), not the marketing figure.
ACCELERATORS_GIB: dict[str, float] = {
    "a100_40gb": 39.4,
    "a100_80gb": 79.2,
    "h100_80gb": 79.1,
    "h100_94gb": 93.1,
    "h200": 139.8,
    "b200": 178.4,
    "l40s": 44.4,
    "a10g": 22.0,
    "mi300x": 191.5,
}


def budget_bytes(value: Any, key: str = "trainer.mem_budget_gib") -> int | None:
    """``trainer.mem_budget_gib`` in bytes: GiB per rank, or a named accelerator from
    :data:`ACCELERATORS_GIB`; None when unset."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ACCELERATORS_GIB:
            return int(ACCELERATORS_GIB[name] * GIB)
        try:
            value = float(name)
        except ValueError:
            raise ConfigError(
                key,
                f"got {value!r}, expected GiB per rank (> 0) or one of: "
                + ", ".join(ACCELERATORS_GIB),
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(key, f"got {value!r}, expected GiB per rank > 0")
    return int(value * GIB)


#: What training adds above the parts the estimate counts (code and kernels first
#: touched by backward and the optimizer, gloo buffers, autograd bookkeeping), per
#: device type and compute-dtype width. CPU: measured, fitted to
#: bench/plan_vs_measured.py (the mean residual of its configurations; peak RSS above
#: the process baseline, glibc retention removed, the model's classes built once on
#: meta before the baseline); bf16 on CPU adds ~12 MiB whatever the model size
#: (oneDNN's bf16 kernels and their scratch buffers). CUDA: assumed, not calibrated
#: yet (no GPU in the calibration runs): a margin for the allocator's cached blocks
#: and workspaces.
RUNTIME_BYTES: dict[str, dict[int, int]] = {
    "cpu": {4: 21 * MIB, 2: 33 * MIB},
    "cuda": {4: 512 * MIB, 2: 512 * MIB},
}
#: The process itself before the model exists: Python + torch + the process group
#: + the model's code. CPU (measured): a train.py rank's resident set just before its
#: model is built (Hydra, the sinks' files, the data and logging set-up), its allocator
#: set as ranks set it (``trainer.malloc_mmap_threshold_kib``): 297 MiB, plus
#: ``torch._dynamo``, which the first step imports (~20 MiB): 316 MiB, the ranks
#: without the logger of bench/plan_vs_measured.py's ``--ordinary`` runs
#: (docs/benchmarks.md). CUDA (assumed): the context, outside the allocator's counters.
PROCESS_BYTES: dict[str, int] = {"cpu": 316 * MIB, "cuda": 600 * MIB}
#: What a model family's own imports (its spec's ``imports``) and the logger's
#: (``LoggerOption.imports``, rank 0) add to the process baseline, CPU resident set
#: (measured in the same ``--ordinary`` runs): transformers with its model classes
#: (an ``hf`` rank's baseline against a GPT rank's), wandb with its offline run (rank 0 against rank 1 at the peak,
#: rank 0 alone logs), and ``sharding.compile=true``'s inductor with its compiled
#: block graphs (regional: one graph per block class, whatever the width: GPT 4x256
#: and Llama dim 256 runs against the same runs uncompiled, +70 and +51 MiB at the
#: peak; a bare process: importing inductor ~45 MiB, the first compiled step ~52).
IMPORT_BYTES: dict[str, int] = {
    "transformers": 80 * MIB,
    "wandb": 25 * MIB,
    "torch.compile": 60 * MIB,
}
#: Where each device's constants come from, said beside them in every estimate.
CONSTANTS_SOURCE: dict[str, str] = {
    "cpu": "CPU-measured, docs/benchmarks.md",
    "cuda": "assumed: not calibrated on a GPU yet",
}


def process_bytes(device: str, imports: Iterable[str] = ()) -> int:
    """The process baseline on ``device`` with the modules ``imports`` loaded (host
    memory: on CUDA only the context counts, outside the allocator)."""
    base = PROCESS_BYTES.get(device, PROCESS_BYTES["cuda"])
    return base + (
        sum(IMPORT_BYTES.get(m, 0) for m in imports) if device == "cpu" else 0
    )


GRAD_SYNC = ("last", "every")
AC_KEY = "sharding.activation_checkpointing"
AC_EVERY_KEY = "sharding.activation_checkpointing_every"
PREFETCH_KEY = "sharding.backward_prefetch"
PRECISION_KEY = "precision.name"
#: The keys ``auto`` may stand for, and what the planner searches.
AUTO_KEYS = ("sharding.min_params", "trainer.grad_accum", "trainer.grad_sync", AC_KEY)
MIN_PARAMS_CANDIDATES = (1e5, 1e6, 1e7, 1e8, 1e9)
#: Relative cost of a change (per token, or in machines), for "the cheapest change":
#: recomputing a checkpointed block's forward is ~1/3 more compute; selective
#: recomputes only elementwise ops; a smaller micro-batch runs smaller matmuls; every
#: micro-batch's reduce-scatter adds communication; smaller units more collectives;
#: more ranks are more machines, the last resort.
COST = {
    "ac": {"none": 1.0, "selective": 1.1, "full": 4 / 3},
    "grad_accum_doubling": 1.03,
    "sync_every": 1.03,
    "min_params_decade_down": 1.01,
    "other_change": 1.001,
    "ranks_doubling": 1.5,
}


# ------------------------------------------------------------------ the estimate


@dataclass(frozen=True)
class RunShape:
    """What the estimate needs beyond the wrap plan: one rank's share of a step."""

    backend: str  # a name of src.sharding.BACKENDS (the planner asks its class)
    world: int
    micro_batch: int  # sequences per rank per micro-step
    seq_len: int
    grad_accum: int = 1
    grad_sync: str = "last"  # last: no_sync until the last micro-batch; every
    param_bytes: int = 4  # compute (all-gather) dtype
    reduce_bytes: int = 4  # gradient reduction dtype
    # True, False, or (FSDP2) a group size the units reshard to after forward
    reshard_after_forward: bool | int = True
    checkpointing: str = "none"
    ac_every: int = 1
    prefetch: int = 1  # units all-gathered ahead in backward (FSDP's default: 1)
    device: str = "cpu"
    optimizer_states: int = 2  # AdamW: exp_avg, exp_avg_sq
    # a pipeline stage (``world``: its ranks; ``micro_batch``: a pipeline
    # micro-batch): torch's schedules keep every unit gathered and its gradients
    # unsharded from the first backward to the step's end (no_sync, no reshard)
    pipelined: bool = False

    @property
    def shards(self) -> bool:
        return backend_class(self.backend).shards_parameters

    @property
    def bucketed_gradients(self) -> bool:
        return backend_class(self.backend).bucketed_gradients

    @property
    def gather_copy_out(self) -> bool:
        return backend_class(self.backend).gather_copy_out

    @property
    def mixed(self) -> bool:
        return self.param_bytes < 4


#: The parts of an estimate, in the order they are printed.
PARTS = (
    "params",
    "gathered_units",
    "grads",
    "optimizer",
    "mixed_precision",
    "activations",
    "loss",
    "transient",
    "pipeline",
    "runtime",
    "process",
)
_LABELS = {
    "params": "parameters (sharded, fp32)",
    "gathered_units": "all-gathered units",
    "grads": "gradients",
    "optimizer": "optimizer state (AdamW)",
    "mixed_precision": "mixed-precision copies",
    "activations": "activations (saved)",
    "loss": "head + loss (fp32 log-probs, grads)",
    "transient": "backward / step working set",
    "pipeline": "pipeline send/recv buffers",
    "runtime": "runtime constant",
    "process": "process baseline",
}


@dataclass
class Estimate:
    """Per-rank bytes of each part at the peak moment (``phase``) of a step."""

    parts: dict[str, int]
    phase: str
    shape: RunShape
    notes: dict[str, str] = field(default_factory=dict)
    caveat: str = ""  # why the run's peak may exceed the estimate (lower_bound_reason)
    stage: str = ""  # a pipeline-parallel run: which pp rank's stages, how run
    pp_rank: int | None = None  # ... and that pp rank

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def training(self) -> int:
        """The peak above the process baseline (what the benchmark measures)."""
        return self.total - self.parts["process"]

    def gib(self) -> dict[str, float]:
        """``{part_gib: GiB, ..., total_gib}`` for summaries and sweep tables."""
        out = {f"{k}_gib": v / GIB for k, v in self.parts.items()}
        out["total_gib"] = self.total / GIB
        return out

    def table(self) -> str:
        s = self.shape
        ranks = (
            f"{s.world} rank(s) per stage, {self.stage}"
            if s.pipelined
            else (f"{s.world} rank(s)")
        )
        batch = "pipeline micro-batch" if s.pipelined else "micro-batch"
        sync = "" if s.pipelined else f" (sync {s.grad_sync})"
        lines = [
            f"per-rank training peak estimate ({s.backend}, {ranks}, "
            f"{batch} {s.micro_batch} x {s.seq_len} tokens, grad_accum "
            f"{s.grad_accum}{sync}, checkpointing {s.checkpointing}); "
            f"peak at: {self.phase}"
        ]
        for k in PARTS:
            if k == "pipeline" and not s.pipelined:
                continue
            note = f"  ({self.notes[k]})" if k in self.notes else ""
            lines.append(f"  {_LABELS[k]:<38} {_gib(self.parts[k]):>12}{note}")
        lines.append(f"  {'total':<38} {_gib(self.total):>12}")
        if self.caveat:
            lines.append(f"  a lower bound: {self.caveat}")
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def runtime_bytes(device: str, param_bytes: int) -> int:
    """The calibrated runtime constant (:data:`RUNTIME_BYTES`)."""
    table = RUNTIME_BYTES.get(device, RUNTIME_BYTES["cuda"])
    return table.get(param_bytes, table[4])


@dataclass(frozen=True)
class _Held:
    """What one rank's parameters and gradients take, by backend (bytes)."""

    params: int  # this rank's fp32 parameters
    gathered: int  # all-gathered units alive in forward and backward
    sharded_grads: int  # gradients after their reduction (this rank's)
    unsharded_grads: int  # gradients before it (the whole model's)
    final_grads: int  # gradients at the optimizer step
    unit_grads: int  # a unit's gradients on their way to the reduce-scatter
    root_grad: int  # the head's gradient, held to the end of backward
    largest_shard: int  # the largest tensor the per-tensor AdamW works on
    mixed_precision: int  # low-precision copies of the weights
    gather_copy: int  # FSDP2's copy-out of an all-gather
    last_gather: int = 0  # the last unit's all-gather output, alive to forward's end
    buckets: int = 0  # DDP's gradient buckets, held in every moment


def _held_sharded(
    plan: WrapPlan, s: RunShape, total: int, notes: dict[str, str]
) -> _Held:
    """FSDP: this rank's shards, plus the units gathered around the current one."""
    root = next((u for u in plan.units if not u.path), None)
    blocks = sorted((u.local_numel for u in plan.units if u.path), reverse=True)
    root_numel = root.local_numel if root else 0
    params = plan.bytes_per_rank()
    # a pipeline stage's units stay gathered from their first backward on
    raf = False if s.pipelined else s.reshard_after_forward
    kept = blocks if raf is False else blocks[: 1 + s.prefetch]
    # With a group size g, the other units keep 1/g of themselves until backward.
    partly = sum(blocks[len(kept) :]) // raf if type(raf) is int else 0
    notes["gathered_units"] = (
        f"root + {'all' if raf is False else len(kept)} unit(s)"
        f"{f' + 1/{raf} of the rest' if partly else ''}, {8 * s.param_bytes}-bit"
    )
    # The unit whose backward ends last before the peak: the largest block, or
    # the root of a model that is one unit (its gradients are the whole model's).
    largest_unit = blocks[0] if blocks else root_numel
    shard_of_largest = max((u.bytes_per_rank for u in plan.units), default=0)
    return _Held(
        params=params,
        gathered=(root_numel + sum(kept) + partly) * s.param_bytes,
        sharded_grads=params,
        unsharded_grads=total * s.reduce_bytes,
        final_grads=params,
        # A unit's unsharded gradients and the reduce-scatter's flat input, alive
        # together; the root's head gradient is held until the end of backward
        # (counted once: with no other unit it is the unit's own).
        unit_grads=largest_unit * (s.param_bytes + s.reduce_bytes),
        root_grad=root_numel * s.param_bytes if blocks else 0,
        largest_shard=shard_of_largest,
        mixed_precision=shard_of_largest // 4 * s.param_bytes if s.mixed else 0,
        # FSDP2 copies a unit out of the all-gather's flat output into its own
        # unsharded parameters: both alive at once while the unit is gathered.
        gather_copy=largest_unit * s.param_bytes if s.gather_copy_out else 0,
        # In forward, FSDP2 frees a unit's all-gather output only once the next
        # unit's is copied out, and the last one's at the root's post-forward: it is
        # alive through the head and the loss (a one-unit model's, the whole
        # model's, through the whole forward). Not with one shard: nothing gathered.
        last_gather=largest_unit * s.param_bytes
        if s.gather_copy_out and plan.shard_size > 1
        else 0,
    )


def _held_unsharded(
    plan: WrapPlan, s: RunShape, total: int, notes: dict[str, str]
) -> _Held:
    """DDP and one process: every rank holds the whole model."""
    root = next((u for u in plan.units if not u.path), None)
    has_blocks = any(u.path for u in plan.units)
    root_numel = root.local_numel if root else 0
    params = total * 4
    buckets = 0
    if s.bucketed_gradients:
        # DDP copies gradients into its buckets (gradient_as_bucket_view=False),
        # allocated (and zeroed) when the model is wrapped: held in every moment.
        buckets = total * 4
        notes["grads"] = "+ DDP's gradient buckets, allocated at construction"
    return _Held(
        params=params,
        gathered=0,
        sharded_grads=total * 4,
        unsharded_grads=total * 4,
        final_grads=total * 4,
        unit_grads=0,
        # The head's gradient is the first one backward makes, held to its end.
        root_grad=root_numel * 4 if has_blocks else 0,
        largest_shard=max((u.numel * 4 for u in plan.units), default=params),
        # Autocast keeps a low-precision copy of each weight for backward.
        mixed_precision=total * s.param_bytes if s.mixed else 0,
        gather_copy=0,
        buckets=buckets,
    )


def _accumulated(h: _Held, s: RunShape, notes: dict[str, str]) -> int:
    """Gradients held through backward: earlier micro-batches' and DDP's buckets."""
    held = 0
    if s.pipelined:
        # unsharded through the schedule's micro-batches (reduced at its end), and
        # the earlier micro-steps' reduced ones
        held = h.unsharded_grads + (h.sharded_grads if s.grad_accum > 1 else 0)
        notes["grads"] = "the stage's unsharded, held through the schedule" + (
            ", + earlier micro-steps' sharded" if s.grad_accum > 1 else ""
        )
        return held
    if s.grad_accum > 1:
        every = s.grad_sync == "every" or not s.shards
        held = h.sharded_grads if every else h.unsharded_grads
        held = h.final_grads if not s.shards else held
        notes["grads"] = (
            f"held from earlier micro-batches, "
            f"{'sharded' if every and s.shards else 'unsharded'}"
            + (", + DDP's gradient buckets" if h.buckets else "")
        )
    return held + h.buckets


def estimate(
    plan: WrapPlan,
    shape: RunShape,
    acts: ActivationBytes,
    process: int | None = None,
    pipeline: int = 0,
) -> Estimate:
    """The per-rank training peak of ``shape`` for the units of ``plan`` (built for
    ``shape.world`` ranks) with the activations ``acts`` of one micro-batch (a
    pipeline stage: of the micro-batches it holds at once); ``process``: the process
    baseline (default: :data:`PROCESS_BYTES` of the device); ``pipeline``: a stage's
    send/recv buffers, held throughout."""
    s = shape
    # What one rank holds before data-parallel sharding: with tensor parallelism, its
    # tp shard of each parameter (gathered units, unsharded gradients).
    total = sum(u.local_numel for u in plan.units) or plan.total_numel
    n_blocks = sum(1 for u in plan.units if u.path)
    notes: dict[str, str] = {}
    held_by = _held_sharded if s.shards else _held_unsharded
    h = held_by(plan, s, total, notes)
    held = _accumulated(h, s, notes)
    # The update's temporaries: torch's foreach AdamW (CUDA) one fp32 copy of all
    # local states, the per-tensor one (CPU) about one parameter's.
    opt_temp = h.params if s.device == "cuda" else h.largest_shard
    base = {
        "params": h.params,
        "gathered_units": h.gathered,
        "optimizer": s.optimizer_states * h.params,
        "mixed_precision": h.mixed_precision,
        "pipeline": pipeline,
        "runtime": runtime_bytes(s.device, s.param_bytes),
        "process": process_bytes(s.device) if process is None else process,
    }
    # The last block's all-gather in forward: every earlier block's activations are
    # saved (a one-unit model gathers before any).
    before_last = acts.saved - acts.saved // n_blocks if n_blocks else 0
    # A one-unit model reduces its gradients after the whole backward, when every
    # activation is freed: its blocks' backward runs with no unit's gradients in
    # flight, and the reduction is a moment of its own.
    per_unit = bool(n_blocks) or not s.shards
    phases = {
        "forward": {
            **base,
            "grads": held,
            "activations": before_last,
            "loss": 0,
            "transient": h.gather_copy,
        },
        "loss forward": {
            **base,
            "grads": held,
            "activations": acts.saved,
            "loss": acts.head,
            "transient": h.last_gather,
        },
        "loss backward": {
            **base,
            "grads": held,
            "activations": acts.saved,
            "loss": acts.head + acts.loss_transient,
            "transient": 0,
        },
        "block backward": {
            **base,
            "grads": held + h.root_grad,
            "activations": acts.saved,
            "loss": 0,
            "transient": acts.block_transient + (h.unit_grads if per_unit else 0),
        },
        "gradient reduction": {
            **base,
            "grads": held,
            "activations": 0,
            "loss": 0,
            "transient": 0 if per_unit else h.unit_grads,
        },
        "optimizer step": {
            **base,
            "gathered_units": 0,
            "mixed_precision": 0,
            "grads": h.final_grads + h.buckets,
            "activations": 0,
            "loss": 0,
            "transient": opt_temp,
        },
    }
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    parts = {k: int(phases[phase][k]) for k in PARTS}
    source = CONSTANTS_SOURCE.get(s.device, CONSTANTS_SOURCE["cuda"])
    notes["runtime"] = notes["process"] = f"{s.device}: {source}"
    return Estimate(parts=parts, phase=phase, shape=shape, notes=notes)


# ------------------------------------------------------------- from a config


_ABSENT = object()
#: FSDP2's own prefetch depth (``sharding.backward_prefetch: null``): one unit ahead.
FSDP2_PREFETCH = 1


def _prefetch(cfg: DictConfig) -> int:
    """Units gathered ahead in backward (0: off; null: FSDP2's own depth)."""
    depth = _get(cfg, PREFETCH_KEY)
    return FSDP2_PREFETCH if depth is None else int(depth)


def _get(cfg: DictConfig, key: str) -> Any:
    """``cfg``'s value of ``key``; the composed config has every key (its value's one
    home is the group's YAML), so the planner holds no defaults of its own."""
    value = OmegaConf.select(cfg, key, default=_ABSENT)
    if value is _ABSENT:
        raise KeyError(f"the planner needs {key}, which this config has not")
    return value


def build_meta_model(cfg: DictConfig, resolved: Resolved) -> torch.nn.Module:
    """The model of ``cfg`` (its family and config: ``resolved``'s) on the meta device,
    units recorded by the ``plan`` backend (nothing is allocated)."""
    from src.build import build_model

    cfg = _ac_chosen(cfg)
    with _plan_backend(cfg) as backend:
        return build_model(cfg, backend, resolved, init_device="meta")


def _ac_chosen(cfg: DictConfig) -> DictConfig:
    if _get(cfg, AC_KEY) == "auto":  # not chosen yet: the units are alike
        return _with(cfg, {AC_KEY: "none"})
    return cfg


@contextlib.contextmanager
def _plan_backend(cfg: DictConfig) -> Iterator[Any]:
    """The ``plan`` backend the meta builds record units with; selective checkpointing
    of a block the policy splits is a config error here, before any rank starts."""
    tp = _tp(cfg)
    backend = build_backend(
        "plan", cfg.precision.name, "cpu", layout=ParallelLayout(tp, tp=tp)
    )
    try:
        yield backend
    except SplitBlockError as err:
        raise ConfigError(
            AC_KEY,
            f"selective needs each {err.block} to be one sharding unit, and "
            f"sharding.policy={cfg.sharding.policy} splits it: set "
            "sharding.policy=block or a larger sharding.min_params, or "
            f"{AC_KEY}=full",
        ) from None
    finally:
        backend.close()  # tensor parallelism's fake process group, if any


def _tp(cfg: DictConfig) -> int:
    return int(_get(cfg, "sharding.tensor_parallel"))


def _tp_layout(cfg: DictConfig) -> ParallelLayout:
    """A layout with ``cfg``'s tp and pp degrees (what a tensor-parallel plan reads)."""
    tp, pp = _tp(cfg), _pp(cfg)
    return ParallelLayout(tp * pp, pp=pp, tp=tp)


def plan_of(cfg: DictConfig, model: torch.nn.Module, world: int) -> WrapPlan:
    """The wrap plan of ``model`` (built by :func:`build_meta_model`) on ``world``
    ranks, with ``cfg``'s HSDP replicas and tensor-parallel degree."""
    replicate = int(cfg.sharding.replicate)
    return wrap_plan(model, ParallelLayout(world, dp_replicate=replicate, tp=_tp(cfg)))


def tp_activations(
    cfg: DictConfig,
    resolved: Resolved,
    shape: RunShape,
    acts: ActivationBytes,
    model: torch.nn.Module | int,
) -> ActivationBytes:
    """One rank's activations under tensor parallelism of degree T (unchanged for
    T = 1). With sequence parallelism every saved activation is split T ways (the
    residual stream and norms over the sequence, attention over heads, the MLP over
    its width), but the colwise matmuls save their all-gathered, full-sequence input
    (two per block: attention and MLP; one block input each, what full checkpointing
    keeps) in the blocks that are not checkpointed. Without sequence parallelism only
    the heads and MLP width split: the blocks are traced on one rank's local shapes
    (:func:`run_activation_fn`, a family with a formula too; :func:`traced_locally`).
    A vocabulary-sharded output layer (``loss_parallel``) splits the logits and the
    loss's buffers T ways. The backward working set of one block adds
    its gathered inputs and the all-gather / reduce-scatter buffers (four block
    inputs: the TP collectives' working set). ``model``: the model, or its number of
    blocks."""
    tp = _tp(cfg)
    if tp == 1:
        return acts
    spec, config = resolved.spec, resolved.model_config
    tpp = tensor_parallel_plan(cfg, spec, config, _tp_layout(cfg))
    full = activation_fn(resolved)(
        shape.micro_batch, shape.seq_len, shape.param_bytes, "full", 1
    )
    classes = spec.block_classes(config)
    blocks = (
        model
        if isinstance(model, int)
        else sum(isinstance(m, classes) for m in model.modules())
    )
    blocks = max(1, blocks)
    block_input = full.saved // blocks  # one block's input, full sequence
    every = shape.ac_every if shape.checkpointing == "full" else 1
    checkpointed = (
        0 if shape.checkpointing != "full" else math.ceil(blocks / max(1, every))
    )
    if traced_locally(resolved, tpp):
        # traced on one rank's local shapes (run_activation_fn): heads and width split
        saved, work = acts.saved, acts.block_transient
    else:
        gathered = 2 * block_input * (blocks - checkpointed)
        saved, work = acts.saved // tp + gathered, acts.block_transient // tp
    split = tp if tpp.loss_parallel else 1
    return ActivationBytes(
        saved=saved,
        head=acts.head // split,
        loss_transient=acts.loss_transient // split,
        block_transient=work + 4 * block_input,
    )


def has_formula(resolved: Resolved) -> bool:
    """Whether the model family's activation formula covers the run's model config
    (its spec's ``activation_bytes`` and ``formula_covers``); else it is traced."""
    spec = resolved.spec
    if spec.activation_bytes is None:
        return False
    return spec.formula_covers is None or spec.formula_covers(resolved.model_config)


def activation_fn(
    resolved: Resolved, tp: int = 1, tp_plan: Any = None, trace: bool = False
) -> Callable[..., ActivationBytes]:
    """The model family's activation formula (its spec's ``activation_bytes``), bound
    to the run's model config; for a family without one (``hf``, ``custom``) or a
    config it does not cover (:func:`has_formula`), or with ``trace``, the
    activations traced on fake tensors (src/planner/trace.py), cached per model
    config and tensor-parallel degree: with ``tp > 1`` the blocks are traced as one
    rank of ``tp_plan`` computes them (:func:`~src.planner.trace.tp_local`)."""
    spec, config = resolved.spec, resolved.model_config
    if has_formula(resolved) and not trace:
        return functools.partial(spec.activation_bytes, config)
    tp = tp if tp_plan is not None else 1
    key = (spec.name, repr(config), tp)
    if key not in _TRACED:
        classes = spec.block_classes(config)
        with torch.device("meta"):
            model = spec.build(config, 0)
        if tp > 1:
            model = tp_local(model, classes, tp_plan, tp)
        _TRACED[key] = traced_activation_bytes(model, classes, spec.trace_context)
    return _TRACED[key]


def traced_locally(resolved: Resolved, tp_plan: Any) -> bool:
    """Whether a run's activations under tensor parallelism are traced on one rank's
    local shapes: a model without a formula (:func:`has_formula`) always; one with a
    formula without sequence parallelism (its formula knows only the sequence split;
    the heads and MLP width split as the plan's Linears do)."""
    return not has_formula(resolved) or not tp_plan.sequence_parallel


def run_activation_fn(
    cfg: DictConfig, resolved: Resolved
) -> Callable[..., ActivationBytes]:
    """:func:`activation_fn` for ``cfg``'s tensor-parallel degree and plan."""
    tp = _tp(cfg)
    if tp == 1:
        return activation_fn(resolved)
    plan = tensor_parallel_plan(
        cfg, resolved.spec, resolved.model_config, _tp_layout(cfg)
    )
    if not traced_locally(resolved, plan):
        return activation_fn(resolved)
    return activation_fn(resolved, tp, plan, trace=True)


_TRACED: dict[tuple[str, str, int], Callable[..., ActivationBytes]] = {}


def family_process_bytes(cfg: DictConfig, resolved: Resolved, device: str) -> int:
    """The process baseline of a run of ``cfg``: its model family's imports, its
    logger's (rank 0 holds the sinks; the peak is the max over ranks) and
    torch.compile's with ``sharding.compile=true``."""
    option = LOGGERS.get(logger_kind(cfg))
    imports = resolved.spec.imports + (option.imports if option else ())
    if OmegaConf.select(cfg, "sharding.compile", default=False):
        imports += ("torch.compile",)
    return process_bytes(device, imports)


def _named_accelerator(cfg: DictConfig) -> str | None:
    """The accelerator ``trainer.mem_budget_gib`` names (as budget_bytes reads it)."""
    budget = OmegaConf.select(cfg, "trainer.mem_budget_gib", default=None)
    if isinstance(budget, str) and budget.strip().lower() in ACCELERATORS_GIB:
        return budget.strip().lower()
    return None


def accelerator_name(cfg: DictConfig) -> str:
    """The accelerator the estimate is for: the one ``trainer.mem_budget_gib`` names,
    else this machine's GPU; empty on a CPU."""
    named = _named_accelerator(cfg)
    if named:
        return named
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def device_type(cfg: DictConfig) -> str:
    """The device the estimate is for: a named accelerator budget means CUDA;
    otherwise this machine's."""
    if _named_accelerator(cfg) or torch.cuda.is_available():
        return "cuda"
    return "cpu"


def run_shape(cfg: DictConfig, resolved: Resolved, world: int) -> RunShape:
    """The :class:`RunShape` of ``cfg`` on ``world`` ranks (``auto`` values must be
    resolved first)."""
    t, s = cfg.trainer, cfg.sharding
    prec = get_precision(cfg.precision.name)
    accum = int(t.grad_accum)
    # the busiest rank's share; the ranks of a tensor-parallel group share rows
    per_rank = math.ceil(t.batch_size / accum / max(1, world // _tp(cfg)))
    return RunShape(
        backend=s.backend,
        world=world,
        micro_batch=max(1, per_rank),
        seq_len=int(resolved.spec.seq_len(resolved.model_config)),
        grad_accum=accum,
        grad_sync=str(_get(cfg, "trainer.grad_sync")),
        param_bytes=prec.param_dtype.itemsize,
        reduce_bytes=prec.reduce_dtype.itemsize,
        reshard_after_forward=s.reshard_after_forward,
        checkpointing=str(_get(cfg, AC_KEY)),
        ac_every=int(_get(cfg, AC_EVERY_KEY)),
        prefetch=_prefetch(cfg),
        device=device_type(cfg),
    )


def estimate_cfg(
    cfg: DictConfig,
    resolved: Resolved,
    world: int,
    model: torch.nn.Module | None = None,
) -> tuple[WrapPlan, Estimate]:
    """The wrap plan and the estimate of ``cfg`` (its model: ``resolved``'s) on
    ``world`` ranks (``model``: a meta model of ``cfg`` already built, reused across
    rank counts). A pipeline-parallel run: its worst stage's (:func:`worst_stage`)."""
    if _pp(cfg) > 1:
        plan, est = worst_stage(pipeline_estimates(cfg, resolved, world))
    else:
        model = model if model is not None else build_meta_model(cfg, resolved)
        plan = plan_of(cfg, model, world)
        shape = run_shape(cfg, resolved, world)
        acts = run_activation_fn(cfg, resolved)(
            shape.micro_batch,
            shape.seq_len,
            shape.param_bytes,
            shape.checkpointing,
            shape.ac_every,
        )
        acts = tp_activations(cfg, resolved, shape, acts, model)
        process = family_process_bytes(cfg, resolved, shape.device)
        est = estimate(plan, shape, acts, process)
        if not has_formula(resolved):
            est.notes["activations"] = "traced: one block per block class, fake tensors"
    est.caveat = lower_bound_reason(resolved, est.shape.device, str(cfg.precision.name))
    return plan, est


def lower_bound_reason(resolved: Resolved, device: str, precision: str) -> str:
    """Why a run's peak grows past any fixed estimate ('' where it does not): a model
    that routes tokens to experts, in a low precision on a CPU, where oneDNN keeps
    memory for every new token-count shape of the experts' matmuls (fp32 does not;
    measured +31% to +76% over 4 to 20 steps, growing: docs/planner.md). The fit
    search does not propose such a precision."""
    routes = resolved.spec.routes_tokens
    if device != "cpu" or routes is None or not routes(resolved.model_config):
        return ""
    if get_precision(precision).param_dtype == torch.float32:
        return ""
    return (
        f"experts in {precision} on a CPU: oneDNN keeps memory for each token-count "
        "shape routing gives the experts' matmuls, growing with the steps (not "
        "counted; precision=fp32 does not)"
    )


def planned_peak_gib(est: Estimate) -> float:
    """The estimate as the quantity a run measures (``peak_mem_gib``): the process's
    peak resident set on CPU (baseline included), the allocator's peak on CUDA (the
    context is outside it)."""
    return (est.total if est.shape.device == "cpu" else est.training) / GIB


def plan_run(cfg: DictConfig, resolved: Resolved, world: int) -> Estimate:
    """The estimate of a run about to start (every ``auto`` value resolved): computed
    once, before the ranks start, so each run logs it beside what it measures."""
    return estimate_cfg(cfg, resolved, world)[1]


# ------------------------------------------------------------- pipeline stages

PP_KEY = "sharding.pipeline_parallel"
PP_MICRO_KEY = "sharding.pp_microbatches"


def _pp(cfg: DictConfig) -> int:
    return int(_get(cfg, PP_KEY))


@dataclass(frozen=True)
class PipelineRank:
    """One pp rank's part of a pipeline-parallel run: its stages and their blocks
    (the stage cut of src/build.py's :func:`~src.build.rank_stages`), and how the
    schedule runs them."""

    pp_rank: int
    stages: tuple[int, ...]  # its stage indices
    blocks: tuple[int, ...]  # the blocks of each
    n_stages: int
    schedule: str
    pp: int
    microbatches: int

    def first(self, k: int) -> bool:
        return self.stages[k] == 0

    def last(self, k: int) -> bool:
        return self.stages[k] == self.n_stages - 1

    def describe(self) -> str:
        many = len(self.stages) > 1
        return (
            f"pp rank {self.pp_rank}: stage{'s' if many else ''} "
            f"{', '.join(map(str, self.stages))} of {self.n_stages}, "
            f"{' + '.join(map(str, self.blocks))} block(s)"
        )


@dataclass
class StagePlans:
    """The pp ranks of a run and their stages built on the meta device with the
    ``plan`` backend (ranks whose stages have the same roles and block counts share
    one build: their plans are alike, only the blocks' indices differ)."""

    ranks: list[PipelineRank]
    built: dict[tuple, list[torch.nn.Module]]
    n_blocks: int  # the whole model's

    @staticmethod
    def signature(rank: PipelineRank) -> tuple:
        return tuple(
            (rank.first(k), rank.last(k), b) for k, b in enumerate(rank.blocks)
        )

    def plans(self, cfg: DictConfig, world: int) -> list[tuple[PipelineRank, WrapPlan]]:
        """Each rank's wrap plan on its stage's ``world / P`` ranks."""
        cache: dict[tuple, WrapPlan] = {}
        out = []
        for rank in self.ranks:
            sig = self.signature(rank)
            if sig not in cache:
                cache[sig] = _merged_plan(
                    [plan_of(cfg, m, world // rank.pp) for m in self.built[sig]]
                )
            out.append((rank, cache[sig]))
        return out


def _merged_plan(plans: list[WrapPlan]) -> WrapPlan:
    """The plan of a rank's stages together: their roots one unit (each stage's
    root is gathered from its forward to the end of backward)."""
    if len(plans) == 1:
        return plans[0]
    roots = [u for p in plans for u in p.units if not u.path]
    units = [u for p in plans for u in p.units if u.path]
    if roots:
        root = Unit(
            "",
            roots[0].cls,
            sum(u.numel for u in roots),
            sum(u.bytes_per_rank for u in roots),
            sum(u.local_numel for u in roots),
        )
        units = [root, *units]
    first = plans[0]
    return replace(
        first,
        units=units,
        total_numel=sum(p.total_numel for p in plans),
        tp_modules=[m for p in plans for m in p.tp_modules],
    )


def stage_plans(
    cfg: DictConfig, resolved: Resolved, only: int | None = None
) -> StagePlans:
    """The pp ranks of ``cfg`` and their stages built on meta (``only``: just that
    rank's, built under its own block indices)."""
    from src.build import build_stages, rank_stages

    cfg = _ac_chosen(cfg)
    pp, s = _pp(cfg), cfg.sharding
    ranks, built = [], {}
    used: set[int] = set()  # modules already built from the skeleton
    with _plan_backend(cfg) as backend:
        cut = rank_stages(cfg, resolved, pp, 0 if only is None else only)
        for r in range(pp) if only is None else [only]:
            ids = local_stages(r, pp, SCHEDULES[s.pp_schedule].stages_per_rank)
            rank = PipelineRank(
                r,
                tuple(ids),
                tuple(len(cut.ranges[i]) for i in ids),
                cut.n_stages,
                str(s.pp_schedule),
                pp,
                int(s.pp_microbatches),
            )
            ranks.append(rank)
            sig = StagePlans.signature(rank)
            if sig not in built:
                # cut from the same skeleton unless it shares a module with a
                # stage built before (a tied embedding): then from a fresh one
                mine = replace(cut, ids=tuple(ids))
                modules = {
                    id(m)
                    for part in mine.parts()
                    for m in part.modules()
                    if m is not part and m._parameters
                }
                if modules & used:
                    mine = rank_stages(cfg, resolved, pp, r)
                used |= modules
                built[sig] = build_stages(cfg, backend, resolved, mine)
    return StagePlans(ranks, built, sum(len(r) for r in cut.ranges))


@functools.cache
def held_counts(
    schedule: str, pp: int, microbatches: int, pp_rank: int
) -> tuple[tuple[int, ...], frozenset[tuple[int, ...]]]:
    """Walking a rank's schedule (:func:`~src.sharding.pipeline.schedule_order`),
    a forward keeping one more micro-batch of its stage and that stage's backward
    freeing one: the rank's stages, and every distinct count of micro-batches
    they hold after a forward (the moments activations peak)."""
    order = schedule_order(schedule, pp, microbatches, pp_rank)
    stages = tuple(sorted({stage for _, stage in order}))
    held = dict.fromkeys(stages, 0)
    seen = set()
    for kind, stage in order:
        held[stage] += 1 if kind == "F" else -1
        if kind == "F":
            seen.add(tuple(held[k] for k in stages))
    return stages, frozenset(seen)


def in_flight(rank: PipelineRank, saved: dict[int, int]) -> tuple[int, dict[int, int]]:
    """The most activation bytes ``rank`` holds at once (``saved[stage]``: one
    micro-batch's in that stage) and the most micro-batches each stage holds."""
    stages, counts = held_counts(
        rank.schedule, rank.pp, rank.microbatches, rank.pp_rank
    )
    peak = max(
        sum(n * saved[k] for n, k in zip(c, stages, strict=True)) for c in counts
    )
    most = {k: max(c[i] for c in counts) for i, k in enumerate(stages)}
    return peak, most


def stage_activations(
    whole: Callable[[str, int], ActivationBytes],
    n_blocks: int,
    blocks: int,
    first: bool,
    last: bool,
    checkpointing: str,
    every: int,
    boundary: int,
) -> ActivationBytes:
    """One micro-batch's activations in a stage of ``blocks`` of the model's
    ``n_blocks`` blocks, from the whole model's (``whole(mode, every)``: its
    blocks are alike): each block saves its share of the whole model's, or of what
    checkpointing keeps (counted from the stage's first block, as each stage's
    blocks are wrapped in turn); the head and the loss on the last stage only. A
    stage that is not the last also holds its output (``boundary``: one block's
    input) until its backward; one that is not the first has its input in the
    receive buffers (counted there, :func:`pipeline_buffers`), and its backward
    makes the input's gradient to send back."""
    from src.models.memory import backward_blocks, checkpointed_blocks

    none = whole("none", 1)
    per_block = none.saved / n_blocks
    kept = {m: whole(m, 1).saved / n_blocks for m in ("full", "selective")}
    ckpt = checkpointed_blocks(blocks, checkpointing, every)
    kept_per_block = [kept[checkpointing] if c else per_block for c in ckpt]
    edges = (0 if last else boundary) - (0 if first else boundary)
    return ActivationBytes(
        saved=int(sum(kept_per_block)) + edges,
        head=none.head if last else 0,
        loss_transient=none.loss_transient if last else 0,
        block_transient=int(
            backward_blocks(kept_per_block, int(per_block), ckpt, none.block_transient)
        )
        + (0 if first else boundary),
    )


def pipeline_buffers(rank: PipelineRank, boundary: int) -> int:
    """A rank's send/recv buffers: torch's ``PipelineStage`` allocates, per
    micro-batch, a buffer for the activation it receives (every stage but the
    first) and one for the gradient it receives (every stage but the last), each
    one micro-batch's tensor at the stage boundary, kept from the first step on."""
    edges = sum(
        (not rank.first(k)) + (not rank.last(k)) for k in range(len(rank.stages))
    )
    return rank.microbatches * boundary * edges


def rank_activations(
    rank: PipelineRank,
    shape: RunShape,
    whole: Callable[[str, int], ActivationBytes],
    n_blocks: int,
    boundary: int,
    cache: dict | None = None,
) -> tuple[ActivationBytes, dict[int, int]]:
    """What one pp rank's stages hold of activations at once: the micro-batches its
    schedule keeps in flight (:func:`in_flight`) times each stage's, the head of
    as many micro-batches as the last stage keeps; and those counts per stage
    (``cache``: stages' activations already computed for ``shape``)."""
    cache = {} if cache is None else cache
    acts = {}
    for k, b in enumerate(rank.blocks):
        key = (rank.first(k), rank.last(k), b)
        if key not in cache:
            cache[key] = stage_activations(
                whole,
                n_blocks,
                b,
                *key[:2],
                shape.checkpointing,
                shape.ac_every,
                boundary,
            )
        acts[rank.stages[k]] = cache[key]
    saved, most = in_flight(rank, {i: a.saved for i, a in acts.items()})
    held = ActivationBytes(
        saved=saved,
        head=sum(most[i] * a.head for i, a in acts.items()),
        loss_transient=max(a.loss_transient for a in acts.values()),
        block_transient=max(a.block_transient for a in acts.values()),
    )
    return held, most


def rank_estimate(
    rank: PipelineRank,
    plan: WrapPlan,
    shape: RunShape,
    held: tuple[ActivationBytes, dict[int, int]],
    boundary: int,
    process: int,
) -> Estimate:
    """The training peak of one pp rank: its stages' parameters (``plan``), the
    activations it holds at once (``held``: :func:`rank_activations`), its
    send/recv buffers."""
    acts, most = held
    est = estimate(plan, shape, acts, process, pipeline_buffers(rank, boundary))
    depth = ", ".join(f"stage {i}: {n}" for i, n in most.items())
    est.notes["activations"] = f"micro-batches held at once: {depth}"
    est.notes["pipeline"] = f"{rank.microbatches} micro-batches' boundary tensors"
    est.stage = rank.describe()
    est.pp_rank = rank.pp_rank
    return est


def worst_rank(
    ranks: list[tuple[PipelineRank, WrapPlan]],
    shape: RunShape,
    whole: Callable[[str, int], ActivationBytes],
    n_blocks: int,
    boundary: int,
    process: int,
) -> Estimate:
    """The estimate of the pp rank with the largest: of ranks whose stages are
    alike (:meth:`StagePlans.signature`) only the one holding the most
    activations is estimated (the rest of their estimate is the same)."""
    heaviest: dict[tuple, tuple] = {}
    cache: dict = {}
    for rank, plan in ranks:
        if SCHEDULES[rank.schedule].stages_per_rank == 1 and (
            StagePlans.signature(rank) in heaviest
        ):
            continue  # one stage per rank: an earlier rank holds as many or more
        held = rank_activations(rank, shape, whole, n_blocks, boundary, cache)
        sig = StagePlans.signature(rank)
        size = held[0].saved + held[0].head
        if sig not in heaviest or size > heaviest[sig][0]:
            heaviest[sig] = (size, rank, plan, held)
    return max(
        (
            rank_estimate(rank, plan, shape, held, boundary, process)
            for _, rank, plan, held in heaviest.values()
        ),
        key=lambda e: e.total,
    )


def pipeline_shape(cfg: DictConfig, resolved: Resolved, world: int) -> RunShape:
    """:func:`run_shape` of one pipeline stage: its ``world / P`` ranks, one pipeline
    micro-batch (each data-parallel rank's rows of a micro-step split
    ``sharding.pp_microbatches`` ways; the busiest rank's share)."""
    shape = run_shape(cfg, resolved, world)
    t = cfg.trainer
    dp = max(1, world // (_tp(cfg) * _pp(cfg)))
    rows = t.batch_size / shape.grad_accum / dp / int(_get(cfg, PP_MICRO_KEY))
    return replace(
        shape,
        world=world // _pp(cfg),
        micro_batch=max(1, math.ceil(rows)),
        pipelined=True,
    )


def whole_activations(
    cfg: DictConfig, resolved: Resolved, shape: RunShape, n_blocks: int
) -> tuple[Callable[[str, int], ActivationBytes], int]:
    """The whole model's activations of one micro-batch of ``shape`` per
    checkpointing mode (tensor parallelism applied), and one block's input (the
    tensor at a stage boundary)."""
    fn = run_activation_fn(cfg, resolved)
    args = (shape.micro_batch, shape.seq_len, shape.param_bytes)

    @functools.cache
    def whole(mode: str, every: int) -> ActivationBytes:
        mode_shape = replace(shape, checkpointing=mode, ac_every=every)
        return tp_activations(
            cfg, resolved, mode_shape, fn(*args, mode, every), n_blocks
        )

    boundary = activation_fn(resolved)(*args, "full", 1).saved // n_blocks
    return whole, boundary


def pipeline_estimates(
    cfg: DictConfig,
    resolved: Resolved,
    world: int,
    plans: StagePlans | None = None,
) -> list[tuple[WrapPlan, Estimate]]:
    """Each pp rank's wrap plan and estimate (``sharding.pipeline_parallel > 1``)."""
    plans = plans or stage_plans(cfg, resolved)
    shape = pipeline_shape(cfg, resolved, world)
    n_blocks = plans.n_blocks
    whole, boundary = whole_activations(cfg, resolved, shape, n_blocks)
    process = family_process_bytes(cfg, resolved, shape.device)
    return [
        (
            plan,
            rank_estimate(
                rank,
                plan,
                shape,
                rank_activations(rank, shape, whole, n_blocks, boundary),
                boundary,
                process,
            ),
        )
        for rank, plan in plans.plans(cfg, world)
    ]


def pipeline_report(cfg: DictConfig, estimates: list[tuple[WrapPlan, Estimate]]) -> str:
    """Each pp rank's peak, the worst named, and what the schedule costs in time."""
    s = cfg.sharding
    pp, m = _pp(cfg), int(s.pp_microbatches)
    _, worst = worst_stage(estimates)
    lines = [
        f"pipeline stages ({s.pp_schedule}, {m} micro-batches per micro-step, "
        f"{bubble_line(str(s.pp_schedule), pp, m)}):"
    ]
    for _, e in estimates:
        lines.append(f"  {e.stage:<44} {_gib(e.total):>12} peak at {e.phase}")
    lines.append(
        f"worst stage: pp rank {worst.pp_rank}, {_gib(worst.total)} "
        "(the estimate below; gradient accumulation: each micro-step's schedule "
        "reduces the stage's gradients at its end, trainer.grad_sync does not apply)"
    )
    return "\n".join(lines)


def bubble_line(schedule: str, pp: int, microbatches: int) -> str:
    """The schedule's idle share, as theory gives it."""
    v = SCHEDULES[schedule].stages_per_rank
    formula = "(P-1)/(M+P-1)" if v == 1 else f"(P-1)/(V M+P-1) with V={v}"
    return f"bubble {formula} = {bubble_fraction(schedule, pp, microbatches):.0%}"


def worst_stage(
    estimates: list[tuple[WrapPlan, Estimate]],
) -> tuple[WrapPlan, Estimate]:
    """The pp rank with the largest estimate (the first of equal ones)."""
    return max(estimates, key=lambda pe: pe[1].total)


# ---------------------------------------------------------------- the budget

MARGIN_KEY = "trainer.mem_margin"


def mem_margin(cfg: DictConfig) -> float:
    """The safety margin of a fit (``trainer.mem_margin``)."""
    return float(_get(cfg, MARGIN_KEY))


def needed(est: Estimate, margin: float) -> int:
    """What a budget must hold for ``est`` to fit: its total with the safety margin."""
    return int(est.total * (1 + margin))


def _with_margin(est: Estimate, margin: float) -> str:
    if not margin:
        return _gib(est.total)
    return (
        f"{_gib(est.total)} (+{margin:.0%} safety margin, {MARGIN_KEY}: "
        f"{_gib(needed(est, margin))})"
    )


def machine_budget_bytes(world: int) -> int:
    """Memory one rank may use on this machine: the GPU's, else available RAM / ranks."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 * GIB
    return avail // max(1, world)


# ---------------------------------------------------------------- the search


@dataclass(frozen=True)
class Candidate:
    """One point of the search: overrides of ``cfg``, its estimate and its cost."""

    overrides: dict[str, Any]
    estimate: Estimate
    cost: float

    def describe(self) -> str:
        shown = {
            k: v
            for k, v in self.settings().items()
            if not (k == AC_EVERY_KEY and v == 1)  # the default: every block
        }
        # the precision is a config group: picked as precision=<name>
        shown = {
            ("precision" if k == PRECISION_KEY else k): v for k, v in shown.items()
        }
        return " ".join(f"{k}={_fmt(v)}" for k, v in shown.items()) or "as is"

    def settings(self) -> dict[str, Any]:
        """The overrides as config keys (checkpointing: its mode and every k)."""
        out: dict[str, Any] = {}
        for k, v in self.overrides.items():
            out.update(v.overrides() if isinstance(v, Checkpointing) else {k: v})
        return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}".replace("e+0", "e").replace("e+", "e")
    return str(v)


def _with(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key, value in overrides.items():
            OmegaConf.update(out, key, value, force_add=True)
    return out


def _cost(
    currents: dict[str, Any], ovr: dict[str, Any], device: tuple[str, str] = ("cpu", "")
) -> float:
    """Relative cost of changing the ``currents`` values to ``ovr`` (see :data:`COST`
    and :func:`precision_cost`; ``device``: the estimate's device and accelerator)."""
    cost = 1.0
    for key, value in ovr.items():
        if key in (PP_KEY, PP_MICRO_KEY):
            continue
        old = currents[key]
        if key == AC_KEY:
            cost *= ac_cost(value) / ac_cost(old)
        elif key == "trainer.grad_accum":
            cost *= COST["grad_accum_doubling"] ** max(0.0, math.log2(value / old))
            cost *= COST["other_change"]
        elif key == "trainer.grad_sync":
            cost *= COST["sync_every"] if value == "every" else COST["other_change"]
        elif key == "sharding.min_params":
            lower = math.log10(float(old)) - math.log10(value) if old > 0 else 0
            cost *= COST["min_params_decade_down"] ** max(0.0, lower)
            cost *= COST["other_change"]
        elif key == "trainer.devices":
            cost *= COST["ranks_doubling"] ** math.log2(value / old)
        elif key == PRECISION_KEY:
            cost *= precision_cost(value, *device) / precision_cost(old, *device)
    return cost  # pipeline keys: pipeline_cost (the search)


def pipeline_cost(schedule: str, pp: int, microbatches: int) -> float:
    """Relative time of a step with ``pp`` stages: the schedule's bubble
    (:func:`~src.sharding.pipeline.bubble_fraction`) idles each rank for that share
    of it, so a step takes ``1 / (1 - bubble)`` of its compute."""
    if pp <= 1:
        return 1.0
    return 1 / (1 - bubble_fraction(schedule, pp, microbatches))


#: Matmul time of a low-precision policy against fp32 where no datasheet says
#: (assumed: tensor cores run bf16/fp16 at twice the tf32 rate).
ASSUMED_LOW_PRECISION_COST = 0.5


def precision_cost(name: str, device: str, accelerator: str = "") -> float:
    """Relative compute of a step in precision ``name`` (fp32 = 1): on a GPU the
    datasheet's fp32 peak over the policy's (src/observe/metrics.py; fp32 matmuls as
    torch runs them by default), :data:`ASSUMED_LOW_PRECISION_COST` for a GPU not in
    it; on a CPU 1 where it computes the dtype natively (nothing measured faster),
    ``inf`` where it emulates it (never proposed)."""
    from src.observe.metrics import lookup_gpu_peak_tflops, precision_support

    dtype = get_precision(name).param_dtype
    if dtype == torch.float32:
        return 1.0
    if device == "cpu":
        native, _ = precision_support(torch.device("cpu"), dtype)
        return 1.0 if native == dtype else math.inf
    low = lookup_gpu_peak_tflops(accelerator, dtype)
    full = lookup_gpu_peak_tflops(accelerator, torch.float32)
    return full / low if low and full else ASSUMED_LOW_PRECISION_COST


def precision_cost_basis(name: str, device: str, accelerator: str = "") -> str:
    """Where :func:`precision_cost`'s figure for ``name`` comes from, as shown."""
    from src.observe.metrics import lookup_gpu_peak_tflops

    if device == "cpu":
        return "this CPU computes it natively: assumed no faster than fp32"
    dtype = get_precision(name).param_dtype
    if lookup_gpu_peak_tflops(accelerator, dtype) and lookup_gpu_peak_tflops(
        accelerator, torch.float32
    ):
        return "the datasheet's peak rates, src/observe/metrics.py"
    return f"assumed for an accelerator with no datasheet entry: {accelerator or '?'}"


@dataclass(frozen=True)
class Checkpointing:
    """A value of the checkpointing search: the mode, every k-th block (``full``) and
    how many of the model's blocks that recomputes."""

    mode: str
    every: int
    recomputed: int  # blocks checkpointed
    blocks: int  # blocks in the model

    def overrides(self) -> dict[str, Any]:
        every = {AC_EVERY_KEY: self.every} if self.mode == "full" else {}
        return {AC_KEY: self.mode, **every}

    def __str__(self) -> str:
        if self.mode == "none":
            return "none"
        every = f" every {self.every}" if self.every > 1 else ""
        return f"{self.mode}{every} ({self.recomputed} of {self.blocks} blocks)"


def ac_cost(ac: Checkpointing) -> float:
    """Relative compute of a step: each checkpointed block runs its forward again,
    ``COST["ac"][mode]`` for the whole model, in proportion to the blocks it covers."""
    share = ac.recomputed / ac.blocks if ac.blocks else 0.0
    return 1.0 + (COST["ac"][ac.mode] - 1.0) * share


def ac_options(mode: str, every: int, blocks: int) -> list[Checkpointing]:
    """The checkpointing the search tries, ``(mode, every)`` first: none, selective
    and ``full`` every k-th block for each distinct number of blocks it recomputes."""
    from src.models.memory import checkpointed_blocks

    def point(m: str, k: int) -> Checkpointing:
        return Checkpointing(m, k, sum(checkpointed_blocks(blocks, m, k)), blocks)

    everies = sorted(
        {math.ceil(blocks / n) for n in range(1, blocks + 1)}, reverse=True
    )
    out = [point(mode, every if mode == "full" else 1), point("none", 1)]
    out += [point("full", k) for k in everies] + [point("selective", 1)]
    return list(dict.fromkeys(out))  # the first of equal points


def _n_blocks(resolved: Resolved) -> int:
    """How many blocks the checkpointing transform targets in the run's model."""
    from src.planner.trace import block_order

    spec, config = resolved.spec, resolved.model_config
    with torch.device("meta"):
        model = spec.build(config, 0)
    return len(block_order(model, spec.block_classes(config)))


def _options(
    cfg: DictConfig,
    resolved: Resolved,
    keys: Iterable[str],
    world: int,
    max_world: int,
):
    """The values the search tries for each key (the current one first)."""
    t = cfg.trainer
    out: dict[str, list] = {}
    for key in keys:
        cur = world if key == "trainer.devices" else _get(cfg, key)
        if key == "sharding.min_params":
            vals = list(MIN_PARAMS_CANDIDATES)
        elif key == "trainer.grad_accum":
            vals = [a for a in range(1, t.batch_size + 1) if t.batch_size % a == 0]
        elif key == "trainer.grad_sync":
            vals = list(GRAD_SYNC)
        elif key == AC_KEY:
            every = int(_get(cfg, AC_EVERY_KEY))
            out[key] = ac_options(str(cur), every, _n_blocks(resolved))
            continue
        elif key == "trainer.devices":
            vals = [world * 2**i for i in range(12) if world * 2**i <= max_world]
        elif key == PRECISION_KEY:
            device = (device_type(cfg), accelerator_name(cfg))
            vals = [
                p
                for p in PRECISIONS
                if precision_cost(p, *device) < math.inf
                and not lower_bound_reason(resolved, device[0], p)
            ]
        elif key == PP_KEY:
            vals = pipeline_options(cfg, resolved, world)
        else:
            continue
        out[key] = ([cur] if cur is not None else []) + [v for v in vals if v != cur]
    return out


def pipeline_options(cfg: DictConfig, resolved: Resolved, world: int) -> list[int]:
    """The stage counts the fit search tries on ``world`` ranks: none (1), and 2, 4,
    8, 16 where they divide the ranks with the run's tp and replica groups and leave each stage a
    block, where the backend and the model family can pipeline (none with
    ``sharding.pp_split`` or sequence parallelism set: they fix the layout)."""
    s, spec = cfg.sharding, resolved.spec
    if (
        not getattr(backend_class(s.backend), "pipeline_parallel", False)
        or spec.pipeline is None
        or spec.init_tensor is None
        or s.pp_split
        or OmegaConf.select(cfg, "sharding.sequence_parallel") is True
    ):
        return []
    per_rank = SCHEDULES[str(s.pp_schedule)].stages_per_rank
    blocks = _n_blocks(resolved)
    group = _tp(cfg) * int(s.replicate)
    return [1] + [
        2**i
        for i in range(1, 5)
        if world % (2**i * group) == 0 and 2**i * per_rank <= blocks
    ]


def search(
    cfg: DictConfig,
    resolved: Resolved,
    keys: Iterable[str],
    budget: int,
    world: int,
    max_world: int | None = None,
) -> tuple[Candidate | None, Candidate]:
    """The cheapest point that fits ``budget`` over ``keys`` (None if none does) and
    the point with the smallest estimate. Deterministic: equal costs keep the order
    in which :func:`_options` lists the values (the current value first). One meta
    model per ``sharding.min_params`` value; everything else is arithmetic. The
    search varies sharding and trainer keys, never the model: ``resolved`` serves
    every point."""
    options = _options(cfg, resolved, keys, world, max_world or world)
    margin = mem_margin(cfg)
    currents = {k: values[0] for k, values in options.items()}
    base = run_shape(cfg, resolved, world)
    device = (base.device, accelerator_name(cfg))
    acts = run_activation_fn(cfg, resolved)
    process = family_process_bytes(cfg, resolved, base.device)
    batch = int(cfg.trainer.batch_size)
    tp = _tp(cfg)
    models: dict[float, torch.nn.Module] = {}
    plans: dict[tuple[float, int], WrapPlan] = {}
    staged: dict[tuple[float, int], StagePlans] = {}
    staged_plans: dict[tuple[float, int, int], list] = {}
    wholes: dict[tuple[int, int], tuple] = {}
    cur_mp, cur_pp = float(cfg.sharding.min_params), _pp(cfg)
    cur_m, schedule = (
        int(_get(cfg, PP_MICRO_KEY)),
        str(_get(cfg, "sharding.pp_schedule")),
    )
    best: Candidate | None = None
    smallest: Candidate | None = None
    for point in _product(options):
        mp = float(point.get("sharding.min_params", cur_mp))
        w = int(point.get("trainer.devices", world))
        accum = int(point.get("trainer.grad_accum", base.grad_accum))
        pp = int(point.get(PP_KEY, cur_pp))
        if batch % accum:
            continue
        if pp > 1:
            if mp != cur_mp or (pp != cur_pp and w != world):
                continue  # other stage counts: at the current ranks; units as set
            if point.get("trainer.grad_sync", base.grad_sync) != base.grad_sync:
                continue  # no effect: each schedule reduces at its end
            m = max(cur_m, pp)
            if microbatches_problem(schedule, pp, m):
                continue  # the schedule cannot split m micro-batches over pp ranks
            if (mp, pp) not in staged:
                at = {"sharding.min_params": mp, PP_KEY: pp, PP_MICRO_KEY: m}
                at[AC_KEY] = "none"  # its units (selective is checked on them below)
                staged[mp, pp] = stage_plans(_with(cfg, at), resolved)
            if (mp, pp, w) not in staged_plans:
                staged_plans[mp, pp, w] = staged[mp, pp].plans(cfg, w)
            ranks = staged_plans[mp, pp, w]
            ac = point.get(AC_KEY)
            if ac is not None and ac.mode == "selective":
                if any(_nested(plan) for _, plan in ranks):
                    continue
            prec = get_precision(point.get(PRECISION_KEY, cfg.precision.name))
            if prec.name == "fp16_mixed":
                continue  # its gradient scaler does not pipeline yet (config.py)
            rows = batch / accum / max(1, w // (tp * pp)) / m
            shape = replace(
                base,
                param_bytes=prec.param_dtype.itemsize,
                reduce_bytes=prec.reduce_dtype.itemsize,
                world=w // pp,
                grad_accum=accum,
                micro_batch=max(1, math.ceil(rows)),
                checkpointing=ac.mode if ac else base.checkpointing,
                ac_every=ac.every if ac else base.ac_every,
                pipelined=True,
            )
            n_blocks = staged[mp, pp].n_blocks
            at = (shape.micro_batch, shape.param_bytes)
            if at not in wholes:
                wholes[at] = whole_activations(cfg, resolved, shape, n_blocks)
            whole, boundary = wholes[at]
            est = worst_rank(ranks, shape, whole, n_blocks, boundary, process)
            changed = {k: v for k, v in point.items() if v != options[k][0]}
            if m != cur_m:
                changed[PP_MICRO_KEY] = m
            cost = _cost(currents, changed, device) * (
                pipeline_cost(schedule, pp, m) / pipeline_cost(schedule, cur_pp, cur_m)
            )
            cand = Candidate(changed, est, cost)
            if smallest is None or est.total < smallest.estimate.total:
                smallest = cand
            if needed(est, margin) <= budget and (best is None or cost < best.cost):
                best = cand
            continue
        if mp not in models:  # its units (selective is checked on them below)
            with_mp = _with(cfg, {"sharding.min_params": mp, AC_KEY: "none"})
            models[mp] = build_meta_model(with_mp, resolved)
        if (mp, w) not in plans:
            plans[mp, w] = plan_of(cfg, models[mp], w)
        ac = point.get(AC_KEY)
        if ac is not None and ac.mode == "selective" and _nested(plans[mp, w]):
            continue  # selective needs each block a unit of its own (transforms.py)
        prec = get_precision(point.get(PRECISION_KEY, cfg.precision.name))
        shape = replace(
            base,
            param_bytes=prec.param_dtype.itemsize,
            reduce_bytes=prec.reduce_dtype.itemsize,
            world=w,
            grad_accum=accum,
            micro_batch=max(1, math.ceil(batch / accum / max(1, w // tp))),
            grad_sync=str(point.get("trainer.grad_sync", base.grad_sync)),
            checkpointing=ac.mode if ac else base.checkpointing,
            ac_every=ac.every if ac else base.ac_every,
        )
        a = acts(
            shape.micro_batch,
            shape.seq_len,
            shape.param_bytes,
            shape.checkpointing,
            shape.ac_every,
        )
        if tp > 1:
            a = tp_activations(cfg, resolved, shape, a, models[mp])
        est = estimate(plans[mp, w], shape, a, process)
        changed = {k: v for k, v in point.items() if v != options[k][0]}
        cost = _cost(currents, changed, device) / pipeline_cost(schedule, cur_pp, cur_m)
        cand = Candidate(changed, est, cost)
        if smallest is None or est.total < smallest.estimate.total:
            smallest = cand
        fits = needed(est, margin) <= budget
        if fits and (best is None or cand.cost < best.cost):
            best = cand
    assert smallest is not None
    return best, smallest


def _nested(plan: WrapPlan) -> bool:
    """Whether a unit sits inside a block (a path going on past a list index, such as
    ``h.0.attn.c_attn``): selective checkpointing needs whole blocks."""
    return any(
        any(part.isdigit() for part in u.path.split(".")[:-1]) for u in plan.units
    )


def _product(options: dict[str, list]) -> Iterable[dict[str, Any]]:
    points: list[dict[str, Any]] = [{}]
    for key, values in options.items():
        points = [{**p, key: v} for p in points for v in values]
    return points


# ------------------------------------------------------------- auto values


def auto_keys(cfg: DictConfig) -> list[str]:
    return [k for k in AUTO_KEYS if OmegaConf.select(cfg, k, default=None) == "auto"]


#: Stand-ins for ``auto`` values, the search's starting point (costs are relative to it).
_AUTO_START: dict[str, Any] = {
    "sharding.min_params": 1e8,
    "trainer.grad_accum": 1,
    "trainer.grad_sync": "last",
    AC_KEY: "none",
}


def resolve_auto(
    cfg: DictConfig, resolved: Resolved, world: int | None = None
) -> tuple[DictConfig, list[str]]:
    """``cfg`` with every ``auto`` value of :data:`AUTO_KEYS` chosen by the planner:
    the cheapest setting that fits the budget (``trainer.mem_budget_gib``, else this
    machine's memory per rank), or the smallest estimate if none fits. Returns the
    new config and one line per choice saying why."""
    keys = auto_keys(cfg)
    quiet = {}
    accum = OmegaConf.select(cfg, "trainer.grad_accum")
    if "trainer.grad_sync" in keys and accum == 1:
        quiet["trainer.grad_sync"] = "last"  # one micro-batch: nothing to choose
        keys.remove("trainer.grad_sync")
    cfg = _with(cfg, quiet) if quiet else cfg
    if not keys:
        return cfg, []
    world = world or resolve_devices(cfg.trainer.devices)
    budget = budget_bytes(OmegaConf.select(cfg, "trainer.mem_budget_gib"))
    source = "trainer.mem_budget_gib"
    if budget is None:
        budget, source = machine_budget_bytes(world), "this machine's memory per rank"
    start = _with(cfg, {k: _AUTO_START[k] for k in keys})
    best, smallest = search(start, resolved, keys, budget, world)
    chosen = best or smallest
    values: dict[str, Any] = {}
    for k in keys:
        v = chosen.overrides.get(k)
        values[k] = v.mode if isinstance(v, Checkpointing) else v
        if v is None:
            values[k] = OmegaConf.select(start, k)
    out = _with(cfg, {**values, **chosen.settings()})
    est = chosen.estimate
    verdict = (
        f"the cheapest setting whose estimate, {_with_margin(est, mem_margin(cfg))}, "
        f"fits {_gib(budget)} "
        f"({source})"
        if best
        else f"nothing fits {_gib(budget)} ({source}); this is the smallest estimate, "
        f"{_gib(est.total)}"
    )
    reasons = [
        f"auto: {k}={_fmt(v)}: {verdict}" for k, v in values.items() if k != AC_KEY
    ]
    if AC_KEY in keys:
        reasons.append(_ac_reason(out, resolved, chosen, world, verdict))
    return out, reasons


def _ac_reason(
    cfg: DictConfig, resolved: Resolved, chosen: Candidate, world: int, verdict: str
) -> str:
    """Why ``auto`` checkpointing is what it is: which blocks, the recompute cost, and
    the estimate without any."""
    ac = chosen.overrides.get(AC_KEY)
    every = int(_get(cfg, AC_EVERY_KEY))
    line = f"auto: {AC_KEY}={cfg.sharding.activation_checkpointing}"
    if not isinstance(ac, Checkpointing) or ac.mode == "none":
        return f"{line}: {verdict}"
    if ac.mode == "full":
        line += f" {AC_EVERY_KEY}={every}"
    _, bare = estimate_cfg(_with(cfg, {AC_KEY: "none"}), resolved, world)
    return (
        f"{line}: {ac.recomputed} of {ac.blocks} blocks recomputed in backward "
        f"(compute x{ac_cost(ac):.2f}); without checkpointing the estimate is "
        f"{_gib(bare.total)}; {verdict}"
    )


POLICY_KEYS = ("sharding.policy", "sharding.min_params")


def default_policy(
    cfg: DictConfig, resolved: Resolved, user_keys: set[str]
) -> tuple[DictConfig, Resolved, str]:
    """``cfg`` with the block policy when the size policy's threshold was not chosen for
    this model: the user set neither key of :data:`POLICY_KEYS` and, with the group's
    default ``sharding.min_params`` (tuned so each block of the CPU models is one unit),
    the size policy would cut a block into several units (``model=llama3_8b``: one per
    Linear, 227 units). One unit per block is what the planner's estimates assume for
    selective checkpointing, and what FSDP users pick for large models. Returns the
    config, its run object (``resolved`` with the block policy when it changed) and
    the line saying so (empty when nothing changed)."""
    s = cfg.sharding
    if (
        set(POLICY_KEYS) & user_keys
        or s.policy != "size"
        or s.min_params == "auto"
        or not backend_class(s.backend).shards_parameters
    ):
        return cfg, resolved, ""
    units = _with(cfg, {AC_KEY: "none"})  # the units do not depend on it
    if _pp(cfg) > 1:  # the first stage's blocks tell (never the whole model)
        plan = stage_plans(units, resolved, only=0).plans(units, resolved.world_size)
        plan = plan[0][1]
    else:
        plan = plan_of(units, build_meta_model(units, resolved), resolved.world_size)
    if not _nested(plan):
        return cfg, resolved, ""
    inside = sum(1 for u in plan.units if u.path)
    block = replace(resolved, policies=resolve_policies("block"))
    return (
        _with(cfg, {"sharding.policy": "block"}),
        block,
        (
            f"sharding.policy=block: with sharding.min_params={_fmt(s.min_params)} the "
            f"size policy would make {inside} units, splitting model={cfg.model.name}'s blocks; "
            "one unit per block (set sharding.policy or sharding.min_params to choose)"
        ),
    )


# ---------------------------------------------------------------- plan-only


def grad_sync_costs(
    cfg: DictConfig, resolved: Resolved, world: int, model: torch.nn.Module
) -> str:
    """Both gradient-accumulation modes side by side (memory and collectives)."""
    accum = int(cfg.trainer.grad_accum)
    lines = ["gradient accumulation modes (trainer.grad_sync):"]
    for mode in GRAD_SYNC:
        sync = _with(cfg, {"trainer.grad_sync": mode})
        _, est = estimate_cfg(sync, resolved, world, model)
        scatters = 1 if mode == "last" else accum
        lines.append(
            f"  {mode:<5} {_gib(est.total):>12} peak, {scatters} gradient reduction(s)"
            f" per step{' (unsharded gradients held)' if mode == 'last' and accum > 1 else ''}"
        )
    return "\n".join(lines)


def fit_report(
    cfg: DictConfig, resolved: Resolved, est: Estimate, world: int
) -> tuple[str, dict]:
    """The verdict against ``trainer.mem_budget_gib`` (and, if it does not fit, the
    cheapest change that does); empty when no budget is set."""
    budget = budget_bytes(OmegaConf.select(cfg, "trainer.mem_budget_gib"))
    if budget is None:
        return "", {}
    pct = mem_margin(cfg)
    need = needed(est, pct)
    margin = budget - need
    info = {
        "budget_gib": budget / GIB,
        "fits": margin >= 0,
        "margin_gib": margin / GIB,
        "mem_margin": pct,
    }
    if margin >= 0:
        return (
            f"fits: {_with_margin(est, pct)} of {_gib(budget)} per rank "
            f"(headroom {_gib(margin)}, {margin / budget:.0%})"
        ), info
    lines = [
        f"does not fit: needs {_with_margin(est, pct)} > budget {_gib(budget)} per rank"
    ]
    keys = [*AUTO_KEYS, PRECISION_KEY, "trainer.devices", PP_KEY]
    best, smallest = search(cfg, resolved, keys, budget, world, max_world=world * 64)
    if best is None:
        lines.append(
            f"no searched change fits; the smallest estimate is {_gib(smallest.estimate.total)}"
            f" with {smallest.describe()}"
        )
    else:
        m = budget - needed(best.estimate, pct)
        lines.append(
            f"cheapest change that fits: {best.describe()} -> "
            f"{_with_margin(best.estimate, pct)}"
            f" (headroom {_gib(m)}, relative cost x{best.cost:.2f})"
        )
        info["fix"] = best.describe()
        if PP_KEY in best.overrides:
            lines.append(pipeline_effects(cfg, best))
        if PRECISION_KEY in best.overrides:
            name = best.overrides[PRECISION_KEY]
            device = (est.shape.device, accelerator_name(cfg))
            lines.append(
                f"precision={name} changes more than memory: "
                f"{get_precision(name).effects}; compute x"
                f"{precision_cost(name, *device):.2f} "
                f"({precision_cost_basis(name, *device)})"
            )
    return "\n".join(lines), info


def pipeline_effects(cfg: DictConfig, best: Candidate) -> str:
    """What a proposed stage count changes besides memory."""
    s = cfg.sharding
    pp = best.overrides[PP_KEY]
    m = best.overrides.get(PP_MICRO_KEY, int(s.pp_microbatches))
    schedule = str(s.pp_schedule)
    if pp == 1:
        was = int(s.pipeline_parallel)
        return (
            f"{PP_KEY}=1 changes more than memory: no pipeline, so no bubble (the "
            f"{bubble_line(schedule, was, int(s.pp_microbatches))} of a step now); "
            "every rank holds shards of all the blocks"
        )
    return (
        f"{PP_KEY}={pp} changes more than memory: {pp} stages of the model's "
        f"blocks, each sharded over {best.estimate.shape.world} ranks; "
        f"{schedule} over {m} micro-batches idles each rank for the "
        f"{bubble_line(schedule, pp, m)} of a step (compute "
        f"x{pipeline_cost(schedule, pp, m):.2f}); activations pass between stages "
        "point to point (docs/sharding.md)"
    )


def uneven_batch(cfg: DictConfig, world: int) -> str:
    """A warning line when ``trainer.batch_size`` does not split into
    ``trainer.grad_accum`` micro-batches of whole sequences on each data-parallel
    rank of ``world`` (and, pipelined, into ``sharding.pp_microbatches`` pipeline
    micro-batches; the estimate plans the busiest rank's share, at least one
    sequence; a run refuses such a batch); empty when it splits."""
    t = cfg.trainer
    batch, accum = int(t.batch_size), int(t.grad_accum)
    pp = _pp(cfg)
    m = int(_get(cfg, PP_MICRO_KEY)) if pp > 1 else 1
    dp = max(1, world // (_tp(cfg) * pp))
    if batch % accum == 0 and (batch // accum) % (dp * m) == 0:
        return ""
    share = batch / accum / dp / m
    into = f" and {m} pipeline micro-batches" if pp > 1 else ""
    return (
        f"warning: trainer.batch_size={batch} in {accum} micro-batch(es){into} over "
        f"{dp} data-parallel rank(s) is {share:g} sequence(s) per rank: planned as "
        f"micro-batch {max(1, math.ceil(share))}, the busiest rank's share; a run needs "
        f"trainer.batch_size a multiple of {accum * dp * m}"
    )


def plan_only(
    cfg: DictConfig, resolved: Resolved, run_dir: str, world_size: int | None = None
) -> WrapPlan:
    """Print the wrap plan, the per-rank training peak estimate part by part, the
    gradient-accumulation modes and, with ``trainer.mem_budget_gib``, the verdict,
    for ``trainer.devices`` ranks; no rank starts and nothing is allocated (the model
    is built on the meta device with the recording-only ``plan`` backend)."""
    world = world_size or resolve_devices(cfg.trainer.devices)
    stages: dict[str, Any] = {}
    if _pp(cfg) > 1:  # each stage planned, never the whole model
        estimates = pipeline_estimates(cfg, resolved, world)
        plan, est = worst_stage(estimates)
        # the worst rank's own blocks (alike ranks share one build)
        rank, plan = stage_plans(cfg, resolved, only=est.pp_rank).plans(cfg, world)[0]
        plan = replace(
            plan,
            layout=replace(plan.layout, world_size=world, pp=rank.pp),
            stages=rank.stages,
            num_stages=rank.n_stages,
        )
        log.info(plan.tree())
        log.info(pipeline_report(cfg, estimates))
        log.info(est.table())
        stages = {
            "worst_pp_rank": est.pp_rank,
            "stage_total_gib": [e.total / GIB for _, e in estimates],
        }
    else:
        model = build_meta_model(cfg, resolved)
        plan, est = estimate_cfg(cfg, resolved, world, model)
        log.info(plan.tree())
        log.info(est.table())
    if uneven_batch(cfg, world):
        log.warning(uneven_batch(cfg, world))
    if _pp(cfg) == 1:
        log.info(grad_sync_costs(cfg, resolved, world, model))
    verdict, info = fit_report(cfg, resolved, est, world)
    if verdict:
        log.info(verdict)
    logger = Logger.files(run_dir)
    logger.log_table("wrap_plan", plan.rows())
    logger.log_summary(
        {
            "world_size": world,
            "replicate": plan.layout.dp_replicate,
            "tensor_parallel": plan.layout.tp,
            "shard_size": plan.shard_size,
            "wrap_units": len(plan.units),
            "peak_phase": est.phase,
            **est.gib(),
            **stages,
            **info,
        }
    )
    logger.finish()
    return plan


def run_budget_bytes(cfg: DictConfig) -> int | None:
    """The per-rank budget a run is judged against: ``trainer.mem_budget_gib``, else
    ``sweep.mem_cap_gib``; None when neither is set."""
    budget = budget_bytes(OmegaConf.select(cfg, "trainer.mem_budget_gib"))
    if budget is None:
        cap = OmegaConf.select(cfg, "sweep.mem_cap_gib", default=None)
        budget = budget_bytes(cap, "sweep.mem_cap_gib")
    return budget


def budget_check(cfg: DictConfig, resolved: Resolved) -> tuple[float, float] | None:
    """``(needed GiB, budget GiB)`` when the planner says ``cfg`` cannot fit its budget
    (``trainer.mem_budget_gib``, else ``sweep.mem_cap_gib``); None when it fits or no
    budget is set. For sweeps: such points are skipped, not launched."""
    budget = run_budget_bytes(cfg)
    if budget is None:
        return None
    cfg, _ = resolve_auto(cfg, resolved)
    _, est = estimate_cfg(cfg, resolved, resolve_devices(cfg.trainer.devices))
    need = needed(est, mem_margin(cfg))
    return (need / GIB, budget / GIB) if need > budget else None
