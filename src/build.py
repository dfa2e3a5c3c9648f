"""Building a run's backend and model from its run plan: what the trainer, the planner
(on the meta device) and the tools that open a finished run all need.

``build_model`` builds the model of the run plan's family inside the wrap context
(each unit sharded as it is constructed, the root last), materialises a meta-device
model shard by shard, and loads the pretrained weights into the shards.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from src.checkpoint.export import load_hf_weights
from src.config.run_plan import RunPlan, tensor_parallel_plan
from src.errors import ConfigError
from src.models.spec import lm_loss
from src.sharding import (
    Backend,
    LoraSpec,
    TiedParametersWarning,
    UnitTransform,
    adapted_layers,
    build_backend,
    build_policy,
    build_sharded_model,
    canonical_name,
    is_adapter,
    set_prefetch,
    wrap,
)
from src.sharding.layout import ParallelLayout
from src.sharding.lora import targeted
from src.sharding.pipeline import (
    SCHEDULES,
    Pipeline,
    PipelineLayout,
    StageRole,
    cut_stage,
    local_stages,
    split_blocks,
)

log = logging.getLogger(__name__)


def make_backend(
    plan: RunPlan, device: torch.device, layout: ParallelLayout | None = None
) -> Backend:
    """The backend of ``plan`` (its name, precision and float8 linear layers) on
    ``device``, on ``layout`` (default: the run's, ``plan.layout``)."""
    return build_backend(
        plan.backend,
        plan.precision,
        device,
        plan.unit.reshard_after_forward,
        layout or plan.layout,
        plan.float8,
    )


@dataclass(frozen=True)
class RankStages:
    """What pp rank ``pp_rank`` of ``pp`` holds of the model: its stages (indices of
    ``n_stages``), cut from a fresh meta skeleton of the whole model by the family's
    ``PipelineLayout``: the one home of the stage cut (the trainer builds these
    parts, the planner plans them)."""

    skeleton: nn.Module
    layout: PipelineLayout
    ranges: tuple[range, ...]  # the blocks of every stage, in stage order
    ids: tuple[int, ...]  # this rank's stages

    @property
    def n_stages(self) -> int:
        return len(self.ranges)

    def roles(self) -> list[StageRole]:
        return [StageRole(i, self.n_stages) for i in self.ids]

    def parts(self) -> list[nn.Module]:
        """This rank's stages, each the skeleton with the other stages' modules left
        out (on meta, unbuilt)."""
        return [
            cut_stage(
                self.skeleton, self.layout, self.ranges[r.index], r.first, r.last, r
            )
            for r in self.roles()
        ]

    def holder(self, stages: list[nn.Module]) -> nn.Module:
        """The module holding the rank's parameters under their names (its stages,
        once built): the stage itself, or a part with every stage's modules."""
        if len(stages) == 1:
            return stages[0]
        blocks = [b for i in self.ids for b in self.ranges[i]]
        first, last = self.ids[0] == 0, self.ids[-1] == self.n_stages - 1
        return cut_stage(self.skeleton, self.layout, blocks, first, last)


def rank_stages(plan: RunPlan, pp: int, pp_rank: int) -> RankStages:
    """The stage cut of the plan's model for pp rank ``pp_rank`` of ``pp`` (its
    schedule's stages per rank, its split)."""
    spec, config, pipe = plan.spec, plan.model_config, plan.pipeline
    layout = spec.pipeline(config)
    per_rank = SCHEDULES[pipe.schedule].stages_per_rank
    with torch.device("meta"):
        skeleton = spec.build(config, plan.seed)
    n_blocks = len(skeleton.get_submodule(layout.blocks))
    ranges = split_blocks(n_blocks, pp * per_rank, list(pipe.split) or None)
    ids = local_stages(pp_rank, pp, per_rank)
    return RankStages(skeleton, layout, tuple(ranges), tuple(ids))


def build_stages(plan: RunPlan, backend: Backend, cut: RankStages) -> list[nn.Module]:
    """The stages of ``cut``, each built from its part under the wrap context as a
    model is (its blocks annotated, tensor-parallelised, checkpointed, compiled and
    sharded over the stage's data-parallel ranks, its root last), then
    materialised shard by shard from the family's per-parameter init."""
    return [
        build_model(plan, backend, "meta", part, cut.layout) for part in cut.parts()
    ]


def build_pipeline(plan: RunPlan, backend: Backend) -> Pipeline:
    """This rank's pipeline stages (the layout's ``pp`` > 1): the family's
    model built whole on the meta device (nothing allocated), cut by its
    ``PipelineLayout`` (:func:`rank_stages`), each stage built by
    :func:`build_stages`, and the schedule."""
    pipe, pp_mesh = plan.pipeline, backend.parallel.pp
    cut = rank_stages(plan, backend.layout.pp, pp_mesh.get_local_rank())
    stages = build_stages(plan, backend, cut)
    # packing by documents: each micro-batch's summed loss, weighed per counted
    # target (src/trainer/pipelined.py), as micro-batches count unequally
    loss = (
        functools.partial(lm_loss, reduction="sum") if plan.batch.documents else lm_loss
    )
    return Pipeline(
        stages,
        pipe.schedule,
        pipe.microbatches,
        pp_mesh,
        backend.device,
        loss,
        cut.holder(stages),
    )


def _annotated(part: nn.Module, layout: PipelineLayout) -> nn.Module:
    """A stage's blocks given to ``wrap()`` (inside the wrap context), as the
    family's constructor does when it builds them."""
    if not layout.annotated:
        return part
    blocks = part.get_submodule(layout.blocks)
    for key, block in list(blocks.items()):
        blocks[key] = wrap(block)
    return part


def build_model(
    plan: RunPlan,
    backend: Backend,
    init_device: str | None = None,
    stage: nn.Module | None = None,
    layout: PipelineLayout | None = None,
) -> nn.Module:
    """The model of the plan's family built inside the wrap context: each unit is
    sharded as it is constructed, and a meta-device model is materialised shard by
    shard from the family's per-parameter init. ``stage``: a pipeline stage's part
    of the model, on meta (:func:`build_pipeline`), built in its place."""
    init_device = init_device or plan.init_device
    spec, config, seed = plan.spec, plan.model_config, plan.seed
    pretrained = plan.pretrained if backend.allocates else None
    if pretrained and backend.meta_init:
        init_device = "meta"  # never whole: each rank fills only its own shards
    w = plan.wrap
    policy = build_policy(
        w.policies,
        min_num_params=w.min_params,
        exclude_wrap_modules=w.exclude_wrap_modules,
        force_leaf_modules=w.force_leaf_modules,
        block_cls=spec.block_classes(config) or None,
    )
    init_fn = None
    if init_device == "meta" and spec.init_tensor is not None:

        def init_fn(name: str, t: torch.Tensor) -> torch.Tensor:
            if pretrained and isinstance(t, nn.Parameter):
                return torch.empty(t.shape)  # loaded below; buffers are computed
            return spec.init_tensor(name, t.shape, config, seed)

    # Float8, checkpointing and compile apply to the model's blocks, whatever units
    # the policy chooses (a block unit, or a block inside a larger unit).
    transform = UnitTransform(
        plan.checkpointing.mode,
        plan.checkpointing.every,
        plan.unit.compile,
        targets=spec.block_classes(config),
        float8=plan.float8,
    )
    with _ties_as_one_line(backend.rank):
        model = build_sharded_model(
            (lambda: _annotated(stage, layout))
            if stage is not None
            else (lambda: spec.build(config, seed)),
            backend,
            policy,
            init_device,
            init_fn,
            transform=transform,
            tp_plan=tensor_parallel_plan(plan, backend.layout),
            parallelize=spec.parallelize,
            lora=plan.lora,
            frozen=functools.partial(_matches, plan.freeze) if plan.freeze else None,
        )
    if plan.lora is not None:
        check_adapted(model, plan.lora)
    check_freeze(model, plan.freeze)
    set_prefetch(model, plan.unit.forward_prefetch, plan.unit.backward_prefetch)
    if pretrained:
        load_hf_weights(
            model,
            os.path.expanduser(pretrained),
            spec.hf.to_hf_name,
            spec.hf.converting_model(config),
            spec.hf.transposed,
            part=stage is not None,
        )
    return model


def check_adapted(model: nn.Module, lora: LoraSpec) -> None:
    """ConfigError naming ``model.lora.targets`` when no linear layer got an adapter,
    or one it matches did not: a layer the wrap policy made a unit of its own is
    sharded as it is built, before its parent's step could adapt it."""
    if not any(is_adapter(n) for n, _ in model.named_parameters()):
        names = sorted(
            {n.split(".")[-2] for n, _ in model.named_parameters() if "." in n}
        )
        raise ConfigError(
            "model.lora.targets",
            f"{list(lora.targets)} matches no linear layer of the model "
            f"(its modules with weights: {', '.join(names[:12])})",
        )
    adapted = {p for p, _ in adapted_layers(model)}
    for name, m in model.named_modules():
        path = canonical_name(name, model)
        if (
            isinstance(m, nn.Linear)
            and path not in adapted
            and not any(path.startswith(f"{a}.") for a in adapted)
            and targeted(path, lora.targets)
        ):
            raise ConfigError(
                "model.lora.targets",
                f"{path} is a sharding unit of its own (sharding.policy / "
                "sharding.min_params): its adapter cannot be added as it is built; "
                "use sharding.policy=block or a larger sharding.min_params",
            )


def _matches(patterns: tuple[str, ...], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_freeze(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """ConfigError naming ``trainer.freeze`` for a pattern that matches no parameter
    of the model (by canonical name, fnmatch)."""
    if not patterns:
        return
    names = [canonical_name(n, model) for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(_matches((pattern,), n) for n in names):
            raise ConfigError(
                "trainer.freeze",
                f"{pattern!r} matches no parameter of the model (names such as "
                f"{', '.join(names[:3])}; fnmatch patterns, e.g. 'layers.0.*')",
            )


@contextlib.contextmanager
def _ties_as_one_line(rank: int) -> Iterator[None]:
    """The sharding layer warns (TiedParametersWarning) when auto_wrap keeps modules
    that share parameters in one unit; for a run that is a known, intended fact (a
    tied embedding and head), reported as one plain line on rank 0. Other warnings
    raised inside pass through as usual."""
    with warnings.catch_warnings(record=True) as caught:
        yield
    users: dict[str, list[str]] = {}
    for w in caught:
        if issubclass(w.category, TiedParametersWarning):
            for path, names in w.message.blocked_by_ties.items():
                for name in names:
                    users.setdefault(name, []).append(path or "<root>")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if users and rank == 0:
        ties = "; ".join(f"{n} ({', '.join(sorted(u))})" for n, u in users.items())
        log.info("tied parameters stay whole in one unit: %s", ties)
