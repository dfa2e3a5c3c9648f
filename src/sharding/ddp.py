"""``sharding=ddp``: no units; the root is wrapped in ``DistributedDataParallel`` (a
baseline: every rank holds the whole model, gradients are all-reduced in buckets).

A whole backend in one file (docs/architecture.md, "Where to add"): a
:class:`~src.sharding.backends.Backend` subclass stating every capability and
overriding the step-time helpers it changes, listed in ``BACKENDS`` by
``@register_backend``; its values are in conf/sharding/ddp.yaml.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .backends import Backend, register_backend


@register_backend
class DDPBackend(Backend):
    """``ddp``: no units; the root is wrapped in ``DistributedDataParallel``."""

    name = "ddp"
    distributed = True
    wraps_units = False
    shards_parameters = False
    bucketed_gradients = True  # gradient_as_bucket_view=False: a second copy
    gather_copy_out = False
    dtensor_parameters = False
    float8 = True
    meta_init = False
    hybrid = False
    partial_reshard = False
    explicit_prefetch = False
    allocates = True
    tensor_parallel = False
    pipeline_parallel = False
    expert_parallel = False
    context_parallel = False

    def place(self, model: nn.Module) -> nn.Module:
        model = model.to(self.device)
        device_ids = [self.device] if self.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()
