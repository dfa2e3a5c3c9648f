"""Shard-as-you-build: ``enable_wrap``, ``wrap`` and ``auto_wrap``.

Why this exists. A model far larger than one process's memory cannot be built first and
sharded afterwards: the unsharded model would have to exist, whole, in every process.
Inside ``enable_wrap(...)`` every module passed to :func:`wrap` (or chosen by
:func:`auto_wrap`) is handed to the wrapper -- FSDP2's ``fully_shard`` by default -- the
moment it has been constructed, so a process only ever holds its shards plus the one
layer being built. Outside the context both functions return the module unchanged, so a
model file can carry the annotations and still run unsharded.

Precedence of settings, highest first:

1. keyword overrides given to ``wrap(module, **overrides)`` / ``auto_wrap(..., **overrides)``;
2. per-module settings: ``enable_wrap(module_overrides={Block: {...}})``, matched by class
   (the most specific class in the module's MRO wins);
3. the context defaults: ``enable_wrap(wrapper_cls, **defaults)``.

The API follows fairscale's (PR #446), carried over to FSDP2 where PyTorch has neither a
wrap context nor an auto-wrap.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.tensor import DTensor

#: Never made units themselves (their forward is not called); their children may be.
DEFAULT_EXCLUDE_WRAP_MODULES: frozenset[type[nn.Module]] = frozenset(
    {nn.ModuleList, nn.ModuleDict}
)
#: Never recursed into (their forward reads their children's parameters directly), so
#: never units by themselves either: their parameters go to the parent's remainder.
DEFAULT_FORCE_LEAF_MODULES: frozenset[type[nn.Module]] = frozenset(
    {nn.MultiheadAttention}
)

_UNIT_ATTR = "_sharding_unit"


class TiedParametersWarning(UserWarning):
    """``auto_wrap`` kept modules out of their own units because they share parameters
    with modules outside them (a tie is never split across units). Intended for a tied
    embedding and head; ``blocked_by_ties`` maps each module path to those parameters."""

    def __init__(self, blocked_by_ties: dict[str, list[str]]) -> None:
        # args are what rebuilds the warning (pickle, pytest-xdist): the mapping
        super().__init__(blocked_by_ties)
        self.blocked_by_ties = blocked_by_ties

    def __str__(self) -> str:
        detail = "; ".join(
            f"{p or '<root>'} (shares {', '.join(n)})"
            for p, n in self.blocked_by_ties.items()
        )
        return (
            "auto_wrap kept these modules out of their own units because they share "
            f"parameters with modules outside them: {detail}"
        )


@dataclass
class UnitInfo:
    """What a unit held when it was wrapped: used by the wrap plan."""

    numel: int
    #: (dim-0 size, elements per dim-0 row, element size in bytes) of each parameter.
    shapes: list[tuple[int, int, int]] = field(default_factory=list)
    #: the ranks of the shard group that hold disjoint parts of it before FSDP
    #: shards each part over the rest (expert parallelism: ``ep``; ``ep / tp``
    #: with tensor parallelism, whose ranks are not in the shard group)
    split: int = 1

    def bytes_per_rank(self, world_size: int) -> int:
        """Bytes of this unit's parameter shards on one rank (dim-0 sharding, padded)."""
        shard = max(1, world_size // self.split)
        return sum(
            math.ceil(rows / shard) * row_numel * elem
            for rows, row_numel, elem in self.shapes
        )


@dataclass
class _WrapContext:
    wrapper_cls: Callable[..., nn.Module | None]
    defaults: dict[str, Any]
    module_overrides: dict[type, dict[str, Any]]
    policy: Any | None
    parallelize: Callable[..., None] | None = None


_active: _WrapContext | None = None


@contextmanager
def enable_wrap(
    wrapper_cls: Callable[..., nn.Module | None] | None = None,
    *,
    module_overrides: dict[type, dict[str, Any]] | None = None,
    policy: Any | None = None,
    parallelize: Callable[..., None] | None = None,
    **defaults: Any,
) -> Iterator[None]:
    """Shard annotated modules as they are constructed, inside this context.

    Build the model inside the context: each ``wrap(layer)`` shards ``layer`` right
    after its construction, so peak host memory is one unsharded layer plus the shards,
    not the whole model (the init-OOM use case this API was made for).

    Args:
        wrapper_cls: callable ``(module, **kwargs) -> module`` applied to each unit:
            FSDP2's ``fully_shard`` (default, in place), FSDP1's
            ``FullyShardedDataParallel`` (returns a new module) or your own.
        module_overrides: per-class settings, ``{Block: {"reshard_after_forward": False}}``;
            they beat the context defaults and lose to ``wrap(..., **overrides)``.
        policy: optional wrap policy (``src.sharding.policies``) that decides what a
            ``wrap()`` annotation does, e.g. auto-wrap it by size. ``None``: wrap it.
        parallelize: optional step ``(module, *, unit: bool)``, the family's
            parallelize function bound to the run (src/sharding/parallelize.py):
            called with ``unit=False`` on each annotated module before the policy,
            and with ``unit=True`` on each unit right before ``wrapper_cls``.
        **defaults: keyword arguments given to every ``wrapper_cls`` call.

    Contexts do not nest: a second ``enable_wrap`` inside the first raises
    ``RuntimeError``, since which defaults win would be ambiguous.
    """
    global _active
    if _active is not None:
        raise RuntimeError(
            "enable_wrap() contexts cannot be nested: leave the current context first "
            "or pass per-call settings to wrap(module, **overrides)"
        )
    _active = _WrapContext(
        wrapper_cls=wrapper_cls if wrapper_cls is not None else fully_shard,
        defaults=dict(defaults),
        module_overrides=dict(module_overrides or {}),
        policy=policy,
        parallelize=parallelize,
    )
    try:
        yield
    finally:
        _active = None


def wrap_enabled() -> bool:
    """True inside an ``enable_wrap`` context."""
    return _active is not None


def is_wrapped(module: nn.Module) -> bool:
    """True if ``module`` is already a sharding unit (of any kind of wrapper)."""
    return isinstance(module, FSDPModule | FSDP1) or bool(
        module.__dict__.get(_UNIT_ATTR, False)
    )


def wrap(module: nn.Module, **overrides: Any) -> nn.Module:
    """Annotate ``module`` as a sharding unit; wrap it now if inside ``enable_wrap``.

    Outside the context this returns ``module`` unchanged. Inside, ``overrides`` beat
    per-module settings, which beat the context defaults. A module that is already
    wrapped is returned as it is (never wrapped twice). If the context carries a
    policy, the policy decides what the annotation means (see ``policies``).
    """
    ctx = _active
    if ctx is None:
        return module
    if ctx.parallelize is not None and not is_wrapped(module):
        ctx.parallelize(module, unit=False)
    if ctx.policy is not None:
        return ctx.policy.annotate(module, overrides)
    return make_unit(module, **overrides)


def make_unit(module: nn.Module, **overrides: Any) -> nn.Module:
    """Make ``module`` a unit now, with the active context's wrapper and settings.

    Unlike :func:`wrap`, no policy is asked: this is what a policy (or a backend, for
    the root) calls once it has decided. Outside the context, ``module`` is returned
    unchanged; a module that is already a unit is returned as it is."""
    ctx = _active
    if ctx is None:
        return module
    if is_wrapped(module):  # FSDP1 returned a new module: hand back that wrapper
        return module.__dict__.get("_sharding_wrapper", module)
    kwargs = {**ctx.defaults, **_class_overrides(ctx, module), **overrides}
    if ctx.parallelize is not None:
        ctx.parallelize(module, unit=True)
    info = _unit_info(module)
    out = ctx.wrapper_cls(module, **kwargs)
    out = module if out is None else out
    for m in {id(module): module, id(out): out}.values():
        m.__dict__[_UNIT_ATTR] = True
    out.__dict__["_sharding_unit_info"] = info
    if out is not module:
        module.__dict__["_sharding_wrapper"] = out
    return out


def mark_unit(module: nn.Module, info: UnitInfo) -> None:
    """Record ``module``, sharded by other means than the context's wrapper (expert
    parallelism's experts), as a unit of the wrap plan holding ``info``."""
    module.__dict__[_UNIT_ATTR] = True
    module.__dict__["_sharding_unit_info"] = info


def _class_overrides(ctx: _WrapContext, module: nn.Module) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for cls in reversed(type(module).__mro__):  # most specific class applied last
        merged.update(ctx.module_overrides.get(cls, {}))
    return merged


def _unwrapped_params(module: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters of ``module`` not inside an already wrapped descendant (deduplicated)."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield p
        stack.extend(
            c for c in m._modules.values() if c is not None and not is_wrapped(c)
        )


def _unit_info(module: nn.Module) -> UnitInfo:
    shapes = []
    numel = 0
    for p in _unwrapped_params(module):
        numel += p.numel()  # global (a tensor-parallel DTensor's whole size)
        # What this rank holds before data-parallel sharding: a tensor-parallel
        # parameter's local shard.
        local = p.to_local() if isinstance(p, DTensor) else p
        n = local.numel()
        rows = local.shape[0] if local.dim() > 0 else 1
        shapes.append((rows, n // max(rows, 1), p.element_size()))
    return UnitInfo(numel=numel, shapes=shapes)


# --------------------------------------------------------------------------- auto_wrap


@dataclass
class _Node:
    module: nn.Module
    parent: int  # index of the parent node, -1 for the root
    name: str  # attribute name in the parent
    depth: int
    children: list[int] = field(default_factory=list)


@dataclass
class AutoWrapUnits:
    """The units ``auto_wrap`` chooses, deepest first, with why ties blocked others."""

    #: (parent module or None for the root, attribute name, module), in post-order.
    units: list[tuple[nn.Module | None, str, nn.Module]]
    #: module path -> names of the shared parameters that kept it from being a unit.
    blocked_by_ties: dict[str, list[str]]


def choose_auto_wrap_units(
    module: nn.Module,
    min_num_params: int | float = 1e8,
    exclude_wrap_modules: Iterable[type[nn.Module]] | None = None,
    force_leaf_modules: Iterable[type[nn.Module]] | None = None,
) -> AutoWrapUnits:
    """Choose units by parameter count, without wrapping anything (works on meta).

    The rule is that of fairscale and of torch's ``size_based_auto_wrap_policy``
    recursion, compared as numbers (``numel >= min_num_params``): a module is explored
    if it is the root or its parent was explored, its not-yet-wrapped parameters reach
    ``min_num_params`` and it is not force-leaf; an explored module that is not
    excluded becomes a unit when its remainder -- parameters not inside units below
    it -- reaches ``min_num_params``. So a force-leaf module is never split and never a
    unit by itself (it stays in its parent's remainder); an excluded one is never a
    unit but its children may be; a module with no not-yet-wrapped parameters, own or
    below, is never a unit. The one difference from torch is ties: a shared parameter is counted once,
    at the lowest common ancestor of its users, and no module strictly between a user
    and that ancestor is a unit, so a tie is never split across units.

    One post-order pass, linear in the number of modules: subtree sizes are summed once
    bottom-up, never re-summed per level.
    """
    min_params = _check_min_params(min_num_params)
    # The pass allocates one small object per module; with the cyclic GC running, its
    # full collections over a 100k-module model make the pass superlinear.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(module, min_params, exclude_wrap_modules, force_leaf_modules)
    finally:
        if gc_was_enabled:
            gc.enable()


def _plan(
    module: nn.Module,
    min_params: int | float,
    exclude_wrap_modules: Iterable[type[nn.Module]] | None,
    force_leaf_modules: Iterable[type[nn.Module]] | None,
) -> AutoWrapUnits:
    exclude = tuple(DEFAULT_EXCLUDE_WRAP_MODULES | set(exclude_wrap_modules or ()))
    force_leaf = tuple(DEFAULT_FORCE_LEAF_MODULES | set(force_leaf_modules or ()))
    nodes, owners, shared_modules = _collect(module)
    home_numel, tied_numel, tainted = _homes(nodes, owners, shared_modules)
    subtree = home_numel[:]
    for i in range(len(nodes) - 1, 0, -1):  # nodes are in pre-order: children after
        subtree[nodes[i].parent] += subtree[i]

    # Explored: torch's policy(recurse=True) said yes, so children are visited and
    # the module's own unit decision is made; an unexplored module stays whole in
    # its parent's remainder.
    explored = [False] * len(nodes)
    for i, node in enumerate(nodes):
        explored[i] = (
            (i == 0 or explored[node.parent])
            and subtree[i] >= min_params
            and not isinstance(node.module, force_leaf)
        )
    is_unit, blocked = _choose_units(
        nodes, home_numel, tied_numel, tainted, subtree, explored,
        min_params, exclude + force_leaf,
    )  # fmt: skip
    units = [
        (
            nodes[nodes[i].parent].module if i else None,
            nodes[i].name,
            nodes[i].module,
        )
        for i in _post_order(nodes)
        if is_unit[i]
    ]
    return AutoWrapUnits(
        units=units,
        blocked_by_ties={
            _path(nodes, i): sorted(set(names)) for i, names in blocked.items()
        },
    )


def _homes(
    nodes: list[_Node],
    owners: list[tuple[list[int], tuple[int, str], int]],
    shared_modules: list[tuple[int, int, str]],
) -> tuple[list[int], list[int], dict[int, list[str]]]:
    """Each parameter lives at ("is homed at") the lowest common ancestor of its
    users; every node strictly between a user and that ancestor may not be a unit.
    Returns the numel each node homes, the shared numel it uses but does not home,
    and the nodes that may not be units (with the shared names that forbid it)."""
    home_numel = [0] * len(nodes)
    tied_numel = [0] * len(nodes)
    tainted: dict[int, list[str]] = {}
    for users, (first_user, local_name), numel in owners:
        home = _lca(nodes, users)
        home_numel[home] += numel
        if len(users) > 1:
            pname = _join(_path(nodes, first_user), local_name)
            for u in users:
                if u != home:
                    tied_numel[u] += numel
                while u != home:
                    tainted.setdefault(u, []).append(pname)
                    u = nodes[u].parent
    for first, other_parent, mname in shared_modules:
        home = _lca(nodes, [first, other_parent])
        for u in (first, other_parent):
            while u != home:
                tainted.setdefault(u, []).append(mname)
                u = nodes[u].parent
    return home_numel, tied_numel, tainted


def _choose_units(
    nodes: list[_Node],
    home_numel: list[int],
    tied_numel: list[int],
    tainted: dict[int, list[str]],
    subtree: list[int],
    explored: list[bool],
    min_params: int | float,
    never_unit: tuple[type[nn.Module], ...],
) -> tuple[list[bool], dict[int, list[str]]]:
    """Bottom-up: a node is a unit when what its non-unit children leave to it
    reaches ``min_params``; a tainted node that would have been one is ``blocked``."""
    remainder = subtree[:]
    is_unit = [False] * len(nodes)
    blocked: dict[int, list[str]] = {}
    for i in range(len(nodes) - 1, -1, -1):  # children have larger indices
        node = nodes[i]
        if explored[i]:
            remainder[i] = home_numel[i] + sum(
                0 if is_unit[c] else remainder[c] for c in node.children
            )
        if isinstance(node.module, never_unit):
            continue
        if i in tainted:
            # Would it have been a unit, had it homed the shared parameters it uses?
            visited = i == 0 or explored[node.parent]
            if visited and remainder[i] + tied_numel[i] >= min_params:
                blocked[i] = tainted[i]
        elif explored[i] and remainder[i] >= min_params and subtree[i] > 0:
            is_unit[i] = True
    return is_unit, blocked


def auto_wrap(
    module: nn.Module,
    min_num_params: int | float = 1e8,
    exclude_wrap_modules: Iterable[type[nn.Module]] | None = None,
    force_leaf_modules: Iterable[type[nn.Module]] | None = None,
    **overrides: Any,
) -> nn.Module:
    """Wrap ``module``'s submodules by parameter count, deepest first (inside the context).

    Outside ``enable_wrap`` this returns ``module`` unchanged. Inside, it applies the
    rule of :func:`choose_auto_wrap_units` (which explains it) and wraps each chosen unit with
    the context's wrapper, children before parents, and ``module`` itself last if its
    remainder reaches ``min_num_params``. Already wrapped submodules count as wrapped:
    their parameters are not counted again. ``overrides`` beat per-module settings and
    context defaults, as in :func:`wrap`. ``exclude_wrap_modules`` and
    ``force_leaf_modules`` extend the defaults ({ModuleList, ModuleDict} and
    {MultiheadAttention}).
    """
    if _active is None or is_wrapped(module):
        return module
    chosen = choose_auto_wrap_units(
        module, min_num_params, exclude_wrap_modules, force_leaf_modules
    )
    if chosen.blocked_by_ties:
        warnings.warn(TiedParametersWarning(chosen.blocked_by_ties), stacklevel=2)
    root = module
    for parent, name, unit in chosen.units:
        wrapped = make_unit(unit, **overrides)
        if parent is None:
            root = wrapped
        elif wrapped is not unit:
            setattr(parent, name, wrapped)
    return root


def _check_min_params(min_num_params: int | float) -> int | float:
    if isinstance(min_num_params, bool) or not isinstance(min_num_params, int | float):
        raise TypeError(f"min_num_params must be a number, got {min_num_params!r}")
    if not math.isfinite(min_num_params) or min_num_params < 0:
        raise ValueError(f"min_num_params must be >= 0, got {min_num_params!r}")
    return min_num_params  # compared as a number, as torch does: never truncated


def _collect(
    root: nn.Module,
) -> tuple[
    list[_Node],
    list[tuple[list[int], tuple[int, str], int]],
    list[tuple[int, int, str]],
]:
    """Nodes of the not-yet-wrapped tree, parameter users, shared modules."""
    nodes = [_Node(root, -1, "", 0)]
    index = {id(root): 0}
    param_users: dict[int, tuple[list[int], tuple[int, str], int]] = {}
    shared_modules: list[tuple[int, int, str]] = []
    stack = [0]
    while stack:
        i = stack.pop()
        node = nodes[i]
        for pname, p in node.module._parameters.items():
            if p is None:
                continue
            entry = param_users.get(id(p))
            if entry is None:
                param_users[id(p)] = ([i], (i, pname), p.numel())
            elif i not in entry[0]:
                entry[0].append(i)
        kids = []
        for name, child in node.module._modules.items():
            if child is None or is_wrapped(child):
                continue
            if id(child) in index:  # the same module registered twice
                shared_modules.append(
                    (index[id(child)], i, _join(_path(nodes, i), name))
                )
                continue
            index[id(child)] = len(nodes)
            nodes.append(_Node(child, i, name, node.depth + 1))
            node.children.append(len(nodes) - 1)
            kids.append(len(nodes) - 1)
        stack.extend(reversed(kids))
    # Every child gets a larger index than its parent: the passes below rely on it.
    return nodes, list(param_users.values()), shared_modules


def _lca(nodes: list[_Node], users: list[int]) -> int:
    a = users[0]
    for b in users[1:]:
        while nodes[a].depth > nodes[b].depth:
            a = nodes[a].parent
        while nodes[b].depth > nodes[a].depth:
            b = nodes[b].parent
        while a != b:
            a, b = nodes[a].parent, nodes[b].parent
    return a


def _post_order(nodes: list[_Node]) -> list[int]:
    out: list[int] = []
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        i, done = stack.pop()
        if done:
            out.append(i)
            continue
        stack.append((i, True))
        stack.extend((c, False) for c in reversed(nodes[i].children))
    return out


def _path(nodes: list[_Node], i: int) -> str:
    parts = []
    while i > 0:
        parts.append(nodes[i].name)
        i = nodes[i].parent
    return ".".join(reversed(parts))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
