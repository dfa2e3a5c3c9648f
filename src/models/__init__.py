"""Models: one spec per family (src/models/spec.py), each built under the wrap context.

Importing this package registers every family: ``get_spec(family)`` is how the rest of
the code reaches a model (docs/models.md).
"""

from src.models import custom, gpt, hf, llama, moe  # noqa: F401  (registers the families)
from src.models.gpt import (
    GPT,
    Block,
    GPTConfig,
    count_params,
    flops_per_token,
    init_tensor,
)
from src.models.spec import (
    ModelKeys,
    ModelSpec,
    families,
    get_spec,
    muon_matrices,
    register,
)

__all__ = [
    "GPT",
    "Block",
    "GPTConfig",
    "ModelKeys",
    "ModelSpec",
    "count_params",
    "families",
    "flops_per_token",
    "get_spec",
    "init_tensor",
    "muon_matrices",
    "register",
]
