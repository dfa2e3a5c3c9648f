"""Mixed-precision policies, one name per policy, translated for each backend.

``bf16_mixed``: parameters are all-gathered and computed in bf16, gradients are reduced
in fp32 and the sharded master weights (and the optimizer) stay fp32. ``fp16_mixed`` is
the same in fp16 and needs a gradient scaler (sharded for FSDP). FSDP casts only
floating-point forward inputs, so integer token ids pass through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    needs_grad_scaler: bool

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


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, torch.float32, False),
    "bf16_mixed": Precision("bf16_mixed", torch.bfloat16, torch.float32, False),
    "fp16_mixed": Precision("fp16_mixed", torch.float16, torch.float32, True),
}


def get_precision(name: str) -> Precision:
    """The precision policy called ``name`` (``fp32``, ``bf16_mixed``, ``fp16_mixed``)."""
    try:
        return PRECISIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown precision {name!r}, expected one of: {', '.join(PRECISIONS)}"
        ) from None
