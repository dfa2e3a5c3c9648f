"""Data mixtures: several corpora sampled with weights, ``data.weights`` beside
``data.paths`` (``data=files``/``text``).

Each glob of ``data.paths`` is one **source**, tokenized into a token cache entry of
its own (its own train/val split, by ``data.val_fraction``) with the one tokenizer of
the whole corpus (a BPE is trained on all of it). ``data.weights`` gives each source's
sampling weight (normalised to sum to 1); without it the globs are one corpus, as
before.

Batches stay stateless (src/data/sources.py): the global batch of ``(step,
micro_step)`` draws, from a generator seeded by ``(seed, step, micro_step)``, a
source for each row (by weight) and then a window in that source's split. The same
batches result whatever the number of ranks, and the mixture's position is the step:
a resume continues it exactly. What each source has contributed (its tokens, a
deterministic function of the steps) is counted by the trainer, saved in every
checkpoint and logged (``share/<source>`` in metrics.jsonl, ``data_mix`` in
summary.json). Validation draws each source's windows in proportion to its weight,
evenly spaced over its val split, the same in every run, and gives each source's
loss beside the mixed one (``val/<source>/loss``, src/trainer/step.py).

A source's name is its glob's last directory without a wildcard
(``~/corpus/web/*.txt`` is ``web``; ``<stdlib>/json/*.py`` is ``json``), with its
position added where two would share one (``web#0``, ``web#1``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from src.errors import ConfigError

_WILD = re.compile(r"[*?\[]")


def mixture_globs(data_cfg: Any) -> list[str] | None:
    """The globs of a mixture (``data.weights`` set), else None."""
    if data_cfg.get("weights") is None:
        return None
    paths = (
        OmegaConf.to_container(data_cfg.paths)
        if not isinstance(data_cfg.paths, str)
        else [data_cfg.paths]
    )
    return [str(p) for p in paths]


def check_weights(data_cfg: Any) -> None:
    """``data.weights``: one positive finite number per glob of ``data.paths``; a
    one-line ConfigError naming it otherwise."""
    weights = data_cfg.get("weights")
    if weights is None:
        return
    globs = mixture_globs(data_cfg)
    values = list(weights) if OmegaConf.is_list(weights) else None
    if values is None or len(values) != len(globs) or len(globs) < 2:
        raise ConfigError(
            "data.weights",
            f"got {weights}, expected a list of one weight per glob of data.paths "
            f"(it has {len(globs)}; a mixture needs 2 or more), e.g. "
            "data.paths='[~/web/*.txt,~/code/*.py]' data.weights='[0.7,0.3]'",
        )
    for w in values:
        if isinstance(w, bool) or not isinstance(w, int | float):
            bad = True
        else:
            bad = not math.isfinite(w) or w <= 0
        if bad:
            raise ConfigError(
                "data.weights", f"got {w!r} in {values}, expected numbers > 0"
            )


def source_names(globs: Sequence[str]) -> list[str]:
    """Each glob's name (see the module's doc)."""
    names = []
    for glob in globs:
        parts = [p for p in glob.replace("\\", "/").split("/") if p]
        fixed = [p for p in parts if not _WILD.search(p)]
        if not fixed:
            name = glob
        elif fixed[-1] == parts[-1]:  # a file itself: its stem
            name = os.path.splitext(parts[-1])[0]
        else:
            name = fixed[-1]
        names.append(name.strip("<>~") or glob)
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def normalised(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    return w / w.sum()


class MixedStream:
    """One split of a mixture: each source's token stream, its name and weight."""

    def __init__(self, streams: Sequence[Any], names: Sequence[str], weights: Any):
        self.streams = list(streams)
        self.names = list(names)
        self.weights = normalised(weights)
        self.source = "data.paths"

    def __len__(self) -> int:
        return sum(len(s) for s in self.streams)

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n} {w:.2f}: {len(s)}"
            for n, w, s in zip(self.names, self.weights, self.streams, strict=True)
        )
        return f"MixedStream({parts})"


