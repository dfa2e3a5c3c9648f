"""Models: a GPT-style transformer built under the wrap context."""

from src.models.gpt import (
    GPT,
    Block,
    GPTConfig,
    count_params,
    flops_per_token,
    init_tensor,
)

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "flops_per_token",
    "init_tensor",
    "count_params",
]
