"""The estimate: a run's training peak per rank, part by part, predicted before
anything runs.

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
  temporaries (the peak when parameters dominate);
- ``embedding backward``: with a tied embedding and head, the same gradients and one
  more of the tied weight's size (its two gradients summed).

With gradient accumulation the first two hold the gradients of earlier micro-batches:
sharded when they are reduce-scattered every micro-batch (``trainer.grad_sync=every``),
unsharded (the whole model's, per rank) when only the last one syncs (``last``).
The parts are documented in docs/planner.md, with how the runtime constant was
calibrated (bench/plan_vs_measured.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from src.config.run_plan import OVERRIDES
from src.models.memory import ActivationBytes
from src.planner.constants import CONSTANTS_SOURCE, process_bytes, runtime_bytes
from src.planner.optimizer_step import step_note
from src.sharding import GIB, MIB, WrapPlan, backend_class


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
    # precision=float8 with FSDP2's float8 all-gather: float8 weights gathered at 1 byte
    float8_all_gather: bool = False
    reduce_bytes: int = 4  # gradient reduction dtype
    # True, False, or (FSDP2) a group size the units reshard to after forward
    reshard_after_forward: bool | int = True
    checkpointing: str = "none"
    ac_every: int = 1
    prefetch: int = 1  # units all-gathered ahead in backward (FSDP's default: 1)
    device: str = "cpu"
    # state buffers per trained parameter (src/planner/optimizer_step.py
    # ``optimizer_states``; AdamW: exp_avg, exp_avg_sq)
    optimizer_states: float = 2
    # fp32 copies of the local states the update allocates (``optimizer_step_copies``)
    optimizer_step_copies: float = 0
    optimizer: str = "adamw"
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
    "experts",
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
    "optimizer": "optimizer state",
    "mixed_precision": "mixed-precision copies",
    "activations": "activations (saved)",
    "experts": "expert dispatch (EP)",
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
        full_every = s.checkpointing == "full" and s.ac_every > 1
        every = f" every {s.ac_every} blocks" if full_every else ""
        lines = [
            f"per-rank training peak estimate ({s.backend}, {ranks}, "
            f"{batch} {s.micro_batch} x {s.seq_len} tokens, grad_accum "
            f"{s.grad_accum}{sync}, checkpointing {s.checkpointing}{every}); "
            f"peak at: {self.phase}"
        ]
        for k in PARTS:
            if (
                k == "pipeline"
                and not s.pipelined
                or k == "experts"
                and k not in self.notes
            ):
                continue
            note = f"  ({self.notes[k]})" if k in self.notes else ""
            lines.append(f"  {_LABELS[k]:<38} {fmt_bytes(self.parts[k]):>12}{note}")
        lines.append(f"  {'total':<38} {fmt_bytes(self.total):>12}")
        if self.caveat:
            lines.append(f"  a lower bound: {self.caveat}")
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class _Held:
    """What one rank's parameters and gradients take, by backend (bytes)."""

    params: int  # this rank's fp32 parameters
    trained: int  # of them, those that train (their gradients, optimizer state)
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
    tied_grad: int = 0  # a tied weight's second gradient, summed into its first


@dataclass
class _Sizes:
    """What :func:`estimate` reads of a plan's units, summed once per plan: a layout
    search estimates one plan in thousands of shapes (llama3_70b's fit on 64 ranks:
    26k estimates of a few plans of 80+ units, 39M unit reads, 45 s of its 75)."""

    root: Any  # the root unit, or None
    blocks: list[tuple[int, int]]  # (local, float8) elements of each unit below it
    local: int  # elements of every unit on this rank (tp shard)
    trained_local: int
    largest_trained_block: int  # a block's trained local elements, the most
    largest_trained_shard: int  # a unit's trained bytes per rank, the most
    largest_shard: int  # a unit's bytes per rank, the most
    params: int  # bytes per rank
    trained: int  # trained bytes per rank
    gathered: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def gathered_blocks(self, param_bytes: int, f8: int) -> list[int]:
        """Each block's bytes as its all-gather moves them, largest first."""
        key = (param_bytes, f8)
        if key not in self.gathered:
            self.gathered[key] = sorted(
                (n * param_bytes - f * f8 for n, f in self.blocks), reverse=True
            )
        return self.gathered[key]


