"""Float8 training of linear layers with torchao (``torchao.float8``).

:class:`Float8` converts the ``nn.Linear`` layers of a module to torchao's
``Float8Linear`` (``convert_to_float8_training``): each matmul casts its input, weight
and output gradient to float8 with a dynamic scale (``tensorwise``: one scale per
tensor; ``rowwise``: one per row) and multiplies them with ``torch._scaled_mm``; the
weights, their gradients and the optimizer stay in high precision, so parameter
names, checkpoints and exports are those of the plain model. Each block is
converted as it is built, first of the family's parallelize steps
(src/sharding/parallelize.py).

A linear layer stays as it is when a ``skip`` entry matches its path inside the
converted module (its name, a dotted suffix such as ``attn.c_proj``, or an ``fnmatch``
pattern) or when a dimension is not a multiple of 16 (what the float8 kernels take).

FSDP2 float8 all-gather (``all_gather``, tensorwise only): the sharded fp32 weights
are cast to float8 before the all-gather, halving its bytes against bf16; the scale of
each weight is computed for all of them at once after the optimizer step
(:func:`precompute_scales`). gloo has no float8 type: :class:`ByteAllGather` moves the
same bytes as uint8 (``FSDPModule.set_custom_all_gather``), so it runs on CPU too.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import importlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from src.entry import quiet_torchao

from .wrap import is_wrapped

#: ``Float8LinearConfig.from_recipe_name``'s recipes offered.
RECIPES = ("tensorwise", "rowwise")
#: The recipes FSDP2's float8 all-gather takes (torchao casts whole tensors only).
ALL_GATHER_RECIPES = ("tensorwise",)
#: Dimensions of a converted layer are multiples of this (``torch._scaled_mm``).
FLOAT8_DIM_MULTIPLE = 16
#: The first CUDA compute capability with float8 tensor cores (Ada, Hopper).
MIN_CUDA_CAPABILITY = (8, 9)
_FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


def _torchao_float8() -> Any:
    """``torchao.float8``, imported without the noise of its compiled CUDA extensions
    that this build cannot load (src/entry.py ``quiet_torchao``: only those lines)."""
    quiet_torchao()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.float8 as float8
    return float8


def device_problem(device: torch.device | str) -> str | None:
    """Why float8 cannot train on ``device`` (a CUDA GPU before sm89), else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap >= MIN_CUDA_CAPABILITY:
        return None
    return (
        f"{torch.cuda.get_device_name(device)} (sm{cap[0]}{cap[1]}) has no float8 "
        f"matmuls (sm{''.join(map(str, MIN_CUDA_CAPABILITY))}+: Ada, Hopper, later)"
    )


