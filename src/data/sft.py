"""``data=chat``: supervised fine-tuning on conversations (docs/finetune.md).

The conversations of ``data.paths`` (JSONL, one ``messages`` list per line) are
rendered by the chat template and tokenized once into the token cache with a loss
mask beside the tokens (src/data/chat.py, src/data/token_cache.py); corpus pinning,
the validation split (the last ``data.val_fraction`` of the bytes, whole
conversations) and data.json are those of ``data=files``.

Batches are rows of whole conversations (:class:`ChatBatches`), not windows at
random offsets: a reply is never trained without its prompt. Conversations are
packed in order into rows of ``block_size + 1`` tokens, the rest of a row padded
with the end-of-document token; with ``data.packing=documents`` (required) each
attends only to itself and the step's loss is the mean over the global batch's
trained tokens (src/trainer/step.py). A conversation longer than a row is cut to
one row (said once, with how many).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from src.data.sources import GlobalBatches, TokenStream

log = logging.getLogger(__name__)


class ChatBatches(GlobalBatches):
    """Global batches of rows of whole conversations (see the module's doc): the
    rows of ``(step, micro_step)`` drawn by a generator seeded as
    :class:`GlobalBatches`'s windows, targets -1 where the mask says the token is
    not trained (``stream``: a split of conversations, with its mask and the end of
    a conversation's id)."""

    def __init__(
        self,
        stream: TokenStream,
        global_batch_size: int,
        block_size: int,
        seed: int,
    ):
        self._hold(stream, global_batch_size, block_size, seed)
        self.eos_id = stream.eos_id
        self.starts, self.stops = self._pack(np.asarray(stream.tokens))

    def _pack(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``[start, stop)`` in the stream: whole conversations, in order,
        while they fit ``block_size + 1`` tokens."""
        width = self.block_size + 1
        ends = np.flatnonzero(tokens == self.eos_id) + 1
        if len(ends) == 0 or ends[-1] != len(tokens):  # a last one cut by the cap
            ends = np.append(ends, len(tokens))
        starts, stops, cut = [], [], 0
        begin = 0
        for end in ends.tolist():
            if starts and end - starts[-1] <= width:
                stops[-1] = end  # fits the current row
            else:
                starts.append(begin)
                stops.append(min(end, begin + width))
                cut += end - begin > width
            begin = end
        if cut:
            log.warning(
                "data=chat: %d of %d conversations are longer than model.block_size "
                "+ 1 = %d tokens: cut to one row (their tails are not trained)",
                cut,
                len(ends),
                width,
            )
        return np.array(starts, dtype=np.int64), np.array(stops, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    def _gather(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        width = self.block_size + 1
        tokens = np.full((len(rows), width), self.eos_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=bool)
        for i, r in enumerate(rows.tolist()):
            a, b = int(self.starts[r]), int(self.stops[r])
            tokens[i, : b - a] = self.stream.tokens[a:b]
            mask[i, : b - a] = self.stream.mask[a:b]
        windows = torch.from_numpy(tokens)
        y = windows[:, 1:].masked_fill(~torch.from_numpy(mask[:, 1:]), -1)
        return windows[:, :-1].contiguous(), y.contiguous()

    def get(
        self, step: int, micro_step: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s rows of the global batch of ``(step, micro_step)``."""
        rows = self._rows(rank, world_size)
        rng = np.random.default_rng([self.seed, step, micro_step])
        return self._gather(
            rng.integers(0, self.num_rows, self.global_batch_size)[rows]
        )

    def covering_batches(self) -> int:
        """The fewest :meth:`val_batches` that hold every row."""
        return max(1, -(-self.num_rows // self.global_batch_size))

    def val_batches(
        self, n: int, rank: int, world_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed batches of rows evenly spaced over the split."""
        rows = self._rows(rank, world_size)
        ids = np.linspace(0, self.num_rows - 1, n * self.global_batch_size)
        ids = ids.round().astype(np.int64).reshape(n, self.global_batch_size)
        return [self._gather(batch[rows]) for batch in ids]
