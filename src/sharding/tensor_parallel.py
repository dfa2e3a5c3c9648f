"""Tensor and sequence parallelism on the ``tp`` dimension of the device mesh.

A :class:`TPPlan` says, per module class, which submodules get which
``torch.distributed.tensor.parallel`` style (Megatron-style colwise/rowwise linears,
sequence-parallel norms, a vocabulary-sharded embedding and output layer), applied
by a step of the family's parallelize function (src/sharding/parallelize.py). The plan comes from the model family (``src/models``); this module names no model and
no config key.

After :func:`tensor_parallelize` a parameter of a parallelised module is a ``DTensor``
on the ``tp`` mesh; ``fully_shard`` over the data-parallel mesh then makes it a DTensor
on both, so DCP checkpoints stay layout-independent (they store global tensors).
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from .float8 import float8_tp_style, is_float8_linear
from .lora import adapter_parts
from .wrap import is_wrapped

#: Set on each module a plan parallelised: the style's short name (for the wrap plan).
STYLE_ATTR = "_tp_style"
_DONE_ATTR = "_tp_done"


class FusedHeadsParallel(ParallelStyle):
    """A fused projection such as GPT-2's ``c_attn`` (q | k | v stacked on the output
    dimension), whose rows cannot be split contiguously without giving one rank all of
    q and another all of v. Its weight stays whole on the tp dimension (``Replicate``:
    a checkpoint holds the same global tensor on every layout), every rank computes
    the projection, and keeps only its own heads of each of the ``chunks`` parts: the
    local output is ``chunks`` slices of width ``out / (chunks * tp)``, in order. The
    gradient of the output is partial (each rank's heads only), so the weight's
    gradient is summed over the tp ranks."""

    def __init__(self, chunks: int, input_layouts: Any = None) -> None:
        super().__init__()
        self.chunks = chunks
        self.input_layout = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_parameters(module, device_mesh, self.src_data_rank)
        chunks = self.chunks

        def local_heads(mod: nn.Module, args: tuple, out: DTensor) -> torch.Tensor:
            full = out.to_local(grad_placements=(Partial(),))
            tp, rank = device_mesh.size(), device_mesh.get_local_rank()
            width = full.size(-1) // chunks
            if width % tp:
                raise ValueError(
                    f"a fused projection of {chunks} x {width} outputs does not split "
                    f"into {tp} tensor-parallel shards"
                )
            parts = full.unflatten(-1, (chunks, tp, width // tp))
            return parts.select(-2, rank).flatten(-2)

        module.register_forward_pre_hook(
            _replicated_input(device_mesh, self.input_layout)
        )
        module.register_forward_hook(local_heads)
        return module


class ReplicateParallel(ParallelStyle):
    """A linear layer whose weight is whole on every tp rank (a LoRA adapter's half
    beside a sharded base layer: :func:`_adapter_styles`): its input made a
    replicated DTensor (from ``input_layouts``), its output redistributed to
    ``output_layouts``, local if ``use_local_output``. Its weight's gradient, partial
    where the layer after it is sharded, is summed over the tp ranks by DTensor."""

    def __init__(
        self,
        input_layouts: Any = None,
        output_layouts: Any = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layout = input_layouts or Replicate()
        self.output_layout = output_layouts or Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _replicate_parameters(module, device_mesh, self.src_data_rank)
        layout, local = self.output_layout, self.use_local_output

        def prepare_output(mod: nn.Module, args: tuple, out: DTensor) -> Any:
            if out.placements != (layout,):
                out = out.redistribute(placements=(layout,))
            return out.to_local() if local else out

        module.register_forward_pre_hook(
            _replicated_input(device_mesh, self.input_layout)
        )
        module.register_forward_hook(prepare_output)
        return module


def _replicate_parameters(module: nn.Module, mesh: DeviceMesh, src: Any) -> None:
    """``module``'s own parameters as DTensors replicated on ``mesh``."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = nn.Parameter(
            _distribute(param, mesh, [Replicate()], src),
            requires_grad=param.requires_grad,
        )
        module.register_parameter(name, dist_param)


