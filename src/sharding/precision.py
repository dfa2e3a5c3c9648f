"""Mixed-precision policies, one name per policy, translated for each backend.

``bf16_mixed``: parameters are all-gathered and computed in bf16, gradients are reduced
in fp32 and the sharded master weights (and the optimizer) stay fp32. ``fp16_mixed`` is
the same in fp16 and needs a gradient scaler (sharded for FSDP). ``float8`` is
``bf16_mixed`` whose blocks' linear layers compute in float8 (``float8.Float8``,
applied per block by the unit transform). FSDP casts only
floating-point forward inputs, so integer token ids pass through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

from src.registry import Registry


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    needs_grad_scaler: bool
    # What choosing it changes besides memory (the planner says it with a proposal).
    effects: str = ""
    #: the blocks' linear layers compute in float8 (torchao; src/sharding/float8.py)
    float8: bool = False

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype != torch.float32

    def fsdp2_policy(self) -> MixedPrecisionPolicy:
        """FSDP2: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``."""
        if not self.is_mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype
        )

    def fsdp1_policy(self) -> MixedPrecision | None:
        """FSDP1: the same, for every nested unit (each one casts its own parameters)."""
        if not self.is_mixed:
            return None
        return MixedPrecision(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            buffer_dtype=self.param_dtype,
        )


#: The policies by ``precision.name``; a new one is one ``PRECISIONS.add`` here plus
#: its conf/precision/<name>.yaml.
PRECISIONS: Registry[Precision] = Registry("precision")
for _precision in (
    Precision("fp32", torch.float32, torch.float32, False, "full fp32 numerics"),
    Precision(
        "bf16_mixed",
        torch.bfloat16,
        torch.float32,
        False,
        "forward and backward in bf16 (8-bit mantissa: losses differ from fp32's "
        "in the 2nd-3rd digit), fp32 master weights, optimizer and gradient reduction; "
        "matmuls at the bf16 rate",
    ),
    Precision(
        "fp16_mixed",
        torch.float16,
        torch.float32,
        True,
        "forward and backward in fp16 with a gradient scaler (steps whose gradients "
        "overflow are skipped), fp32 master weights and optimizer",
    ),
    Precision(
        "float8",
        torch.bfloat16,
        torch.float32,
        False,
        "bf16_mixed with the blocks' linear layers in float8 (torchao: inputs, "
        "weights and output gradients cast with dynamic scales; losses differ from "
        "bf16's in the 2nd-3rd digit), fp32 master weights and optimizer; matmuls at "
        "the float8 rate on sm89+ GPUs",
        float8=True,
    ),
):
    PRECISIONS.add(_precision.name, _precision)


def get_precision(name: str) -> Precision:
    """The precision policy called ``name`` (one of :data:`PRECISIONS`)."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown precision {name!r}, expected one of: {', '.join(PRECISIONS)}"
        ) from None
