"""``sharding=none``: one process, nothing wrapped (the :class:`Backend` base class
as it is, with its capabilities stated)."""

from __future__ import annotations

from .backends import Backend, register_backend


@register_backend
class SingleProcessBackend(Backend):
    """``none``: one process, nothing wrapped."""

    name = "none"
    distributed = False
    wraps_units = False
    shards_parameters = False
    bucketed_gradients = False
    meta_init = True
    hybrid = False
    partial_reshard = False
    explicit_prefetch = False
    allocates = True
    tensor_parallel = False
    pipeline_parallel = False
    expert_parallel = False
    context_parallel = False
    gather_copy_out = False
    dtensor_parameters = False
    float8 = True
