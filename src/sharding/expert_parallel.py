"""Expert parallelism: each routed expert of a mixture of experts lives on one of
``ep`` ranks, and tokens travel to it and back by all-to-all.

A family's stacked experts module subclasses :class:`ExpertModule`: its parameters are
``[num_experts, ...]`` tensors. :func:`expert_parallelize` (the expert-parallel step of a
family's parallelize function, src/sharding/parallelize.py) makes each of them a DTensor
sharded on dim 0 over the ``ep`` mesh, so a rank computes with its ``num_experts / ep``
local experts, and shards the module with FSDP2 over the data-parallel ranks left
(``dp_shard / ep``; with HSDP, replicated over ``dp_replicate`` too). The
parameters keep their names and global ``[num_experts, ...]`` shape, so a checkpoint
(DCP) does not depend on ``ep``: an EP run's resumes on FSDP alone and back.

:func:`dispatch` sends each rank's assignments, grouped by expert, to the ranks
holding those experts (``all_to_all_single`` with uneven splits); the returned
:class:`Dispatched` brings the experts' outputs back (:meth:`Dispatched.combine`).
Both are differentiable: the backward of an all-to-all is the all-to-all with the
splits swapped (:class:`_AllToAll`). The experts' gradients are scaled by ``1 / ep``
(:func:`local_weight`): each one sums the tokens of its ``ep`` group, on top of the
mean FSDP takes over the data-parallel ranks it shards over.

With tensor parallelism the ep group is whole tp groups (src/sharding/layout.py), and
the ranks of a tp group hold the same tokens: each routes all of them (the same
routing on each, the router is replicated), then dispatches only its ``1 / tp``
contiguous share of the assignments grouped by expert, so every assignment is
computed exactly once; :meth:`Dispatched.combine` all-gathers the shares over the tp
group (a DTensor ``Shard(0) -> Replicate``, whose backward hands each rank its share
of the gradient back). An ep group then holds ``ep / tp`` batches, so the experts'
gradients are scaled by ``tp / ep``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from .layout import ParallelMesh
from .wrap import UnitInfo, is_wrapped, mark_unit


class ExpertModule(nn.Module):
    """A module of stacked experts (every parameter ``[num_experts, ...]``); after
    :func:`expert_parallelize`, ``parallel`` is the run's mesh, where ``ep_mesh``
    (the ranks its experts are split over; None: all experts here) and ``tp_mesh``
    (the ranks that share its tokens; None: no tensor parallelism) are read."""

    parallel: ParallelMesh | None = None

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        return self.parallel.ep if self.parallel is not None else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.parallel.tp if self.parallel is not None else None


def expert_parallelize(module: nn.Module, mesh: ParallelMesh, **fsdp: object) -> None:
    """Split each :class:`ExpertModule` under ``module`` over ``mesh.ep`` (dim 0) and
    shard it with ``fully_shard(mesh=mesh.expert_fsdp, **fsdp)``; ``mesh.tp``: the
    tp group inside each ep group, whose ranks share the tokens. Idempotent."""
    ep_mesh, tp_mesh = mesh.ep, mesh.tp
    if ep_mesh is None or mesh.expert_fsdp is None:
        raise ValueError("expert parallelism without its mesh (layout.ep is 1)")
    for m in _unsplit(module):
        ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        info = _split_info(m, ep, ep // (tp_mesh.size() if tp_mesh is not None else 1))
        for name, p in list(m.named_parameters(recurse=False)):
            if p.size(0) % ep:
                raise ValueError(
                    f"{p.size(0)} experts do not split over {ep} expert-parallel ranks"
                )
            local = p.detach().chunk(ep)[rank].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(m, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        m.parallel = mesh
        fully_shard(m, mesh=mesh.expert_fsdp, **fsdp)
        mark_unit(m, info)


def plan_experts(module: nn.Module, ep: int, shard_ranks: int) -> None:
    """For a plan (nothing allocated): record each :class:`ExpertModule` under
    ``module`` as a unit holding ``1 / ep`` of its experts, sharded over the shard
    group's ranks / ``shard_ranks`` (the ep group's part of it: ``ep``, or ``ep /
    tp`` with tensor parallelism)."""
    for m in _unsplit(module):
        mark_unit(m, _split_info(m, ep, shard_ranks))


def _unsplit(module: nn.Module) -> list[ExpertModule]:
    """The expert modules under ``module`` not split yet (a split one is a unit)."""
    return [
        m for m in module.modules() if isinstance(m, ExpertModule) and not is_wrapped(m)
    ]


def _split_info(m: ExpertModule, ep: int, shard_ranks: int) -> UnitInfo:
    """The wrap plan's record of ``m`` split over ``ep`` ranks: each holds
    ``num_experts / ep`` whole experts (what it gathers), FSDP-sharded over the
    shard group's ranks / ``shard_ranks``."""
    shapes = [
        (p.size(0) // ep, p[0].numel(), p.element_size())
        for p in m.parameters(recurse=False)
    ]
    return UnitInfo(
        numel=sum(p.numel() for p in m.parameters()), shapes=shapes, split=shard_ranks
    )


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def local_weight(w: torch.Tensor, module: ExpertModule) -> torch.Tensor:
    """This rank's experts of ``w`` (a plain tensor as is), gradient scaled by
    ``tp / ep`` (see the module docstring)."""
    if module.ep_mesh is None or not isinstance(w, DTensor):
        return w
    tp = module.tp_mesh.size() if module.tp_mesh is not None else 1
    return _ScaleGrad.apply(w.to_local(), tp / module.ep_mesh.size())


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group
        )
        return back, None, None, None