def _replicated_input(mesh: DeviceMesh, layout: Any) -> Any:
    """A forward pre-hook making the first input a replicated DTensor (a local
    tensor read as ``layout``)."""

    def prepare_input(mod: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (layout,), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        return (x, *args[1:])

    return prepare_input


def _distribute(param: torch.Tensor, mesh: DeviceMesh, placements: list, src) -> Any:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(param.data, mesh, placements, src_data_rank=src)


@dataclass(frozen=True)
class TPPlan:
    """A model's tensor-parallel plan: for each module class, the styles of its
    submodules by relative path (``""`` is the module itself; ``*`` matches one path
    component, as in ``parallelize_module``)."""

    modules: Mapping[type[nn.Module], Mapping[str, ParallelStyle]] = field(
        default_factory=dict
    )
    sequence_parallel: bool = False  # activations between blocks sharded on sequence
    loss_parallel: bool = False  # logits stay vocabulary-sharded into the loss

    def loss_context(self) -> contextlib.AbstractContextManager:
        """``loss_parallel()`` when the output layer keeps its logits sharded: the
        forward's loss and the backward must both run inside it."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()


def style_name(style: ParallelStyle) -> str:
    """A short name for the wrap plan: colwise, rowwise, sequence, input, fused."""
    return {
        ColwiseParallel: "colwise",
        RowwiseParallel: "rowwise",
        SequenceParallel: "sequence",
        PrepareModuleInput: "input",
        PrepareModuleInputOutput: "input-output",
        FusedHeadsParallel: "fused-heads",
        ReplicateParallel: "replicate",
    }.get(type(style), type(style).__name__)


def tensor_parallelize(module: nn.Module, mesh: DeviceMesh, plan: TPPlan) -> None:
    """Apply ``plan`` to ``module`` and every module under it that is an instance of a
    class the plan names and was not parallelised yet (sharding units already made
    are left alone: they were parallelised when they were built). Parameters tied
    before (the same ``Parameter`` under two names) are tied again after, which needs
    the same placement under both names."""
    for target in _targets(module, plan):
        styles = next(s for cls, s in plan.modules.items() if isinstance(target, cls))
        # A pipeline stage lacks the other stages' modules (its embedding, its head).
        names = [n for n, m in target.named_modules() if not isinstance(m, nn.Identity)]
        styles = {p: st for p, st in styles.items() if _matching(names, p)}
        styles = _float8_styles(target, styles, mesh)
        styles = _adapter_styles(target, styles)
        ties = _ties(target)
        parallelize_module(target, mesh, dict(styles), src_data_rank=None)
        _mark(target, styles)
        _retie(target, ties)
        target.__dict__[_DONE_ATTR] = True


def _has_float8_type(mesh: DeviceMesh) -> bool:
    """Whether the mesh's process group moves float8 tensors (gloo does not)."""
    return dist.get_backend(mesh.get_group()) != "gloo"


def _float8_styles(
    target: nn.Module, styles: Mapping[str, ParallelStyle], mesh: DeviceMesh
) -> Mapping[str, ParallelStyle]:
    """``styles`` by exact module path, each as ``float8.float8_tp_style`` makes it
    for the module, when ``target`` holds float8 linear layers (converted before
    tensor parallelism, torchtitan's order). The mesh's backend is asked only
    then: the planner's fake process group has none to ask."""
    if not any(is_float8_linear(m) for m in target.modules()):
        return styles
    float8_comm = _has_float8_type(mesh)
    modules = dict(target.named_modules())
    return {
        name: float8_tp_style(sub, style, float8_comm)
        for pattern, style in styles.items()
        for name, sub in modules.items()
        if _matches(name, pattern)
    }


def _adapter_styles(
    target: nn.Module, styles: Mapping[str, ParallelStyle]
) -> Mapping[str, ParallelStyle]:
    """``styles`` with each one on a LoRA-adapted linear layer (src/sharding/lora.py)
    put on its parts, by exact module path: the base layer as planned; of a colwise
    (or fused-heads) layer, ``lora_A`` replicated and ``lora_B`` colwise (its heads);
    of a rowwise one, ``lora_A``
    rowwise (its small output all-reduced) and ``lora_B`` replicated, giving the
    base's output layout. ``base + B(A(x))`` then adds like placements, and each
    adapter's gradient is summed where DTensor needs it."""
    modules = dict(target.named_modules())
    adapted = {n for n, m in modules.items() if adapter_parts(m)}
    if not adapted:
        return styles
    out: dict[str, ParallelStyle] = {}
    for pattern, style in styles.items():
        names = [n for n in modules if _matches(n, pattern)]
        if not adapted & set(names):
            out[pattern] = style
            continue
        if not isinstance(
            style, ColwiseParallel | RowwiseParallel | FusedHeadsParallel
        ):
            raise ValueError(
                f"tensor parallelism: {pattern} has LoRA adapters and a "
                f"{style_name(style)} style; only colwise, rowwise and fused-heads "
                "layers take them"
            )
        for name in names:
            out.update(_split_adapted(name, style, modules[name]))
    return out


def _split_adapted(
    name: str, style: ParallelStyle, module: nn.Module
) -> dict[str, ParallelStyle]:
    parts = adapter_parts(module)
    if parts is None:
        return {name: style}
    base, lora_a, lora_b = (f"{name}.{p}" for p in parts)
    if isinstance(style, FusedHeadsParallel):  # lora_B's heads as the base's
        return {
            base: style,
            lora_a: ReplicateParallel(style.input_layout, use_local_output=False),
            lora_b: FusedHeadsParallel(style.chunks),
        }
    (given,), (wanted,) = style.input_layouts, style.output_layouts
    local = style.use_local_output
    if isinstance(style, ColwiseParallel):
        return {
            base: style,
            lora_a: ReplicateParallel(given, Replicate(), use_local_output=False),
            lora_b: ColwiseParallel(
                input_layouts=Replicate(), output_layouts=wanted, use_local_output=local
            ),
        }
    return {
        base: style,
        lora_a: RowwiseParallel(
            input_layouts=given, output_layouts=Replicate(), use_local_output=False
        ),
        lora_b: ReplicateParallel(Replicate(), wanted, use_local_output=local),
    }


def _targets(module: nn.Module, plan: TPPlan) -> Iterator[nn.Module]:
    classes = tuple(plan.modules)
    stack = [module]
    found = []
    while stack:
        m = stack.pop()
        if m.__dict__.get(_DONE_ATTR) or (m is not module and is_wrapped(m)):
            continue
        if isinstance(m, classes):
            found.append(m)
        stack.extend(c for c in m._modules.values() if c is not None)
    return iter(found)


def _matches(name: str, pattern: str) -> bool:
    """``name`` is what ``pattern`` of a plan names (``*``: one path component)."""
    return (
        name == pattern or (pattern and fnmatch.fnmatchcase(name, pattern))
    ) and len(name.split(".")) == len(pattern.split("."))


def _matching(names: list[str], pattern: str) -> bool:
    return any(_matches(name, pattern) for name in names)


def _mark(target: nn.Module, styles: Mapping[str, ParallelStyle]) -> None:
    names = dict(target.named_modules())
    for pattern, style in styles.items():
        for name, sub in names.items():
            if _matches(name, pattern):
                sub.__dict__[STYLE_ATTR] = style_name(style)


def _ties(module: nn.Module) -> list[tuple[str, str]]:
    first: dict[int, str] = {}
    ties = []
    for name, p in module.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(p), name)
        if kept != name:
            ties.append((name, kept))
    return ties


