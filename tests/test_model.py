"""The GPT model: shapes, loss, tied head, deterministic init, meta build, FLOPs, presets."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from src.harness import compose_config
from src.models import get_spec
from src.models.gpt import (
    GPT,
    Block,
    GPTConfig,
    count_params,
    flops_per_token,
    init_tensor,
)

PRESETS = Path(__file__).resolve().parents[1] / "conf" / "model"
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64)


def _batch(cfg: GPTConfig, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return x, y


def _preset(name: str) -> GPTConfig:
    return get_spec("gpt").make_config(compose_config(f"model={name}").model)


def test_shapes_and_untrained_loss():
    model = GPT(TINY)
    for seq in (TINY.block_size, 17):
        x, y = _batch(TINY, 4, seq)
        logits, loss = model(x, y)
        assert logits.shape == (4, seq, TINY.vocab_size)
        assert loss.shape == () and loss.dtype == torch.float32
        # GPT-2 init gives near-uniform predictions: loss ~ ln(vocab).
        assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1
        logits, loss = model(x)
        assert logits.shape == (4, seq, TINY.vocab_size) and loss is None
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_head_is_tied_to_the_token_embedding():
    model = GPT(TINY)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # counted once
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert model.num_params() == count_params(TINY)
    assert model.num_params(non_embedding=True) == count_params(TINY) - 64 * 64
    assert list(model.buffers()) == []  # the causal mask comes from SDPA


def test_init_is_deterministic_and_equals_init_tensor():
    a, b = GPT(TINY, seed=3), GPT(TINY, seed=3)
    for (name, p), (name_b, q) in zip(
        a.named_parameters(), b.named_parameters(), strict=True
    ):
        assert name == name_b and p.dtype == torch.float32
        assert torch.equal(p, q), name
        assert torch.equal(p, init_tensor(name, p.shape, TINY, seed=3)), name
    assert torch.equal(
        init_tensor("lm_head.weight", a.wte.weight.shape, TINY, 3), a.wte.weight
    )
    # A block built alone (as a sharded build may) equals the same block in the model.
    lone = Block(TINY, 1, seed=3)
    for name, p in lone.named_parameters():
        assert torch.equal(p, a.get_parameter(f"h.1.{name}")), name
    # GPT-2 statistics, and another seed gives other values.
    assert torch.all(a.h[0].ln_1.weight == 1) and torch.all(
        a.h[0].attn.c_attn.bias == 0
    )
    assert abs(a.wte.weight.std().item() - 0.02) < 1e-3
    c_proj_std = 0.02 / math.sqrt(2 * TINY.n_layer)
    assert abs(a.h[0].mlp.c_proj.weight.std().item() - c_proj_std) < 1e-3
    assert not torch.equal(GPT(TINY, seed=4).wte.weight, a.wte.weight)
    with pytest.raises(ValueError, match="not a GPT parameter"):
        init_tensor("h.0.attn.rotary.weight", (4,), TINY, 0)


def test_meta_build_allocates_nothing_and_materialises_identically():
    cpu = GPT(TINY, seed=1)
    with torch.device("meta"):
        meta = GPT(TINY, seed=1)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.wte.weight
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [
        (n, p.shape) for n, p in cpu.named_parameters()
    ]
    # What the sharding layer does: storage, then init_tensor by canonical name.
    meta.to_empty(device="cpu")
    assert meta.lm_head.weight is meta.wte.weight
    with torch.no_grad():
        for name, p in meta.named_parameters():
            p.copy_(init_tensor(name, p.shape, TINY, seed=1))
    x, y = _batch(TINY, 2, 32)
    assert torch.equal(meta(x, y)[1], cpu(x, y)[1])
    # A 65B-parameter shape (260 GB in fp32) builds on meta: nothing is allocated.
    with torch.device("meta"):
        big = GPT(_preset("gpt_70b"))
    assert big.num_params() == count_params(big.config) > 6e10


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_init_on_cuda_equals_cpu():
    cpu = GPT(TINY, seed=2)
    with torch.device("cuda"):
        gpu = GPT(TINY, seed=2)
    for (name, p), (_, q) in zip(
        cpu.named_parameters(), gpu.named_parameters(), strict=True
    ):
        assert q.is_cuda and torch.equal(p, q.cpu()), name


def _sharded_init_matches(rank, world_size):
    from torch.distributed.tensor import DTensor

    from src.sharding import (
        build_backend,
        build_policy,
        build_sharded_model,
        canonical_name,
    )

    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    ref = GPT(cfg, seed=5)
    checked = []
    for policy, init_device in (("block", "cpu"), ("size", "meta")):
        model = build_sharded_model(
            lambda: GPT(cfg, seed=5),
            build_backend("fsdp2", "fp32", "cpu"),
            build_policy(policy, min_num_params=3000, block_cls=GPT.block_cls),
            init_device,
            lambda name, t: init_tensor(name, t.shape, cfg, 5),
        )
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            name = canonical_name(name, model)
            assert torch.equal(full.detach(), ref.get_parameter(name)), name
            checked.append(name)
    return len(checked)


@pytest.mark.slow
def test_sharded_init_equals_unsharded_whatever_the_policy_and_device():
    """2 FSDP2 ranks, block policy on CPU and size policy on meta: every full
    parameter equals the one-process model's."""
    from tests.distributed import run_distributed

    assert run_distributed(_sharded_init_matches, 2) == [80, 80]


