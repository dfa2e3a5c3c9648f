"""How a packed window's documents are read: ``data.packing`` (docs/data.md).

Windows are cut from the token stream, where every document ends with the
tokenizer's end-of-document token. ``stream`` reads a window as one sequence (plain
causal attention across documents). ``documents`` reads it as the documents in it
(:class:`Documents`): each token's document id, counted from the row's start (an
end-of-document token belongs to the document it ends), for the model's attention
mask and per-document positions (src/models/attention.py); and the targets with the
loss at each document's first token dropped (the token after an end-of-document
token is not predicted from the previous document: torchtitan's choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ``data.packing``'s values; the first is the default.
PACKINGS = ("stream", "documents")
#: The first steps whose batches measure the mean attention span (MFU's count).
SPAN_STEPS = 8


@dataclass(frozen=True)
class Documents:
    """``data.packing=documents`` with the run's end-of-document token id."""

    eos_id: int

    def ids(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T) document ids: 0 at each row's start, one more
        after every end-of-document token."""
        ends = (x == self.eos_id).long()
        return ends.cumsum(1) - ends

    def targets(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` with -1 (ignored) where the input is an end-of-document token: the
        target there is the next document's first token."""
        return y.masked_fill(x == self.eos_id, -1)

    def last(self, ids: list[int]) -> list[int]:
        """A prompt's last document: the tokens after its last end-of-document
        token (the end token alone where none follow: a document starts)."""
        ends = [i for i, t in enumerate(ids) if t == self.eos_id]
        return (ids[ends[-1] + 1 :] or [self.eos_id]) if ends else ids

    def until_end(self, row: list[int], start: int) -> list[int]:
        """A decoded ``row`` (the prompt's ``start`` tokens, then the new ones) up
        to its first new end-of-document token, left out: the document ends."""
        new = row[start:]
        return (
            row[:start] + new[: new.index(self.eos_id) if self.eos_id in new else None]
        )

    def attention_span(self, x: torch.Tensor) -> float:
        """The keys a token's query sees under the full-square count of a sequence
        (T for plain causal attention, as FLOP counts take it): the mean over the
        tokens of their document's length, i.e. the sum of the documents' squared
        lengths over the tokens."""
        ids = self.ids(x)
        counts = torch.zeros(ids.shape, dtype=torch.float64)
        counts.scatter_add_(1, ids.cpu(), torch.ones(ids.shape, dtype=torch.float64))
        return float((counts**2).sum() / ids.numel())


def mean_attention_span(documents: Documents, batches, steps: int) -> float:
    """:meth:`Documents.attention_span` over the first micro-batches of the first
    ``steps`` steps (at most :data:`SPAN_STEPS`; ``batches``: src/data/sources.py
    ``GlobalBatches``), for the attention FLOPs a document-masked step computes."""
    steps = range(max(1, min(steps, SPAN_STEPS)))
    rows = [batches.get(step, 0, 0, 1)[0] for step in steps]
    return documents.attention_span(torch.cat(rows))
