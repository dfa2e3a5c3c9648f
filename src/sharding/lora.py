"""Low-rank adapters (LoRA) on a model's linear layers, added as the model is built.

The adapters are peft's own (``peft.inject_adapter_in_model`` with a ``LoraConfig``):
each targeted ``nn.Linear`` becomes peft's ``lora.Linear`` holding the original as
``base_layer`` and the adapter's ``lora_A`` / ``lora_B``. They are added by the
build's first step on each module as it is constructed (src/sharding/parallelize.py),
before its unit is sharded, so a model too large for one process gets its adapters
without ever being whole. ``base_layer`` is a wrapper segment of the canonical names
(src/sharding/backends.py ``canonical_name``): the base weights keep their names in
checkpoints, the per-parameter init and Hugging Face weights; the adapters' names
are the base layer's path plus ``lora_A.default.weight`` / ``lora_B.default.weight``.

Everything but the adapters is frozen (``requires_grad=False``): FSDP2 all-gathers the
frozen weights and reduces only the adapters' gradients; the optimizer holds state for
the adapters alone.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn

#: peft's adapter name in every LoRA layer (the one adapter a run trains).
ADAPTER = "default"
#: The segments of an adapter parameter's name (peft's).
ADAPTER_SEGMENTS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoraSpec:
    """The adapters of a run: rank ``r``, scale ``alpha / r``, dropout on their input,
    and the linear layers they go on (``targets``: module-name patterns, matched
    with fnmatch against the module's own name and its dotted path's tails)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    seed: int = 0  # the adapters' init (by name: :func:`lora_init`)

    def init_fn(
        self, base: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    ) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """An init by canonical name: the adapters' (:func:`lora_init`), else
        ``base``'s."""

        def init(name: str, t: torch.Tensor) -> torch.Tensor:
            if is_adapter(name) or base is None:
                return lora_init(name, t.shape, self.seed)
            return base(name, t)

        return init


def is_adapter(name: str) -> bool:
    """Whether a parameter (by name) belongs to a LoRA adapter."""
    return any(seg in ADAPTER_SEGMENTS for seg in name.split("."))


def targeted(path: str, targets: Iterable[str]) -> bool:
    """Whether a module path (or one of its dotted tails) matches a target pattern."""
    parts = path.split(".")
    tails = [".".join(parts[i:]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(t, p) for p in targets for t in tails)


def add_lora(module: nn.Module, spec: LoraSpec) -> int:
    """Put adapters on the linear layers under ``module`` that ``spec`` targets and
    that have none yet; freezes everything else under it. Returns the layers
    adapted (a step on a module as built: the layers its children already adapted
    are left as they are)."""
    from peft.tuners.lora import LoraLayer

    inside = {
        f"{name}.{child}"
        for name, m in module.named_modules()
        if isinstance(m, LoraLayer)
        for child, _ in m.named_modules()
        if child
    }
    names = [
        name
        for name, m in module.named_modules()
        if type(m) is nn.Linear and name not in inside and targeted(name, spec.targets)
    ]
    if names:
        _inject(module, spec, names)
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter(name))
    return len(names)


def _inject(module: nn.Module, spec: LoraSpec, names: list[str]) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=names,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Already found a `peft_config`")
        inject_adapter_in_model(config, module, adapter_name=ADAPTER)
    if hasattr(module, "peft_config"):
        del module.peft_config  # peft's record of the call: the layers hold theirs


def lora_init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """An adapter weight's initial value, by canonical name (peft's defaults):
    ``lora_A`` Kaiming-uniform (a = sqrt 5, as ``nn.Linear``), ``lora_B`` zero, so a
    new adapter changes nothing; from the parameter's own generator (the value
    depends on nothing else: not the ranks, not the build order)."""
    from .backends import name_generator

    if ".lora_B." in f".{name}.":
        return torch.zeros(shape)
    bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) of a (r, in) weight
    out = torch.empty(shape)
    return out.uniform_(-bound, bound, generator=name_generator(seed, name))


def adapter_parts(module: nn.Module) -> tuple[str, str, str] | None:
    """The paths under a LoRA-adapted linear layer of its base layer and its
    adapter's two halves (``lora_A``, ``lora_B``); None for any other module."""
    lora_a = getattr(module, "lora_A", None)
    if not isinstance(lora_a, nn.ModuleDict) or ADAPTER not in lora_a:
        return None
    return "base_layer", f"lora_A.{ADAPTER}", f"lora_B.{ADAPTER}"


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters of ``model`` (sharded ones counted whole)."""
    seen, trained, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trained += p.numel() if p.requires_grad else 0
    return trained, total


def adapted_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(canonical module path, peft LoRA layer)`` of every adapted linear layer
    (peft is imported only where there are some)."""
    if not any(is_adapter(n) for n, _ in model.named_parameters()):
        return []
    from peft.tuners.lora import LoraLayer

    from .backends import canonical_name

    return [
        (canonical_name(name, model), m)
        for name, m in model.named_modules()
        if isinstance(m, LoraLayer) and ADAPTER in m.lora_A
    ]


@torch.no_grad()
def merged_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each adapted layer's weight with its adapter merged in, ``W + scale B A`` (what
    an export holds), by canonical name, sharded as the base weight is (a collective:
    the adapters, small, are gathered whole on every rank)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for path, layer in adapted_layers(model):
        base = layer.base_layer.weight
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
        delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]
        if isinstance(base, DTensor):
            local = distribute_tensor(
                delta, base.device_mesh, base.placements, src_data_rank=None
            ).to_local()
            merged = DTensor.from_local(
                base.to_local() + local.to(base.dtype),
                base.device_mesh,
                base.placements,
                shape=base.shape,
                stride=base.stride(),
            )
        else:
            merged = base + delta.to(base.dtype)
        out[f"{path}.weight"] = merged
    return out
