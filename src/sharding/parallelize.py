"""Parallelizing a model as it is built: one function per family applies the steps
in order, the wrap context calls it.

The order is written once, in the family's function (its spec's ``parallelize``;
the decoders, twins, share :func:`parallelize_decoder`). Units are sharded as they
are constructed, so the function is a step on one module, which
``enable_wrap(parallelize=...)`` calls with ``unit=False`` on each module as it is
built (each ``wrap()``-annotated module, and the root once the model exists), and
with ``unit=True`` on each unit the wrap policy picked, before the context's wrapper
shards it. Each step does only what is not done yet under the module, and nothing
where its parallelism is off (:class:`UnitSteps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch.nn as nn

from .layout import ParallelMesh
from .lora import LoraSpec, add_lora
from .tensor_parallel import TPPlan, tensor_parallelize
from .transforms import UnitTransform


@dataclass
class UnitSteps:
    """The steps of one build, bound to the run's mesh and settings."""

    #: float8, activation checkpointing and compile, of the target blocks
    transform: UnitTransform = field(default_factory=UnitTransform)
    mesh: ParallelMesh | None = None  # the run's groups (None: no mesh)
    tp_plan: TPPlan | None = None  # None: no tensor parallelism
    #: splits the expert modules under a module (None: no expert parallelism)
    experts: Callable[[nn.Module], None] | None = None
    lora: LoraSpec | None = None  # the adapters (None: no LoRA)

    def adapt(self, module: nn.Module) -> None:
        if self.lora is not None:
            add_lora(module, self.lora)

    def float8(self, module: nn.Module) -> None:
        self.transform.convert_float8(module)

    def tensor_parallel(self, module: nn.Module) -> None:
        if self.tp_plan is not None and self.mesh is not None:
            tensor_parallelize(module, self.mesh.tp, self.tp_plan)

    def expert_parallel(self, module: nn.Module) -> None:
        if self.experts is not None:
            self.experts(module)

    def checkpoint(self, unit: nn.Module) -> None:
        self.transform.add_checkpoint(unit)

    def compile(self, unit: nn.Module) -> None:
        self.transform.add_compile(unit)


class Parallelize(Protocol):
    """A family's parallelize function, as its spec's ``parallelize`` holds it."""

    def __call__(self, module: nn.Module, steps: UnitSteps, *, unit: bool) -> None: ...


def parallelize_decoder(module: nn.Module, steps: UnitSteps, *, unit: bool) -> None:
    """A decoder's parallelism (GPT, Llama, the MoE, Hugging Face's), in order."""
    # As built, whole: before the policy picks units inside the module.
    steps.adapt(module)  # LoRA adapters on its linear layers, the rest frozen
    steps.float8(module)  # torchao's float8 TP styles take float8 linear layers
    steps.tensor_parallel(module)  # on the tp mesh, by the family's plan
    steps.expert_parallel(module)  # split over ep, sharded over the rest: units
    if not unit:
        return
    # A unit, about to be sharded.
    steps.checkpoint(module)  # its blocks' activations
    steps.compile(module)  # its blocks' forward (regional), the checkpoint inside
    # The wrap context's wrapper (FSDP) shards the unit when this returns.
