"""The Llama family: logits equal transformers' LlamaForCausalLM with the same weights
(1 rank and sharded on 2), and meta init gives every buffer its true value."""

from __future__ import annotations

import pytest
import torch

from src.models import get_spec
from src.models.llama import LlamaConfig, rope_inv_freq, to_hf_config, to_hf_name
from src.sharding import (
    build_backend,
    build_policy,
    build_sharded_model,
    canonical_name,
)
from tests.distributed import run_distributed

SPEC = get_spec("llama")
SEED = 3
# GQA (4 query heads over 2 kv heads), a SwiGLU width rounded to multiple_of.
CFG = LlamaConfig(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=96,
    multiple_of=16,
    rope_theta=10000.0,
    max_seq_len=32,
)
TIED = LlamaConfig(**{**CFG.__dict__, "n_kv_heads": None, "tie_embeddings": True})


def hf_twin(config: LlamaConfig, state: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM holding the weights ``state`` (our names)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(to_hf_config(config)).eval()
    missing, unexpected = hf.load_state_dict(
        {to_hf_name(n): t for n, t in state.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: one tensor
    return hf


def tokens(config: LlamaConfig, batch: int = 2, seq: int = 24) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=gen)


@pytest.mark.parametrize("config", [CFG, TIED], ids=["gqa_untied", "mha_tied"])
def test_logits_equal_transformers_llama(config):
    model = SPEC.build(config, SEED).eval()
    hf = hf_twin(config, model.state_dict())
    idx = tokens(config)
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def test_flops_and_params_of_the_llama3_shapes():
    """Llama 3 8B / 70B parameter counts, and FLOPs = 6 N_matmul + attention."""
    sizes = {"8b": (4096, 32, 32, 1024), "70b": (8192, 80, 64, 4096)}
    counts = {}
    for key, (dim, layers, heads, multiple_of) in sizes.items():
        config = LlamaConfig(dim, layers, heads, 8, 128256, multiple_of, 1.3)
        counts[key] = SPEC.num_params(config)
        embedding = config.vocab_size * config.dim  # a lookup, not a matmul
        attention = 12 * layers * dim * 8192
        expected = 6 * (counts[key] - embedding) + attention
        assert SPEC.flops_per_token(config, 8192) == expected
    assert 8.02e9 < counts["8b"] < 8.04e9 and 70.5e9 < counts["70b"] < 70.6e9


def _meta_build(config: LlamaConfig, init_buffers: bool = True):
    """Built on meta and materialised by name; ``init_buffers=False`` is the known bug:
    parameters filled, buffers left as to_empty() made them."""
    backend = build_backend("none", "fp32", "cpu")

    def init_fn(name: str, t: torch.Tensor) -> torch.Tensor:
        if not init_buffers and name == "rope.inv_freq":
            return t.detach().clone()  # whatever to_empty() left there
        return SPEC.init_tensor(name, t.shape, config, SEED)

    return build_sharded_model(
        lambda: SPEC.build(config, SEED), backend, None, "meta", init_fn
    ).eval()


def meta_init_matches(model: torch.nn.Module, config: LlamaConfig) -> bool:
    """Every parameter and buffer equals the CPU build's, and so do the logits."""
    ref = SPEC.build(config, SEED).eval()
    tensors = dict(ref.named_parameters()) | dict(ref.named_buffers())
    same = all(
        torch.equal(t, tensors[n])
        for n, t in [*model.named_parameters(), *model.named_buffers()]
    )
    with torch.no_grad():
        idx = tokens(config)
        return same and torch.allclose(model(idx)[0], ref(idx)[0], atol=1e-6)


def test_meta_init_gives_the_rope_buffer_its_true_value():
    model = _meta_build(CFG)
    assert torch.equal(model.rope.inv_freq, rope_inv_freq(CFG))
    assert meta_init_matches(model, CFG)
    # The check above catches a build whose rope buffer was left uninitialised.
    torch.manual_seed(0)
    broken = _meta_build(CFG, init_buffers=False)
    broken.rope.inv_freq.copy_(torch.rand(CFG.head_dim // 2))  # stale memory
    assert not meta_init_matches(broken, CFG)


def _sharded_logits(rank: int, world: int, config: LlamaConfig) -> list:
    backend = build_backend("fsdp2", "fp32", "cpu")
    policy = build_policy("block", block_cls=SPEC.block_classes(config))
    model = build_sharded_model(
        lambda: SPEC.build(config, SEED),
        backend,
        policy,
        "meta",
        lambda name, t: SPEC.init_tensor(name, t.shape, config, SEED),
    ).eval()
    assert all(p.to_local().numel() < p.numel() for n, p in model.named_parameters()), (
        "every parameter is sharded"
    )
    assert torch.equal(model.rope.inv_freq, rope_inv_freq(config))
    # The same weights, whole, in transformers (built on this rank for the test only).
    full = {
        canonical_name(n): SPEC.init_tensor(canonical_name(n), p.shape, config, SEED)
        for n, p in model.named_parameters()
    }
    hf = hf_twin(config, full)
    idx = tokens(config)
    with torch.no_grad():
        ours = model(idx)[0]
        theirs = hf(idx).logits
    torch.distributed.barrier()  # both ranks done before either tears down
    return [(ours - theirs).abs().max().item()]


@pytest.mark.slow
def test_sharded_logits_equal_transformers_on_two_ranks():
    diffs = run_distributed(_sharded_logits, 2, CFG)
    assert max(d for r in diffs for d in r) < 1e-5, diffs
