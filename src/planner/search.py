"""The fit search: every point of the searched fields' values (the run plan's, varied
with ``dataclasses.replace``), its estimate and cost; the cheapest point that fits a
budget and the one with the smallest estimate."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from src.config.run_plan import OVERRIDES, RunPlan, field_of, varied
from src.config.schema import GRAD_SYNC
from src.models.memory import ActivationBytes
from src.planner.activations import (
    cp_activations,
    ep_dispatch,
    run_activation_fn,
    tp_activations,
)
from src.planner.costs import Checkpointing, change_cost, pipeline_cost, precision_cost
from src.planner.estimate import Estimate, RunShape, estimate, needed
from src.planner.inputs import (
    build_meta_model,
    family_process_bytes,
    lower_bound_reason,
    plan_of,
    run_shape,
)
from src.planner.pipeline import StagePlans, stage_plans, whole_activations, worst_rank
from src.planner.settings import (
    AC,
    ACCUM,
    BATCH,
    CP,
    DEVICES,
    EP,
    MICRO,
    MIN_PARAMS,
    PP,
    PRECISION,
    SYNC,
    accelerator_name,
    device_type,
    mem_margin,
)
from src.sharding import (
    PRECISIONS,
    LayoutError,
    WrapPlan,
    backend_class,
    get_precision,
    refusal,
)
from src.sharding.layout import refused_with
from src.sharding.pipeline import SCHEDULES, microbatches_problem

MIN_PARAMS_CANDIDATES = (1e5, 1e6, 1e7, 1e8, 1e9)


@dataclass(frozen=True)
class Candidate:
    """One point of the search: its changes of the run plan's fields, its estimate
    and its cost."""

    changes: dict[str, Any]
    estimate: Estimate
    cost: float
    #: what ``cost`` comes from where not :data:`~src.planner.costs.COST`'s factors:
    #: the step-time model's profile (:meth:`_Points.timed`)
    basis: str = ""

    def describe(self) -> str:
        every = OVERRIDES[f"{AC}.every"]
        shown = {
            k: v
            for k, v in self.settings().items()
            if not (k == every and v == 1)  # the default: every block
        }
        # the precision is a config group: picked as precision=<name>
        group = OVERRIDES[PRECISION]
        shown = {("precision" if k == group else k): v for k, v in shown.items()}
        return " ".join(f"{k}={fmt_value(v)}" for k, v in shown.items()) or "as is"

    def fields(self) -> dict[str, Any]:
        """The changes as plain plan fields (checkpointing: its mode and every k)."""
        out: dict[str, Any] = {}
        for k, v in self.changes.items():
            out.update(v.fields() if isinstance(v, Checkpointing) else {k: v})
        return out

    def settings(self) -> dict[str, Any]:
        """The changes as the overrides a user types (:data:`OVERRIDES`)."""
        return {OVERRIDES[k]: v for k, v in self.fields().items()}


def fmt_value(v: Any) -> str:
    """A value as a command line writes it (``1e+08``: ``1e8``)."""
    if isinstance(v, float):
        return f"{v:g}".replace("e+0", "e").replace("e+", "e")
    return str(v)


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


_N_BLOCKS: dict[tuple[str, str], int] = {}


def n_blocks(resolved: RunPlan) -> int:
    """How many blocks the checkpointing transform targets in the run's model (a
    meta build, once per model: a plan-only of gpt_70b asked five times)."""
    from src.planner.trace import block_order

    spec, config = resolved.spec, resolved.model_config
    key = (spec.name, repr(config))
    if key not in _N_BLOCKS:
        with torch.device("meta"):
            model = spec.build(config, 0)
        _N_BLOCKS[key] = len(block_order(model, spec.block_classes(config)))
    return _N_BLOCKS[key]


def _options(
    resolved: RunPlan,
    keys: Iterable[str],
    world: int,
    max_world: int,
):
    """The values the search tries for each field (the current one first)."""
    batch = resolved.batch.batch_size
    out: dict[str, list] = {}
    for key in keys:
        cur = world if key == DEVICES else field_of(resolved, key)
        if key == MIN_PARAMS:
            vals = list(MIN_PARAMS_CANDIDATES)
        elif key == ACCUM:
            vals = [a for a in range(1, batch + 1) if batch % a == 0]
        elif key == SYNC:
            vals = list(GRAD_SYNC)
        elif key == AC:
            ac = resolved.checkpointing
            out[key] = ac_options(str(ac.mode), int(ac.every), n_blocks(resolved))
            continue
        elif key == DEVICES:
            vals = [world * 2**i for i in range(12) if world * 2**i <= max_world]
        elif key == PRECISION:
            device = (device_type(resolved), accelerator_name(resolved))
            vals = [
                p
                for p in PRECISIONS
                if precision_cost(p, *device) < math.inf
                and not lower_bound_reason(resolved, device[0], p)
            ]
        elif key == PP:
            vals = pipeline_options(resolved, world)
        elif key == CP:
            vals = cp_options(resolved)
        elif key == EP:
            vals = ep_options(resolved)
        else:
            continue
        out[key] = ([cur] if cur is not None else []) + [v for v in vals if v != cur]
    return out


def _degree_options(
    resolved: RunPlan,
    capability: str,
    hook: str,
    refused: bool,
    degrees: Callable[[Any], list[int] | None],
) -> list[int]:
    """A dimension's degrees for the fit search: none (``[]``) where the backend
    lacks ``capability``, the family has no ``hook`` (a :class:`ModelSpec` field),
    the run ``refused`` it or the hook refuses the config (ValueError); else 1 and
    ``degrees(what the hook returned)`` (None: no degree at all)."""
    fn = getattr(resolved.spec, hook)
    if (
        refused
        or fn is None
        or not getattr(backend_class(resolved.backend), capability)
    ):
        return []
    try:
        found = fn(resolved.model_config)
    except ValueError:
        return []
    listed = degrees(found)
    return [] if listed is None else [1, *listed]


def pipeline_options(resolved: RunPlan, world: int) -> list[int]:
    """The stage counts the fit search tries on ``world`` ranks: none (1), and 2, 4,
    8, 16 where they divide the ranks with the run's tp and replica groups and leave each stage a
    block, where the backend and the model family can pipeline (none with
    a stage cut or sequence parallelism set: they fix the layout)."""
    per_rank = SCHEDULES[str(resolved.pipeline.schedule)].stages_per_rank
    blocks = n_blocks(resolved)
    layout = resolved.layout
    group = layout.tp * layout.cp * layout.dp_replicate
    fixed = (
        resolved.spec.init_tensor is None
        or bool(resolved.pipeline.split)
        or resolved.unit.sequence_parallel is True
    )
    return _degree_options(
        resolved,
        "pipeline_parallel",
        "pipeline",
        fixed,
        lambda _: [
            2**i
            for i in range(1, 5)
            if world % (2**i * group) == 0 and 2**i * per_rank <= blocks
        ],
    )


def cp_options(resolved: RunPlan) -> list[int]:
    """The cp degrees the fit search tries: none (1), and 2, 4, 8 where the backend
    and the model can split sequences and the run's other degrees take cp (the one
    rule, :func:`src.sharding.layout.refusal`, judges each point: its 2C chunks, its
    ranks)."""
    refused = resolved.spec.kv_width is None or refused_with("cp", resolved.layout)
    return _degree_options(
        resolved,
        "context_parallel",
        "context_parallel",
        refused,
        lambda _: [2, 4, 8],
    )


def ep_options(resolved: RunPlan) -> list[int]:
    """The expert-parallel degrees the fit search tries: none (1), and 2, 4, 8, 16,
    32, 64 that divide the model's experts, where the backend and the model can
    split experts (an HF MoE model without a ``base_model_ep_plan``: not) and the
    run's other degrees take ep (the one rule). A point whose ranks the degree does
    not fit is skipped (the shard ranks; with tensor parallelism, tp times a divisor
    of them)."""
    refused = refused_with("ep", resolved.layout)
    return _degree_options(
        resolved,
        "expert_parallel",
        "num_experts",
        refused,
        lambda experts: (
            [e for e in (2, 4, 8, 16, 32, 64) if experts % e == 0] if experts else None
        ),
    )


def search(
    resolved: RunPlan,
    keys: Iterable[str],
    budget: int,
    world: int,
    max_world: int | None = None,
) -> tuple[Candidate | None, Candidate]:
    """The cheapest point that fits ``budget`` over ``keys`` (None if none does) and
    the point with the smallest estimate. Deterministic: equal costs keep the order
    in which :func:`_options` lists the values (the current value first). One meta
    model per ``sharding.min_params`` value; everything else is arithmetic. The
    search varies sharding and batch fields, never the model: ``resolved`` varied
    serves every point."""
    found = fit_search(resolved, keys, budget, world, max_world)
    return found.best, found.smallest


@dataclass(frozen=True)
class Found:
    """What :func:`fit_search` found: the cheapest fit, the cheapest fit on the
    ``world`` ranks as set (None if none fits there), the smallest estimate, and the
    smallest on the ``world`` ranks as set."""

    best: Candidate | None
    best_here: Candidate | None
    smallest: Candidate
    smallest_here: Candidate | None


def fit_search(
    resolved: RunPlan,
    keys: Iterable[str],
    budget: int,
    world: int,
    max_world: int | None = None,
    complete_batch: bool = False,
    by_model: bool = False,
) -> Found:
    """:func:`search`, with the cheapest fit at ``world`` ranks too.
    ``complete_batch``: a point whose ranks would get no whole share of
    ``trainer.batch_size`` (fewer sequences than data-parallel ranks x
    micro-batches, or an uneven split) also sets the smallest batch that splits,
    so that it runs as printed (the plan-only proposals; never ``auto``).
    ``by_model``: the fits are ranked by the step-time model's device time per
    token (:meth:`_Points.timed`) where the device has a profile, not by
    :data:`~src.planner.costs.COST`'s factors."""
    options = _options(resolved, keys, world, max_world or world)
    margin = mem_margin(resolved)
    points = _Points.of(resolved, options, world, complete_batch)
    fits: list[Candidate] = []
    smallest = smallest_here = None
    for point in _product(options):
        cand = points.candidate(point)
        if cand is None:
            continue
        same = cand.changes.get(DEVICES, world) == world
        total = cand.estimate.total
        if smallest is None or total < smallest.estimate.total:
            smallest = cand
        if same and (smallest_here is None or total < smallest_here.estimate.total):
            smallest_here = cand
        if needed(cand.estimate, margin) <= budget:
            fits.append(cand)
    assert smallest is not None
    if by_model:
        fits = points.timed(fits) or fits
    here = [c for c in fits if c.changes.get(DEVICES, world) == world]
    return Found(cheapest(fits), cheapest(here), smallest, smallest_here)


