"""The decoder skeleton the native families share (GPT, Llama and the MoE built on
Llama): token ids -> embedding -> blocks -> final norm and head -> logits and loss,
with the token positions, the pipeline stage and the KV cache handled once, here.

A family supplies its parts: :attr:`Decoder.blocks` (its ``ModuleList``, or a
stage's :class:`~src.sharding.pipeline.StageBlocks`), :attr:`Decoder.context` (the
longest sequence it takes; ``context_key`` names it), :meth:`Decoder.embed`,
:meth:`Decoder.block_args` (what every block takes after the hidden states: Llama's
rotary cos and sin), :meth:`Decoder.head` and, if its loss is not the plain
cross-entropy, :meth:`Decoder.loss` (the MoE's balance term). Every block takes
``(x, *block_args, cache)`` and the keywords ``cp`` and ``mask``.

Nothing is read from outside the call: the positions, the documents and context
parallelism are arguments of ``forward`` (the trainer's step passes the global
positions of a rank's tokens and its ``ContextParallel``, or the tokens' document
ids; without them, positions are ``0..T-1`` after any cached tokens), and a pipeline
stage knows its role from its own ``pp_stage``, given when it was cut
(src/sharding/pipeline.py). With document ids, positions restart at each document
and every block gets the keyword ``mask`` (src/models/attention.py), made once here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from src.models.attention import document_mask, document_positions
from src.models.generate import KVCache
from src.models.spec import lm_loss

if TYPE_CHECKING:
    from src.sharding.context_parallel import ContextParallel
    from src.sharding.pipeline import StageRole


class Decoder(nn.Module):
    """The forward of a decoder-only language model; a family's model subclasses it
    and supplies the parts named in the module's docstring."""

    #: The pipeline stage this model is (None: the whole model): set on a stage when
    #: it is cut (``src.sharding.pipeline.cut_stage``), never looked up in forward.
    pp_stage: StageRole | None = None

    # -- the family's parts ---------------------------------------------------------
    @property
    def blocks(self) -> nn.Module:
        raise NotImplementedError

    #: Attention dropout in training (a document mask's kernel depends on it).
    attention_dropout = 0.0

    #: The config key of :attr:`context`, for the error past it.
    context_key = "the model's context"

    @property
    def context(self) -> int:
        raise NotImplementedError

    def embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def block_args(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss(
        self, logits: torch.Tensor, targets: torch.Tensor | None
    ) -> torch.Tensor | None:
        return lm_loss(logits, targets)

    # -- the skeleton ---------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        positions: torch.Tensor | None = None,
        cp: ContextParallel | None = None,
        docs: torch.Tensor | None = None,
    ):
        """``idx`` (B, T) token ids -> ``(logits (B, T, vocab), loss)``; ``loss`` is
        the mean cross-entropy (fp32) when ``targets`` is given (-1 ignored), else
        None. ``positions`` (T,): the tokens' positions (default ``0..T-1``, after
        the ``cache``'s); ``cp``: the context parallelism ``idx`` is this rank's
        share of (its attention layers gather the keys and values over it);
        ``docs`` (B, T): each token's document (attention stays within it and
        positions restart at its first token, unless ``positions`` are given);
        ``cache``: decoding (src/models/generate.py), ``idx`` holds the tokens after
        the cached ones. A pipeline stage (``pp_stage``) takes the previous stage's
        hidden states unless first, and returns the logits if last, else its hidden
        states."""
        stage = self.pp_stage
        start = 0 if cache is None else cache.pos
        length = start + idx.size(1) * (1 if cp is None else cp.size)
        if length > self.context:
            raise ValueError(
                f"sequence length {length} exceeds {self.context_key} {self.context}"
            )
        mask = None
        # a batch whose rows are one document each is plain causal attention
        if docs is not None and bool(docs[:, -1].any()):
            mask = document_mask(docs, self.training and self.attention_dropout > 0)
            positions = document_positions(docs) if positions is None else positions
        if positions is None:
            positions = (
                torch.arange(idx.size(1), device=idx.device)
                if cache is None
                else cache.positions(idx.size(1), idx.device)
            )
        x = self.embed(idx, positions) if stage is None or stage.first else idx
        x = self._blocks(x, self.block_args(positions), cache, cp, mask)
        if stage is not None:
            return self.head(x) if stage.last else x
        logits = self.head(x)
        return logits, self.loss(logits, targets)

    def _blocks(
        self,
        x: torch.Tensor,
        args: tuple[torch.Tensor, ...],
        cache: KVCache | None,
        cp: ContextParallel | None,
        mask: object = None,
    ) -> torch.Tensor:
        if cache is None:
            kwargs = {} if cp is None else {"cp": cp}
            if mask is not None:
                kwargs["mask"] = mask
            for block in self.blocks:
                x = block(x, *args, **kwargs)
            return x
        for i, block in enumerate(self.blocks):
            x = block(x, *args, cache[i])
        cache.advance(x.size(1))
        return x
