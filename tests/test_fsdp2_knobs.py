"""FSDP2 knobs: explicit forward/backward prefetch depth and ``reshard_after_forward``
as FSDP2 takes it (true, false, or a smaller group size). Each one changes when
parameters are gathered, never the numbers: losses equal the default run's.
One 4-rank run (gloo) computes every variant; each test checks one knob."""

from __future__ import annotations

import pytest
import torch

from src.models import get_spec
from src.sharding import build_backend, build_policy, build_sharded_model, set_prefetch
from tests.distributed import run_distributed
from tests.test_config import config_error

WORLD, N_BLOCKS, STEPS = 4, 4, 3
VARIANTS = {
    "default": {},
    "forward_prefetch": {"forward": 2},
    "backward_prefetch": {"backward": 2},
    "no_prefetch": {"forward": 0, "backward": 0},
    "keep_after_forward": {"reshard_after_forward": False},
    "reshard_to_2": {"reshard_after_forward": 2},
}


def run_variant(rank, world, reshard_after_forward=True, forward=None, backward=None):
    spec = get_spec("gpt")
    config = spec.config_cls(
        n_layer=N_BLOCKS, n_head=2, n_embd=32, vocab_size=64, block_size=16
    )
    backend = build_backend("fsdp2", "fp32", "cpu", reshard_after_forward)
    policy = build_policy("block", block_cls=spec.block_classes(config))
    model = build_sharded_model(lambda: spec.build(config, 0), backend, policy)
    units = set_prefetch(model, forward, backward)

    def prefetched(unit, attr):
        states = getattr(unit._get_fsdp_state(), attr)
        return [[u._get_fsdp_state() for u in units].index(s) for s in states]

    out = {
        "forward": [prefetched(u, "_states_to_forward_prefetch") for u in units],
        "backward": [prefetched(u, "_states_to_backward_prefetch") for u in units],
        "losses": [],
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (WORLD, 16), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS):
        _, loss = model(x[rank : rank + 1], torch.roll(x, -1, 1)[rank : rank + 1])
        if step == 0:  # between forward and backward: what a block holds
            w = model.h[0].attn.c_attn.weight
            out["rows_after_forward"] = getattr(w, "_local_tensor", w).shape[0]
            out["full_rows"] = w.shape[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.distributed.all_reduce(loss.detach(), op=torch.distributed.ReduceOp.AVG)
        out["losses"].append(loss.item())
    return out


def all_variants(rank, world):
    return {name: run_variant(rank, world, **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(all_variants, WORLD)[0]


def same_losses(runs, name):
    assert runs[name]["losses"] == pytest.approx(runs["default"]["losses"], abs=1e-6)


@pytest.mark.slow
def test_forward_prefetch_depth(runs):
    got = runs["forward_prefetch"]["forward"]
    # the 4 blocks in forward order: each gathers the next two
    assert got == [[1, 2], [2, 3], [3], []]
    assert runs["default"]["forward"] == [[]] * N_BLOCKS  # FSDP2's default: none
    same_losses(runs, "forward_prefetch")


@pytest.mark.slow
def test_backward_prefetch_depth(runs):
    assert runs["backward_prefetch"]["backward"] == [[], [0], [1, 0], [2, 1]]
    assert runs["no_prefetch"]["backward"] == [[]] * N_BLOCKS
    same_losses(runs, "backward_prefetch")
    same_losses(runs, "no_prefetch")


@pytest.mark.slow
def test_reshard_after_forward_bool_or_group_size(runs):
    full = runs["default"]["full_rows"]
    assert runs["default"]["rows_after_forward"] == full // WORLD  # resharded
    assert runs["keep_after_forward"]["rows_after_forward"] == full  # kept gathered
    assert runs["reshard_to_2"]["rows_after_forward"] == full // 2  # over 2 ranks
    same_losses(runs, "keep_after_forward")
    same_losses(runs, "reshard_to_2")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["sharding.reshard_after_forward=2"], "sharding.reshard_after_forward"),
        (
            ["sharding.reshard_after_forward=2", "sharding=fsdp1"],
            "sharding.reshard_after_forward",
        ),
        (["sharding.reshard_after_forward=maybe"], "sharding.reshard_after_forward"),
        (["sharding.forward_prefetch=-1"], "sharding.forward_prefetch"),
        (
            ["sharding.backward_prefetch=1", "sharding=fsdp1"],
            "sharding.backward_prefetch",
        ),
    ],
)
def test_bad_knob_fails_naming_the_key(overrides, key):
    # 2 ranks (the default): no group size lies strictly between 1 and 2
    assert config_error(*overrides).startswith(key)
