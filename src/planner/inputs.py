"""What an estimate is made from: a run's model built on the meta device and its wrap
plan, its :class:`~src.planner.estimate.RunShape`, its process baseline, and why its
peak may grow past any estimate."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from src.errors import ConfigError
from src.observe.loggers import LOGGERS, logger_kind
from src.planner.constants import process_bytes
from src.planner.estimate import RunShape
from src.planner.settings import (
    AC_EVERY_KEY,
    AC_KEY,
    PREFETCH_KEY,
    device_type,
    setting,
    with_values,
)
from src.resolved import RunPlan, float8_linears
from src.sharding import (
    ParallelLayout,
    WrapPlan,
    build_backend,
    get_precision,
    wrap_plan,
)
from src.sharding.transforms import SplitBlockError


def build_meta_model(cfg: DictConfig, resolved: RunPlan) -> torch.nn.Module:
    """The model of ``cfg`` (its family and config: ``resolved``'s) on the meta device,
    units recorded by the ``plan`` backend (nothing is allocated)."""
    from src.build import build_model

    cfg = with_ac_chosen(cfg)
    with plan_backend(cfg, resolved) as backend:
        return build_model(cfg, backend, resolved, init_device="meta")


def with_ac_chosen(cfg: DictConfig) -> DictConfig:
    if setting(cfg, AC_KEY) == "auto":  # not chosen yet: the units are alike
        return with_values(cfg, {AC_KEY: "none"})
    return cfg


@contextlib.contextmanager
def plan_backend(cfg: DictConfig, resolved: RunPlan) -> Iterator[Any]:
    """The ``plan`` backend the meta builds record units with; selective checkpointing
    of a block the policy splits is a config error here, before any rank starts."""
    tp = resolved.layout.tp  # the model is tensor-parallelised on meta for real
    # and its experts recorded as split over the ep ranks (each gathers E / ep)
    ep = resolved.layout.ep
    layout = ParallelLayout(tp * ep, tp=tp, ep=ep)
    backend = build_backend(
        "plan", cfg.precision.name, "cpu", layout=layout, float8=float8_linears(cfg)
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


def plan_of(resolved: RunPlan, model: torch.nn.Module, world: int) -> WrapPlan:
    """The wrap plan of ``model`` (built by :func:`build_meta_model`) on ``world``
    ranks holding it (a stage's, under pipeline parallelism), with the run's HSDP
    replicas and tensor-parallel degree."""
    return wrap_plan(model, resolved.layout.stage(world))


#: FSDP2's own prefetch depth (``sharding.backward_prefetch: null``): one unit ahead.
FSDP2_PREFETCH = 1


def _prefetch(cfg: DictConfig) -> int:
    """Units gathered ahead in backward (0: off; null: FSDP2's own depth)."""
    depth = setting(cfg, PREFETCH_KEY)
    return FSDP2_PREFETCH if depth is None else int(depth)


def run_shape(cfg: DictConfig, resolved: RunPlan, world: int) -> RunShape:
    """The :class:`RunShape` of ``cfg`` on ``world`` ranks (``auto`` values must be
    resolved first)."""
    t, s = cfg.trainer, cfg.sharding
    prec = get_precision(cfg.precision.name)
    f8 = float8_linears(cfg)
    accum = int(t.grad_accum)
    # the busiest rank's share; the ranks of a tensor-parallel group share rows
    per_rank = math.ceil(
        t.batch_size
        / accum
        / max(1, world // (resolved.layout.tp * resolved.layout.cp))
    )
    return RunShape(
        backend=s.backend,
        world=world,
        micro_batch=max(1, per_rank),
        # each rank's tokens of a sequence (context parallelism: 1/C of them)
        seq_len=int(resolved.spec.seq_len(resolved.model_config)) // resolved.layout.cp,
        grad_accum=accum,
        grad_sync=str(setting(cfg, "trainer.grad_sync")),
        param_bytes=prec.param_dtype.itemsize,
        float8_all_gather=bool(f8 and f8.all_gather),
        reduce_bytes=prec.reduce_dtype.itemsize,
        reshard_after_forward=s.reshard_after_forward,
        checkpointing=str(setting(cfg, AC_KEY)),
        ac_every=int(setting(cfg, AC_EVERY_KEY)),
        prefetch=_prefetch(cfg),
        device=device_type(cfg),
    )


def family_process_bytes(cfg: DictConfig, resolved: RunPlan, device: str) -> int:
    """The process baseline of a run of ``cfg``: its model family's imports, its
    logger's (rank 0 holds the sinks; the peak is the max over ranks),
    torch.compile's with ``sharding.compile=true`` and torchao's float8 with
    ``precision=float8``."""
    option = LOGGERS.get(logger_kind(cfg))
    imports = resolved.spec.imports + (option.imports if option else ())
    if OmegaConf.select(cfg, "sharding.compile", default=False):
        imports += ("torch.compile",)
    if float8_linears(cfg) is not None:
        imports += ("torchao.float8",)
    return process_bytes(device, imports)


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