def _retie(module: nn.Module, ties: list[tuple[str, str]]) -> None:
    for alias, kept in ties:
        owner, _, leaf = alias.rpartition(".")
        current = module.get_parameter(alias)
        target = module.get_parameter(kept)
        if current is target:
            continue
        if getattr(current, "placements", None) != getattr(target, "placements", None):
            raise ValueError(
                f"tensor parallelism: {alias} is tied to {kept}, but the plan places "
                "them differently; give both the same sharding"
            )
        setattr(module.get_submodule(owner) if owner else module, leaf, target)


def tp_modules(model: nn.Module) -> list[tuple[str, str]]:
    """``(module path, style)`` of every module a plan parallelised, in module order."""
    return [
        (name, m.__dict__[STYLE_ATTR])
        for name, m in model.named_modules()
        if STYLE_ATTR in m.__dict__
    ]


#: transformers' ``base_model_tp_plan`` style strings that map onto torch's styles.
HF_STYLES: dict[str, Any] = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(),
}


def styles_from_strings(
    plan: Mapping[str, str], owner: str
) -> dict[str, ParallelStyle]:
    """A transformers-style plan (``{"layers.*.self_attn.q_proj": "colwise"}``) as
    torch styles; ``ValueError`` naming ``owner`` for a style with no equivalent."""
    out = {}
    for path, name in plan.items():
        make = HF_STYLES.get(name)
        if make is None:
            raise ValueError(
                f"{owner}: tensor-parallel style {name!r} of {path!r} has no torch "
                f"equivalent here (known: {', '.join(HF_STYLES)})"
            )
        out[path] = make()
    return out


__all__ = [
    "FusedHeadsParallel",
    "TPPlan",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "Replicate",
    "Shard",
    "styles_from_strings",
    "tensor_parallelize",
    "tp_modules",
]
