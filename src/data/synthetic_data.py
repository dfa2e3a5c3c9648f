"""``data=synthetic``: seeded random tokens (vocabulary from the model), for
benchmarks; the last ``data.val_fraction`` of them is the validation split.

A data source in one file, as tokens_data.py (docs/architecture.md, "Where to add");
its values are in conf/data/synthetic.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from src.data.sources import DATA_SOURCES, DataConfig, DataSource, TokenStream
from src.errors import ConfigError
from src.registry import described


@dataclass
class SyntheticDataConfig(DataConfig):
    num_tokens: int = described("synthetic: how many random tokens")
    val_fraction: float = described(
        "synthetic: the last fraction of the tokens used for validation (0: none)"
    )


def check(cfg: Any) -> None:
    if cfg.num_tokens < 2:
        raise ConfigError("data.num_tokens", f"got {cfg.num_tokens}, at least 2")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(
            "data.val_fraction",
            f"got {cfg.val_fraction}, expected a fraction in [0, 1) (0: no "
            "validation split)",
        )


def sizes(cfg: Any) -> dict[str, int]:
    """``{"train_tokens", "val_tokens"}``: how many tokens each split holds."""
    num_tokens = int(cfg.num_tokens)
    val = max(1, int(num_tokens * cfg.val_fraction)) if cfg.val_fraction else 0
    return {"train_tokens": num_tokens - val, "val_tokens": val}


def splits(cfg: Any, vocab_size: int, seed: int) -> tuple[TokenStream, TokenStream]:
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    data = np.random.default_rng(seed).integers(
        0, vocab_size, int(cfg.num_tokens), dtype=dtype
    )
    cut = sizes(cfg)["train_tokens"]
    return (
        TokenStream(data[:cut], vocab_size, "data.num_tokens"),
        TokenStream(data[cut:], vocab_size, "data.val_fraction"),
    )


DATA_SOURCES.add(
    "synthetic",
    DataSource(
        SyntheticDataConfig,
        splits,
        check,
        sizes=sizes,
        size_keys={"train": "data.num_tokens", "val": "data.val_fraction"},
    ),
)
