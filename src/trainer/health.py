"""Per-block health (``trainer.health_every``): each block's parameter and gradient
norm, logged as ``health/<block>/param_norm`` and ``health/<block>/grad_norm`` on the
steps it runs (metrics.jsonl; wandb's ``health`` section).

A block is the parameters under one numbered module (``layers.3``, ``h.3``,
``model.layers.3``); the rest are grouped by their top module (``tok_embeddings``,
``norm``, ``output``). The gradients are read after clipping's norm is taken and before
the optimizer step (unclipped: the block's share of the logged ``grad_norm``, whose
square is the sum of theirs). Every rank takes part: a sharded tensor's norm is one
collective on its mesh (src/sharding/backends.py ``tensors_norm``), two per block on
the steps it runs; with pipeline parallelism each stage norms its own blocks and rank
0 gathers them.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from src.sharding import canonical_name
from src.sharding.backends import tensors_norm

PREFIX = "health"


def block_of(name: str) -> str:
    """The block a parameter (by canonical name) belongs to: its path up to the first
    numbered module, else its top module."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def block_norms(model: nn.Module, gather: bool = False) -> dict[str, float]:
    """``health/<block>/param_norm`` and ``.../grad_norm`` of each block of ``model``
    (a collective on every rank); ``gather``: pipeline stages' blocks gathered to
    every rank (each stage holds its own)."""
    blocks: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        blocks.setdefault(block_of(canonical_name(name, model)), []).append(p)
    out = {}
    for block, params in blocks.items():
        grads = [p.grad for p in params if p.grad is not None]
        out[f"{PREFIX}/{block}/param_norm"] = float(tensors_norm(params))
        if grads:  # a frozen block has none
            out[f"{PREFIX}/{block}/grad_norm"] = float(tensors_norm(grads))
    if gather and dist.is_initialized():
        every: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, out)
        out = {k: v for d in every for k, v in d.items()}
    return out