_SIZES: dict[int, tuple[WrapPlan, int, _Sizes]] = {}


def _sizes(plan: WrapPlan) -> _Sizes:
    """``plan``'s :class:`_Sizes` (kept with the plan object while it lives)."""
    found = _SIZES.get(id(plan))
    if found is not None and found[0] is plan and found[1] == len(plan.units):
        return found[2]
    units = plan.units
    below = [u for u in units if u.path]
    sizes = _Sizes(
        root=next((u for u in units if not u.path), None),
        blocks=[(u.local_numel, u.float8_numel) for u in below],
        local=sum(u.local_numel for u in units),
        trained_local=sum(u.trained(u.local_numel) for u in units),
        largest_trained_block=max((u.trained(u.local_numel) for u in below), default=0),
        largest_trained_shard=max(
            (u.trained(u.bytes_per_rank) for u in units), default=0
        ),
        largest_shard=max((u.bytes_per_rank for u in units), default=0),
        params=plan.bytes_per_rank(),
        trained=plan.trained_bytes_per_rank(),
    )
    if len(_SIZES) > 256:
        _SIZES.clear()
    _SIZES[id(plan)] = (plan, len(units), sizes)
    return sizes


def _held_sharded(
    plan: WrapPlan, s: RunShape, total: int, notes: dict[str, str]
) -> _Held:
    """FSDP: this rank's shards, plus the units gathered around the current one."""
    z = _sizes(plan)
    root = z.root
    # a unit's bytes gathered, each as the all-gather moves it (float8: 1 byte)
    f8 = s.param_bytes - 1 if s.float8_all_gather else 0
    blocks = z.gathered_blocks(s.param_bytes, f8)
    root_bytes = (
        root.local_numel * s.param_bytes - root.float8_numel * f8 if root else 0
    )
    params = z.params
    # a pipeline stage's units stay gathered from their first backward on
    raf = False if s.pipelined else s.reshard_after_forward
    kept = blocks if raf is False else blocks[: 1 + s.prefetch]
    # With a group size g, the other units keep 1/g of themselves until backward.
    partly = sum(blocks[len(kept) :]) // raf if type(raf) is int else 0
    notes["gathered_units"] = (
        f"root + {'all' if raf is False else len(kept)} unit(s)"
        f"{f' + 1/{raf} of the rest' if partly else ''}, {8 * s.param_bytes}-bit"
        + (", float8 weights 8-bit" if f8 else "")
    )
    # The unit whose backward ends last before the peak: the largest block, or
    # the root of a model that is one unit (its gradients are the whole model's).
    largest_unit = blocks[0] if blocks else root_bytes
    largest_numel = (
        z.largest_trained_block
        if z.blocks
        else (root.trained(root.local_numel) if root else 0)
    )
    shard_of_largest = z.largest_trained_shard
    trained = z.trained
    return _Held(
        params=params,
        trained=trained,
        gathered=root_bytes + sum(kept) + partly,
        sharded_grads=trained,
        unsharded_grads=_trained_numel(plan, total) * s.reduce_bytes,
        final_grads=trained,
        # A unit's unsharded gradients and the reduce-scatter's flat input, alive
        # together; the root's head gradient is held until the end of backward
        # (counted once: with no other unit it is the unit's own).
        unit_grads=largest_numel * (s.param_bytes + s.reduce_bytes),
        root_grad=root.trained(root.local_numel) * s.param_bytes
        if blocks and root
        else 0,
        largest_shard=shard_of_largest,
        mixed_precision=z.largest_shard // 4 * s.param_bytes if s.mixed else 0,
        # FSDP2 copies a unit out of the all-gather's flat output into its own
        # unsharded parameters: both alive at once while the unit is gathered.
        gather_copy=largest_unit if s.gather_copy_out else 0,
        # In forward, FSDP2 frees a unit's all-gather output only once the next
        # unit's is copied out, and the last one's at the root's post-forward: it is
        # alive through the head and the loss (a one-unit model's, the whole
        # model's, through the whole forward). Not with one shard: nothing gathered.
        last_gather=largest_unit if s.gather_copy_out and plan.shard_size > 1 else 0,
        tied_grad=plan.tied_numel * s.param_bytes,
    )


