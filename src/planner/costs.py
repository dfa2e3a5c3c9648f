"""The relative cost of a change of settings, for the fit search's "cheapest change":
checkpointing, gradient accumulation, smaller units, more ranks, a pipeline's bubble
and a lower precision."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from src.planner.settings import (
    AC,
    ACCUM,
    CP,
    DEVICES,
    EP,
    MICRO,
    MIN_PARAMS,
    PP,
    PRECISION,
    SYNC,
)
from src.sharding import get_precision
from src.sharding.pipeline import bubble_fraction

#: Relative cost of a change (per token, or in machines), for "the cheapest change":
#: recomputing a checkpointed block's forward is ~1/3 more compute; selective
#: recomputes only elementwise ops; a smaller micro-batch runs smaller matmuls; every
#: micro-batch's reduce-scatter adds communication; smaller units more collectives;
#: context parallelism gathers K and V in every layer and masks a T/C x T score
#: matrix (and only helps once a micro-batch is one sequence): proposed after
#: checkpointing; expert parallelism sends every routed token to another rank and
#: back (two all-to-alls per MoE layer); more ranks are more machines, the last resort.
COST = {
    "ac": {"none": 1.0, "selective": 1.1, "full": 4 / 3},
    "grad_accum_doubling": 1.03,
    "sync_every": 1.03,
    "min_params_decade_down": 1.01,
    "other_change": 1.001,
    "cp_doubling": 1.4,
    "ep_doubling": 1.1,
    "ranks_doubling": 1.5,
}


@dataclass(frozen=True)
class Checkpointing:
    """A value of the checkpointing search: the mode, every k-th block (``full``) and
    how many of the model's blocks that recomputes."""

    mode: str
    every: int
    recomputed: int  # blocks checkpointed
    blocks: int  # blocks in the model

    def fields(self) -> dict[str, Any]:
        """As the run plan's fields (``every``: of ``full`` only)."""
        every = {f"{AC}.every": self.every} if self.mode == "full" else {}
        return {f"{AC}.mode": self.mode, **every}

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


def change_cost(
    currents: dict[str, Any], ovr: dict[str, Any], device: tuple[str, str] = ("cpu", "")
) -> float:
    """Relative cost of changing the ``currents`` values to ``ovr`` (see :data:`COST`
    and :func:`precision_cost`; ``device``: the estimate's device and accelerator):
    the product of :func:`cost_factors`."""
    return math.prod(f for _, f in cost_factors(currents, ovr, device))


def cost_factors(
    currents: dict[str, Any], ovr: dict[str, Any], device: tuple[str, str] = ("cpu", "")
) -> list[tuple[str, float]]:
    """Each change's factor of :func:`change_cost`, named as the console shows it."""
    out: list[tuple[str, float]] = []
    for key, value in ovr.items():
        if key not in currents or key in (PP, MICRO):
            continue  # pipeline keys: pipeline_cost (the search); the batch: none
        old = currents[key]
        if key == AC:
            out.append((f"checkpointing {value}", ac_cost(value) / ac_cost(old)))
        elif key == ACCUM:
            doublings = max(0.0, math.log2(value / old))
            factor = COST["grad_accum_doubling"] ** doublings * COST["other_change"]
            out.append((f"grad_accum {old} -> {value}", factor))
        elif key == SYNC:
            every = COST["sync_every"] if value == "every" else COST["other_change"]
            out.append((f"grad_sync {value}", every))
        elif key == MIN_PARAMS:
            lower = math.log10(float(old)) - math.log10(value) if old > 0 else 0
            factor = COST["min_params_decade_down"] ** max(0.0, lower)
            out.append((f"min_params {value:g}", factor * COST["other_change"]))
        elif key == CP:
            doubling = COST["cp_doubling"]
            factor = doubling ** math.log2(value / old)
            out.append(
                (
                    f"context_parallel {old} -> {value} (x{doubling:g} a doubling)",
                    factor,
                )
            )
        elif key == EP:
            doubling = COST["ep_doubling"]
            factor = doubling ** abs(math.log2(value / old))
            out.append(
                (f"expert_parallel {old} -> {value} (x{doubling:g} a doubling)", factor)
            )
        elif key == DEVICES:
            factor = COST["ranks_doubling"] ** math.log2(value / old)
            doubling = COST["ranks_doubling"]
            out.append((f"devices {old} -> {value} (x{doubling:g} a doubling)", factor))
        elif key == PRECISION:
            factor = precision_cost(value, *device) / precision_cost(old, *device)
            out.append((f"precision {value}", factor))
    return out


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