@dataclass
class Dispatched:
    """Rows received for this rank's experts, grouped by local expert."""

    rows: torch.Tensor  # (received, ...) grouped by local expert
    counts: torch.Tensor  # (local experts,) rows of each
    order: torch.Tensor  # rows[i] is the received row order[i]
    send: list[int]
    recv: list[int]
    group: dist.ProcessGroup
    bytes_moved: int  # both all-to-alls' rows sent by this rank
    tp_mesh: DeviceMesh | None = None  # combine all-gathers the tp group's shares
    shape: torch.Size | None = None  # ... of this many rows (all the assignments)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The experts' outputs (as ``rows``) back to the ranks that sent the
        rows, in the order they were sent (with a tp group: all its shares)."""
        back = torch.empty_like(out).index_copy(0, self.order, out)
        # index_copy's backward gathers by order: the inverse permutation
        mine = _AllToAll.apply(back, self.recv, self.send, self.group)
        if self.tp_mesh is None:
            return mine
        shape = (self.shape[0], *mine.shape[1:])  # every share's rows, out's width
        stride = torch.empty(shape, device="meta").stride()
        share = DTensor.from_local(
            mine, self.tp_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )
        return share.full_tensor()


def _share(
    rows: torch.Tensor, counts: torch.Tensor, tp_mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """This tp rank's contiguous share of ``rows`` (as DTensor's ``Shard(0)`` splits
    them: ``ceil(n / tp)`` each) and its rows of each expert; the backward
    all-gathers the shares' gradients."""
    n, tp, r = rows.size(0), tp_mesh.size(), tp_mesh.get_local_rank()
    size = -(-n // tp)
    lo, hi = min(r * size, n), min((r + 1) * size, n)
    mine = (
        DTensor.from_local(rows, tp_mesh, [Replicate()], run_check=False)
        .redistribute(tp_mesh, [Shard(0)])
        .to_local()
    )
    ends = counts.cumsum(0)
    starts = ends - counts
    mine_counts = (ends.clamp(max=hi) - starts.clamp(min=lo)).clamp_min(0)
    return mine, mine_counts


def dispatch(
    rows: torch.Tensor,
    counts: torch.Tensor,
    ep_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
) -> Dispatched:
    """Send ``rows`` (grouped by global expert, ``counts[e]`` of expert ``e``) to the
    ranks of ``ep_mesh`` holding those experts (rank ``r`` holds the ``r``-th
    contiguous block of experts); with ``tp_mesh``, only this tp rank's share of
    them (see the module docstring)."""
    shape = rows.shape
    if tp_mesh is not None:
        rows, counts = _share(rows, counts, tp_mesh)
    ep, group = ep_mesh.size(), ep_mesh.get_group()
    local = counts.numel() // ep
    # how many rows of each of my local experts every rank sends me
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts, group=group)
    theirs = theirs.view(ep, local)
    send = counts.view(ep, local).sum(1).tolist()
    recv = theirs.sum(1).tolist()
    got = _AllToAll.apply(rows, send, recv, group)
    # received: by source rank, then local expert; regroup by local expert
    expert = torch.repeat_interleave(
        torch.arange(local, device=counts.device).repeat(ep), theirs.reshape(-1)
    )
    order = expert.argsort(stable=True)
    row_bytes = rows[0].numel() * rows.element_size() if rows.numel() else 0
    return Dispatched(
        rows=got[order],
        counts=theirs.sum(0),
        order=order,
        send=send,
        recv=recv,
        group=group,
        bytes_moved=2 * (sum(send) - send[ep_mesh.get_local_rank()]) * row_bytes,
        tp_mesh=tp_mesh,
        shape=shape,
    )
