"""Token streams and per-rank shards of every global batch.

Sources, chosen by ``data.name``:

- ``text`` / ``files``: local files (``data.paths``, ``data.format`` text, jsonl or
  parquet) tokenized by ``data.tokenizer`` (byte, bpe or a path) once into the token
  cache (src/data/token_cache.py) and memory-mapped from it. ``text`` is the preset
  whose corpus is the Python standard library's own sources (``<stdlib>``), so it
  exists on every machine without a download.
- ``tokens`` (src/data/tokens_data.py): nanoGPT's format, a flat ``np.uint16``
  binary per split, read through ``np.memmap`` so a large corpus is never loaded into
  RAM.
- ``synthetic`` (src/data/synthetic_data.py): seeded random tokens, for benchmarks.

A source in a file of its own adds itself to :data:`DATA_SOURCES` on import
(src/trainer/__init__.py lists those files).

Batches are stateless: the global batch of ``(step, micro_step)`` is a set of windows at
offsets drawn from a generator seeded by ``(seed, step, micro_step)``, and rank ``r`` of
``W`` takes its contiguous slice of rows. The same global batch (hence the same losses)
results whatever the number of ranks, and resuming needs only the step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from src.data.chat import AUTO, template_of
from src.data.corpus import CHAT_FORMAT, DATA_FORMATS, Corpus, CorpusError
from src.data.mixture import (
    MixedStream,
    check_weights,
    mixture_globs,
    normalised,
    source_names,
)
from src.data.packing import PACKINGS
from src.data.pinning import DataPin, data_changes, data_record
from src.data.token_cache import SPLITS, token_cache
from src.data.tokenizer import Tokenizer, cache_path, load_tokenizer
from src.errors import ConfigError
from src.registry import Registry, described, no_check, or_list

log = logging.getLogger(__name__)

VOCAB_MULTIPLE = 64
_MAX_CHUNK = 1 << 24  # tokens per chunk when scanning a memmap for its max


class TokenStream:
    """A 1-D integer token array (``np.memmap`` or ndarray) checked against the vocab.

    ``source`` is the config key the tokens came from, so errors point at it;
    ``max_token``, when known (the token cache records it), spares a scan; ``mask``
    (conversations, ``data=chat``): 1 where a token is a trained target, and
    ``eos_id`` ends each conversation.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        vocab_size: int,
        source: str,
        max_token: int | None = None,
        mask: np.ndarray | None = None,
        eos_id: int | None = None,
    ):
        if tokens.ndim != 1:
            raise ValueError(
                f"{source}: expected a 1-D token array, got {tokens.shape}"
            )
        self.tokens = tokens
        self.source = source
        self.mask, self.eos_id = mask, eos_id
        top = _max_token(tokens) if max_token is None else max_token
        if top >= vocab_size:
            raise ValueError(
                f"{source}: token id {top} is out of range for "
                f"model.vocab_size={vocab_size} (needs model.vocab_size >= {top + 1})"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        kind = type(self.tokens).__name__
        return f"TokenStream({self.source}, {len(self)} tokens, {kind})"


def _max_token(tokens: np.ndarray) -> int:
    """Largest token id, read in chunks so a memmap is scanned without loading it."""
    if len(tokens) == 0:
        return -1
    return max(
        int(tokens[i : i + _MAX_CHUNK].max()) for i in range(0, len(tokens), _MAX_CHUNK)
    )


def load_splits(
    data_cfg: Any, vocab_size: int, seed: int
) -> tuple[TokenStream, TokenStream]:
    """Build the (train, val) token streams described by the ``data`` config group."""
    name = data_cfg.name
    if name not in DATA_SOURCES:
        raise ValueError(f"data.name={name!r} is not one of: {', '.join(DATA_SOURCES)}")
    return DATA_SOURCES[name].splits(data_cfg, vocab_size, seed)


def prepare_data(
    data_cfg: Any,
    verbose: bool = True,
    progress: bool = True,
    record: bool = False,
    pin: DataPin | None = None,
) -> dict | None:
    """Build (or find) the token cache of a text/files source, in the launcher before
    any rank starts; returns its ``meta`` (``vocab_size``, ``max_id``, ``formats``,
    ``tokenizer_file``...), or None for the sources without a tokenizer. With
    ``record``, its ``record`` is what the run dir keeps of it, to be written once
    the run is admitted (:class:`~src.data.pinning.DataRecord`: ``data.json``).
    With ``pin`` (a resume's), a corpus that differs from the run's is a one-line
    ``CorpusError`` naming the files, before anything is built.
    Bad input raises a one-line ``ConfigError``."""
    if not DATA_SOURCES[data_cfg.name].tokenized:
        return None
    start = time.perf_counter()
    corpus = Corpus.from_config(data_cfg)
    changed = corpus_changes(data_cfg, corpus, pin)
    if changed:
        raise CorpusError(
            f"data.paths: the run trained on other data: {changed}; a resume keeps "
            "the checkpoint's data and tokenizer (restore the files, or train "
            "another in a new hydra.run.dir)"
        )
    globs = mixture_globs(data_cfg)
    if globs is None:
        entry = token_cache(data_cfg, verbose, progress, corpus)
        meta, tokenizer, fingerprint = entry.meta, entry.tokenizer, entry.corpus
    else:
        meta, tokenizer = _mixture_meta(data_cfg, globs, verbose, progress, corpus)
        fingerprint = corpus.fingerprint(cache_path(data_cfg))
    counts = meta["formats"]
    if verbose:
        log.info(
            "data ready in %.2fs: %d file(s): %s",
            time.perf_counter() - start,
            sum(counts.values()),
            ", ".join(f"{n} {fmt}" for fmt, n in counts.items()),
        )
    if record:
        fields = {
            "paths": OmegaConf.to_container(data_cfg, resolve=True)["paths"],
            "files": counts,
            "tokenizer": str(data_cfg.tokenizer),
            "tokenizer_file": meta["tokenizer_file"],
            "token_cache": meta["token_cache"],
            **{k: meta[k] for k in ("vocab_size", "train_tokens", "val_tokens")},
        }
        if "mix" in meta:
            fields["mix"] = meta["mix"]
        meta = {**meta, "record": data_record(fields, tokenizer, fingerprint)}
    return meta


def corpus_changes(data_cfg: Any, corpus: Corpus, pin: DataPin | None) -> str | None:
    """How ``corpus`` (read by ``data_cfg``) differs from the run's pinned data, in a
    few words naming the files; None when it does not (or there is no pin)."""
    if pin is None:
        return None
    return data_changes(pin.corpus, corpus.fingerprint(cache_path(data_cfg)))


def training_splits(trainer: Any, meta: dict | None) -> tuple[str, ...]:
    """The splits a training run reads (``trainer``: its ``trainer`` node; ``meta``:
    the token cache's): the training split, and the validation split when validation
    runs and there is one (``data.val_fraction=0`` leaves none: no validation)."""
    validates = trainer.val_every and trainer.val_batches
    return (
        ("train", "val") if validates and (meta or {}).get("val_tokens") else ("train",)
    )


def split_sizes(data_cfg: Any, meta: dict | None) -> dict | None:
    """How many tokens each split holds (``train_tokens``, ``val_tokens``): the token
    cache's ``meta`` of a text/files source, else what the source says without reading
    its tokens (None for a source that cannot say)."""
    if meta is not None:
        return meta
    source = DATA_SOURCES[data_cfg.name]
    return None if source.sizes is None else source.sizes(data_cfg)


def check_split_sizes(
    data_cfg: Any, meta: dict | None, seq_len: int, splits: tuple[str, ...]
) -> None:
    """Each of ``splits`` (``train``, ``val`` or ``all``; ``meta``: their sizes, from
    :func:`split_sizes`) holds one window of ``seq_len + 1`` tokens; else a
    ``ConfigError`` naming the key that sizes it (before any rank starts: a rank would
    stop in :class:`GlobalBatches`). Nothing to check for a source without sizes."""
    if meta is None:
        return
    window = seq_len + 1
    if data_cfg.get("format") == CHAT_FORMAT:  # rows of conversations, padded
        window = 2
    for source in meta.get("mix", ()):  # a mixture: each of its sources
        check_split_sizes(data_cfg, {**source, "mix": ()}, seq_len, splits)
    fraction = data_cfg.get("val_fraction")
    keys = DATA_SOURCES[data_cfg.name].size_keys
    for split in splits:
        have = meta["train_tokens"] + meta["val_tokens"]
        if split != "all":
            have = meta[f"{split}_tokens"]
        if have >= window:
            continue
        sized = f"a window is the model's sequence length + 1 = {window} tokens"
        if split == "val" and fraction == 0:
            raise ConfigError(
                "data.val_fraction",
                "0: there is no validation split to read; read split=train or all, "
                "or train with data.val_fraction > 0",
            )
        if split == "val" and fraction is not None:
            enough = fraction * window / max(have, 1)
            raise ConfigError(
                "data.val_fraction",
                f"{fraction} gives a validation split of {have} tokens, fewer than "
                f"one window ({sized}); raise it to about {enough:.2g} or more, or "
                "set data.val_fraction=0 to train without a validation split",
            )
        key = keys.get("val" if split == "val" else "train")
        if key is None:  # text/files
            key = "data.max_bytes" if data_cfg.max_bytes is not None else "data.paths"
        what = {"train": "the training split", "val": "the validation split"}
        if "name" in meta:  # a source of a mixture
            what = {
                k: f"{meta['name']} ({meta['paths']}): {v}" for k, v in what.items()
            }
        raise ConfigError(
            key,
            f"{what.get(split, 'the data')} has {have} tokens, fewer than one window "
            f"({sized})",
        )


def tokenizer_of(data_cfg: Any) -> Tokenizer | None:
    """The tokenizer the run's text was tokenized with (``data.tokenizer``; a BPE from
    its cache, which needs the corpus; byte and a file need none), or None for the
    sources without one (``synthetic``, ``tokens``). Of conversations, it renders a
    prompt by the run's chat template (``Tokenizer.chat``)."""
    if not DATA_SOURCES[data_cfg.name].tokenized:
        return None
    corpus = Corpus.from_config(data_cfg) if data_cfg.tokenizer == "bpe" else None
    tokenizer = load_tokenizer(data_cfg, corpus, verbose=False)
    if data_cfg.format == CHAT_FORMAT:
        template = template_of(str(data_cfg.chat_template), str(data_cfg.tokenizer))
        tokenizer.chat_template = template[:3]
    return tokenizer


#: A Hugging Face checkpoint's own tokenizer, in the ``model.pretrained`` directory.
PRETRAINED_TOKENIZER = "tokenizer.json"


def pretrained_tokenizer(cfg: Any, user_keys: set[str], say: bool = True) -> bool:
    """A fine-tune of a pretrained model reads its text with the model's own
    tokenizer: where ``model.pretrained`` holds ``tokenizer.json`` and the data has a
    tokenizer the user did not set (``data.tokenizer`` not in ``user_keys``),
    ``data.tokenizer`` becomes that directory, said in one line (``say``: rank 0),
    and so recorded in the run's config and data.json. Returns whether it changed."""
    pretrained = OmegaConf.select(cfg, "model.pretrained")
    if not pretrained or "tokenizer" not in cfg.data or "data.tokenizer" in user_keys:
        return False
    directory = os.path.abspath(os.path.expanduser(str(pretrained)))
    if not os.path.isfile(os.path.join(directory, PRETRAINED_TOKENIZER)):
        return False
    if os.path.abspath(os.path.expanduser(str(cfg.data.tokenizer))) == directory:
        return False
    if say:
        log.info(
            "data.tokenizer=%s: the pretrained model's own (%s in model.pretrained; "
            "data.tokenizer=%s on the command line to keep that one)",
            directory,
            PRETRAINED_TOKENIZER,
            cfg.data.tokenizer,
        )
    cfg.data.tokenizer = directory
    return True


def follow_tokenizer_vocab(
    cfg: Any, spec: Any, model_config: Any, meta: dict, user_keys: set[str]
) -> bool:
    """The model's vocabulary follows the tokenizer (``meta`` of the token cache): the
    family's vocabulary key (``model.vocab_size`` for GPT and Llama) becomes the
    tokenizer's size rounded up to a multiple of :data:`VOCAB_MULTIPLE` (faster
    matmuls). It stays as it is when the user set it (it is in ``user_keys``, the
    command line's keys), when weights are loaded (``model.pretrained``) or when the
    family fixes it; then it must hold every id of the tokenizer. ``spec``,
    ``model_config``: the run plan's model of ``cfg`` as it is. Returns whether
    ``cfg.model`` changed (its run plan is then out of date)."""
    vocab = meta["vocab_size"]
    key = f"model.{spec.vocab_key}" if spec.vocab_key else "model"
    if cfg.model.get("pretrained"):
        key, advice = "model.pretrained", "use the model's own tokenizer"
        directory = os.path.abspath(os.path.expanduser(str(cfg.model.pretrained)))
        if os.path.isfile(os.path.join(directory, PRETRAINED_TOKENIZER)):
            same = os.path.abspath(os.path.expanduser(str(cfg.data.tokenizer)))
            advice = (
                f"the directory's {PRETRAINED_TOKENIZER} does not fit its own weights"
                if same == directory
                else f"drop data.tokenizer to use the model's own ({PRETRAINED_TOKENIZER})"
            )
    elif spec.vocab_key is None:
        advice = "use the model's own tokenizer"
    elif key in user_keys:
        advice = f"drop the override or set it >= {vocab}"
    else:
        padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        if padded == cfg.model[spec.vocab_key]:
            return False
        log.info(
            f"{key}={padded}: follows data.tokenizer={cfg.data.tokenizer} ({vocab} "
            f"tokens, padded to a multiple of {VOCAB_MULTIPLE})"
        )
        cfg.model[spec.vocab_key] = padded
        return True
    have = spec.vocab_size(model_config)
    if have < vocab:
        raise ConfigError(
            key,
            f"vocabulary of {have} is smaller than data.tokenizer="
            f"{cfg.data.tokenizer}'s ({vocab} ids, up to {vocab - 1}); {advice}",
        )
    return False


def text_splits(
    cfg: Any, vocab_size: int, seed: int
) -> tuple[TokenStream, TokenStream]:
    globs = mixture_globs(cfg)
    if globs is not None:
        entries = _mixture_entries(cfg, globs, verbose=False)
        names = source_names(globs)
        return tuple(
            MixedStream(
                [
                    TokenStream(e.tokens(split), vocab_size, f"data.paths: {n}")
                    for n, e in zip(names, entries, strict=True)
                ],
                names,
                cfg.weights,
            )
            for split in SPLITS
        )
    entry = token_cache(cfg, verbose=False)  # the launcher built it, usually
    return tuple(
        TokenStream(
            entry.tokens(split),
            vocab_size,
            "data.paths",
            entry.meta["max_id"],
            entry.mask(split),
            entry.meta["eos_id"],
        )
        for split in SPLITS
    )


def _source_cfg(cfg: Any, glob: str) -> Any:
    """The ``data`` config of one source of a mixture: its glob alone."""
    one = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    one.paths, one.weights = glob, None
    return one


def _mixture_entries(
    cfg: Any,
    globs: list[str],
    verbose: bool,
    progress: bool = False,
    corpus: Corpus | None = None,
) -> list[Any]:
    """Each source's token cache entry, tokenized by the whole corpus's tokenizer."""
    corpus = corpus or Corpus.from_config(cfg)
    tokenizer = load_tokenizer(cfg, corpus, verbose, progress)
    return [
        token_cache(_source_cfg(cfg, g), verbose, progress, tokenizer=tokenizer)
        for g in globs
    ]


def _mixture_meta(
    cfg: Any, globs: list[str], verbose: bool, progress: bool, corpus: Corpus
) -> tuple[dict, Any]:
    """The token cache meta of a mixture: its sources' (one tokenizer) summed, with
    each source's entry and token counts under ``mix``; and that tokenizer."""
    entries = _mixture_entries(cfg, globs, verbose, progress, corpus)
    metas = [e.meta for e in entries]
    meta = dict(metas[0])
    for key in ("train_tokens", "val_tokens", "bytes", "files"):
        meta[key] = sum(m[key] for m in metas)
    meta["max_id"] = max(m["max_id"] for m in metas)
    meta["formats"] = {
        f: sum(m["formats"].get(f, 0) for m in metas)
        for f in dict.fromkeys(f for m in metas for f in m["formats"])
    }
    meta["token_cache"] = [e.path for e in entries]
    weights = normalised(cfg.weights)
    meta["mix"] = [
        {
            "name": name,
            "paths": glob,
            "weight": float(w),
            "token_cache": e.path,
            **{k: e.meta[k] for k in ("train_tokens", "val_tokens")},
        }
        for name, glob, w, e in zip(
            source_names(globs), globs, weights, entries, strict=True
        )
    ]
    return meta, entries[0].tokenizer


# ------------------------------------------------------------------- the sources


@dataclass
class DataConfig:
    """The key every source has. Each option of the ``data`` group selects its
    source's schema (``defaults: [base_<source>]`` in conf/data/), so a key of another
    source is an unknown key."""

    name: str = described(
        lambda: f"the source: {or_list(DATA_SOURCES)} (pick with data=...)"
    )
    # keyword-only: the sources' own keys (no default here) may follow it
    packing: str = field(
        default=PACKINGS[0],
        kw_only=True,
        metadata={
            "help": f"how windows read their documents: {or_list(PACKINGS)} "
            "(documents: attention and positions per document)"
        },
    )


@dataclass
class FilesDataConfig(DataConfig):
    """``data=files`` (and its preset ``data=text``): local files, tokenized once into
    the token cache (src/data/token_cache.py)."""

    paths: Any = described("a glob or a list of globs of your corpus (~ and ** work)")
    format: str = described(f"auto (by file extension), {or_list(DATA_FORMATS)}")
    text_key: str = described("the JSONL field / Parquet column holding the text")
    tokenizer: str = described(
        "byte, bpe, or a tokenizer.json / Hugging Face tokenizer dir"
    )
    bpe_vocab_size: int = described("tokenizer=bpe: its vocabulary size")
    eos_token: str | None = described(
        "end-of-document token (null: the tokenizer's own)"
    )
    val_fraction: float = described(
        "the last fraction of the corpus bytes used for validation"
    )
    max_bytes: int | None = described("cap on the corpus bytes read (null = all)")
    weights: Any = described(
        "a mixture: one sampling weight per glob of data.paths (null: one corpus)"
    )
    chat_template: str = described(
        f"data.format={CHAT_FORMAT}: {AUTO} (the tokenizer's own, else ChatML), a "
        ".jinja file, or a Jinja template"
    )
    cache_dir: str = described("where tokenized corpora are cached")


def check_files(data: Any) -> None:
    if OmegaConf.is_missing(data, "paths"):
        raise ConfigError(
            "data.paths",
            "required with data=files: a glob or a list of globs of your corpus",
        )
    check_weights(data)
    if data.format != CHAT_FORMAT:
        return
    if data.get("weights") is not None:
        raise ConfigError(
            "data.weights",
            f"data.format={CHAT_FORMAT} takes one corpus of conversations (no "
            "mixture); drop it",
        )
    if data.packing != "documents":
        raise ConfigError(
            "data.packing",
            f"{data.packing}: conversations (data.format={CHAT_FORMAT}) are packed "
            "whole into rows, each attending only to itself; use documents",
        )


@dataclass(frozen=True)
class DataSource:
    """One ``data.name``: its schema (the group's keys), the checks its types cannot
    say (``ConfigError`` naming the key, run by ``validate()``), and its splits."""

    schema: type[DataConfig]
    #: ``(data_cfg, vocab_size, seed) -> (train, val)`` token streams
    splits: Callable[[Any, int, int], tuple[TokenStream, TokenStream]]
    check: Callable[[Any], None] = no_check
    tokenized: bool = False  # local files through the token cache (prepare_data)
    #: ``data_cfg -> {"train_tokens", "val_tokens"}`` without reading the tokens (the
    #: split-size check before any rank starts); the token cache's meta for text/files
    sizes: Callable[[Any], dict[str, int]] | None = None
    #: the key that sizes each split (``train``, ``val``), named when one is too small
    size_keys: dict[str, str] = field(default_factory=dict)


#: ``data.name`` -> its :class:`DataSource`. A new source is one file that calls
#: ``DATA_SOURCES.add`` (listed in src/trainer/__init__.py, which imports it) plus its
#: conf/data/<name>.yaml; docs/architecture.md shows it step by step (tokens_data.py).
DATA_SOURCES: Registry[DataSource] = Registry("data source")
for _name in ("text", "files", "chat"):
    DATA_SOURCES.add(
        _name, DataSource(FilesDataConfig, text_splits, check_files, tokenized=True)
    )


class GlobalBatches:
    """Stateless global batches of ``global_batch_size`` windows of ``block_size + 1``
    tokens, of which each rank gathers only its own rows."""

    def __init__(
        self, stream: TokenStream, global_batch_size: int, block_size: int, seed: int
    ):
        self._hold(stream, global_batch_size, block_size, seed)
        if len(stream) < block_size + 1:
            raise ValueError(
                f"{stream.source}: split has {len(stream)} tokens, fewer than "
                f"model.block_size + 1 = {block_size + 1}"
            )
        self._window = np.arange(block_size + 1)
        self._num_offsets = len(stream) - block_size  # valid window starts

    def _hold(
        self, stream: TokenStream, global_batch_size: int, block_size: int, seed: int
    ) -> None:
        if global_batch_size <= 0 or block_size <= 0:
            raise ValueError(
                f"global batch size ({global_batch_size}) and model.block_size "
                f"({block_size}) must be positive"
            )
        self.stream = stream
        self.global_batch_size = global_batch_size
        self.block_size = block_size
        self.seed = seed

    def _rows(self, rank: int, world_size: int) -> slice:
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if self.global_batch_size % world_size:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by "
                f"world_size={world_size} (trainer.devices)"
            )
        per_rank = self.global_batch_size // world_size
        return slice(rank * per_rank, (rank + 1) * per_rank)

    def _gather(self, offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # Fancy indexing reads only these windows, even from a memmap.
        windows = np.asarray(self.stream.tokens[offsets[:, None] + self._window])
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def get(
        self, step: int, micro_step: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s rows of the global batch of ``(step, micro_step)``: int64
        ``x`` of shape (B/W, T) and ``y`` = ``x`` shifted by one token."""
        rows = self._rows(rank, world_size)
        rng = np.random.default_rng([self.seed, step, micro_step])
        offsets = rng.integers(0, self._num_offsets, self.global_batch_size)
        return self._gather(offsets[rows])

    def covering_batches(self) -> int:
        """The fewest :meth:`val_batches` whose windows leave no token of the split
        out (evenly spaced, at most ``block_size`` apart)."""
        gaps = -(-(self._num_offsets - 1) // self.block_size)  # ceil
        return max(1, -(-(gaps + 1) // self.global_batch_size))

    def val_batches(
        self, n: int, rank: int, world_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` fixed batches (this rank's rows), the same in every run whatever the
        seed: windows evenly spaced over the split, so val losses are comparable."""
        rows = self._rows(rank, world_size)
        offsets = np.linspace(0, self._num_offsets - 1, n * self.global_batch_size)
        offsets = offsets.astype(np.int64).reshape(n, self.global_batch_size)
        return [self._gather(batch[rows]) for batch in offsets]
