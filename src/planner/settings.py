"""What the planner reads of a config: the keys it reads and searches, its one reader
of a key (:func:`setting`), the pipeline stages it plans (:func:`pipeline_stages`), the
budget, margin and device an estimate is for."""

from __future__ import annotations

import copy
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from src.planner.constants import ACCELERATORS_GIB, budget_bytes
from src.resolved import LAYOUT_KEYS, RunPlan
from src.sharding import ParallelLayout

AC_KEY = "sharding.activation_checkpointing"
AC_EVERY_KEY = "sharding.activation_checkpointing_every"
PREFETCH_KEY = "sharding.backward_prefetch"
PRECISION_KEY = "precision.name"
PP_KEY = LAYOUT_KEYS["pp"]
CP_KEY = LAYOUT_KEYS["cp"]
EP_KEY = LAYOUT_KEYS["ep"]
PP_MICRO_KEY = "sharding.pp_microbatches"
MARGIN_KEY = "trainer.mem_margin"


_ABSENT = object()


def setting(cfg: DictConfig, key: str) -> Any:
    """``cfg``'s value of ``key``; the composed config has every key (its value's one
    home is the group's YAML), so the planner holds no defaults of its own."""
    value = OmegaConf.select(cfg, key, default=_ABSENT)
    if value is _ABSENT:
        raise KeyError(f"the planner needs {key}, which this config has not")
    return value


def pipeline_stages(cfg: DictConfig) -> int:
    """The pipeline stages ``cfg`` plans: a key the fit search changes, so read from
    the config being planned (the run's other degrees: ``resolved.layout.stage``)."""
    return int(setting(cfg, PP_KEY))


def tp_layout(cfg: DictConfig, resolved: RunPlan) -> ParallelLayout:
    """The run's tensor-parallel degree with the pipeline stages ``cfg`` plans: what
    a tensor-parallel plan reads of a layout (``resolved.tensor_parallel_plan``)."""
    tp, pp = resolved.layout.tp, pipeline_stages(cfg)
    return ParallelLayout(tp * pp, pp=pp, tp=tp)


def with_values(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with ``overrides`` (config keys to values) set."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key, value in overrides.items():
            OmegaConf.update(out, key, value, force_add=True)
    return out


def mem_margin(cfg: DictConfig) -> float:
    """The safety margin of a fit (``trainer.mem_margin``)."""
    return float(setting(cfg, MARGIN_KEY))


def run_budget_bytes(cfg: DictConfig) -> int | None:
    """The per-rank budget a run is judged against: ``trainer.mem_budget_gib``, else
    ``sweep.mem_cap_gib``; None when neither is set."""
    budget = budget_bytes(OmegaConf.select(cfg, "trainer.mem_budget_gib"))
    if budget is None:
        cap = OmegaConf.select(cfg, "sweep.mem_cap_gib", default=None)
        budget = budget_bytes(cap, "sweep.mem_cap_gib")
    return budget


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
