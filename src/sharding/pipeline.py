"""Pipeline parallelism on the ``pp`` dimension of the device mesh.

A model is cut into stages by its family's :class:`PipelineLayout`: the blocks (a
``ModuleList``) split into contiguous runs, the modules only the first stage runs
(embeddings) and those only the last one runs (final norm, output head). A stage is
the model itself with the other stages' modules left out (:class:`Absent`), its blocks under
their own indices (:class:`StageBlocks`), so every parameter keeps the name it has in
the whole model: checkpoints (DCP, by name) move between layouts. A module the stage
does not run but that shares a parameter with one it runs (an embedding tied to the
head) stays on it; :class:`Pipeline` sums such parameters' gradients over the stages
that hold them, so each copy takes the same step.

A stage is given its :class:`StageRole` when it is cut (:func:`cut_stage` sets the
``pp_stage`` attribute the family's model declares, None for the whole model), and
its forward reads it from itself: the first stage takes token ids, the others the
previous stage's hidden states, and the last returns the logits, which the
schedule's loss function turns into the loss.

Schedules are ``torch.distributed.pipelining``'s. Measured on gloo (CPU) with torch
2.13: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and
DualPipeV all give the gradients of one process when stages hold plain modules; with
``fully_shard`` inside the stages (how every stage is built here) the zero-bubble
schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), which split backward
into input and weight passes, leave gradients missing or wrong, so ``zbv`` is refused.
This module names no model and no config key.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .backends import canonical_name, clip_grads_with_norm_, grad_norm


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: torch's class (by name), stages per rank, and why it is
    refused here (None: it runs)."""

    name: str
    stages_per_rank: int = 1
    refused: str | None = None

    @property
    def cls(self) -> type:
        # Imported when a pipeline is built: torch.distributed.pipelining imports
        # torch._dynamo and inductor (over a second), which a run without pipeline
        # parallelism (and its launcher, and the planner) never needs.
        from torch.distributed.pipelining import schedules

        return getattr(schedules, self.name)


#: ``sharding.pp_schedule``'s names.
SCHEDULES: dict[str, Schedule] = {
    "gpipe": Schedule("ScheduleGPipe"),
    "1f1b": Schedule("Schedule1F1B"),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", stages_per_rank=2),
    "zbv": Schedule(
        "ScheduleZBVZeroBubble",
        stages_per_rank=2,
        refused=(
            "torch 2.13's zero-bubble schedule gives wrong gradients with fully_shard "
            "stages on gloo (measured: the weight pass misses FSDP's gradients); use "
            "1f1b or interleaved_1f1b"
        ),
    ),
}


