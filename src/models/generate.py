"""Autoregressive decoding: a key/value cache for the native families and the
sampling loop (nanoGPT's ``generate``, with the cache).

A family whose spec sets ``kv_cache`` (GPT, Llama) takes ``forward(idx, cache=cache,
positions=...)``: ``idx`` holds only the tokens not yet seen, at positions
``cache.pos`` onwards (:meth:`KVCache.positions`, what the loop passes), and
each attention layer appends their keys and values to its slot of the cache and
attends over everything cached. Without a cache (``cache=None``, training) the forward
is the plain causal one, unchanged.

The cache holds at most the model's context (``model.block_size`` /
``model.max_seq_len``) tokens. Past it, decoding goes on as nanoGPT's does without a
cache: each new token is predicted from the last ``context`` tokens, recomputed (the
learned or rotary positions restart at 0 for that window). So greedy decoding with
and without the cache gives the same tokens at any length (tests/test_research_loop.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerKV:
    """One attention layer's cached keys and values, ``(B, kv_heads, context, D)``,
    allocated on the first call (shape, dtype and device of the first keys)."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """Causal attention of the new queries ``q`` (B, heads, T, D) over the cached
        keys and values plus the new ``k``, ``v`` (appended to the cache)."""
        pos, T = self.cache.pos, k.size(2)
        if pos + T > self.cache.context:
            raise ValueError(
                f"KV cache full: {pos} cached + {T} new tokens > {self.cache.context}"
            )
        if self.k is None:
            B, H, _, D = k.shape
            self.k = k.new_empty(B, H, self.cache.context, D)
            self.v = v.new_empty(B, H, self.cache.context, D)
        self.k[:, :, pos : pos + T] = k
        self.v[:, :, pos : pos + T] = v
        keys, values = self.k[:, :, : pos + T], self.v[:, :, : pos + T]
        mask = None
        if pos and T > 1:  # new query i sees the cache and new tokens up to i
            mask = torch.ones(T, pos + T, dtype=torch.bool, device=q.device)
            mask = mask.tril(diagonal=pos)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=pos == 0, enable_gqa=enable_gqa
        )


class KVCache:
    """Keys and values of the tokens decoded so far, one :class:`LayerKV` per
    attention layer (``cache[i]``), for up to ``context`` tokens. The model's forward
    calls :meth:`advance` once its layers have appended the new tokens."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.pos = 0  # tokens cached (the position of the next new token)
        self._layers: dict[int, LayerKV] = {}

    def __getitem__(self, layer: int) -> LayerKV:
        if layer not in self._layers:
            self._layers[layer] = LayerKV(self)
        return self._layers[layer]

    def positions(self, n: int, device: torch.device) -> torch.Tensor:
        """The positions of ``n`` new tokens: right after the cached ones."""
        return torch.arange(self.pos, self.pos + n, device=device)

    def advance(self, n: int) -> None:
        self.pos += n


def next_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, V): the most likely one when
    ``temperature`` is 0 (greedy), else drawn from the softmax of ``logits /
    temperature`` restricted to the ``top_k`` most likely (None: all). Ids from
    ``vocab_size`` on (a vocabulary padded past the tokenizer's) are never chosen."""
    logits = logits.float()
    if vocab_size is not None and vocab_size < logits.size(-1):
        logits = logits[:, :vocab_size]
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    context: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    kv_cache: bool = True,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``idx`` (B, T) followed by ``max_new_tokens`` tokens of ``model``
    (``forward(idx[, cache=...]) -> (logits, _)``), each from :func:`next_token`.

    ``context``: the model's window; ``kv_cache``: feed only the new token each step
    (the model must take ``cache=``), else recompute the window every step.
    ``agree``: applied to each step's new tokens (on several ranks, rank 0's
    broadcast, so every rank feeds its sharded model the same tokens).
    """
    model.eval()
    cache = KVCache(context) if kv_cache else None
    new = idx
    for _ in range(max_new_tokens):
        if cache is not None and cache.pos + new.size(1) <= context:
            positions = cache.positions(new.size(1), new.device)
            logits, _ = model(new, cache=cache, positions=positions)
        else:  # no cache, or past the window: the last `context` tokens, recomputed
            cache = None
            logits, _ = model(idx[:, -context:])
        new = next_token(logits[:, -1], temperature, top_k, generator, vocab_size)
        if agree is not None:
            new = agree(new)
        idx = torch.cat((idx, new), dim=1)
    return idx
