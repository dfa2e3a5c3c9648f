"""Sharding API: shard-as-you-build (``enable_wrap``/``wrap``/``auto_wrap``) on FSDP2 and
FSDP1, wrap policies, the run's parallel layout and its device mesh, backends, mixed
precision, the parallelize steps (LoRA adapters, float8, TP, EP, activation checkpointing,
torch.compile) and the wrap plan."""

# The backends in their own files add themselves to BACKENDS on import (in this
# order: fsdp2 and fsdp1 from .backends, then ddp, then none).
from . import ddp, single  # noqa: F401
from .backends import (
    BACKENDS,
    Backend,
    backend_class,
    build_backend,
    build_sharded_model,
    canonical_name,
    fill_,
    fsdp1_wrapper,
    materialize_meta_,
    set_prefetch,
    with_capability,
)
from .layout import Axis, LayoutError, ParallelLayout, ParallelMesh, refusal
from .lora import (
    LoraSpec,
    adapted_layers,
    is_adapter,
    lora_init,
    merged_weights,
    trainable_counts,
)
from .parallelize import Parallelize, UnitSteps, parallelize_decoder
from .plan import GIB, MIB, ModelUnits, Unit, WrapPlan, model_units, wrap_plan
from .policies import (
    BlockPolicy,
    ComposedPolicy,
    SizePolicy,
    WrapPolicy,
    build_policy,
)
from .precision import PRECISIONS, Precision, get_precision
from .transforms import CHECKPOINTING, UnitTransform
from .wrap import (
    DEFAULT_EXCLUDE_WRAP_MODULES,
    DEFAULT_FORCE_LEAF_MODULES,
    TiedParametersWarning,
    auto_wrap,
    choose_auto_wrap_units,
    enable_wrap,
    is_wrapped,
    make_unit,
    wrap,
    wrap_enabled,
)

__all__ = [
    "Axis",
    "refusal",
    "BACKENDS",
    "CHECKPOINTING",
    "DEFAULT_EXCLUDE_WRAP_MODULES",
    "DEFAULT_FORCE_LEAF_MODULES",
    "GIB",
    "LayoutError",
    "MIB",
    "PRECISIONS",
    "Backend",
    "BlockPolicy",
    "ComposedPolicy",
    "ParallelLayout",
    "ParallelMesh",
    "Parallelize",
    "Precision",
    "SizePolicy",
    "TiedParametersWarning",
    "ModelUnits",
    "Unit",
    "UnitSteps",
    "UnitTransform",
    "WrapPlan",
    "WrapPolicy",
    "auto_wrap",
    "backend_class",
    "build_backend",
    "build_policy",
    "build_sharded_model",
    "canonical_name",
    "fill_",
    "is_adapter",
    "adapted_layers",
    "merged_weights",
    "lora_init",
    "LoraSpec",
    "trainable_counts",
    "choose_auto_wrap_units",
    "enable_wrap",
    "fsdp1_wrapper",
    "get_precision",
    "is_wrapped",
    "make_unit",
    "model_units",
    "materialize_meta_",
    "parallelize_decoder",
    "set_prefetch",
    "with_capability",
    "wrap",
    "wrap_enabled",
    "wrap_plan",
]
