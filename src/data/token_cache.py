"""The token cache: a corpus tokenized once into memory-mapped token files.

An entry is a directory ``<data.cache_dir>/tokens-<key>/`` holding ``train.bin`` and
``val.bin`` (flat token ids, uint8/uint16/uint32 by vocabulary size, each document
followed by the tokenizer's end-of-document id) and ``meta.json``. ``key`` hashes the
corpus (each file's path, size and mtime, format, split, cap), the tokenizer (its
serialised JSON) and :data:`CACHE_VERSION`: a run with the same corpus, tokenizer and
settings reuses the entry, any change builds a new one. An entry is written into a
temporary directory and published by one atomic rename, so a crashed build never leaves
an entry that looks complete, and two concurrent builders cannot corrupt each other.

The launcher builds the entry before the ranks start; under torchrun the first rank to
take the entry's file lock builds it while the others wait (:func:`build_lock`), and
the ranks only memory-map it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from src.data.corpus import EOD, Corpus, build_lock, digest
from src.data.tokenizer import Tokenizer, cache_path, load_tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 1
BATCH_BYTES = 1 << 23  # text handed to the tokenizer's thread pool at a time
SPLITS = ("train", "val")


@dataclass
class CacheEntry:
    """A built entry: its directory and what ``meta.json`` records."""

    path: str
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.memmap:
        return np.memmap(
            os.path.join(self.path, f"{split}.bin"), dtype=self.dtype, mode="r"
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of the vocabulary."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocabulary of {vocab_size} tokens does not fit in uint32")


def _write_splits(
    corpus: Corpus, tokenizer: Tokenizer, paths: list[str], bar: tqdm
) -> list[tuple[int, int]]:
    """Tokenize the corpus in one pass into the files ``paths`` (train, val); returns
    (tokens, largest id) of each."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    stats = [[0, -1] for _ in paths]
    files = [open(path, "wb") for path in paths]  # noqa: SIM115 (closed below)

    def flush(batch: list[tuple[int, bytes | None]]) -> None:
        encoded = iter(tokenizer.encode([p for _, p in batch if p is not EOD]))
        parts: list[list[np.ndarray]] = [[] for _ in paths]
        for split, piece in batch:
            parts[split].append(eos if piece is EOD else next(encoded))
        for split, arrays in enumerate(parts):
            ids = np.concatenate(arrays) if arrays else eos[:0]
            if len(ids):
                stats[split][1] = max(stats[split][1], int(ids.max()))
            stats[split][0] += len(ids)
            ids.astype(dtype).tofile(files[split])
        bar.update(sum(1 if p is EOD else len(p) for _, p in batch))

    try:
        batch, size = [], 0
        for item in corpus.pieces():
            batch.append(item)
            size += 1 if item[1] is EOD else len(item[1])
            if size >= BATCH_BYTES:
                flush(batch)
                batch, size = [], 0
        flush(batch)
    finally:
        for f in files:
            f.close()
    return [tuple(s) for s in stats]


def build_entry(
    corpus: Corpus, tokenizer: Tokenizer, path: str, progress: bool = True
) -> CacheEntry:
    """Tokenize ``corpus`` into a new entry at ``path`` (written aside, then renamed)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        total = corpus.num_bytes()
        meta: dict[str, Any] = {
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "dtype": token_dtype(tokenizer.vocab_size).name,
            "files": len(corpus.files),
            "bytes": total,
        }
        start = time.perf_counter()
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=f"tokenizing ({tokenizer.name})",
            disable=not progress,
            dynamic_ncols=True,
        ) as bar:
            paths = [os.path.join(tmp, f"{split}.bin") for split in SPLITS]
            stats = _write_splits(corpus, tokenizer, paths, bar)
        for split, (n, _) in zip(SPLITS, stats, strict=True):
            meta[f"{split}_tokens"] = n
        meta["max_id"] = max(top for _, top in stats)
        meta["build_s"] = round(time.perf_counter() - start, 3)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        os.rename(tmp, path)  # atomic: the entry appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CacheEntry(path, meta)


def _read_entry(path: str) -> CacheEntry | None:
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        return None
    with open(meta_file) as f:
        return CacheEntry(path, json.load(f))


def token_cache(
    data_cfg: Any, verbose: bool = True, progress: bool = True
) -> CacheEntry:
    """The cache entry for the ``data`` config (a text/files source): reused if built,
    else built here. ``verbose``: say which; ``progress``: also show progress bars."""
    corpus = Corpus.from_config(data_cfg)
    tokenizer = load_tokenizer(data_cfg, corpus, verbose, verbose and progress)
    key = digest(
        {
            "version": CACHE_VERSION,
            "corpus": corpus.fingerprint(),
            "tokenizer": tokenizer.identity,
        }
    )
    path = os.path.join(cache_path(data_cfg), f"tokens-{key}")
    built = False
    entry = _read_entry(path)
    if entry is None:
        with build_lock(path):  # waits while another process builds it
            entry = _read_entry(path)
            if entry is None:
                entry = build_entry(corpus, tokenizer, path, verbose and progress)
                built = True
    verb = (
        f"built {path} in {entry.meta['build_s']:.1f}s" if built else f"reusing {path}"
    )
    # What this run read (not saved in the entry: the same tokens may come from a
    # tokenizer file elsewhere with the same contents).
    entry.meta.update(
        formats=corpus.format_counts(),
        tokenizer_file=tokenizer.path,
        token_cache=path,
    )
    if verbose:
        m = entry.meta
        log.info(
            f"token cache: {verb} ({m['train_tokens']:,} train + {m['val_tokens']:,} "
            f"val tokens, {tokenizer.name}, vocab {m['vocab_size']}, {m['dtype']})"
        )
    return entry
