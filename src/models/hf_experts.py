"""Expert parallelism for transformers' MoE models, following the config's
``base_model_ep_plan`` (transformers' own record of which module holds the stacked
experts: the one it plans as ``ep_dispatch_experts``).

:func:`split_ready` gives each such module the class :func:`ep_class` makes for its
own: a subclass of both the transformers class (so its ``_init_weights``, names and
checkpoint layout are the model's) and :class:`ExpertModule` (so the backend splits it
over the ep ranks, src/sharding/expert_parallel.py). While no ep mesh is set it runs
transformers' forward unchanged; once split, each rank sends its tokens' assignments
to the ranks holding their experts with the native family's :func:`dispatch`, runs
its local experts the way transformers does (gate-up, activation, down, times the
router's weight) and combines. The router is the model's own, so routing is exactly
transformers'.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.models.spec import ExpertShape
from src.sharding.expert_parallel import ExpertModule, dispatch, local_weight

#: The ``base_model_ep_plan`` value naming the module that dispatches to its experts.
DISPATCH = "ep_dispatch_experts"
#: The stacked expert weights this adapter computes with (transformers' names).
WEIGHTS = ("gate_up_proj", "down_proj")


def expert_patterns(hf_config) -> list[str]:
    """The module patterns the config's ``base_model_ep_plan`` dispatches to (empty:
    the architecture declares no expert parallelism)."""
    plan = getattr(hf_config.get_text_config(), "base_model_ep_plan", None) or {}
    return [k for k, v in plan.items() if v == DISPATCH]


def _ep_forward(self, hidden_states, top_k_index, top_k_weights):
    if self.ep_mesh is None:
        return super(type(self), self).forward(
            hidden_states, top_k_index, top_k_weights
        )
    k = top_k_index.size(1)
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept
    token = order // k
    counts = torch.bincount(flat, minlength=self.num_experts)
    sent = dispatch(hidden_states[token], counts, self.ep_mesh, self.tp_mesh)
    gate_up, down = (local_weight(getattr(self, w), self) for w in WEIGHTS)
    outs = []
    for e, rows in enumerate(sent.rows.split(sent.counts.tolist())):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(self.act_fn(gate) * up, down[e]))
    back = sent.combine(torch.cat(outs))
    back = back * top_k_weights.reshape(-1)[order, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token, back.to(out.dtype))


_CLASSES: dict[type, type] = {}


def ep_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The expert-parallel subclass of transformers' experts class ``cls`` (one per
    class, so instances pickle and compare alike)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            cls.__name__, (cls, ExpertModule), {"forward": _ep_forward}
        )
    return _CLASSES[cls]


def _planned(base_model: nn.Module, hf_config: Any) -> list[nn.Module]:
    """The modules of ``base_model`` the config's plan dispatches to."""
    patterns = expert_patterns(hf_config)
    return [
        m
        for name, m in base_model.named_modules()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def _unlike(m: nn.Module) -> str | None:
    """Why ``m`` is not the stacked experts this adapter computes (None: it is):
    exactly ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` and an ``act_fn``
    (GPT-OSS's biases and interleaved gate-up, say, are not)."""
    names = sorted(n for n, _ in m.named_parameters(recurse=False))
    if names != sorted(WEIGHTS) or not hasattr(m, "act_fn"):
        return f"parameters {names}"
    (e, i2, h), (e2, h2, i) = m.gate_up_proj.shape, m.down_proj.shape
    if (e, i2, h) != (e2, 2 * i, h2):
        return f"gate_up_proj {tuple(m.gate_up_proj.shape)}"
    return None


def check(hf_config: Any, skeleton: Callable[[], nn.Module]) -> None:
    """ValueError (one line) when the model cannot be split: its config has no
    ``base_model_ep_plan``, or the experts it names in ``skeleton()`` (the base
    model, on meta) are not ones this adapter computes exactly as transformers does."""
    if not expert_patterns(hf_config):
        raise ValueError(
            f"{hf_config.model_type!r} declares no base_model_ep_plan "
            "(transformers' expert-parallel plan); use 1"
        )
    found = _planned(skeleton(), hf_config)
    if not found:
        raise ValueError(
            f"{hf_config.model_type!r}: no module matches its base_model_ep_plan; use 1"
        )
    for m in found:
        why = _unlike(m)
        if why is not None:
            raise ValueError(
                f"{hf_config.model_type!r}: its experts ({type(m).__name__}, {why}) "
                "are not split by this trainer yet; use 1"
            )


def split_ready(base_model: nn.Module, hf_config: Any) -> None:
    """Give each experts module of ``base_model`` that the plan names, and that this
    adapter computes exactly, the expert-parallel class (:func:`ep_class`)."""
    for m in _planned(base_model, hf_config):
        if _unlike(m) is None and not isinstance(m, ExpertModule):
            m.__class__ = ep_class(type(m))


def expert_shape(hf_config: Any, base_model: nn.Module) -> ExpertShape:
    """The experts the plan dispatches to in ``base_model`` (on meta), for the
    planner: per row, autograd keeps the input, the gate-up output, the activation and
    its product with up (``H + 4 I``); transformers' routers have no capacity."""
    found = [m for m in _planned(base_model, hf_config) if _unlike(m) is None]
    experts, gate_up, hidden = found[0].gate_up_proj.shape
    return ExpertShape(
        layers=len(found),
        experts=experts,
        top_k=int(hf_config.get_text_config().num_experts_per_tok),
        dim=hidden,
        saved_per_row=hidden + 2 * gate_up,
        capacity=None,
    )
