"""What a run says of its model as it starts: the wrap plan, the float8 layers and
the trainable parameters' count (src/trainer/loop.py's header line)."""

from __future__ import annotations

import logging

import torch.nn as nn

from src.observe.loggers import Logger
from src.sharding import Backend, WrapPlan
from src.sharding.float8 import Float8, is_float8_linear

log = logging.getLogger(__name__)


def log_wrap_plan(plan: WrapPlan, logger: Logger, rank: int) -> None:
    if plan.units:  # ddp and none have no units
        log.info(plan.tree())
    logger.log_table("wrap_plan", plan.rows())


def log_float8(model: nn.Module, backend: Backend, f8: Float8) -> None:
    """Once per run: how many linear layers compute in float8, and on a CPU that
    they run at CPU speed (there for correctness)."""
    n = sum(is_float8_linear(m) for m in model.modules())
    where = (
        "; on CPU the float8 matmuls run at CPU speed (for correctness, not speed)"
        if backend.device.type == "cpu"
        else ""
    )
    log.info(
        "float8: %d linear layers (%s, all-gather in float8 %s)%s",
        n,
        f8.recipe,
        "on" if f8.all_gather else "off",
        where,
    )


def millions(n: int) -> str:
    """``0.84M``; below 100k ``18.7K``; below 1,000 the count (the run header's
    trainable parameters)."""
    if n >= 100_000:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K" if n >= 1_000 else str(n)