class MixedBatches:
    """:class:`GlobalBatches` of a :class:`MixedStream`: each row from a source drawn
    by weight, then a window of that source (see the module's doc)."""

    def __init__(
        self, stream: MixedStream, global_batch_size: int, block_size: int, seed: int
    ):
        from src.data.sources import GlobalBatches

        # one per source: its checks (a window fits) and row slicing
        self.parts = [
            GlobalBatches(s, global_batch_size, block_size, seed)
            for s in stream.streams
        ]
        self.stream = stream
        self.global_batch_size = global_batch_size
        self.block_size = block_size
        self.seed = seed
        self._cum = np.cumsum(stream.weights)
        self._num_offsets = np.array([p._num_offsets for p in self.parts])

    def _draw(self, step: int, micro_step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, micro_step])
        u = rng.random(self.global_batch_size)
        src = np.minimum(
            np.searchsorted(self._cum, u, side="right"), len(self.parts) - 1
        )
        offsets = rng.integers(0, self._num_offsets[src])
        return src, offsets

    def source_rows(self, step: int, micro_step: int) -> np.ndarray:
        """How many rows of the global batch of ``(step, micro_step)`` each source
        gives (the same on every rank)."""
        src, _ = self._draw(step, micro_step)
        return np.bincount(src, minlength=len(self.parts))

    def _gather(self, src: np.ndarray, offsets: np.ndarray):
        window = np.arange(self.block_size + 1)
        rows = np.empty((len(src), self.block_size + 1), dtype=np.int64)
        for i, part in enumerate(self.parts):
            mine = np.flatnonzero(src == i)
            if len(mine):
                tokens = part.stream.tokens
                rows[mine] = np.asarray(tokens[offsets[mine][:, None] + window])
        windows = torch.from_numpy(rows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def get(self, step: int, micro_step: int, rank: int, world_size: int):
        """Rank ``rank``'s rows of the global batch of ``(step, micro_step)``."""
        rows = self.parts[0]._rows(rank, world_size)
        src, offsets = self._draw(step, micro_step)
        return self._gather(src[rows], offsets[rows])

    def _quotas(self, total: int) -> np.ndarray:
        """``total`` windows shared by weight (largest remainders)."""
        exact = self.stream.weights * total
        quotas = np.floor(exact).astype(np.int64)
        order = np.argsort(-(exact - quotas), kind="stable")
        quotas[order[: total - quotas.sum()]] += 1
        return quotas

    def covering_batches(self) -> int:
        """The fewest :meth:`val_batches` whose windows leave no token of any source
        out."""
        need = [
            max(1, -(-(p._num_offsets - 1) // self.block_size) + 1) for p in self.parts
        ]
        n = 1
        while any(self._quotas(n * self.global_batch_size) < need):
            n += 1
        return n

    def val_batches(self, n: int, rank: int, world_size: int) -> ValBatches:
        """``n`` fixed batches: each source's share of the windows, evenly spaced over
        its split, grouped by source (a batch holds one source but where two meet),
        so that each source's loss (``val/<source>/loss``) costs few forwards beyond
        the batches; the same in every run."""
        rows = self.parts[0]._rows(rank, world_size)
        quotas = self._quotas(n * self.global_batch_size)
        src, offsets = [], []
        for i, (part, q) in enumerate(zip(self.parts, quotas, strict=True)):
            if q == 0:
                continue
            src.append(np.full(q, i))
            offsets.append(np.linspace(0, part._num_offsets - 1, q).astype(np.int64))
        src = np.concatenate(src).reshape(n, -1)
        offsets = np.concatenate(offsets).reshape(n, -1)
        return ValBatches(
            [self._gather(s[rows], o[rows]) for s, o in zip(src, offsets, strict=True)],
            names=self.stream.names,
            row_sources=[torch.from_numpy(s[rows]) for s in src],
            present=[np.unique(s).tolist() for s in src],
        )


class ValBatches(list):
    """A mixture's validation batches (a list of ``(x, y)``) with, per batch, the
    source index of each of this rank's rows (``row_sources``) and the sources in
    the whole global batch (``present``: the same on every rank)."""

    def __init__(
        self,
        batches: list,
        names: Sequence[str],
        row_sources: list[torch.Tensor],
        present: list[list[int]],
    ):
        super().__init__(batches)
        self.names = list(names)
        self.row_sources = row_sources
        self.present = present

    def of_source(self, i: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(batch index, x, y)`` of each batch source ``i`` has rows in, its other
        rows' targets -1 (not counted)."""
        return [
            (b, x, torch.where(self.row_sources[b][:, None] == i, y, -1))
            for b, (x, y) in enumerate(self)
            if i in self.present[b]
        ]


def make_batches(stream: Any, global_batch_size: int, block_size: int, seed: int):
    """The global batches of a split: mixed for a :class:`MixedStream`, rows of
    conversations for one with a loss mask (``data=chat``)."""
    from src.data.sft import ChatBatches
    from src.data.sources import GlobalBatches

    cls = MixedBatches if isinstance(stream, MixedStream) else GlobalBatches
    if getattr(stream, "mask", None) is not None:
        cls = ChatBatches
    return cls(stream, global_batch_size, block_size, seed)


#: In a checkpoint's ``extra`` and summary.json: the tokens each source gave.
MIX_STATE = "data_mix"


class MixCounter:
    """The tokens each source of a mixture has given the training steps so far."""

    def __init__(self, batches: MixedBatches):
        self.batches = batches
        self.names = batches.stream.names
        self.weights = batches.stream.weights
        self.tokens = np.zeros(len(self.names), dtype=np.int64)

    def count(self, step: int, micro_steps: int) -> None:
        """Add the rows of (0-based) ``step``'s ``micro_steps`` global batches."""
        for micro in range(micro_steps):
            rows = self.batches.source_rows(step, micro)
            self.tokens += rows * self.batches.block_size

    def shares(self) -> dict[str, float]:
        """``share/<source>``: each source's share of the tokens trained on so far."""
        total = max(int(self.tokens.sum()), 1)
        return {
            f"share/{n}": int(t) / total
            for n, t in zip(self.names, self.tokens, strict=True)
        }

    def state(self) -> dict[str, int]:
        return {n: int(t) for n, t in zip(self.names, self.tokens, strict=True)}

    def restore(self, saved: dict[str, int] | None) -> list[str]:
        """The counts of a resumed checkpoint (a source it has not: 0); returns the
        names of the checkpoint's sources this mixture has not."""
        saved = saved or {}
        for i, name in enumerate(self.names):
            self.tokens[i] = saved.get(name, 0)
        return [n for n in saved if n not in self.names]

    def summary(self) -> dict[str, dict]:
        """``summary.json``'s ``data_mix``: each source's weight, realised share and
        tokens."""
        shares = self.shares()
        return {
            n: {"weight": float(w), "share": shares[f"share/{n}"], "tokens": int(t)}
            for n, w, t in zip(self.names, self.weights, self.tokens, strict=True)
        }


def whole_stream(train: Any, val: Any, vocab_size: int) -> Any:
    """The stream the splits were cut from (train then val, in order); of a mixture,
    each source's."""
    from src.data.sources import TokenStream

    if isinstance(train, MixedStream):
        return MixedStream(
            [
                whole_stream(a, b, vocab_size)
                for a, b in zip(train.streams, val.streams, strict=True)
            ],
            train.names,
            train.weights,
        )
    tokens = np.concatenate([np.asarray(train.tokens), np.asarray(val.tokens)])
    mask = None  # conversations: their loss mask too
    if train.mask is not None:
        mask = np.concatenate([np.asarray(train.mask), np.asarray(val.mask)])
    # both checked
    return TokenStream(tokens, vocab_size, "data", 0, mask, train.eos_id)
