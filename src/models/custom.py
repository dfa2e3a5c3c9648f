"""A user's own model from config alone: ``model=custom model._target_=pkg.MyModel``.

The class is imported by its dotted path and built as
``MyModel(vocab_size=..., block_size=..., **model.args)`` inside the wrap context (so
its own ``wrap()`` annotations shard as it is built). Its ``forward(idx, targets)``
returns ``(logits, loss)`` like the GPT. Optional class attributes refine the spec:
``block_cls`` (a class or a tuple of classes, for ``sharding.policy=block``) and
``flops_per_token(seq_len)`` (a method; by default 6 x the parameter count). A family
that wants meta init, a Hugging Face adapter or presets gets a spec of its own instead
(docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from src.models.spec import ModelSpec, import_module_class, register


@dataclass
class CustomConfig:
    _target_: str = "???"  # dotted path of an nn.Module class
    vocab_size: int = 256
    block_size: int = 128
    args: dict[str, Any] = field(default_factory=dict)  # more constructor arguments

    def __post_init__(self) -> None:
        try:
            self.cls = import_module_class(self._target_)
        except ValueError as err:
            raise ValueError(f"model._target_: {err}") from None


def build(config: CustomConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the class initialises itself; same seed, same model
    return config.cls(
        vocab_size=config.vocab_size, block_size=config.block_size, **config.args
    )


def block_classes(config: CustomConfig) -> tuple[type[nn.Module], ...]:
    blocks = getattr(config.cls, "block_cls", ())
    return (blocks,) if isinstance(blocks, type) else tuple(blocks)


def flops_per_token(config: CustomConfig, seq_len: int) -> float:
    """The class's ``flops_per_token(seq_len)`` if it has one, else 6 N (N from a
    meta-device instance: nothing is allocated)."""
    with torch.device("meta"):
        model = build(config, 0)
    if hasattr(model, "flops_per_token"):
        return model.flops_per_token(seq_len)
    return 6 * sum(p.numel() for p in model.parameters())


register(
    ModelSpec(
        name="custom",
        config_cls=CustomConfig,
        key_help={
            "_target_": "custom: dotted path of your nn.Module class",
            "args": "custom: more constructor arguments (+model.args.dim=64)",
        },
        build=build,
        block_classes=block_classes,
        flops_per_token=flops_per_token,
    )
)
