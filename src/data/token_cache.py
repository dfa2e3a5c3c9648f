"""The token cache: a corpus tokenized once into memory-mapped token files.

An entry is a directory ``<data.cache_dir>/tokens-<key>/`` holding ``train.bin`` and
``val.bin`` (flat token ids, uint8/uint16/uint32 by vocabulary size, each document
followed by the tokenizer's end-of-document id) and ``meta.json``. ``key`` hashes the
corpus (each file's path, size and content digest, format, split, cap), the tokenizer (its
serialised JSON) and :data:`CACHE_VERSION`: a run with the same corpus, tokenizer and
settings reuses the entry, any change builds a new one. An entry is written into a
temporary directory and published by one atomic rename, so a crashed build never leaves
an entry that looks complete, and two concurrent builders cannot corrupt each other;
what a build that was killed left (its temporary directory, a BPE tokenizer's
temporary file) is removed when the cache is next opened, once no process holds that
entry's lock (:func:`remove_interrupted_builds`).

An entry is checked before it is reused: ``meta.json`` strict JSON with every field of
its type and range, sealed by its own CRC-32, and matching the tokenizer (vocabulary, end-of-document id,
dtype), each ``.bin`` a regular file of exactly the recorded number of tokens and, in
the launcher (``check_contents``), of the recorded CRC-32 and no token id above the
recorded ``max_id`` (which the ranks take for the vocabulary check). A damaged entry is rebuilt,
with a line saying why.

The launcher builds the entry before the ranks start; under torchrun the first rank to
take the entry's file lock builds it while the others wait (:func:`build_lock`), and
the ranks only memory-map it.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import shutil
import stat
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from src.data.chat import Trained
from src.data.corpus import DIGESTS_FILE, EOD, Corpus, build_lock, digest
from src.data.tokenizer import Tokenizer, cache_path, load_tokenizer
from src.files import read_json

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 2: meta.json holds each split's CRC-32; 3: keyed by contents
BATCH_BYTES = 1 << 23  # text handed to the tokenizer's thread pool at a time
SPLITS = ("train", "val")


@dataclass
class CacheEntry:
    """A built entry: its directory and what ``meta.json`` records."""

    path: str
    meta: dict
    tokenizer: Tokenizer | None = None  # what made its tokens (set by token_cache)
    corpus: dict | None = None  # the corpus fingerprint it was keyed by

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.ndarray:
        if self.meta[f"{split}_tokens"] == 0:  # data.val_fraction=0: no val split
            return np.zeros(0, self.dtype)  # (an empty file cannot be mapped)
        return np.memmap(
            os.path.join(self.path, f"{split}.bin"), dtype=self.dtype, mode="r"
        )

    def mask(self, split: str) -> np.ndarray | None:
        """The loss mask of a split of conversations (1: a trained token); None for
        plain text."""
        if f"{split}_mask_crc32" not in self.meta:
            return None
        if self.meta[f"{split}_tokens"] == 0:
            return np.zeros(0, np.uint8)
        file = mask_file(os.path.join(self.path, f"{split}.bin"))
        return np.memmap(file, dtype=np.uint8, mode="r")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of the vocabulary."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocabulary of {vocab_size} tokens does not fit in uint32")


def _write_splits(
    corpus: Corpus, tokenizer: Tokenizer, paths: list[str], bar: tqdm
) -> list[tuple[int, int, int, int]]:
    """Tokenize the corpus in one pass into the files ``paths`` (train, val), and of
    conversations (``corpus.chat``) each split's loss mask beside it (:func:`mask_file`:
    1 where the token is the assistant's, and at the end of a conversation that
    ends with the assistant's turn); returns (tokens, largest id, CRC-32, the mask's
    CRC-32) of each."""
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    stats = [[0, -1, 0, 0] for _ in paths]
    files = [open(path, "wb") for path in paths]  # noqa: SIM115 (closed below)
    masks = []
    if corpus.chat is not None:
        masks = [open(mask_file(path), "wb") for path in paths]  # noqa: SIM115
    trained = False  # the last piece's (an end of document inherits it)

    def flush(batch: list[tuple[int, bytes | None]]) -> None:
        nonlocal trained
        encoded = iter(tokenizer.encode([p for _, p in batch if p is not EOD]))
        parts: list[list[np.ndarray]] = [[] for _ in paths]
        flags: list[list[np.ndarray]] = [[] for _ in paths]
        for split, piece in batch:
            ids = eos if piece is EOD else next(encoded)
            parts[split].append(ids)
            trained = trained if piece is EOD else isinstance(piece, Trained)
            flags[split].append(np.full(len(ids), trained, dtype=np.uint8))
        for split, arrays in enumerate(parts):
            ids = np.concatenate(arrays) if arrays else eos[:0]
            if len(ids):
                stats[split][1] = max(stats[split][1], int(ids.max()))
            stats[split][0] += len(ids)
            out = ids.astype(dtype)
            stats[split][2] = zlib.crc32(out, stats[split][2])
            out.tofile(files[split])
            if masks:
                mask = np.concatenate(flags[split] or [np.zeros(0, np.uint8)])
                stats[split][3] = zlib.crc32(mask, stats[split][3])
                mask.tofile(masks[split])
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
        for f in files + masks:
            f.close()
    return [tuple(s) for s in stats]


def mask_file(tokens_file: str) -> str:
    """Where the loss mask of a split's tokens lives (conversations only)."""
    return tokens_file.removesuffix(".bin") + ".mask.bin"


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
        for split, (n, _, crc, mask_crc) in zip(SPLITS, stats, strict=True):
            meta[f"{split}_tokens"] = n
            meta[f"{split}_crc32"] = f"{crc:08x}"
            if corpus.chat is not None:
                meta[f"{split}_mask_crc32"] = f"{mask_crc:08x}"
        meta["max_id"] = max(s[1] for s in stats)
        meta["build_s"] = round(time.perf_counter() - start, 3)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "meta_crc32": _seal(meta)}, f, indent=1)
        os.rename(tmp, path)  # atomic: the entry appears complete or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CacheEntry(path, meta)


