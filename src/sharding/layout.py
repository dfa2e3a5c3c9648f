"""The run's parallel layout: one object for the degree of every mesh dimension.

A run's ranks form one device mesh. Its dimensions, outermost first, are
:data:`MESH_DIMS`: ``pp`` (pipeline stages), ``dp_replicate`` (HSDP replica groups),
``dp_shard`` (the ranks FSDP shards one replica over), ``cp`` (context parallelism:
each sequence split over these ranks) and ``tp`` (tensor parallelism: each block's
matmuls split over them). Consecutive ranks share the innermost dimensions, so on
GPUs the chattiest groups (tp, then cp and the shard group) stay inside a node.
Expert parallelism is no dimension of its own: as in torchtitan, its ``ep`` ranks
are borrowed from ``dp_shard`` (they hold the same dense weights anyway), so ``ep``
must divide it; with tensor parallelism they are borrowed from ``dp_shard x tp``
with the whole tp group inside (``ep`` is ``tp`` times a divisor of ``dp_shard``):
the ranks of a tp group see the same tokens, so each sends its share of them to the
experts, and every rank of the group holds its own experts. (Expert parallelism
over context-parallel ranks is not built.) Every mesh dimension and group has its
name in :class:`Axis`.

:class:`ParallelLayout` holds the degrees and is checked once, when it is made: a
degree that does not fit raises :class:`LayoutError` naming the dimension (the config
layer names its key). It is plain data, so a launcher hands it to its ranks; each rank
builds the mesh once (:meth:`ParallelLayout.build_mesh`) and takes its named groups
from the :class:`ParallelMesh`: the ranks FSDP shards over, the tp and pp groups, and
the data-parallel index the data loader reads its rows by. This module is the only
one in src/ that calls ``init_device_mesh``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class Axis(StrEnum):
    """The name of every dimension and group of the device mesh."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    #: FSDP's shard group with context parallelism: ``dp_shard x cp``
    DP_SHARD_CP = "dp_shard_cp"
    #: ``dp_replicate x dp_shard x cp``, flattened to be split as (replicate, shard)
    DP_HSDP_CP = "dp_hsdp_cp"
    #: ``dp_shard x tp``, flattened: a value partial over both (the gradient
    #: norm of FSDP's tensor-parallel parameters) is then one all-reduce, not two
    DP_SHARD_TP = "dp_shard_tp"
    #: expert parallelism: the ranks a MoE's experts are split over
    EP = "ep"
    #: ... their part of ``dp_shard`` (with tp, ``ep`` is this times tp)
    EP_SHARD = "ep_shard"
    #: the rest of ``dp_shard``: the ranks each expert is FSDP-sharded over
    EXPERT_SHARD = "dp_shard_mod_ep"


#: The mesh dimensions, outermost first (the order ranks are laid out in).
MESH_DIMS = (Axis.PP, Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)
#: The degrees a layout is made of (``dp_shard`` is what the world size leaves).
DEGREES = (Axis.PP, Axis.DP_REPLICATE, Axis.CP, Axis.TP, Axis.EP)


class LayoutError(ValueError):
    """A degree that does not fit the world size (``dim``: which one, from
    :data:`DEGREES`)."""

    def __init__(self, dim: str, message: str) -> None:
        super().__init__(message)
        self.dim = dim


