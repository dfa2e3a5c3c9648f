"""The wrap plan: which units a model has, how big they are, what a rank holds.

The "small visualization" asked for in the original auto-wrap design: a list of units
(module path, class, parameter count, bytes per rank) that prints as a tree; the
planner (src/planner/estimate.py) estimates the training peak from it. It reads the tags that ``make_unit`` leaves on each unit,
so it works on a sharded model and on one built on the meta device with the ``plan``
backend (which shards nothing and allocates nothing).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch.nn as nn

from src.text import plural

from .backends import canonical_name
from .float8 import is_float8_linear
from .layout import ParallelLayout
from .tensor_parallel import tp_modules
from .wrap import UnitInfo, is_wrapped

GIB = 2**30
MIB = 2**20


@dataclass
class Unit:
    path: str  # canonical module path; "" is the root
    cls: str
    numel: int
    bytes_per_rank: int
    #: elements one rank holds before data-parallel sharding (its tensor-parallel
    #: shard of each parameter; ``numel`` without tensor parallelism)
    local_numel: int = -1
    #: of those, the weights of its float8 linear layers (``precision=float8``),
    #: which FSDP2's float8 all-gather moves and holds at one byte each
    float8_numel: int = 0
    #: of ``numel``, the elements that train (``requires_grad``: not frozen, not a
    #: LoRA base weight); -1: all of them
    trained_numel: int = -1
    #: its parameter tensors (what an optimizer step over DTensors dispatches per)
    tensors: int = 0

    def __post_init__(self) -> None:
        if self.local_numel < 0:
            self.local_numel = self.numel
        if self.trained_numel < 0:
            self.trained_numel = self.numel

    def trained(self, n: int) -> int:
        """The trained share of ``n`` (bytes or elements of this unit)."""
        return (
            n
            if self.trained_numel == self.numel
            else n * self.trained_numel // max(1, self.numel)
        )


@dataclass
class WrapPlan:
    units: list[Unit]
    #: the run's parallel layout (an int: that many ranks, sharding only)
    layout: ParallelLayout | int
    total_numel: int
    #: (module path, style) of each tensor-parallelised module
    tp_modules: list[tuple[str, str]] = field(default_factory=list)
    #: pipeline parallelism: the plan is one pp rank's stages (``stages`` of
    #: ``num_stages``)
    stages: tuple[int, ...] = ()
    num_stages: int = 0
    #: trained elements of parameters two modules share (a tied embedding and output
    #: head): backward sums their two gradients, one more of that size alive
    tied_numel: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.layout, int):
            self.layout = ParallelLayout(self.layout)

    @property
    def world_size(self) -> int:
        """The ranks the plan's units live on: one pipeline stage's (the world's
        without pipeline parallelism)."""
        return self.layout.stage_size

    @property
    def shard_size(self) -> int:
        return self.layout.fsdp_shard

    def describe_layout(self) -> str:
        """How the ranks hold the parameters, e.g. ``2 x 2 mesh (replicate x shard)``;
        under pipeline parallelism, also which stage(s) the plan is."""
        stage = self._stage_layout()
        pp = self.layout.pp
        if pp == 1:
            return stage
        which = ", ".join(map(str, self.stages))
        text = (
            f"world size {self.layout.world_size}: pp {pp} x "
            f"{self.world_size} rank(s) per stage; the plan of pp rank "
            f"{self.stages[0] % pp if self.stages else 0}'s "
            f"stage{'s' * (len(self.stages) > 1)} {which} of {self.num_stages}"
        )
        within = stage.removeprefix(f"world size {self.world_size}").lstrip(": ")
        return f"{text}, on a {within}" if within else text

    def _stage_layout(self) -> str:
        replicate, tp = self.layout.dp_replicate, self.layout.tp
        if tp > 1:
            dims = [("replicate", replicate)] if replicate > 1 else []
            dims += [("shard", self.shard_size), ("tp", tp)]
            return (
                f"world size {self.world_size}: "
                f"{' x '.join(str(n) for _, n in dims)} mesh "
                f"({' x '.join(d for d, _ in dims)}), units sharded {self.shard_size} "
                f"ways, tensor-parallel {tp} ways"
            )
        if replicate == 1:
            return f"world size {self.world_size}"
        return (
            f"world size {self.world_size}: {replicate} x {self.shard_size} mesh "
            f"(replicate x shard), each replica sharded {self.shard_size} ways"
        )

    def tp_summary(self) -> str:
        """The tensor-parallelised modules, one entry per distinct path pattern (block
        indices as ``*``), with their styles."""
        seen: dict[str, str] = {}
        for path, style in self.tp_modules:
            pattern = ".".join("*" if p.isdigit() else p for p in path.split("."))
            seen.setdefault(canonical_name(pattern) or "<root>", style)
        return ", ".join(f"{p} ({s})" for p, s in seen.items())

    def rows(self) -> list[dict]:
        """One dict per unit, for tables (wandb, CSV)."""
        return [
            {
                "path": u.path or "<root>",
                "class": u.cls,
                "params": u.numel,
                "bytes_per_rank": u.bytes_per_rank,
            }
            for u in self.units
        ]

    def tree(self, max_units: int = 40) -> str:
        """The units as an indented tree (parents before children), with sizes."""
        units = sorted(self.units, key=lambda u: _sort_key(u.path))
        lines = [
            f"wrap plan: {plural(len(self.units), 'unit')}, "
            f"{_count(self.total_numel)} params, "
            f"{_bytes(self.bytes_per_rank())} of parameters per rank "
            f"({self.describe_layout()})"
        ]
        shown = units if len(units) <= max_units else units[: max_units - 1]
        for u in shown:
            indent = "  " * _nesting(u.path, units)
            lines.append(
                f"  {indent}{u.path or '<root>'} ({u.cls}): {_count(u.numel)} params, "
                f"{_bytes(u.bytes_per_rank)}/rank"
            )
        if len(shown) < len(units):
            lines.append(f"  ... {len(units) - len(shown)} more units")
        if self.tp_modules:
            lines.append(
                f"  tensor-parallel ({self.layout.tp} ways): {self.tp_summary()}"
            )
        return "\n".join(lines)

    def bytes_per_rank(self) -> int:
        return sum(u.bytes_per_rank for u in self.units)

    def trained_bytes_per_rank(self) -> int:
        """Of :meth:`bytes_per_rank`, the parameters that train (their gradients and
        optimizer state are the model's)."""
        return sum(u.trained(u.bytes_per_rank) for u in self.units)


def wrap_plan(model: nn.Module, layout: ParallelLayout | int = 1) -> WrapPlan:
    """The units of a wrapped (or ``plan``-backend) model, in module order; bytes per
    rank are for the layout's sharding (``layout.fsdp_shard`` ways, within each HSDP
    replica) of what each tp rank holds. An int ``layout``: that many ranks, each
    sharding."""
    return model_units(model).on(layout)


@dataclass(frozen=True)
class ModelUnits:
    """A model's units whatever the layout: the walk over its modules (a 70B model's
    takes ~35 ms), which a planner laying one meta model out on many rank counts
    does once (:meth:`on`)."""

    units: tuple[Unit, ...]  # bytes_per_rank unset: the layout's
    infos: tuple[UnitInfo, ...]
    tp_modules: tuple[tuple[str, str], ...]
    tied_numel: int

    def on(self, layout: ParallelLayout | int = 1) -> WrapPlan:
        """The :class:`WrapPlan` of these units on ``layout``."""
        plan = WrapPlan([], layout, 0, list(self.tp_modules))
        for unit, info in zip(self.units, self.infos, strict=True):
            unit = copy.copy(unit)
            unit.bytes_per_rank = info.bytes_per_rank(plan.shard_size)
            plan.units.append(unit)
        plan.total_numel = sum(u.numel for u in plan.units)
        plan.tied_numel = self.tied_numel
        return plan


def model_units(model: nn.Module) -> ModelUnits:
    """The :class:`ModelUnits` of a wrapped (or ``plan``-backend) model."""
    units, infos = [], []
    for name, module in model.named_modules(remove_duplicate=True):
        info: UnitInfo | None = module.__dict__.get("_sharding_unit_info")
        if info is None or not is_wrapped(module):
            continue
        infos.append(info)
        units.append(
            Unit(
                path=canonical_name(name, model),
                cls=_class_name(module),
                numel=info.numel,
                bytes_per_rank=0,
                local_numel=sum(rows * row for rows, row, _ in info.shapes),
                tensors=len(info.shapes),
            )
        )
    _count_float8(model, units)
    _count_trained(model, units)
    return ModelUnits(
        tuple(units), tuple(infos), tuple(tp_modules(model)), _tied_numel(model)
    )


def _tied_numel(model: nn.Module) -> int:
    """Trained elements of the parameters that more than one module holds."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return sum(
        p.numel() for p in model.parameters() if p.requires_grad and seen[id(p)] > 1
    )


def _owner(by_path: dict[str, Unit], path: str) -> Unit | None:
    """The innermost unit around the module or parameter at ``path``."""
    parts = path.split(".")
    return next(
        (
            by_path[p]
            for p in (".".join(parts[:i]) for i in range(len(parts), -1, -1))
            if p in by_path
        ),
        None,
    )


def _count_float8(model: nn.Module, units: list[Unit]) -> None:
    """Each unit's ``float8_numel``: the weights of the float8 linear layers it
    holds (a layer belongs to the innermost unit around it)."""
    by_path = {u.path: u for u in units}
    for name, module in model.named_modules():
        if is_float8_linear(module):
            owner = _owner(by_path, canonical_name(name, model))
            if owner is not None:
                owner.float8_numel += module.weight.numel()


def _count_trained(model: nn.Module, units: list[Unit]) -> None:
    """Each unit's ``trained_numel``, where some parameter is frozen (LoRA's base
    weights, ``trainer.freeze``)."""
    params = list(model.named_parameters())
    if all(p.requires_grad for _, p in params):
        return
    by_path = {u.path: u for u in units}
    for u in units:
        u.trained_numel = 0
    for name, p in params:
        owner = _owner(by_path, canonical_name(name, model).rpartition(".")[0])
        if p.requires_grad and owner is not None:
            owner.trained_numel += p.numel()


def _class_name(module: nn.Module) -> str:
    inner = getattr(module, "_fsdp_wrapped_module", module)
    name = type(inner).__name__
    # FSDP2 swaps in a subclass named FSDP<Class>.
    return name[4:] if name.startswith("FSDP") and len(name) > 4 else name


def _sort_key(path: str) -> tuple:
    # numeric names (list indices) in numeric order, before named siblings
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def _nesting(path: str, units: list[Unit]) -> int:
    if not path:
        return 0
    return sum(
        1
        for u in units
        if u.path != path and (not u.path or path.startswith(u.path + "."))
    )


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"
