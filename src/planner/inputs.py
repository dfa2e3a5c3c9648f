"""What an estimate is made from: a run's model built on the meta device and its wrap
plan, its :class:`~src.planner.estimate.RunShape`, its process baseline, and why its
peak may grow past any estimate."""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from src.config.run_plan import OVERRIDES, RunPlan, varied
from src.errors import ConfigError
from src.observe.loggers import LOGGERS
from src.planner.constants import process_bytes
from src.planner.estimate import RunShape
from src.planner.optimizer_step import optimizer_states, optimizer_step_copies
from src.planner.settings import device_type
from src.sharding import (
    ParallelLayout,
    WrapPlan,
    build_backend,
    get_precision,
    model_units,
)
from src.sharding.transforms import SplitBlockError


def build_meta_model(plan: RunPlan) -> torch.nn.Module:
    """The model of ``plan`` on the meta device, units recorded by the ``plan``
    backend (nothing is allocated)."""
    from src.build import build_model

    plan = with_ac_chosen(plan)
    with plan_backend(plan) as backend:
        return build_model(plan, backend, init_device="meta")


def with_ac_chosen(plan: RunPlan) -> RunPlan:
    if plan.checkpointing.mode == "auto":  # not chosen yet: the units are alike
        return varied(plan, {"checkpointing.mode": "none"})
    return plan


@contextlib.contextmanager
def plan_backend(plan: RunPlan) -> Iterator[Any]:
    """The ``plan`` backend the meta builds record units with; selective checkpointing
    of a block the policy splits is a config error here, before any rank starts."""
    tp = plan.layout.tp  # the model is tensor-parallelised on meta for real
    # and its experts recorded as split over the ep ranks (each gathers E / ep)
    ep = plan.layout.ep
    layout = ParallelLayout(tp * ep, tp=tp, ep=ep)
    backend = build_backend(
        "plan", plan.precision, "cpu", layout=layout, float8=plan.float8
    )
    ac, policy = OVERRIDES["checkpointing.mode"], OVERRIDES["wrap.policies"]
    try:
        yield backend
    except SplitBlockError as err:
        policies = ",".join(plan.wrap.policies)
        if ep > 1:  # EP's experts are a unit of their own whatever the policy
            raise ConfigError(
                ac,
                f"selective needs each {err.block} to be one sharding unit, and "
                f"sharding.expert_parallel={ep} makes its experts a unit of their "
                f"own (under any {policy}): set {ac}=full (it runs with expert "
                "parallelism), or sharding.expert_parallel=1 to keep selective",
            ) from None
        raise ConfigError(
            ac,
            f"selective needs each {err.block} to be one sharding unit, and "
            f"{policy}={policies} splits it: set "
            f"{policy}=block or a larger {OVERRIDES['wrap.min_params']}, or "
            f"{ac}=full",
        ) from None
    finally:
        backend.close()  # tensor parallelism's fake process group, if any


def plan_of(resolved: RunPlan, model: torch.nn.Module, world: int) -> WrapPlan:
    """The wrap plan of ``model`` (built by :func:`build_meta_model`) on ``world``
    ranks holding it (a stage's, under pipeline parallelism), with the run's HSDP
    replicas and tensor-parallel degree. The model's walk is kept with it: a search
    lays one meta model out on many rank counts."""
    if model not in _UNITS:
        _UNITS[model] = model_units(model)
    return _UNITS[model].on(resolved.layout.stage(world))


_UNITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: FSDP2's own prefetch depth (``sharding.backward_prefetch: null``): one unit ahead.
FSDP2_PREFETCH = 1


def _prefetch(plan: RunPlan) -> int:
    """Units gathered ahead in backward (0: off; null: FSDP2's own depth)."""
    depth = plan.unit.backward_prefetch
    return FSDP2_PREFETCH if depth is None else int(depth)


def run_shape(plan: RunPlan, world: int) -> RunShape:
    """The :class:`RunShape` of ``plan`` on ``world`` ranks (``auto`` values must be
    chosen first)."""
    b, prec, f8, layout = plan.batch, plan.precision, plan.float8, plan.layout
    accum = int(b.grad_accum)
    # the busiest rank's share; the ranks of a tensor-parallel group share rows
    per_rank = math.ceil(
        b.batch_size / accum / max(1, world // (layout.tp * layout.cp))
    )
    return RunShape(
        backend=plan.backend,
        world=world,
        micro_batch=max(1, per_rank),
        # each rank's tokens of a sequence (context parallelism: 1/C of them)
        seq_len=int(b.seq_len) // layout.cp,
        grad_accum=accum,
        grad_sync=str(b.grad_sync),
        param_bytes=prec.param_dtype.itemsize,
        float8_all_gather=bool(f8 and f8.all_gather),
        reduce_bytes=prec.reduce_dtype.itemsize,
        reshard_after_forward=plan.unit.reshard_after_forward,
        checkpointing=str(plan.checkpointing.mode),
        ac_every=int(plan.checkpointing.every),
        prefetch=_prefetch(plan),
        device=device_type(plan),
        optimizer_states=optimizer_states(plan),
        optimizer_step_copies=optimizer_step_copies(plan),
        optimizer=plan.optimizer,
    )


def family_process_bytes(plan: RunPlan, device: str) -> int:
    """The process baseline of a run of ``plan``: its model family's imports, its
    logger's (rank 0 holds the sinks; the peak is the max over ranks),
    torch.compile's with compile on, torchao's float8 with float8 linears and peft's
    with LoRA adapters; less
    where its ranks fork from the rank server (``budget.forked_ranks``)."""
    option = LOGGERS.get(plan.budget.logger)
    imports = plan.spec.imports + (option.imports if option else ())
    if plan.unit.compile:
        imports += ("torch.compile",)
    if plan.float8 is not None:
        imports += ("torchao.float8",)
    if plan.lora is not None:
        imports += ("peft",)
    return process_bytes(device, imports, plan.budget.forked_ranks)


def lower_bound_reason(resolved: RunPlan, device: str, precision: str) -> str:
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
