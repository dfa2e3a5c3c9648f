"""Wrap policies: what a ``wrap()`` annotation means, and what to wrap after the build.

A policy has two hooks. ``annotate(module, overrides)`` runs when model code calls
``wrap(module)`` inside ``enable_wrap(policy=...)``, right after ``module`` was built:
this is where shard-as-you-build happens. ``finalize(model)`` runs once the whole model
exists (still inside the context), for units that span more than one annotated module.

- ``manual``: an annotation wraps the module; nothing else is wrapped.
- ``block``: every instance of the model's block class is a unit.
- ``size``: units by parameter count (``auto_wrap``): an annotated module is explored
  and split as it is built; after the build, the rest of the model is planned as a
  whole, which is also where tied parameters (embedding and head) are seen together.

Policies compose: ``build_policy(["block", "size"])`` applies each hook in turn, and a
module already wrapped by an earlier policy is left as it is by later ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from src.registry import Registry

from .wrap import auto_wrap, is_wrapped, make_unit


@dataclass(frozen=True)
class PolicyOptions:
    """What :func:`build_policy` was given (its defaults are the only ones); each
    policy takes what it needs."""

    min_num_params: int | float
    exclude_wrap_modules: tuple[type[nn.Module], ...]
    force_leaf_modules: tuple[type[nn.Module], ...]
    block_cls: tuple[type[nn.Module], ...] | None  # None: not given


class WrapPolicy:
    """Base policy: annotations wrap, nothing else is wrapped (``manual``)."""

    @classmethod
    def from_options(cls, options: PolicyOptions) -> WrapPolicy:
        """The policy for :func:`build_policy`'s arguments."""
        return cls()

    def annotate(self, module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        return make_unit(module, **overrides)

    def finalize(self, model: nn.Module) -> nn.Module:
        return model


@dataclass
class SizePolicy(WrapPolicy):
    min_num_params: int | float = 1e8
    exclude_wrap_modules: Sequence[type[nn.Module]] = ()
    force_leaf_modules: Sequence[type[nn.Module]] = ()

    @classmethod
    def from_options(cls, options: PolicyOptions) -> WrapPolicy:
        return cls(
            options.min_num_params,
            options.exclude_wrap_modules,
            options.force_leaf_modules,
        )

    def annotate(self, module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        return self._auto_wrap(module, overrides)

    def finalize(self, model: nn.Module) -> nn.Module:
        return self._auto_wrap(model, {})

    def _auto_wrap(self, module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        return auto_wrap(
            module,
            self.min_num_params,
            self.exclude_wrap_modules,
            self.force_leaf_modules,
            **overrides,
        )


@dataclass
class BlockPolicy(WrapPolicy):
    block_cls: tuple[type[nn.Module], ...] = ()

    @classmethod
    def from_options(cls, options: PolicyOptions) -> WrapPolicy:
        if options.block_cls is None:
            raise ValueError(
                "the block policy needs the model's block class (block_cls)"
            )
        return cls(options.block_cls)

    def annotate(self, module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        return self._wrap_blocks(module, overrides)

    def finalize(self, model: nn.Module) -> nn.Module:
        return self._wrap_blocks(model, {})

    def _wrap_blocks(self, module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        if is_wrapped(module):
            return make_unit(module)  # the unit's wrapper (FSDP1 returns a new one)
        # Children first, so nested blocks become units before their parents.
        for name, child in list(module.named_children()):
            new = self._wrap_blocks(child, overrides)
            if new is not child:
                setattr(module, name, new)
        if isinstance(module, self.block_cls):
            return make_unit(module, **overrides)
        return module


@dataclass
class ComposedPolicy(WrapPolicy):
    policies: list[WrapPolicy] = field(default_factory=list)

    def annotate(self, module: nn.Module, overrides: dict[str, Any]) -> nn.Module:
        for policy in self.policies:
            module = policy.annotate(module, overrides)
        return module

    def finalize(self, model: nn.Module) -> nn.Module:
        for policy in self.policies:
            model = policy.finalize(model)
        return model


#: The policies by ``sharding.policy`` name (see the module docstring); a new one is
#: a :class:`WrapPolicy` subclass (``from_options``, ``annotate``, ``finalize``) and
#: its ``POLICIES.add`` here.
POLICIES: Registry[type[WrapPolicy]] = Registry("wrap policy")
POLICIES.add("size", SizePolicy)
POLICIES.add("block", BlockPolicy)
POLICIES.add("manual", WrapPolicy)  # annotations wrap, nothing else does


def policy_names(policy: str | Iterable[str] | None) -> list[str]:
    """A policy name or a list of them (they compose) as a list of known names;
    ``ValueError`` otherwise."""
    names = [policy] if isinstance(policy, str) else list(policy or [])
    if not names or any(n not in POLICIES for n in names):
        raise ValueError(
            f"unknown sharding policy {policy!r}, expected one of "
            f"{', '.join(POLICIES)} or a list of them"
        )
    return names


def build_policy(
    names: str | Iterable[str] = "size",
    min_num_params: int | float = 1e8,
    exclude_wrap_modules: Sequence[type[nn.Module]] = (),
    force_leaf_modules: Sequence[type[nn.Module]] = (),
    block_cls: type[nn.Module] | Sequence[type[nn.Module]] | None = None,
) -> WrapPolicy:
    """The policy (or composition of policies) named by ``names``."""
    if isinstance(block_cls, type):
        block_cls = (block_cls,)
    options = PolicyOptions(
        min_num_params,
        tuple(exclude_wrap_modules),
        tuple(force_leaf_modules),
        None if block_cls is None else tuple(block_cls),
    )
    policies = [POLICIES[n].from_options(options) for n in policy_names(names)]
    return policies[0] if len(policies) == 1 else ComposedPolicy(policies)