@dataclass(frozen=True)
class ParallelLayout:
    """How a run's ``world_size`` ranks are split over the mesh dimensions."""

    world_size: int = 1
    pp: int = 1  # pipeline stages
    dp_replicate: int = 1  # HSDP replica groups
    cp: int = 1  # ranks each sequence is split over
    tp: int = 1  # ranks each block's matmuls are split over
    ep: int = 1  # ranks the experts are split over (taken from dp_shard)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f.name, f"got {value!r}, expected an integer >= 1")
        world, r = self.world_size, self.dp_replicate
        if world % r:
            raise LayoutError(
                "dp_replicate",
                f"{r} does not divide the {world} devices (each replica group "
                "shards over devices / replicate ranks)",
            )
        if (world // r) % self.tp:
            raise LayoutError(
                "tp",
                f"{self.tp} does not divide the {world // r} ranks of each replica "
                f"group ({world} devices / {r} replicas)",
            )
        if world % (r * self.tp * self.cp):
            raise LayoutError(
                "cp",
                f"{self.cp} x {r} replicas x tp {self.tp} do not divide the "
                f"{world} devices",
            )
        if world % (self.pp * r * self.cp * self.tp):
            raise LayoutError(
                "pp",
                f"{self.pp} stages x {r} replicas x tp {self.tp}"
                + (f" x cp {self.cp}" if self.cp > 1 else "")
                + f" do not divide the {world} devices",
            )
        if self.tp > 1 and self.ep > 1:
            if self.ep % self.tp or self.dp_shard % (self.ep // self.tp):
                raise LayoutError(
                    "ep",
                    f"with tensor parallelism {self.tp}, {self.ep} must be tp times "
                    f"a divisor of the {self.dp_shard} shard ranks (experts are split "
                    "over shard x tp ranks, whole tp groups)",
                )
        elif self.dp_shard % self.ep:
            raise LayoutError(
                "ep",
                f"{self.ep} does not divide the {self.dp_shard} shard ranks experts "
                "are split over",
            )

    @property
    def dp_shard(self) -> int:
        """Ranks FSDP shards one replica over (what the other degrees leave)."""
        return self.world_size // (self.pp * self.dp_replicate * self.cp * self.tp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks each parameter is sharded over (cp ranks hold the same weights, so
        FSDP shards over them too)."""
        return self.dp_shard * self.cp

    @property
    def ep_shard(self) -> int:
        """The shard ranks an expert-parallel group spans (``ep`` without tensor
        parallelism; ``ep / tp`` with it: the group is whole tp groups)."""
        return self.ep // self.tp if self.tp > 1 else self.ep

    @property
    def stage_size(self) -> int:
        """Ranks that hold one pipeline stage (the whole world without pp)."""
        return self.world_size // self.pp

    def size(self, dim: str) -> int:
        """The degree of mesh dimension ``dim`` (one of :data:`MESH_DIMS`)."""
        return getattr(self, dim)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank``: the ranks of a tp (and cp)
        group read the same rows of the batch, and so do the pp stages."""
        return rank % self.stage_size // (self.cp * self.tp)

    def stage(self, world_size: int | None = None) -> ParallelLayout:
        """The layout of the ranks that hold one pipeline stage (``pp`` = 1, the
        other degrees as they are): ``stage_size`` of them, or ``world_size`` (the
        planner's candidate rank counts)."""
        return replace(self, world_size=world_size or self.stage_size, pp=1)

    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh's (name, size) dimensions: ``dp_shard`` always, the others where
        their degree is above 1."""
        return tuple(
            (name, self.size(name))
            for name in MESH_DIMS
            if name == Axis.DP_SHARD or self.size(name) > 1
        )

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The device mesh of this layout over the initialised process group."""
        return ParallelMesh(self, device_type)

    def describe(self) -> str:
        """The data, context, tensor and expert degrees above 1, for the run's
        start-up line: ``", 2 replicas, TP2"`` (``""`` when there are none)."""
        parts = [f", {self.dp_replicate} replicas"] if self.dp_replicate > 1 else []
        parts += [
            f", {d.upper()}{self.size(d)}"
            for d in ("cp", "tp", "ep")
            if self.size(d) > 1
        ]
        return "".join(parts)


#: The degrees that do not run together (each pair: the first named when both are
#: above 1), and what is not built.
NOT_TOGETHER = (
    ("cp", "pp", "context parallelism with pipeline parallelism is not built"),
    ("ep", "pp", "expert parallelism with pipeline parallelism is not built yet"),
    ("ep", "cp", "expert parallelism with context parallelism is not built yet"),
)

#: A degree above 1 and the backend capability it needs (``Backend.CAPABILITIES``).
NEEDS = (
    ("dp_replicate", "hybrid", "hybrid sharding"),
    ("tp", "tensor_parallel", "tensor parallelism"),
    ("pp", "pipeline_parallel", "pipeline parallelism"),
    ("ep", "expert_parallel", "expert parallelism"),
    ("cp", "context_parallel", "context parallelism"),
)


def refusal(
    layout: ParallelLayout,
    backend: type | None = None,
    precision: str | None = None,
    seq_len: int | None = None,
) -> LayoutError | None:
    """Why ``layout`` cannot run with ``backend`` (a ``Backend`` class), the precision
    named ``precision`` and a model of ``seq_len`` tokens per sequence: a
    :class:`LayoutError` naming the dimension (``precision``: the precision), None
    when it can. The one rule that validation, the backends and the planner's
    search all ask (each argument left out is not checked)."""
    if backend is not None:
        for dim, capability, what in NEEDS:
            if layout.size(dim) > 1 and not getattr(backend, capability):
                from .backends import with_capability  # the registry: one floor

                able = " or sharding=".join(with_capability(capability))
                return LayoutError(
                    dim, f"{what} needs sharding={able}, not sharding={backend.name}"
                )
    for dim, other, why in NOT_TOGETHER:
        if layout.size(dim) > 1 and layout.size(other) > 1:
            return LayoutError(dim, f"{why}; use one of them")
    if backend is not None and precision is not None and not backend.float8:
        from .precision import PRECISIONS

        if precision in PRECISIONS and PRECISIONS[precision].float8:
            from .backends import with_capability

            able = " or sharding=".join(with_capability("float8"))
            return LayoutError(
                "precision",
                f"float8 needs sharding={able}, not sharding={backend.name}",
            )
    if precision == "fp16_mixed" and layout.pp > 1:
        return LayoutError(
            "precision",
            f"{precision!r}: fp16's gradient scaler with pipeline parallelism is not "
            "supported yet",
        )
    cp = layout.cp
    if seq_len is not None and cp > 1 and seq_len % (2 * cp):
        return LayoutError(
            "cp",
            f"{cp} ranks split each sequence into 2 x {cp} chunks, which do not "
            f"divide its {seq_len} tokens (the model's sequence length)",
        )
    return None


def refused_with(dim: str, layout: ParallelLayout) -> bool:
    """Whether a ``dim`` degree above 1 cannot join ``layout``'s other degrees
    (:data:`NOT_TOGETHER`): the planner's search skips such degrees."""
    return any(
        layout.size(b if a == dim else a) > 1
        for a, b, _ in NOT_TOGETHER
        if dim in (a, b)
    )


class ParallelMesh:
    """A layout's device mesh, built once, and the named groups taken from it: the
    one holder of each group (the backend, the experts and the pipeline read them
    here)."""

    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        self.layout = layout
        dims = layout.mesh_dims()
        names = tuple(n for n, _ in dims)
        #: the whole mesh, one dimension per name of ``layout.mesh_dims()``
        self.world: DeviceMesh = init_device_mesh(
            device_type, tuple(n for _, n in dims), mesh_dim_names=names
        )
        #: the mesh FSDP shards (and replicates) units on: ``dp_shard`` (x ``cp``),
        #: behind ``dp_replicate`` for HSDP
        self.fsdp: DeviceMesh = self._fsdp_mesh(names)
        self.tp: DeviceMesh | None = self._dim(Axis.TP, names)
        self.pp: DeviceMesh | None = self._dim(Axis.PP, names)
        self.cp: DeviceMesh | None = self._dim(Axis.CP, names)
        #: expert parallelism: the ranks a MoE's experts are split over, and the
        #: ones each expert is FSDP-sharded over (the shard ranks / ep, behind
        #: dp_replicate for HSDP), both from ``dp_shard`` split in two (ep inner;
        #: with tp, the ep group is that inner part x tp)
        self.ep: DeviceMesh | None = None
        self.expert_fsdp: DeviceMesh | None = None
        if layout.ep > 1:
            self._split_experts(names)
        if Axis.TP in names and Axis.CP not in names:
            # found by DTensor's redistribution where a reduction spans both
            self.world[Axis.DP_SHARD, Axis.TP]._flatten(Axis.DP_SHARD_TP)

    def _dim(self, axis: Axis, names: tuple[str, ...]) -> DeviceMesh | None:
        return self.world[axis] if axis in names else None

    def _split_experts(self, names: tuple[str, ...]) -> None:
        layout = self.layout
        inner = layout.ep_shard
        split = self.world._unflatten(
            Axis.DP_SHARD,
            (layout.dp_shard // inner, inner),
            (Axis.EXPERT_SHARD, Axis.EP_SHARD if layout.tp > 1 else Axis.EP),
        )
        if layout.tp > 1:
            self.ep = split[Axis.EP_SHARD, Axis.TP]._flatten(Axis.EP)
        else:
            self.ep = split[Axis.EP]
        outer = (Axis.DP_REPLICATE,) if Axis.DP_REPLICATE in names else ()
        self.expert_fsdp = split[(*outer, Axis.EXPERT_SHARD)]

    def _fsdp_mesh(self, names: tuple[str, ...]) -> DeviceMesh:
        if names == (Axis.DP_SHARD,):
            return self.world
        if Axis.CP not in names:
            dp = tuple(n for n in names if n in (Axis.DP_REPLICATE, Axis.DP_SHARD))
            return self.world[dp if len(dp) > 1 else dp[0]]
        if Axis.DP_REPLICATE in names:
            # (replicate, shard x cp) as its own 2-D mesh: torch deprecates slicing
            # a flattened dimension (dp_shard_cp) beside a root one
            dims = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP)
            dp = self.world[dims]._flatten(Axis.DP_HSDP_CP)
            sizes = (self.layout.dp_replicate, self.layout.fsdp_shard)
            return dp._unflatten(
                Axis.DP_HSDP_CP, sizes, (Axis.DP_REPLICATE, Axis.DP_SHARD_CP)
            )
        return self.world[Axis.DP_SHARD, Axis.CP]._flatten(Axis.DP_SHARD_CP)


def flat_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """A 1-D mesh over all ``world_size`` ranks (reading or writing a whole tensor
    as each rank's slice of it, whatever the run's layout)."""
    return ParallelLayout(world_size).build_mesh(device_type).world


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor must be for a collective on ``group`` (default: the world):
    this rank's GPU under NCCL, else the CPU (gloo)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