#: meta.json's fields and their types (integers >= 0).
_META_FIELDS = {
    "tokenizer": (str,),
    "vocab_size": (int,),
    "eos_id": (int,),
    "dtype": (str,),
    "files": (int,),
    "bytes": (int,),
    "train_tokens": (int,),
    "val_tokens": (int,),
    "max_id": (int,),
    "build_s": (int, float),
    "train_crc32": (str,),
    "val_crc32": (str,),
}


def _read_entry(
    path: str, tokenizer: Tokenizer, check_contents: bool
) -> tuple[CacheEntry | None, str | None]:
    """The entry at ``path`` if it is intact, else ``(None, why it is damaged)``;
    ``(None, None)`` if there is none. See the module's doc for what is checked."""
    if not os.path.lexists(path):
        return None, None
    try:
        meta = read_json(os.path.join(path, "meta.json"))
    except (OSError, ValueError) as exc:
        return None, f"meta.json unreadable ({exc})"
    if not isinstance(meta, dict):
        return None, "meta.json is not a JSON object"
    if meta.pop("meta_crc32", None) != _seal(meta):
        return None, "meta.json fails its checksum (corrupted)"
    for key, types in _META_FIELDS.items():
        value = meta.get(key)
        if type(value) not in types or (type(value) is int and value < 0):
            return None, f"meta.json: {key} is {value!r:.40}"
    dtype = token_dtype(tokenizer.vocab_size)
    if (meta["vocab_size"], meta["eos_id"], meta["dtype"]) != (
        tokenizer.vocab_size,
        tokenizer.eos_id,
        dtype.name,
    ):
        return None, (
            f"meta.json records vocab {meta['vocab_size']}, end id {meta['eos_id']}, "
            f"{meta['dtype']}; the tokenizer has {tokenizer.vocab_size}, "
            f"{tokenizer.eos_id}, {dtype.name}"
        )
    if meta["max_id"] >= tokenizer.vocab_size:
        return None, f"meta.json: max_id {meta['max_id']} is outside the vocabulary"
    for split in SPLITS:
        file = os.path.join(path, f"{split}.bin")
        files = [(file, dtype, f"{split}_crc32")]
        if f"{split}_mask_crc32" in meta:  # conversations: the loss mask too
            files.append((mask_file(file), np.dtype(np.uint8), f"{split}_mask_crc32"))
        for name, kind, crc_key in files:
            damage = _check_bin(name, kind, meta, split, crc_key, check_contents)
            if damage:
                return None, damage
    return CacheEntry(path, meta), None


