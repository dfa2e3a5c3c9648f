"""Context parallelism: each sequence split over the ``cp`` ranks of the mesh.

The all-gather form (as Llama 3 was trained): every rank of a cp group reads the
same sequences and keeps 1/C of each, load-balanced for causal attention: of the
2C equal chunks, rank i keeps chunks i and 2C-1-i (early chunks attend to few keys,
late ones to many, so each rank gets one of each). Positions (and RoPE) use the
global indices of the tokens kept. Attention gathers K and V over the group
(torch's functional ``all_gather_single``: its backward reduce-scatters the
gradients back to their rank) and masks by global position, so any kernel
works, on gloo too: SDPA gets an additive (T/C x T) mask, made once per forward and
shared by every layer (at very long sequences its T^2/C elements are what a
mask-free per-chunk kernel would save; not built). Given the whole rows' document
ids (packing by documents), the mask also keeps each query within its document:
one (T/C x T) mask per row.

The loss is each rank's mean over its T/C tokens: all ranks hold the same number of
(never ignored) tokens, so the mean of the ranks' means is the mean over the
sequences, and FSDP averaging gradients over ``dp_shard x cp`` gives the gradient
of the global batch's mean exactly as without CP. (Packing by documents ignores
some targets: the trainer's step then weighs each rank's mean by its count.)

A model is given context parallelism as arguments of its forward
(:meth:`ContextParallel.forward_kwargs`: the global ``positions`` of the rank's
tokens and the ``cp`` object its attention layers call), by whoever runs the step
and holds the object (the backend's ``cp``); activation checkpointing's recomputation
gets the same arguments. Without them, models run unchanged. Nothing here is global:
the backend enters :meth:`ContextParallel.entered` around forward and backward
(``Backend.loss_context``) only to bound the shared mask's lifetime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_single
from torch.distributed.device_mesh import DeviceMesh


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` keeps of a ``seq_len`` sequence:
    chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` equal ones, in that order."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"a sequence of {seq_len} tokens does not split into 2 x {cp} equal chunks"
        )
    s = seq_len // (2 * cp)
    first, second = rank * s, (2 * cp - 1 - rank) * s
    return torch.cat((torch.arange(first, first + s), torch.arange(second, second + s)))


def gathered_positions(seq_len: int, cp: int) -> torch.Tensor:
    """The global positions of the keys after the all-gather: each rank's
    :func:`chunk_positions`, in rank order."""
    return torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])


def unshard(local: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`ContextParallel.shard` (in rank
    order) along ``dim``: the inverse of the load-balanced split."""
    cp = len(local)
    seq_len = sum(t.size(dim) for t in local)
    order = torch.argsort(gathered_positions(seq_len, cp))
    return torch.cat(local, dim).index_select(dim, order.to(local[0].device))


def position_mask(
    q_pos: torch.Tensor, kv_pos: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The additive causal mask of queries at global positions ``q_pos`` over keys
    at ``kv_pos`` (any order): 0 where ``kv_pos <= q_pos``, -inf elsewhere (the form
    SDPA turns a boolean mask into, made once and shared by every layer)."""
    mask = torch.zeros(q_pos.numel(), kv_pos.numel(), dtype=dtype, device=q_pos.device)
    return mask.masked_fill_(kv_pos[None, :] > q_pos[:, None], float("-inf"))


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA of ``q`` over ``k``, ``v`` with the :func:`position_mask` ``mask``."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=enable_gqa,
    )


class ContextParallel:
    """One rank's place in its cp group: splits sequences, gives positions and
    attends over the gathered keys and values."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self._mask: tuple[tuple, torch.Tensor] | None = None
        # the whole sequences' document ids of this forward (None: one each)
        self._docs: torch.Tensor | None = None

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's two chunks of ``t`` along ``dim`` (the sequence)."""
        pos = chunk_positions(t.size(dim), self.size, self.rank)
        return t.index_select(dim, pos.to(t.device))

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens."""
        return chunk_positions(local_len * self.size, self.size, self.rank).to(device)

    def forward_kwargs(
        self, local: torch.Tensor, docs: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """What a model's forward takes for this rank's tokens ``local`` (rows,
        T/C): their global ``positions`` and this object as ``cp``, which its
        attention layers call (:meth:`attention`). ``docs`` (rows, T): the whole
        sequences' document ids, which the attention then stays within (until
        :meth:`entered` ends; the caller gives the positions within documents)."""
        self._docs, self._mask = docs, None
        return {"positions": self.positions(local.size(1), local.device), "cp": self}

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        """Attention of this rank's queries (B, heads, T/C, head_dim) over the keys
        and values of the whole sequence, gathered from the group (one collective);
        ``kwargs`` as :func:`masked_attention`'s."""
        # (C * 2, B, heads, T/C, head_dim) -> (2, B, heads, T, head_dim), rank order
        kv = all_gather_single(torch.stack((k, v)), 0, self.group)
        kv = kv.unflatten(0, (self.size, 2)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        mask = self.mask(q.size(-2), q.dtype, q.device)
        return masked_attention(q, kv[0], kv[1], mask, **kwargs)

    def mask(
        self, local_len: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The :func:`position_mask` of this rank's queries over the gathered keys
        (kept until :meth:`entered` ends: every layer of a forward shares it)."""
        key = (local_len, dtype, device)
        if self._mask is None or self._mask[0] != key:
            q_pos = self.positions(local_len, device)
            kv_pos = gathered_positions(local_len * self.size, self.size).to(device)
            mask = position_mask(q_pos, kv_pos, dtype)
            if self._docs is not None:  # and within documents: (rows, 1, T/C, T)
                docs = self._docs.to(device)
                same = self.shard(docs)[:, :, None] == docs[:, kv_pos][:, None, :]
                mask = mask.masked_fill(~same[:, None], float("-inf"))
            self._mask = key, mask
        return self._mask[1]

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The mask made inside (:meth:`mask`) and the document ids are dropped on
        leaving: they live as long as a forward and its backward."""
        try:
            yield
        finally:
            self._mask = self._docs = None