#: Costs within this factor of the cheapest are a tie, won by the fewest changes:
#: below what the step-time model resolves (a change that fits and one that also
#: moves an unrelated setting for a predicted 0.3% are the same proposal).
TIE = 1.01


def cheapest(cands: list[Candidate]) -> Candidate | None:
    """The candidate of least cost, of those within :data:`TIE` of it the one with
    the fewest changes (then the least cost; then the first: the order of
    :func:`_options`' values); None for none. Of those that grow the batch (so
    that it splits over their ranks), only the least grown compete: a bigger batch
    is another experiment, and a step's fixed costs spread over more tokens would
    make it look cheap."""
    if not cands:
        return None
    batch = min(c.changes.get(BATCH, 0) for c in cands)  # 0: the batch as set
    cands = [c for c in cands if c.changes.get(BATCH, 0) == batch]
    least = min(c.cost for c in cands)
    near = [c for c in cands if c.cost <= least * TIE]
    return min(near, key=lambda c: (len(c.changes), c.cost))


@dataclass
class _Points:
    """What the points of one search share: the run as it is set (its shape,
    activations, process baseline and the values the search starts from) and what
    is built once for many points (meta models, wrap and stage plans, a pipeline's
    whole-model activations)."""

    resolved: RunPlan
    options: dict[str, list]
    currents: dict[str, Any]  # the values the search starts from (each key's first)
    world: int
    batch: int
    base: RunShape
    device: tuple[str, str]  # the estimate's device and accelerator
    acts: Callable[..., ActivationBytes]
    process: int
    tp: int
    cur_cp: int
    seq_len: int  # the whole sequence (a rank holds 1/C of it)
    cur_mp: float
    cur_pp: int
    cur_m: int
    schedule: str
    complete_batch: bool = False
    models: dict[tuple[float, int], torch.nn.Module] = field(default_factory=dict)
    plans: dict[tuple[float, int, int], WrapPlan] = field(default_factory=dict)
    staged: dict[tuple[float, int], StagePlans] = field(default_factory=dict)
    staged_plans: dict[tuple[float, int, int], list] = field(default_factory=dict)
    wholes: dict[tuple[int, int], tuple] = field(default_factory=dict)
    timing_models: dict[tuple[float, int], Any] = field(default_factory=dict)
    timing_plans: dict[tuple, Any] = field(default_factory=dict)  # their wrap plans
    # what many points share: the one rule's verdict on a layout, an estimate (a
    # 70B's search met each of its 15,960 twice), both pure functions of the key
    refusals: dict[tuple, bool] = field(default_factory=dict)
    estimates: dict[tuple, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        resolved: RunPlan,
        options: dict[str, list],
        world: int,
        complete_batch: bool = False,
    ) -> _Points:
        base = run_shape(resolved, world)
        device = (base.device, accelerator_name(resolved))
        acts = functools.lru_cache(maxsize=None)(run_activation_fn(resolved))
        process = family_process_bytes(resolved, base.device)
        return cls(
            resolved,
            options,
            {k: values[0] for k, values in options.items()},
            world,
            int(resolved.batch.batch_size),
            base,
            device,
            acts,
            process,
            tp=resolved.layout.tp,
            cur_cp=resolved.layout.cp,
            seq_len=int(resolved.spec.seq_len(resolved.model_config)),
            cur_mp=float(resolved.wrap.min_params),
            cur_pp=resolved.layout.pp,
            cur_m=int(resolved.pipeline.microbatches),
            schedule=str(resolved.pipeline.schedule),
            complete_batch=complete_batch,
        )

    def timed(self, cands: list[Candidate]) -> list[Candidate] | None:
        """``cands`` with their cost the step-time model's device time per token
        (seconds of all the point's ranks for one token) over the run as set's
        (a point the model cannot time: last); None where the device has no
        profile or the run as set cannot be timed."""
        from src.planner.profiles import profile_for

        profile = profile_for(*self.device)
        if profile is None:
            return None
        blocks = n_blocks(self.resolved)
        base = self._device_time(self.resolved, profile, blocks)
        if not base:
            return None
        out = []
        for cand in cands:
            try:
                run = varied(self.resolved, cand.fields())
            except LayoutError:
                run = None
            t = self._device_time(run, profile, blocks) if run else None
            basis = f"the step-time model on {profile.name} ({profile.source})"
            out.append(replace(cand, cost=t / base if t else math.inf, basis=basis))
        return out

    def _device_time(self, run: RunPlan, profile: Any, blocks: int) -> float | None:
        """Predicted seconds of all of ``run``'s ranks per token (its pipeline's
        stages predicted on the whole model's units, as the layout search does)."""
        from src.planner.step_time import predict

        lay = run.layout
        key = (float(run.wrap.min_params), lay.ep)
        if key not in self.timing_models and self.cur_pp == 1 and key in self.models:
            self.timing_models[key] = self.models[key]  # the same unpipelined build
        if key not in self.timing_models:
            flat = varied(
                run, {"layout": replace(lay, pp=1), "checkpointing.mode": "none"}
            )
            try:
                self.timing_models[key] = build_meta_model(flat)
            except Exception:  # a point the model cannot build: not timed
                self.timing_models[key] = None
        model = self.timing_models[key]
        if model is None:
            return None
        # A wrap plan walks the whole model: one per model and stage layout (the
        # candidates share a few; planned each time, gpt_70b on 64 ranks took 11,155)
        at = (key, lay.stage(lay.world_size // lay.pp))
        try:
            if at not in self.timing_plans:
                self.timing_plans[at] = plan_of(run, model, lay.world_size // lay.pp)
            step = predict(run, self.timing_plans[at], profile, lay.world_size, blocks)
        except Exception:  # a prediction is a ranking aid, never in the way
            return None
        return step.total_s * lay.world_size / step.tokens_per_step

    def candidate(self, point: dict[str, Any]) -> Candidate | None:
        """``point``'s estimate and cost; None for a point the search skips."""
        mp = float(point.get(MIN_PARAMS, self.cur_mp))
        w = int(point.get(DEVICES, self.world))
        accum = int(point.get(ACCUM, self.base.grad_accum))
        pp = int(point.get(PP, self.cur_pp))
        cp = int(point.get(CP, self.cur_cp))
        ep = int(point.get(EP, self.resolved.layout.ep))
        if self.batch % accum or self._refused(point, w, pp, cp, ep):
            return None
        if pp > 1:
            return self._pipelined(point, mp, w, accum, pp)
        return self._unpipelined(point, mp, w, accum, cp, ep)

    def _refused(
        self, point: dict[str, Any], w: int, pp: int, cp: int, ep: int
    ) -> bool:
        """Whether the one rule refuses the point's layout (its degrees, backend,
        precision and sequence); ep's fit to the shard ranks is judged where the
        point is estimated."""
        prec = point.get(PRECISION, self.resolved.precision.name)
        key = (w, pp, cp, ep, prec)
        if key not in self.refusals:
            self.refusals[key] = self._refusal(w, pp, cp, ep, prec)
        return self.refusals[key]

    def _refusal(self, w: int, pp: int, cp: int, ep: int, prec: str) -> bool:
        try:
            degrees = replace(self.resolved.layout, world_size=w, pp=pp, cp=cp, ep=1)
        except LayoutError:
            return True  # the degrees do not divide the ranks
        if refusal(degrees, backend_class(self.resolved.backend), prec, self.seq_len):
            return True
        return ep > 1 and refused_with("ep", degrees)

    def _changed(
        self, point: dict[str, Any], w: int, accum: int, pp: int = 1, m: int = 1
    ) -> dict[str, Any]:
        """The point's values that differ from the run's (its overrides), with the
        batch that splits over its ranks where :attr:`complete_batch` asks."""
        changed = {k: v for k, v in point.items() if v != self.options[k][0]}
        if self.complete_batch:
            batch = splitting_batch(self.batch, self.resolved.layout, w, accum, pp, m)
            if batch != self.batch:
                changed[BATCH] = batch
        return changed

    def _shape(self, point: dict[str, Any], **changes: Any) -> RunShape:
        """The run's shape in ``point``'s precision and checkpointing, ``changes``
        made."""
        prec = get_precision(point.get(PRECISION, self.resolved.precision.name))
        ac = point.get(AC)
        return replace(
            self.base,
            param_bytes=prec.param_dtype.itemsize,
            reduce_bytes=prec.reduce_dtype.itemsize,
            **changes,
            checkpointing=ac.mode if ac else self.base.checkpointing,
            ac_every=ac.every if ac else self.base.ac_every,
        )

    def _unpipelined(
        self, point: dict[str, Any], mp: float, w: int, accum: int, cp: int, ep: int
    ) -> Candidate | None:
        base, tp = self.base, self.tp
        resolved = self._with_ep(ep, w)
        if resolved is None:
            return None  # ep does not divide the point's shard ranks
        if (mp, ep) not in self.models:  # its units (selective is checked on them)
            with_mp = varied(resolved, {MIN_PARAMS: mp, f"{AC}.mode": "none"})
            self.models[mp, ep] = build_meta_model(with_mp)
        if (mp, w, ep) not in self.plans:
            self.plans[mp, w, ep] = plan_of(resolved, self.models[mp, ep], w)
        plan, ac = self.plans[mp, w, ep], point.get(AC)
        if ac is not None and ac.mode == "selective" and splits_blocks(plan):
            return None  # selective needs each block a unit of its own (transforms.py)
        shape = self._shape(
            point,
            world=w,
            grad_accum=accum,
            micro_batch=max(1, math.ceil(self.batch / accum / max(1, w // (tp * cp)))),
            seq_len=self.seq_len // cp,
            grad_sync=str(point.get(SYNC, base.grad_sync)),
        )
        a = self.acts(
            shape.micro_batch,
            shape.seq_len,
            shape.param_bytes,
            shape.checkpointing,
            shape.ac_every,
        )
        if tp > 1:
            a = tp_activations(resolved, shape, a, self.models[mp, ep])
        a = cp_activations(resolved, shape, a, self.models[mp, ep], cp)
        dispatch = ep_dispatch(resolved, shape)
        key = (mp, w, ep, shape, a, dispatch)
        if key not in self.estimates:
            self.estimates[key] = estimate(
                plan, shape, a, self.process, dispatch=dispatch
            )
        est = self.estimates[key]
        changed = self._changed(point, w, accum)
        cost = change_cost(self.currents, changed, self.device)
        cost /= pipeline_cost(self.schedule, self.cur_pp, self.cur_m)
        return Candidate(changed, est, cost)

    def _with_ep(self, ep: int, w: int) -> RunPlan | None:
        """The run with ``ep`` expert-parallel ranks (None: ``ep`` does not divide
        the shard ranks of ``w``)."""
        layout = self.resolved.layout
        if ep == layout.ep:
            return self.resolved
        try:
            return replace(self.resolved, layout=replace(layout, world_size=w, ep=ep))
        except LayoutError:
            return None

    def _pipelined(
        self, point: dict[str, Any], mp: float, w: int, accum: int, pp: int
    ) -> Candidate | None:
        base, schedule = self.base, self.schedule
        if mp != self.cur_mp or (pp != self.cur_pp and w != self.world):
            return None  # other stage counts: at the current ranks; units as set
        if point.get(SYNC, base.grad_sync) != base.grad_sync:
            return None  # no effect: each schedule reduces at its end
        m = max(self.cur_m, pp)
        if microbatches_problem(schedule, pp, m):
            return None  # the schedule cannot split m micro-batches over pp ranks
        ranks = self._stage_ranks(mp, pp, m, w)
        ac = point.get(AC)
        if ac is not None and ac.mode == "selective":
            if any(splits_blocks(plan) for _, plan in ranks):
                return None
        rows = self.batch / accum / max(1, w // (self.tp * pp)) / m
        shape = self._shape(
            point,
            world=w // pp,
            grad_accum=accum,
            micro_batch=max(1, math.ceil(rows)),
            pipelined=True,
        )
        n_blocks = self.staged[mp, pp].n_blocks
        at = (shape.micro_batch, shape.param_bytes)
        if at not in self.wholes:
            self.wholes[at] = whole_activations(self.resolved, shape, n_blocks)
        whole, boundary = self.wholes[at]
        est = worst_rank(ranks, shape, whole, n_blocks, boundary, self.process)
        changed = self._changed(point, w, accum, pp, m)
        if m != self.cur_m:
            changed[MICRO] = m
        cost = change_cost(self.currents, changed, self.device) * (
            pipeline_cost(schedule, pp, m)
            / pipeline_cost(schedule, self.cur_pp, self.cur_m)
        )
        return Candidate(changed, est, cost)

    def _stage_ranks(self, mp: float, pp: int, m: int, w: int) -> list:
        """Each pp rank's plan with ``pp`` stages of ``mp``'s units on ``w`` ranks
        (built once per ``(mp, pp)``, planned once per rank count)."""
        if (mp, pp) not in self.staged:
            at = varied(self._staged_plan(mp, pp, m), {f"{AC}.mode": "none"})
            self.staged[mp, pp] = stage_plans(at)  # (selective is checked below)
        if (mp, pp, w) not in self.staged_plans:
            self.staged_plans[mp, pp, w] = self.staged[mp, pp].plans(self.resolved, w)
        return self.staged_plans[mp, pp, w]

    def _staged_plan(self, mp: float, pp: int, m: int) -> RunPlan:
        """The run with ``pp`` stages of ``mp``'s units, ``m`` micro-batches (at the
        run's ranks: other stage counts are searched there only)."""
        layout = replace(self.resolved.layout, pp=pp, cp=1, ep=1)  # (the rule)
        return replace(varied(self.resolved, {MIN_PARAMS: mp, MICRO: m}), layout=layout)


def splitting_batch(
    batch: int, layout: Any, world: int, accum: int, pp: int = 1, m: int = 1
) -> int:
    """The smallest global batch >= ``batch`` that splits into ``accum``
    micro-batches of whole sequences on each data-parallel rank of ``world`` ranks
    in ``pp`` stages (and into ``m`` pipeline micro-batches): what the run
    validates (src/config/validate.py)."""
    dp = layout.stage(max(1, world // pp)).dp
    step = accum * dp * (m if pp > 1 else 1)
    return -(-batch // step) * step


def splits_blocks(plan: WrapPlan) -> bool:
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
