"""``data=tokens``: nanoGPT's format, a flat ``np.uint16`` binary per split
(``data.train_path``, ``data.val_path``), read through ``np.memmap`` so a large corpus
is never loaded into RAM.

A whole data source in one file (docs/architecture.md, "Where to add"): the schema of
its keys, the check its types cannot say, its ``(train, val)`` splits, and the entry
in ``DATA_SOURCES``; its values are in conf/data/tokens.yaml.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from src.data.sources import DATA_SOURCES, DataConfig, DataSource, TokenStream
from src.errors import ConfigError
from src.registry import described

SPLIT_KEYS = ("train_path", "val_path")


@dataclass
class TokensDataConfig(DataConfig):
    train_path: str = described("tokens: the training split (flat np.uint16 .bin)")
    val_path: str = described("tokens: the validation split (flat np.uint16 .bin)")


def check(data: Any) -> None:
    for key in SPLIT_KEYS:
        path = os.path.expanduser(data[key])
        if not os.path.isfile(path):
            raise ConfigError(f"data.{key}", f"no such file {path!r}")
        if not _whole_tokens(os.path.getsize(path)):
            raise ConfigError(f"data.{key}", _not_tokens(path))


def _whole_tokens(size: int) -> bool:
    return size > 0 and size % 2 == 0


def _not_tokens(path: str) -> str:
    size = os.path.getsize(path)
    return f"{path!r} has {size} bytes, not a non-empty np.uint16 token file"


def _memmap_tokens(path: str, key: str) -> np.memmap:
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise ValueError(
            f"{key}: no such file {path!r} (expected a flat np.uint16 .bin)"
        )
    if not _whole_tokens(os.path.getsize(path)):
        raise ValueError(f"{key}: {_not_tokens(path)}")
    return np.memmap(path, dtype=np.uint16, mode="r")


def sizes(cfg: Any) -> dict[str, int]:
    """``{"train_tokens", "val_tokens"}``: each split file's size in tokens."""
    return {
        f"{key.removesuffix('_path')}_tokens": os.path.getsize(
            os.path.expanduser(cfg[key])
        )
        // 2
        for key in SPLIT_KEYS
    }


def splits(cfg: Any, vocab_size: int, seed: int) -> tuple[TokenStream, TokenStream]:
    return tuple(
        TokenStream(
            _memmap_tokens(getattr(cfg, key), f"data.{key}"), vocab_size, f"data.{key}"
        )
        for key in SPLIT_KEYS
    )


DATA_SOURCES.add(
    "tokens",
    DataSource(
        TokensDataConfig,
        splits,
        check,
        sizes=sizes,
        size_keys={"train": "data.train_path", "val": "data.val_path"},
    ),
)
