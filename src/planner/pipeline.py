"""A pipeline-parallel run (``sharding.pipeline_parallel > 1``): each pp rank's stages
built on meta, the micro-batches its schedule holds at once, and its estimate."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from src.config.run_plan import RunPlan
from src.models.memory import ActivationBytes
from src.planner.activations import (
    activation_fn,
    documents_activations,
    run_activation_fn,
    tp_activations,
)
from src.planner.estimate import Estimate, RunShape, estimate, fmt_bytes
from src.planner.inputs import (
    family_process_bytes,
    plan_backend,
    plan_of,
    run_shape,
    with_ac_chosen,
)
from src.sharding import Unit, WrapPlan
from src.sharding.pipeline import (
    SCHEDULES,
    bubble_fraction,
    local_stages,
    schedule_order,
)


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

    def plans(
        self, resolved: RunPlan, world: int
    ) -> list[tuple[PipelineRank, WrapPlan]]:
        """Each rank's wrap plan on its stage's ``world / P`` ranks."""
        cache: dict[tuple, WrapPlan] = {}
        out = []
        for rank in self.ranks:
            sig = self.signature(rank)
            if sig not in cache:
                cache[sig] = _merged_plan(
                    [plan_of(resolved, m, world // rank.pp) for m in self.built[sig]]
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
            tensors=sum(u.tensors for u in roots),
        )
        units = [root, *units]
    first = plans[0]
    return replace(
        first,
        units=units,
        total_numel=sum(p.total_numel for p in plans),
        tp_modules=[m for p in plans for m in p.tp_modules],
    )


def stage_plans(resolved: RunPlan, only: int | None = None) -> StagePlans:
    """The pp ranks of the run plan and their stages built on meta (``only``: just that
    rank's, built under its own block indices)."""
    from src.build import build_stages, rank_stages

    resolved = with_ac_chosen(resolved)
    pp, s = resolved.layout.pp, resolved.pipeline
    ranks, built = [], {}
    used: set[int] = set()  # modules already built from the skeleton
    with plan_backend(resolved) as backend:
        cut = rank_stages(resolved, pp, 0 if only is None else only)
        for r in range(pp) if only is None else [only]:
            ids = local_stages(r, pp, SCHEDULES[s.schedule].stages_per_rank)
            rank = PipelineRank(
                r,
                tuple(ids),
                tuple(len(cut.ranges[i]) for i in ids),
                cut.n_stages,
                str(s.schedule),
                pp,
                int(s.microbatches),
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
                    mine = rank_stages(resolved, pp, r)
                used |= modules
                built[sig] = build_stages(resolved, backend, mine)
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


def pipeline_shape(resolved: RunPlan, world: int) -> RunShape:
    """:func:`run_shape` of one pipeline stage: its ``world / P`` ranks, one pipeline
    micro-batch (each data-parallel rank's rows of a micro-step split
    ``sharding.pp_microbatches`` ways; the busiest rank's share)."""
    shape = run_shape(resolved, world)
    stage = resolved.layout.stage(world // resolved.layout.pp)
    m = int(resolved.pipeline.microbatches)
    rows = resolved.batch.batch_size / shape.grad_accum / stage.dp / m
    return replace(
        shape,
        world=stage.world_size,
        micro_batch=max(1, math.ceil(rows)),
        pipelined=True,
    )


def whole_activations(
    resolved: RunPlan, shape: RunShape, n_blocks: int
) -> tuple[Callable[[str, int], ActivationBytes], int]:
    """The whole model's activations of one micro-batch of ``shape`` per
    checkpointing mode (tensor parallelism and packing by documents applied), and
    one block's input (the tensor at a stage boundary)."""
    fn = run_activation_fn(resolved)
    args = (shape.micro_batch, shape.seq_len, shape.param_bytes)

    @functools.cache
    def whole(mode: str, every: int) -> ActivationBytes:
        mode_shape = replace(shape, checkpointing=mode, ac_every=every)
        acts = tp_activations(resolved, mode_shape, fn(*args, mode, every), n_blocks)
        return documents_activations(resolved, mode_shape, acts, n_blocks)

    boundary = activation_fn(resolved)(*args, "full", 1).saved // n_blocks
    return whole, boundary


def pipeline_estimates(
    resolved: RunPlan,
    world: int,
    plans: StagePlans | None = None,
) -> list[tuple[WrapPlan, Estimate]]:
    """Each pp rank's wrap plan and estimate (``sharding.pipeline_parallel > 1``)."""
    plans = plans or stage_plans(resolved)
    shape = pipeline_shape(resolved, world)
    n_blocks = plans.n_blocks
    whole, boundary = whole_activations(resolved, shape, n_blocks)
    process = family_process_bytes(resolved, shape.device)
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
        for rank, plan in plans.plans(resolved, world)
    ]


def pipeline_report(
    resolved: RunPlan, estimates: list[tuple[WrapPlan, Estimate]]
) -> str:
    """Each pp rank's peak, the worst named, and what the schedule costs in time."""
    s = resolved.pipeline
    pp, m = resolved.layout.pp, int(s.microbatches)
    _, worst = worst_stage(estimates)
    lines = [
        f"pipeline stages ({s.schedule}, {m} micro-batches per micro-step, "
        f"{bubble_line(str(s.schedule), pp, m)}):"
    ]
    for _, e in estimates:
        lines.append(f"  {e.stage:<44} {fmt_bytes(e.total):>12} peak at {e.phase}")
    lines.append(
        f"worst stage: pp rank {worst.pp_rank}, {fmt_bytes(worst.total)} "
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
