"""``data=synthetic``: seeded random tokens (vocabulary from the model), for
benchmarks; the last :data:`VAL_FRACTION` of them is the validation split.

A data source in one file, as tokens_data.py (docs/architecture.md, "Where to add");
its values are in conf/data/synthetic.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from src.data.sources import DATA_SOURCES, DataConfig, DataSource, TokenStream
from src.registry import described

VAL_FRACTION = 0.05


@dataclass
class SyntheticDataConfig(DataConfig):
    num_tokens: int = described("synthetic: how many random tokens")


def splits(cfg: Any, vocab_size: int, seed: int) -> tuple[TokenStream, TokenStream]:
    num_tokens = int(cfg.num_tokens)
    if num_tokens < 2:
        raise ValueError(f"data.num_tokens={num_tokens} must be at least 2")
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    data = np.random.default_rng(seed).integers(0, vocab_size, num_tokens, dtype=dtype)
    cut = num_tokens - max(1, int(num_tokens * VAL_FRACTION))
    return (
        TokenStream(data[:cut], vocab_size, "data.num_tokens"),
        TokenStream(data[cut:], vocab_size, "data.num_tokens"),
    )


DATA_SOURCES.add("synthetic", DataSource(SyntheticDataConfig, splits))
