"""What a model family tells the planner about its activations (see src/planner/activations.py).

Each family has a function ``(config, micro_batch, seq_len, act_bytes, checkpointing,
every) -> ActivationBytes`` next to its FLOPs formula: the bytes autograd keeps for one
micro-batch on one rank, and the short-lived buffers of the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

# The modes the sharding layer's per-unit transform implements (one list for both).
from src.sharding import CHECKPOINTING


@dataclass(frozen=True)
class ActivationBytes:
    """Activation memory of one micro-batch on one rank, in bytes.

    - ``saved``: kept by autograd for all blocks from forward until each block's
      backward (with checkpointing: what the checkpoints keep);
    - ``head``: kept by the embedding, final norm, output head and loss (the loss's
      fp32 log-probabilities included), freed first in backward;
    - ``loss_transient``: the loss's backward buffers, alive while ``head`` still is;
    - ``block_transient``: the largest backward working set inside one block (with
      checkpointing, the recomputed block's activations as well), alive once ``head``
      is freed.
    """

    saved: int
    head: int
    loss_transient: int
    block_transient: int

    @property
    def peak(self) -> int:
        """The most held at once in one forward + backward."""
        return self.saved + max(self.head + self.loss_transient, self.block_transient)


def backward_peak(kept: list[int], excess: list[int]) -> int:
    """``block_transient`` of blocks that keep ``kept[i]`` bytes each and whose
    backward holds at most ``excess[i]`` bytes above that: backward runs from the
    last block to the first; while block ``b`` runs, blocks ``0..b`` still hold what
    they kept. The largest of these, minus everything kept (counted in ``saved``)."""
    peak, alive = 0, sum(kept)
    for b in reversed(range(len(kept))):
        peak = max(peak, alive + excess[b])
        alive -= kept[b]
    return peak - sum(kept)


def backward_blocks(
    kept: list[int], full: int, checkpointed: list[bool], work: int
) -> int:
    """:func:`backward_peak` of blocks that keep ``kept[i]`` bytes (``full`` without
    checkpointing): a checkpointed block has its dropped activations back
    (``full - kept[b]``) while its backward runs, and ``work`` bytes of gradients are
    in flight."""
    return backward_peak(
        kept,
        [
            (full - k if c else 0) + work
            for k, c in zip(kept, checkpointed, strict=True)
        ],
    )


def checkpointed_blocks(layers: int, checkpointing: str, every: int) -> list[bool]:
    """Which of ``layers`` blocks src/sharding/transforms.py checkpoints: ``full``
    blocks 0, ``every``, 2 ``every``, ...; ``selective`` every block."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}")
    every = every if checkpointing == "full" else 1
    return [checkpointing != "none" and i % every == 0 for i in range(layers)]


def block_activations(
    layers: int,
    block: int,
    kept: dict[str, int],
    checkpointing: str,
    every: int,
    head: int,
    loss_transient: int,
    work: int,
) -> ActivationBytes:
    """The :class:`ActivationBytes` of ``layers`` blocks that each save ``block``
    bytes, or ``kept[checkpointing]`` when checkpointed (:func:`checkpointed_blocks`).
    ``work``: the gradients in flight in one block's backward."""
    ckpt = checkpointed_blocks(layers, checkpointing, every)
    kept_per_block = [kept[checkpointing] if c else block for c in ckpt]
    return ActivationBytes(
        saved=sum(kept_per_block),
        head=head,
        loss_transient=loss_transient,
        block_transient=backward_blocks(kept_per_block, block, ckpt, work),
    )