def test_a_few_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(TINY, 4, 32)
    losses = []
    for _ in range(10):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_dropout_is_off_in_eval():
    cfg = dataclasses.replace(TINY, dropout=0.2)
    model = GPT(cfg)
    x, _ = _batch(cfg, 2, 16)
    model.eval()
    assert torch.equal(model(x)[0], model(x)[0])
    model.train()
    assert not torch.equal(model(x)[0], model(x)[0])


def _counted_flops_per_token(
    model: GPT, batch: int, seq: int
) -> tuple[float, set[str]]:
    x, y = _batch(model.config, batch, seq)
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x, y)
        loss.backward()
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    return counter.get_total_flops() / (batch * seq), ops


SHAPES = [  # (n_layer, n_head, n_embd, vocab_size, block_size, seq_len)
    (2, 2, 64, 256, 64, 64),
    (2, 2, 64, 256, 64, 16),
    (3, 4, 128, 512, 128, 128),
    (4, 4, 128, 256, 128, 32),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_flops_formula_matches_flop_counter(shape):
    *dims, seq = shape
    cfg = GPTConfig(*dims)
    model = GPT(cfg)
    expected = flops_per_token(cfg, seq)
    # The math SDPA backend runs attention as bmm's, which FlopCounterMode counts:
    # the whole formula, attention term included, is checked.
    with sdpa_kernel(SDPBackend.MATH):
        counted, ops = _counted_flops_per_token(model, 2, seq)
    assert "aten.bmm" in ops
    assert abs(counted - expected) / expected < 0.03, (counted, expected)
    # The default CPU kernel (aten._scaled_dot_product_flash_attention_for_cpu) has no
    # flop formula in torch's FlopCounterMode, so attention is not counted there: the
    # count is then the 6 * N matmul term alone.
    counted, ops = _counted_flops_per_token(model, 2, seq)
    attention = 12 * cfg.n_layer * cfg.n_embd * seq
    if not any("attention" in op for op in ops):
        expected -= attention
    assert abs(counted - expected) / expected < 0.03, (counted, expected, ops)


# The GPT family's presets, diffs over conf/model/base_gpt.yaml (other families'
# presets are tested in tests/test_models.py).
PRESET_NAMES = sorted(
    p.stem for p in PRESETS.glob("*.yaml") if "  - base_gpt\n" in p.read_text()
)


def test_all_presets_exist():
    assert set(PRESET_NAMES) >= {
        "tiny",
        "small",
        "gpt2",
        "gpt2_medium",
        "gpt2_large",
        "gpt2_xl",
        "design_card",
        "gpt_13b",
        "gpt_70b",
    }


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_loads(name):
    raw = compose_config(f"model={name}").model
    assert raw.name == name and raw.init_device == "cpu"
    cfg = get_spec("gpt").make_config(raw)
    assert cfg.n_embd % cfg.n_head == 0
    if cfg.vocab_size == 256:
        assert name in ("tiny", "small")  # byte-level presets
    if name == "gpt2":
        with torch.device("meta"):
            model = GPT(cfg)
        assert model.num_params() == count_params(cfg)
        assert 124e6 < model.num_params() < 125e6  # GPT-2 small, vocab padded to 50304


def test_config_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="model.n_embd"):
        GPTConfig(n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ValueError, match="model.n_layer"):
        GPTConfig(n_layer=0)