def _held_unsharded(
    plan: WrapPlan, s: RunShape, total: int, notes: dict[str, str]
) -> _Held:
    """DDP and one process: every rank holds the whole model."""
    root = next((u for u in plan.units if not u.path), None)
    has_blocks = any(u.path for u in plan.units)
    root_numel = root.trained(root.local_numel) if root else 0
    params, trained = total * 4, _trained_numel(plan, total) * 4
    buckets = 0
    if s.bucketed_gradients:
        # DDP copies gradients into its buckets (gradient_as_bucket_view=False),
        # allocated (and zeroed) when the model is wrapped: held in every moment.
        buckets = trained
        notes["grads"] = "+ DDP's gradient buckets, allocated at construction"
    return _Held(
        params=params,
        trained=trained,
        gathered=0,
        sharded_grads=trained,
        unsharded_grads=trained,
        final_grads=trained,
        unit_grads=0,
        # The head's gradient is the first one backward makes, held to its end.
        root_grad=root_numel * 4 if has_blocks else 0,
        largest_shard=max(
            (u.trained(u.numel * 4) for u in plan.units), default=trained
        ),
        # Autocast keeps a low-precision copy of each weight for backward.
        mixed_precision=total * s.param_bytes if s.mixed else 0,
        gather_copy=0,
        tied_grad=plan.tied_numel * 4,
        buckets=buckets,
    )


def _trained_numel(plan: WrapPlan, total: int) -> int:
    """Of ``total`` (elements one rank holds before data-parallel sharding), those
    that train."""
    z = _sizes(plan)
    if not z.local:
        return total
    return total * z.trained_local // z.local


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


@dataclass(frozen=True)
class Dispatch:
    """Expert parallelism's bytes beyond the activations traced on one rank (which
    compute the rank's own assignments: a balanced dispatch): ``saved``, the rows a
    rank receives above that, kept from forward to backward; ``buffers``, one MoE
    layer's all-to-all send and receive buffers, alive around its forward and its
    backward; ``note``: the bound they assume."""

    saved: int
    buffers: int
    note: str


def estimate(
    plan: WrapPlan,
    shape: RunShape,
    acts: ActivationBytes,
    process: int | None = None,
    pipeline: int = 0,
    dispatch: Dispatch | None = None,
) -> Estimate:
    """The per-rank training peak of ``shape`` for the units of ``plan`` (built for
    ``shape.world`` ranks) with the activations ``acts`` of one micro-batch (a
    pipeline stage: of the micro-batches it holds at once); ``process``: the process
    baseline (default: :data:`PROCESS_BYTES` of the device); ``pipeline``: a stage's
    send/recv buffers, held throughout; ``dispatch``: expert parallelism's."""
    s = shape
    # What one rank holds before data-parallel sharding: with tensor parallelism, its
    # tp shard of each parameter (gathered units, unsharded gradients).
    z = _sizes(plan)
    total = z.local or plan.total_numel
    n_blocks = len(z.blocks)
    notes: dict[str, str] = {}
    held_by = _held_sharded if s.shards else _held_unsharded
    h = held_by(plan, s, total, notes)
    base = {
        "params": h.params,
        "gathered_units": h.gathered,
        "optimizer": s.optimizer_states * h.trained,
        "mixed_precision": h.mixed_precision,
        "pipeline": pipeline,
        "runtime": runtime_bytes(s.device, s.param_bytes),
        "process": process_bytes(s.device) if process is None else process,
    }
    phases = _moments(h, s, acts, base, _accumulated(h, s, notes), n_blocks)
    _add_dispatch(phases, dispatch)
    phase = max(phases, key=lambda p: sum(phases[p].values()))
    parts = {k: int(phases[phase][k]) for k in PARTS}
    source = CONSTANTS_SOURCE.get(s.device, CONSTANTS_SOURCE["cuda"])
    notes["runtime"] = notes["process"] = f"{s.device}: {source}"
    if phase == "optimizer step":
        notes["transient"] = step_note(s.optimizer, s.optimizer_step_copies)
    if dispatch is not None:
        notes["experts"] = dispatch.note
    return Estimate(parts=parts, phase=phase, shape=shape, notes=notes)