@dataclass(frozen=True)
class Float8:
    """Which linear layers become float8, and how (see the module docstring)."""

    recipe: str = "tensorwise"
    skip: tuple[str, ...] = ()
    all_gather: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(
                f"float8 recipe {self.recipe!r}: expected one of {', '.join(RECIPES)}"
            )
        if self.all_gather and self.recipe not in ALL_GATHER_RECIPES:
            raise ValueError(
                f"float8 all-gather takes the {' or '.join(ALL_GATHER_RECIPES)} "
                f"recipe, not {self.recipe}"
            )
        object.__setattr__(self, "skip", tuple(self.skip))

    def linear_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for the recipe and the all-gather."""
        config = _torchao_float8().Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(
            config, enable_fsdp_float8_all_gather=self.all_gather
        )

    def skipped(self, path: str, module: nn.Module) -> bool:
        """Whether the linear layer at ``path`` (inside the converted module) stays
        in high precision: a ``skip`` match, or dimensions the kernels cannot take."""
        if any(_matches(path, entry) for entry in self.skip):
            return True
        dims = (module.in_features, module.out_features)
        return any(d % FLOAT8_DIM_MULTIPLE for d in dims)

    def convert(self, module: nn.Module) -> list[str]:
        """Convert ``module``'s linear layers (``module`` itself if it is one) in
        place; returns the paths converted."""
        converted: list[str] = []

        def keep(m: nn.Module, path: str) -> bool:
            ok = (
                isinstance(m, nn.Linear)
                and not is_float8_linear(m)  # converted already (before TP)
                and not is_wrapped(m)  # a unit already: sharded, DTensor weights
                and not self.skipped(path, m)
            )
            if ok:
                converted.append(path)
            return ok

        float8 = _torchao_float8()
        float8.convert_to_float8_training(
            module, module_filter_fn=keep, config=self.linear_config()
        )
        return converted

    def after_optimizer_step(self, model: nn.Module) -> None:
        """With the all-gather: the float8 scales of every sharded weight, computed
        once for the next step (one all-reduce for all of them)."""
        if self.all_gather:
            precompute_scales(model)


def _matches(path: str, entry: str) -> bool:
    return (
        path == entry
        or path.endswith("." + entry)
        or fnmatch.fnmatchcase(path, entry)
        or fnmatch.fnmatchcase(path.rsplit(".", 1)[-1], entry)
    )


def precompute_scales(model: nn.Module) -> None:
    """torchao's ``precompute_float8_dynamic_scale_for_fsdp`` (tensorwise weights
    all-gathered in float8)."""
    with torch.no_grad():
        _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def is_float8_linear(module: nn.Module) -> bool:
    """A torchao ``Float8Linear``, also once a unit (FSDP2's ``FSDPFloat8Linear``)."""
    return any(c.__name__ == "Float8Linear" for c in type(module).__mro__)


def _gathers_float8(style: Any) -> bool:
    """Whether ``style`` as a float8 style all-gathers float8 data: an input
    redistributed (Shard -> Replicate), or a rowwise output reduce-scattered
    (sequence parallelism), whose backward gathers the float8 output gradient."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    have = getattr(style, "input_layouts", None) or ()
    want = getattr(style, "desired_input_layouts", None) or ()
    moved = any(
        a is not None and b is not None and a != b
        for a, b in zip(have, want, strict=False)
    )
    out = getattr(style, "output_layouts", None) or ()
    return moved or (
        isinstance(style, RowwiseParallel) and any(isinstance(o, Shard) for o in out)
    )


def _tensorwise(module: nn.Module) -> bool:
    if not is_float8_linear(module):
        return False
    return module.config.cast_config_input.scaling_granularity.name == "TENSORWISE"


def float8_tp_style(module: nn.Module, style: Any, float8_comm: bool = True) -> Any:
    """The tensor-parallel ``style`` for ``module`` once its linear layers are float8:
    torchao's float8 styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
    ``PrepareFloat8ModuleInput``: the activations cast to float8 before their TP
    collectives, each once) where the layers take them (the ``tensorwise`` recipe);
    ``style`` itself elsewhere (rowwise float8 layers take the plain styles, as
    torchtitan does). Without ``float8_comm`` (gloo has no float8 type) a style
    that would all-gather its float8 input (sequence parallelism's gathers) stays
    plain: that input is gathered in high precision and cast after."""
    if not float8_comm and _gathers_float8(style):
        return style
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    _torchao_float8()  # quietly first
    tp = importlib.import_module("torchao.float8.float8_tensor_parallel")
    kind = type(style)
    if kind in (ColwiseParallel, RowwiseParallel) and _tensorwise(module):
        same = copy.copy(style)  # its layouts; the float8 class adds no state
        same.__class__ = (
            tp.Float8ColwiseParallel
            if kind is ColwiseParallel
            else tp.Float8RowwiseParallel
        )
        return same
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if kind is PrepareModuleInput and linears and all(map(_tensorwise, linears)):
        return tp.PrepareFloat8ModuleInput(
            input_layouts=style.input_layouts,
            desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts or None,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts or None,
            use_local_output=style.use_local_output,
        )
    return style


class ByteAllGather(DefaultAllGather):
    """FSDP2's all-gather, moving float8 buffers as uint8 (the same bytes): for
    process groups without a float8 type (gloo)."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> Any:
        if output_tensor.dtype in _FLOAT8_DTYPES:
            output_tensor = output_tensor.view(torch.uint8)
            input_tensor = input_tensor.view(torch.uint8)
        return super().__call__(output_tensor, input_tensor, group, async_op)


def byte_all_gather(unit: nn.Module) -> None:
    """Give the FSDP2 unit ``unit`` :class:`ByteAllGather`."""
    unit.set_custom_all_gather(ByteAllGather())
