"""Causal attention of the native families, plain or within documents
(``data.packing=documents``: docs/data.md).

A packed sequence's document ids (``docs``, (B, T): a token's document, counted from
0 in its row) give two things, made once per forward by the decoder
(src/models/decoder.py) and shared by every layer: each token's position in its own
document (:func:`document_positions`) and a mask that lets a query see only the
earlier keys of its own document (:func:`document_mask`). :func:`attention_kernel`
chooses the kernel by device: FlexAttention with a block mask on CUDA (only the
blocks the documents keep are computed), SDPA with a boolean (B, 1, T, T) mask
elsewhere (FlexAttention has no CPU backward in torch 2.13). :func:`attend` runs
whichever mask it is given, or SDPA's own causal mask without one.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position in its own document: (B, T) ``docs`` -> (B, T) int64,
    0 at every document's first token (and at the row's first)."""
    index = torch.arange(docs.size(1), device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values
    return index - first


@functools.cache
def _flex_attention() -> Any:
    """FlexAttention compiled once (its eager form materialises the scores), or
    None where it does not import."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:  # pragma: no cover - every torch this project supports
        return None
    return torch.compile(flex_attention, dynamic=False)


def attention_kernel(device: torch.device, dropout: bool = False) -> str:
    """The kernel document masks run on: ``flex`` (FlexAttention, a block mask) on
    CUDA where it imports and no attention dropout is asked (it has none), else
    ``sdpa`` (a boolean mask)."""
    if device.type == "cuda" and not dropout and _flex_attention() is not None:
        return "flex"
    return "sdpa"


def kernel_line(device: torch.device, dropout: bool = False) -> str:
    """The run header's words for the documents' attention on ``device``."""
    if attention_kernel(device, dropout) == "flex":
        return "FlexAttention, block mask"
    return "SDPA, boolean mask"


def document_mask(docs: torch.Tensor, dropout: bool = False) -> Any:
    """The mask of causal attention within documents, for :func:`attend`: a
    FlexAttention ``BlockMask`` or a boolean (B, 1, T, T) tensor (True: attend), by
    :func:`attention_kernel`."""
    B, T = docs.shape
    if attention_kernel(docs.device, dropout) == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        def within(b, h, q, kv):
            return (docs[b, q] == docs[b, kv]) & (kv <= q)

        return create_block_mask(within, B, None, T, T, device=docs.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any = None,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of ``q`` over ``k``, ``v`` (B, heads, T, head_dim): SDPA's
    own causal mask without ``mask``, else within the documents of a
    :func:`document_mask`."""
    if mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa
        )
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=enable_gqa
        )
    return _flex_attention()(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
