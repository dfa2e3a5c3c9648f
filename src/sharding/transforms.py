"""Per-unit transforms: float8 linear layers, activation checkpointing and
``torch.compile`` of a model's blocks (steps of the family's parallelize function,
src/sharding/parallelize.py, which says when they run).

Float8 (``float8.Float8``) swaps the module's ``nn.Linear`` layers for torchao's
``Float8Linear`` (a subclass keeping the same parameters under the same names).
Checkpointing and compile replace the module's ``forward`` on the instance and nothing
else, so the module tree and every parameter name stay as they are (no ``_checkpoint_wrapped_module.`` or
``_orig_mod.`` segment reaches checkpoints, export or the optimizer's no-decay rule),
and the sharding wrapper's hooks (all-gather before forward, reshard after) stay
outside the checkpointed and the compiled region. The checkpoint is torch's
non-reentrant ``torch.utils.checkpoint.checkpoint``; compiling the checkpointed
forward lets dynamo trace the checkpoint as one region, as torchtitan does.

- ``full``: a target keeps only its inputs; everything inside is recomputed in
  backward. ``every=k`` checkpoints targets 0, k, 2k, ... (in build order).
- ``selective``: torch's ``create_selective_checkpoint_contexts`` saves the outputs of
  matmuls and attention (:data:`SAVED_OPS`) and recomputes the cheap elementwise ops
  (norms, activations, adds) in between.
- ``compile``: each target's forward is compiled on its own (regional compilation:
  every block of a model shares the same code, so the compile cost is one block's,
  not the depth's).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .float8 import Float8
from .wrap import is_wrapped

CHECKPOINTING = ("none", "full", "selective")

# What each step leaves on a module it has acted on.
_FLOAT8, _CHECKPOINTED, _COMPILED = (
    "_sharding_float8",
    "_sharding_checkpointed",
    "_sharding_compiled",
)


def _ops(*names: str) -> frozenset:
    """The aten overloads of this torch build among ``names`` (some are CUDA-only)."""
    return frozenset(
        getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)
    )


#: Ops whose outputs selective checkpointing keeps: matmuls and attention (the
#: expensive ones to recompute); everything else in a target is recomputed.
SAVED_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",  # float8 linear layers' matmuls
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls)


class SplitBlockError(ValueError):
    """Selective checkpointing of a block that holds smaller sharding units."""

    def __init__(self, block: str) -> None:
        super().__init__(
            f"selective activation checkpointing: a {block} holds smaller sharding "
            "units; make each one unit (a larger size threshold or the block policy) "
            "or use full checkpointing"
        )
        self.block = block


@dataclass
class UnitTransform:
    """Float8, activation checkpointing and compile settings, and the steps that
    apply them (``parallelize.UnitSteps`` calls them in order).

    Each step acts on every target in a unit (the unit itself or a module inside
    it, not inside an already wrapped child) that it has not acted on yet.
    ``targets`` are the classes to transform (a model's block classes); empty
    means the unit itself.
    """

    checkpointing: str = "none"
    every: int = 1
    compile: bool = False
    targets: tuple[type[nn.Module], ...] = ()
    float8: Float8 | None = None
    #: targets checkpointed (or not, by ``every``) so far, in build order
    seen: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"activation checkpointing: unknown mode {self.checkpointing!r}; "
                f"choose from {list(CHECKPOINTING)}"
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int):
            raise TypeError(f"checkpoint every k-th target: got {self.every!r}")
        if self.every < 1:
            raise ValueError(
                f"checkpoint every k-th target: k must be >= 1, got {self.every}"
            )
        self.targets = tuple(self.targets)

    def convert_float8(self, unit: nn.Module) -> None:
        """The targets' linear layers to float8 (torchao's ``Float8Linear``)."""
        if self.float8 is not None:
            for module in self._pending(unit, _FLOAT8):
                self.float8.convert(module)

    def add_checkpoint(self, unit: nn.Module) -> None:
        """The targets' forward under activation checkpointing (``full``: every
        ``every``-th target, in build order; ``selective``: each, keeping
        :data:`SAVED_OPS`)."""
        if self.checkpointing == "none":
            return
        selective = self.checkpointing == "selective"
        for module in self._pending(unit, _CHECKPOINTED):
            index, self.seen = self.seen, self.seen + 1
            if selective and any(is_wrapped(m) for m in module.modules()):
                # Their sharding hooks would run inside the region, differently in
                # the recomputation (measured: FSDP2 on one rank), which selective
                # checkpointing rejects.
                raise SplitBlockError(type(module).__name__)
            if selective or index % self.every == 0:
                module.forward = checkpointed(module.forward, selective)

    def add_compile(self, unit: nn.Module) -> None:
        """The targets' forward compiled, each on its own (regional)."""
        if self.compile:
            for module in self._pending(unit, _COMPILED):
                module.forward = torch.compile(module.forward)

    def _pending(self, unit: nn.Module, step: str) -> list[nn.Module]:
        """The targets in ``unit`` that ``step`` has not acted on, now marked."""
        pending = [
            m
            for m in _unit_modules(unit)
            if not m.__dict__.get(step)
            and (isinstance(m, self.targets) if self.targets else m is unit)
        ]
        for m in pending:
            m.__dict__[step] = True
        return pending


def compile_cache_dir() -> tuple[str, str]:
    """Where ``torch.compile`` (inductor) writes its cache, and the environment
    variable that moves it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    var = "TORCHINDUCTOR_CACHE_DIR"
    return var, os.environ.get(var) or default_cache_dir()


def checkpointed(forward: Callable, selective: bool) -> Callable:
    """``forward`` under torch's non-reentrant checkpoint (``selective``: keeping the
    outputs of :data:`SAVED_OPS`); also what the planner traces (src/planner/trace.py)."""
    context_fn = _selective_contexts if selective else None

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        extra = {"context_fn": context_fn} if context_fn else {}
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def _unit_modules(unit: nn.Module) -> Iterator[nn.Module]:
    """``unit`` and its descendants not inside an already wrapped child, in module
    order (pre-order)."""
    stack = [unit]
    while stack:
        m = stack.pop()
        yield m
        kids = [c for c in m._modules.values() if c is not None and not is_wrapped(c)]
        stack.extend(reversed(kids))