def _moments(
    h: _Held,
    s: RunShape,
    acts: ActivationBytes,
    base: dict[str, int],
    held: int,
    n_blocks: int,
) -> dict[str, dict[str, int]]:
    """The parts of each moment of a step (``base``: those every moment holds alike;
    ``held``: the gradients held through backward, :func:`_accumulated`)."""
    # The update's temporaries (src/planner/optimizer_step.py).
    opt_temp = int(s.optimizer_step_copies * h.trained)
    # The last block's all-gather in forward: every earlier block's activations are
    # saved (a one-unit model gathers before any).
    before_last = acts.saved - acts.saved // n_blocks if n_blocks else 0
    # A one-unit model reduces its gradients after the whole backward, when every
    # activation is freed: its blocks' backward runs with no unit's gradients in
    # flight, and the reduction is a moment of its own.
    per_unit = bool(n_blocks) or not s.shards
    return {
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
    } | ({"embedding backward": _embedding_backward(h, s, base)} if h.tied_grad else {})


def _embedding_backward(h: _Held, s: RunShape, base: dict[str, int]) -> dict[str, int]:
    """The last moment of backward for a model whose embedding and output head share
    a weight: the embedding's gradient is made beside the head's (held since the loss)
    and summed into it. Every other gradient is made (sharded, with FSDP, but the
    root's own), no activation is left."""
    root = h.root_grad if s.shards else 0
    return {
        **base,
        "grads": h.final_grads + h.buckets + root,
        "activations": 0,
        "loss": 0,
        "transient": h.tied_grad,
    }


def _add_dispatch(phases: dict[str, dict[str, int]], dispatch: Dispatch | None) -> None:
    """Each moment's ``experts`` part: the extra rows received while activations are
    saved, and the all-to-all buffers in the moments inside a block (forward, a
    block's backward)."""
    for name, parts in phases.items():
        held = dispatch is not None and parts["activations"] > 0
        inside = name in ("forward", "block backward")
        parts["experts"] = (
            dispatch.saved + (dispatch.buffers if inside else 0) if held else 0
        )


def needed(est: Estimate, margin: float) -> int:
    """What a budget must hold for ``est`` to fit: its total with the safety margin."""
    return int(est.total * (1 + margin))


def with_margin(est: Estimate, margin: float) -> str:
    """``est``'s total as shown, with what the safety margin makes of it."""
    if not margin:
        return fmt_bytes(est.total)
    return (
        f"{fmt_bytes(est.total)} (+{margin:.0%} safety margin, {OVERRIDES['budget.margin']}: "
        f"{fmt_bytes(needed(est, margin))})"
    )


def planned_peak_gib(est: Estimate) -> float:
    """The estimate as the quantity a run measures (``peak_mem_gib``): the process's
    peak resident set on CPU (baseline included), the allocator's peak on CUDA (the
    context is outside it)."""
    return (est.total if est.shape.device == "cpu" else est.training) / GIB
