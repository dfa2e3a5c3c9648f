"""The on-disk layout of a transformers model's weights, against its in-memory names.

transformers 5 keeps some weights in another form in memory than on disk: Mixtral's and
Qwen3-MoE's experts are fused (``mlp.experts.gate_up_proj`` [E, 2I, H]) in memory,
while ``save_pretrained`` and published checkpoints hold one tensor per expert
(``block_sparse_moe.experts.0.w1.weight`` ...). The installed transformers converts
between the two (its ``conversion_mapping``; ``revert_weight_conversion`` when
saving). :class:`HFLayout` applies that same conversion, nothing copied from it:

- a tensor the conversion only renames keeps its own slices: each rank reads and
  writes its part under the on-disk name;
- a group of tensors the conversion converts (one fused tensor <-> its experts) is
  converted whole, one group at a time, by ``revert_weight_conversion`` itself when
  writing; when reading, the same reverted conversion applied to the positions of
  the group's elements says where each on-disk element goes (the conversions move
  elements; one that does not is refused).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

Shapes = dict[str, tuple[int, ...]]


@dataclass
class Group:
    """In-memory tensors that the conversion turns into the on-disk ones together."""

    names: tuple[str, ...]  # in-memory (transformers) names
    disk: Shapes = field(default_factory=dict)  # on-disk name -> shape


def _reverse_transforms(skeleton: nn.Module) -> tuple[list, list]:
    """transformers' weight transforms of ``skeleton`` reversed for saving (the
    renamings, the converters), as ``revert_weight_conversion`` builds them for a
    model that was not loaded by ``from_pretrained``."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
    )

    conversions = getattr(skeleton, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(skeleton, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    return (
        [r for r in reverse if isinstance(r, WeightRenaming)],
        [r for r in reverse if isinstance(r, WeightConverter)],
    )


def _revert(skeleton: nn.Module, state: Mapping[str, torch.Tensor]):
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(skeleton, dict(state))


class HFLayout:
    """In-memory names and shapes (``shapes``) of ``skeleton`` (a transformers model,
    on the meta device) against the names and shapes ``save_pretrained`` writes.
    ``skeleton=None``: the names are the on-disk ones (no conversion)."""

    def __init__(self, skeleton: nn.Module | None, shapes: Mapping[str, tuple]):
        self.skeleton = skeleton
        self.shapes: Shapes = {n: tuple(s) for n, s in shapes.items()}
        self.renames: dict[str, str] = {n: n for n in shapes}  # in memory -> on disk
        self.groups: list[Group] = []
        if skeleton is None:
            self.disk_shapes: Shapes = {n: tuple(s) for n, s in shapes.items()}
            return
        from transformers.core_model_loading import apply_converters, apply_renamings

        renamings, converters = _reverse_transforms(skeleton)
        grouped: dict[str, list[str]] = {}
        for name in shapes:
            target, pattern = apply_converters(name, converters)
            if pattern is None:
                self.renames[name] = apply_renamings(name, renamings)
            else:
                del self.renames[name]
                grouped.setdefault(target, []).append(name)
        meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        for names in grouped.values():
            disk = _revert(skeleton, {n: meta[n] for n in names})
            self.groups.append(
                Group(tuple(names), {d: tuple(t.shape) for d, t in disk.items()})
            )
        self.disk_shapes = {self.renames[n]: tuple(shapes[n]) for n in self.renames}
        for group in self.groups:
            self.disk_shapes.update(group.disk)
        # The groups and renames together must be what transformers writes for the
        # whole model (a conversion that spans groups would show here).
        whole = {d: tuple(t.shape) for d, t in _revert(skeleton, meta).items()}
        if whole != self.disk_shapes:
            odd = sorted(set(whole.items()) ^ set(self.disk_shapes.items()))
            raise ValueError(
                f"cannot follow transformers' weight conversion of "
                f"{type(skeleton).__name__} tensor by tensor (at {odd[0][0]!r})"
            )

    def as_stored(self, found: Mapping[str, tuple]) -> HFLayout:
        """This layout for a checkpoint holding ``found`` (name -> shape): a tensor
        it holds under its in-memory name and shape (transformers 5's fused experts,
        ``mlp.experts.gate_up_proj``, which transformers opens too) is read as is,
        and a group converts only when some of its tensors are not held so."""

        def held(name: str) -> bool:
            return tuple(found.get(name, ())) == self.shapes[name]

        if self.skeleton is None or not any(map(held, self.shapes)):
            return self
        layout = copy.copy(self)
        layout.renames = {n: n if held(n) else d for n, d in self.renames.items()}
        layout.groups = [g for g in self.groups if not all(map(held, g.names))]
        for group in self.groups:
            if group not in layout.groups:
                layout.renames.update({n: n for n in group.names})
        layout.disk_shapes = {d: self.shapes[n] for n, d in layout.renames.items()}
        for group in layout.groups:
            layout.disk_shapes.update(group.disk)
        return layout

    @property
    def converts(self) -> bool:
        return bool(self.groups)

    def to_disk(self, group: Group, tensors: Mapping[str, torch.Tensor]):
        """The on-disk tensors of ``group`` from its whole in-memory tensors."""
        return _revert(self.skeleton, {n: tensors[n] for n in group.names})

    def to_memory(self, group: Group, disk: Mapping[str, torch.Tensor]):
        """The whole in-memory tensors of ``group`` from its on-disk tensors: the
        reverted conversion of the elements' positions says where each goes."""
        sizes = [math.prod(self.shapes[n]) for n in group.names]
        total = sum(sizes)
        dtype = torch.int32 if total < 2**31 else torch.int64
        positions = torch.arange(total, dtype=dtype).split(sizes)
        where = _revert(
            self.skeleton,
            {
                n: p.view(self.shapes[n])
                for n, p in zip(group.names, positions, strict=True)
            },
        )
        del positions  # the reverted copies are what is kept (``where``)
        first = next(iter(disk.values()))
        flat = torch.empty(total, dtype=first.dtype, device=first.device)
        seen = torch.zeros(total, dtype=torch.bool)
        count = 0
        while where:  # each position list is dropped once used
            name, index = where.popitem()
            index = index.reshape(-1).long()
            flat[index.to(flat.device)] = disk[name].reshape(-1).to(flat.dtype)
            seen[index] = True
            count += index.numel()
        if count != total or not bool(seen.all()):  # a one-to-one move of elements
            raise ValueError(
                f"transformers' weight conversion of {group.names[0]!r} does not "
                "move elements one to one; it cannot be read in place"
            )
        return {
            n: part.view(self.shapes[n])
            for n, part in zip(group.names, flat.split(sizes), strict=True)
        }