def schedule_order(
    schedule: str, pp: int, microbatches: int, pp_rank: int
) -> list[tuple[str, int]]:
    """The forward (``"F"``) and backward (``"B"``) passes pp rank ``pp_rank`` runs
    in one step of ``schedule``, in order, each with its stage index: what the
    planner walks to know how many micro-batches each stage holds at once. Read off
    torch 2.13's schedules (tests/test_planner.py checks it against them): GPipe runs
    every forward, then every backward; 1F1B ``min(M, P - stage)`` forwards, then one
    backward and one forward at a time; Interleaved1F1B its warm-up of
    ``(V - 1) * m + 2 * (P - 1 - rank)`` forwards (m micro-batches a round, capped at
    ``V * M``), forwards cycling through the rank's V stages every m, then a forward
    and a backward at a time, backwards visiting the stages in reverse."""
    v = SCHEDULES[schedule].stages_per_rank
    if schedule == "gpipe":
        return [("F", pp_rank)] * microbatches + [("B", pp_rank)] * microbatches
    if v == 1:  # 1f1b
        warmup = min(microbatches, pp - pp_rank)
        order = [("F", pp_rank)] * warmup
        for _ in range(microbatches - warmup):
            order += [("B", pp_rank), ("F", pp_rank)]
        return order + [("B", pp_rank)] * warmup
    per_round = microbatches // max(1, microbatches // pp)
    total = v * microbatches
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)

    def forward(op: int) -> int:
        return (op // per_round) % v * pp + pp_rank

    def backward(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + pp_rank

    order = [("F", forward(op)) for op in range(warmup)]
    for op in range(warmup, total):
        order += [("F", forward(op)), ("B", backward(op))]
    return order + [("B", backward(op)) for op in range(total, total + warmup)]


def microbatches_problem(schedule: str, pp: int, microbatches: int) -> str | None:
    """Why torch's ``schedule`` cannot run ``microbatches`` micro-batches over ``pp``
    ranks (None: it can). Interleaved1F1B runs them in ``max(1, M // P)`` rounds of
    equal size, and raises on the ranks (in the schedule's constructor) otherwise:
    P=2, M=5 is 2 rounds of 2.5."""
    if SCHEDULES[schedule].stages_per_rank == 1:
        return None
    rounds = max(1, microbatches // pp)
    if microbatches % rounds == 0:
        return None
    return (
        f"{schedule} runs the micro-batches in rounds of equal size (here "
        f"{microbatches} // {pp} stages = {rounds} rounds), so {microbatches} must be a "
        f"multiple of {rounds}: e.g. {pp * rounds}"
    )


def bubble_fraction(schedule: str, pp: int, microbatches: int) -> float:
    """The idle share of a step in theory: ``(P - 1) / (M + P - 1)`` for GPipe and
    1F1B; with V stages per rank (interleaved) ``(P - 1) / (V M + P - 1)``."""
    v_m = SCHEDULES[schedule].stages_per_rank * microbatches
    return (pp - 1) / (v_m + pp - 1)


@dataclass(frozen=True)
class PipelineLayout:
    """How a family's model cuts into stages (``ModelSpec.pipeline``)."""

    blocks: str  # dotted path of the ModuleList of blocks: "h", "model.layers"
    first: tuple[str, ...]  # dotted paths of the modules only the first stage runs
    last: tuple[str, ...]  # ... and those only the last stage runs
    # The family's constructor gives each block to ``wrap()`` (GPT, Llama); a stage
    # does the same. False: units come from the policy once the stage exists (HF).
    annotated: bool = True


@dataclass(frozen=True)
class StageRole:
    """Which stage a model is (its ``pp_stage`` attribute, set by :func:`cut_stage`)."""

    index: int
    num_stages: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_role(model: nn.Module) -> StageRole | None:
    """The stage ``model`` was cut as (None: the whole model)."""
    return getattr(model, "pp_stage", None)


class StageBlocks(nn.ModuleDict):
    """A stage's blocks under their indices in the whole model (``h.2``, ``h.3``),
    iterated (and sliced) in order like the ``ModuleList`` they come from."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())

    def __getitem__(self, key: str | slice) -> nn.Module | list[nn.Module]:
        if isinstance(key, slice):  # transformers: self.layers[: num_hidden_layers]
            return list(self.values())[key]
        return super().__getitem__(key)


class Absent(nn.Identity):
    """In a stage, a module of another stage: no parameters, passes its input on
    (transformers' forward then runs as it is: a stage without the output head
    returns its hidden states as the "logits")."""


def split_blocks(
    n_blocks: int, n_stages: int, split: Sequence[int] | None = None
) -> list[range]:
    """The blocks of each stage: ``split`` (blocks per stage, summing to
    ``n_blocks``), or as even as possible (earlier stages take the remainder)."""
    if split:
        if len(split) != n_stages or sum(split) != n_blocks or min(split) < 1:
            raise ValueError(
                f"{list(split)} must be {n_stages} positive block counts summing to "
                f"the model's {n_blocks} blocks"
            )
        counts = list(split)
    else:
        if n_blocks < n_stages:
            raise ValueError(f"{n_blocks} blocks do not fill {n_stages} stages")
        base, extra = divmod(n_blocks, n_stages)
        counts = [base + (i < extra) for i in range(n_stages)]
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts, strict=True)]


def local_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stage indices rank ``pp_rank`` of ``pp`` holds: ``pp_rank + k * pp``
    (looped: interleaved schedules visit the ranks in order, then again)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def _get(root: nn.Module, path: str) -> nn.Module | None:
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _own_copy(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """Make ``root``'s modules along ``path`` (but the leaf) shallow copies of their
    own, so setting the leaf leaves the skeleton as it was; returns (parent, leaf)."""
    *parents, leaf = path.split(".")
    module = root
    for part in parents:
        child = copy.copy(module._modules[part])
        _fresh_dicts(child)
        module._modules[part] = child
        module = child
    return module, leaf


def _fresh_dicts(module: nn.Module) -> None:
    for attr in ("_modules", "_parameters", "_buffers"):
        module.__dict__[attr] = dict(module.__dict__[attr])


def cut_stage(
    skeleton: nn.Module,
    layout: PipelineLayout,
    blocks: Sequence[int],
    first: bool,
    last: bool,
    role: StageRole | None = None,
) -> nn.Module:
    """The part of ``skeleton`` (the whole model, on the meta device) with the
    ``blocks`` and, if ``first`` / ``last``, the first / last stage's modules; the
    rest left out, except modules sharing a parameter with what it keeps. The same
    module objects (not copies: build the skeleton for this rank's use), so parts
    cut from one skeleton share them. ``role``: the stage it runs as, given to the
    part as its ``pp_stage`` (an attribute its family's model declares)."""
    stage = copy.copy(skeleton)
    _fresh_dicts(stage)
    if role is not None:
        if not hasattr(skeleton, "pp_stage"):
            raise ValueError(
                f"{type(skeleton).__name__} declares no pp_stage: it cannot run as a "
                "pipeline stage"
            )
        stage.pp_stage = role
    all_blocks = _get(skeleton, layout.blocks)
    parent, leaf = _own_copy(stage, layout.blocks)
    parent._modules[leaf] = StageBlocks({str(i): all_blocks[i] for i in blocks})
    dropped = [*(() if first else layout.first), *(() if last else layout.last)]
    for path in dropped:
        if _get(stage, path) is None:  # pragma: no cover - a layout's own error
            raise ValueError(f"pipeline layout: the model has no module {path!r}")
        parent, leaf = _own_copy(stage, path)
        parent._modules[leaf] = Absent()
    # A parameter the stage uses that is named in a module it left out (the head
    # tied to the embedding: named wte.weight) brings that module back, so the
    # parameter keeps its name (the optimizer's and the checkpoint's).
    kept = {id(p) for p in stage.parameters()}
    named = {id(p): name for name, p in skeleton.named_parameters()}
    for path in dropped:
        module = _get(skeleton, path)
        if any(
            id(p) in kept and named[id(p)].startswith(path + ".")
            for p in module.parameters()
        ):
            parent, leaf = _own_copy(stage, path)
            parent._modules[leaf] = module
    return stage


class Pipeline:
    """One rank's part of the pipeline: its stage modules (built and sharded), the
    schedule, and what makes the stages together train as the whole model does:
    tied parameters' gradients summed over the stages holding them, and the global
    gradient norm.

    ``loss_fn(output, target)`` is the last stage's loss (the mean over the
    micro-batch); the schedule runs with ``scale_grads=False`` and each micro-batch's
    loss multiplied by ``scale`` (:meth:`step`), so gradients accumulate over the
    trainer's micro-steps exactly as without pipelining."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        schedule: str,
        microbatches: int,
        pp_mesh: DeviceMesh,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        model: nn.Module | None = None,
    ) -> None:
        info = SCHEDULES[schedule]
        if info.refused:
            raise ValueError(f"pipeline schedule {schedule!r}: {info.refused}")
        self.modules = list(stages)
        #: the rank's parameters under their names in the whole model (optimizer,
        #: checkpoints): the stage, or a part holding the rank's stages' modules
        self.model = model if model is not None else self.modules[0]
        self.roles = [stage_role(m) for m in self.modules]
        self.group = pp_mesh.get_group()
        self.microbatches = microbatches
        self._loss_fn = loss_fn
        self._scale = 1.0
        from torch.distributed.pipelining import PipelineStage

        self.stages = [
            PipelineStage(m, r.index, r.num_stages, device, group=self.group)
            for m, r in zip(self.modules, self.roles, strict=True)
        ]
        self.first = any(r.first for r in self.roles)
        self.last = any(r.last for r in self.roles)
        kwargs = {
            "n_microbatches": microbatches,
            "loss_fn": self._scaled_loss,
            "scale_grads": False,
        }
        if info.stages_per_rank == 1:
            self.schedule = info.cls(self.stages[0], **kwargs)
        else:
            self.schedule = info.cls(self.stages, **kwargs)
        self._find_shared()

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(output, target) * self._scale

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by canonical name, each once."""
        for name, p in self.model.named_parameters():
            yield canonical_name(name, self.model), p

    def _find_shared(self) -> None:
        """Parameters several pp ranks hold (a tied embedding and head): their names
        and local shapes, and which rank counts each in the gradient norm (the
        lowest)."""
        mine = {
            n: (tuple(_local(p).shape), _local(p).dtype)
            for n, p in self.named_parameters()
        }
        everyone: list[dict] = [None] * dist.get_world_size(self.group)  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine, group=self.group)
        holders: dict[str, list[int]] = {}
        for rank, names in enumerate(everyone):
            for name in names:
                holders.setdefault(name, []).append(rank)
        me = dist.get_rank(self.group)
        self.shared = {
            name: next(everyone[r][name] for r in ranks)
            for name, ranks in sorted(holders.items())
            if len(ranks) > 1
        }
        self.not_counted = {
            name
            for name in self.shared
            if me in holders[name] and holders[name][0] != me
        }

    @torch.no_grad()
    def gather_into(self, whole: nn.Module) -> None:
        """Copy every stage's weights into ``whole``: the whole model (no stages),
        on these ranks, sharded on any layout (each rank keeps its slices), one
        tensor at a time: the stage holding it (the lowest, for a tensor several
        hold) gathers it and broadcasts it over the pp group. A collective."""
        mine = get_model_state_dict(self.model)
        everyone: list[list[str]] = [None] * dist.get_world_size(self.group)  # type: ignore[list-item]
        dist.all_gather_object(everyone, list(mine), group=self.group)
        me = dist.get_rank(self.group)
        state = {}
        for name, ref in get_model_state_dict(whole).items():
            owner = next((r for r, names in enumerate(everyone) if name in names), None)
            if owner is None:
                raise ValueError(f"no pipeline stage holds {name!r}")
            if owner == me:
                t = mine[name]
                t = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()
            else:
                t = torch.empty(ref.shape, dtype=ref.dtype, device=_local(ref).device)
            dist.broadcast(t, group=self.group, group_src=owner)
            if isinstance(ref, DTensor):
                t = distribute_tensor(
                    t, ref.device_mesh, ref.placements, src_data_rank=None
                )
            state[name] = t
        set_model_state_dict(whole, state)

    # -- a step ---------------------------------------------------------------------
    def step(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        scale: float,
        train: bool = True,
        **inputs: torch.Tensor,
    ) -> torch.Tensor:
        """Run the schedule over one batch (split into the micro-batches): forward
        and, with ``train``, backward (gradients accumulate). ``inputs``: keyword
        tensors every stage's forward takes (batch first, split with it). Returns
        the sum over micro-batches of ``loss * scale`` on the last stage's ranks, 0
        elsewhere."""
        self._scale = scale
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        target = y if self.last else None
        if train:  # the losses are all it needs: no stage keeps its logits
            self.schedule.step(
                *args, target=target, losses=losses, return_outputs=False, **inputs
            )
        else:
            self.schedule.eval(*args, target=target, losses=losses, **inputs)
        total = torch.zeros((), device=x.device)
        for loss in losses:
            total += loss.detach().float()
        return total

    def share(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the pp ranks (the loss, known to the last stage)."""
        value = value.clone()
        dist.all_reduce(value, group=self.group)
        return value

    @torch.no_grad()
    def sync_shared_grads(self) -> None:
        """Sum the gradients of parameters several stages hold, over those stages,
        so each copy takes the step of the whole model's one parameter."""
        params = dict(self.named_parameters())
        for name, (shape, dtype) in self.shared.items():
            p = params.get(name)
            if p is not None and p.grad is not None:
                grad = _local(p.grad)
            else:
                grad = torch.zeros(shape, dtype=dtype, device=_device(params))
            dist.all_reduce(grad, group=self.group)
            if p is not None and p.grad is None:
                p.grad = _like(p, grad)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every stage (a parameter several
        stages hold counted once); returns that norm."""
        counted = [p for n, p in self.named_parameters() if n not in self.not_counted]
        local = grad_norm(counted).float() ** 2
        dist.all_reduce(local, group=self.group)
        total = local.sqrt()
        clip_grads_with_norm_(self.model.parameters(), max_norm, total)
        return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _device(params: dict[str, nn.Parameter]) -> torch.device:
    return next(iter(params.values())).device


def _like(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local