def _check_bin(
    file: str, dtype: np.dtype, meta: dict, split: str, crc_key: str, contents: bool
) -> str | None:
    """Why a split's ``.bin`` (tokens or mask) is damaged, or None: a regular file of
    the recorded tokens, and (``contents``) of the recorded CRC-32 and, of tokens,
    no id above ``max_id``."""
    name = os.path.basename(file)
    if not isinstance(meta[crc_key], str):
        return f"meta.json: {crc_key} is {meta[crc_key]!r:.40}"
    want = meta[f"{split}_tokens"] * dtype.itemsize
    try:
        info = os.lstat(file)
    except OSError:
        return f"{name} is missing"
    if not stat.S_ISREG(info.st_mode):
        return f"{name} is not a regular file"
    if info.st_size != want:
        return f"{name} has {info.st_size:,} bytes, {want:,} were written"
    if not contents:
        return None
    crc, top = _crc32_and_max(file, dtype)
    if f"{crc:08x}" != meta[crc_key]:
        return f"{name} fails its checksum (corrupted)"
    if crc_key.endswith("_mask_crc32"):
        return None if top <= 1 else f"{name} holds {top}, not a 0/1 mask"
    if top > meta["max_id"]:  # the ranks take max_id for the vocabulary check
        return f"{name} holds token id {top}, above max_id {meta['max_id']}"
    return None


def _crc32_and_max(file: str, dtype: np.dtype) -> tuple[int, int]:
    """CRC-32 and largest token id of a ``.bin`` (-1 if empty), in one read of 16 MiB
    blocks (a whole number of tokens each)."""
    crc, top = 0, -1
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
            top = max(top, int(np.frombuffer(block, dtype).max()))
    return crc, top


def _seal(meta: dict) -> str:
    """The CRC-32 of ``meta`` (without its own), as canonical JSON."""
    return f"{zlib.crc32(json.dumps(meta, sort_keys=True).encode()):08x}"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _discard(path: str) -> None:
    """Remove a damaged entry: renamed aside first, so it vanishes at once."""
    aside = f"{path}.tmp-damaged-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    _remove(aside)


#: What the cache's builders write before their one rename, ``<entry>.tmp-<suffix>``:
#: a token entry's dir (or a damaged one set aside) and a BPE tokenizer's file
#: (:func:`atomic_path`).
_BUILDS = ("tokens-*.tmp-*", "bpe-*.json.tmp-*", f"{DIGESTS_FILE}.tmp-*")


def remove_interrupted_builds(cache_dir: str) -> list[str]:
    """Remove from ``cache_dir`` what builds that were killed (or stopped by a full
    disk) left: the temporary dirs and files of :data:`_BUILDS` whose entry's lock no
    process holds (a build in progress holds it). Returns their names."""
    removed = []
    for pattern in _BUILDS:
        for tmp in sorted(glob.glob(os.path.join(glob.escape(cache_dir), pattern))):
            entry = tmp.rsplit(".tmp-", 1)[0]
            try:
                with open(f"{entry}.lock", "a") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not building
                    _remove(tmp)
            except OSError:  # held (a build in progress), or already gone
                continue
            removed.append(os.path.basename(tmp))
    return removed


def token_cache(
    data_cfg: Any,
    verbose: bool = True,
    progress: bool = True,
    corpus: Corpus | None = None,
    tokenizer: Tokenizer | None = None,
) -> CacheEntry:
    """The cache entry for the ``data`` config (a text/files source): reused if built
    and intact, else built (or rebuilt, saying why) here. ``verbose`` (the launcher):
    say which, and check the tokens' checksums too; ``progress``: also show progress
    bars; ``corpus``: the config's, if already read; ``tokenizer``: the one to
    use (a mixture's source: the whole corpus's), default ``data.tokenizer``'s."""
    removed = remove_interrupted_builds(cache_path(data_cfg))
    if removed and verbose:
        log.warning(
            "token cache: removed what interrupted builds (killed, or a full disk) "
            "left in %s: %s",
            cache_path(data_cfg),
            ", ".join(removed),
        )
    corpus = corpus or Corpus.from_config(data_cfg)
    if tokenizer is None:
        tokenizer = load_tokenizer(data_cfg, corpus, verbose, verbose and progress)
    key = digest(
        {
            "version": CACHE_VERSION,
            "corpus": corpus.fingerprint(cache_path(data_cfg)),
            "tokenizer": tokenizer.identity,
        }
    )
    path = os.path.join(cache_path(data_cfg), f"tokens-{key}")
    built = False
    entry, _ = _read_entry(path, tokenizer, verbose)
    if entry is None:
        with build_lock(path):  # waits while another process builds it
            entry, damage = _read_entry(path, tokenizer, verbose)
            if entry is None:
                if damage:
                    log.warning(
                        "token cache: %s is damaged (%s): rebuilding it", path, damage
                    )
                    _discard(path)
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
    entry.tokenizer, entry.corpus = tokenizer, corpus.fingerprint(cache_path(data_cfg))
    if verbose:
        m = entry.meta
        log.info(
            f"token cache: {verb} ({m['train_tokens']:,} train + {m['val_tokens']:,} "
            f"val tokens, {tokenizer.name}, vocab {m['vocab_size']}, {m['dtype']})"
        )
    return entry
