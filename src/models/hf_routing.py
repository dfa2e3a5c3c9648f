"""Routing metrics of transformers' MoE models: the native family's per-layer MoE
metrics (src/models/moe.py: tokens per expert, balance loss, router entropy) from the
routers transformers already runs.

:func:`count_routing` puts a forward hook on each router (the ``gate`` beside each
experts module the config's ``base_model_ep_plan`` names: transformers' top-k routers
return the router logits, the gates and the chosen experts). In training it adds the
forward's counts to the router: the assignments per expert, the summed routing
probabilities per expert, the summed entropy of those probabilities, the rows.
:func:`after_step` sums them over all ranks once per optimizer step, so the metrics do
not depend on the layout. A layer's ``aux_loss`` is the Switch balance loss
transformers' ``load_balancing_loss_func`` computes for that layer (``E sum_e f_e
P_e``, ``f_e`` the assignments to ``e`` per row, ``P_e`` its mean probability; top_k
when balanced) over the step's rows on all ranks; ``moe/aux_loss`` is their sum times
the config's ``router_aux_loss_coef``.

In the gradient (:func:`balance_loss`, added by the model's forward as transformers
adds it with ``output_router_logits``): transformers' ``load_balancing_loss_func`` over
all the forward's routers at once, ``E sum_e f_e P_e`` with ``f_e`` the assignments
to ``e`` over the rows of every layer and ``P_e`` the mean probability, times
``router_aux_loss_coef``. The assignments are counted over all ranks (one all-reduce
of E + 1 numbers a forward), the probabilities are this rank's mean: averaged over
the ranks as every gradient is, that is the loss of the whole batch on one rank, so
the gradient does not depend on the layout (a rank's own counts did: issue 57). The
logged ``loss`` stays the language model's. A pipeline stage adds none (its forward
returns no loss). transformers' routers keep every
assignment (no capacity): ``dropped`` is 0. A pipeline stage logs none (each holds
some of the routers; the native family has no pipeline).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from src.models.hf_experts import expert_patterns
from src.models.moe import (
    layer_metrics,
    numbered,
    overall_metrics,
    recomputing,
    summed_over_ranks,
)

_STATS = "_routing_stats"  # the counts since the last after_step (on each router)
_COEF = "_aux_coef"  # the config's router_aux_loss_coef (on each router)
_SHAPE = "_routing_shape"  # (routers in the whole model, experts) (on each router)
_AUX = "_aux_parts"  # this forward's (assignments, probabilities with grad, rows)


def routers(base_model: nn.Module, hf_config: Any) -> list[nn.Module]:
    """The router (``gate``) beside each experts module the config's plan names."""
    patterns = expert_patterns(hf_config)
    found = []
    for name, _ in base_model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            parent = base_model.get_submodule(name.rpartition(".")[0])
            gate = getattr(parent, "gate", None)
            if isinstance(gate, nn.Module):
                found.append(gate)
    return found


def count_routing(base_model: nn.Module, hf_config: Any, experts: int) -> None:
    """Hook each router of ``base_model`` (of ``experts`` experts) to count its
    routing in training."""
    coef = float(getattr(hf_config.get_text_config(), "router_aux_loss_coef", 0.0))
    found = routers(base_model, hf_config)
    for router in found:
        router.__dict__.update({_COEF: coef, _STATS: None})
        router.__dict__[_SHAPE] = (len(found), experts)
        router.register_forward_hook(_count)


def _count(router: nn.Module, args: tuple, output: tuple) -> None:
    if not router.training or recomputing():
        return
    logits, _, chosen = output
    in_loss = bool(router.__dict__[_COEF]) and torch.is_grad_enabled()
    with torch.set_grad_enabled(in_loss):  # the probabilities, for both uses
        probs = logits.float().softmax(-1)
    counts = torch.zeros(probs.size(-1), dtype=torch.float64, device=probs.device)
    ones = torch.ones(chosen.numel(), dtype=counts.dtype, device=counts.device)
    counts.scatter_add_(0, chosen.reshape(-1), ones)
    if in_loss:
        router.__dict__[_AUX] = (counts.float(), probs.sum(0), float(probs.size(0)))
    with torch.no_grad():
        _stats(router, probs.detach(), counts)


def _stats(router: nn.Module, probs: torch.Tensor, counts: torch.Tensor) -> None:
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum()
    rows = torch.tensor(float(probs.size(0)), dtype=torch.float64, device=probs.device)
    row = torch.cat([counts, probs.sum(0).double(), entropy.double()[None], rows[None]])
    kept = router.__dict__[_STATS]
    router.__dict__[_STATS] = row if kept is None else kept + row


def after_step(model: nn.Module, replicas: int = 1) -> dict[str, float]:
    """The step's routing metrics, as the native family's ``after_step`` names them
    (``moe/layer{i}/...`` and over the layers), summed over all ranks (``replicas``:
    ranks that counted the same tokens); nothing when no router counted, and
    nothing on a pipeline stage (it holds some of the routers: every stage does,
    so no rank all-reduces)."""
    found = [(i, m) for i, m in numbered(model, nn.Module) if _SHAPE in m.__dict__]
    if not found or len(found) < found[0][1].__dict__[_SHAPE][0]:
        return {}
    E = found[0][1].__dict__[_SHAPE][1]
    empty = torch.zeros(2 * E + 2, dtype=torch.float64)
    kept = [m.__dict__[_STATS] for _, m in found]
    if all(k is None for k in kept):
        return {}  # the same on every rank: each ran the same forwards
    stats = summed_over_ranks([empty if k is None else k for k in kept], replicas)
    rows: dict[str, float] = {}
    for (layer, m), s in zip(found, stats, strict=True):
        m.__dict__[_STATS] = None
        counts, probs, (entropy, n) = s[:E], s[E : 2 * E], s[2 * E :]
        aux = E * ((counts / n) * (probs / n)).sum()
        rows.update(layer_metrics(layer, counts, 0, aux.item(), (entropy / n).item()))
    return overall_metrics(rows, found[0][1].__dict__[_COEF])


def drop_parts(base_model: nn.Module) -> None:
    """Forget the forward's parts of the balance loss (nothing will add it)."""
    for m in base_model.modules():
        m.__dict__.pop(_AUX, None)


def balance_loss(base_model: nn.Module) -> torch.Tensor | None:
    """``router_aux_loss_coef`` x transformers' balance loss of the forward just run
    (see the module docstring), with gradients through this rank's probabilities;
    None when no router kept its parts (evaluation, a zero coefficient)."""
    found = [m for m in base_model.modules() if m.__dict__.get(_AUX) is not None]
    if not found:
        return None
    parts = [m.__dict__.pop(_AUX) for m in found]
    layers, rows = len(parts), parts[0][2]
    assigned = torch.stack([a for a, _, _ in parts]).sum(0)
    counted = torch.cat([assigned, assigned.new_tensor([rows])])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counted)  # replicas count alike: f is a ratio of the sums
    share = counted[:-1] / (layers * counted[-1])
    prob = torch.stack([p for _, p, _ in parts]).sum(0) / (layers * rows)
    E = share.numel()
    return found[0].__dict__[_COEF] * E * (share * prob).sum()
