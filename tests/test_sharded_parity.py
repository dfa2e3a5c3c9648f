"""Sharded training matches unsharded training: same init, same data, fp32, 2 ranks
(LoRA adapters too).

For FSDP2 and FSDP1, at several ``min_num_params`` (down to many small units, up to
nothing but the root) and with the tied embedding/head of the GPT, every step's global
loss and the final parameters agree with one-process training within 1e-5. The meta
init test checks that building on the meta device and materialising shard by shard
gives the same weights and the same losses as a normal build.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from src.config.schema import OPTIMIZERS
from src.harness import compose_config
from src.models import get_spec
from src.models.gpt import GPT, GPTConfig, init_tensor
from src.sharding import (
    LoraSpec,
    build_backend,
    build_policy,
    build_sharded_model,
    is_adapter,
    trainable_counts,
    wrap_plan,
)
from src.trainer.optimizer import build_optimizer
from tests.distributed import run_distributed

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
BATCH, STEPS, SEED = 8, 4, 0


def batches():
    gen = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.block_size), generator=gen)
        yield x, torch.roll(x, -1, dims=1)


def train(model, backend, x_y, rank=0, world=1, optimizer=None):
    """AdamW (or ``trainer.optimizer=optimizer`` as the trainer builds it) +
    global-norm clipping; returns the global loss of each step."""
    if optimizer is None:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    else:
        cfg = compose_config(f"trainer.optimizer={optimizer}", "trainer.lr=2e-3")
        opt = build_optimizer(model, cfg, get_spec("gpt"))
    losses = []
    for x, y in x_y:
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        _, loss = model(x[rows], y[rows])
        loss.backward()
        backend.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in sd.items()}


def reference(optimizer=None):
    backend = build_backend("none", "fp32", "cpu")
    model = build_sharded_model(lambda: GPT(CFG, seed=SEED), backend, None)
    losses = train(model, backend, batches(), optimizer=optimizer)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded_run(
    rank, world, backend_name, policy_names, min_params, init_device, optimizers=()
):
    torch.manual_seed(rank)  # different global RNG per rank: init must not depend on it
    backend = build_backend(backend_name, "fp32", "cpu")
    policy = build_policy(
        policy_names, min_num_params=min_params, block_cls=GPT.block_cls
    )
    model = build_sharded_model(
        lambda: GPT(CFG, seed=SEED),
        backend,
        policy,
        init_device=init_device,
        init_fn=lambda name, t: init_tensor(name, t.shape, CFG, SEED),
    )
    units = [u.path for u in wrap_plan(model, world).units]
    init = full_state(model)
    losses = train(model, backend, batches(), rank, world)
    out = {"losses": losses, "final": full_state(model), "init": init, "units": units}
    for name in optimizers:  # the same model trained afresh by each optimizer
        model = build_sharded_model(lambda: GPT(CFG, seed=SEED), backend, policy)
        losses = train(model, backend, batches(), rank, world, optimizer=name)
        out[name] = {"losses": losses, "final": full_state(model)}
    return out


def check_against_reference(results, optimizer=None):
    ref_losses, ref_final = reference(optimizer)
    for out in results:
        out = out if optimizer is None else out[optimizer]
        assert out["losses"] == pytest.approx(ref_losses, abs=1e-5, rel=0)
        for name, value in ref_final.items():
            torch.testing.assert_close(out["final"][name], value, atol=1e-5, rtol=0)
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize(
    ("min_params", "expected_units"),
    [
        (1e3, 9),  # the four Linears of each block (c_attn is 3168 params)
        (4e3, 7),  # attention (4224), c_fc (4224) and the MLP's c_proj (4128)
        (1e9, 1),  # nothing but the root
    ],
)
def test_sharded_training_matches_unsharded(backend_name, min_params, expected_units):
    results = run_distributed(sharded_run, 2, backend_name, "size", min_params, "cpu")
    assert len(results[0]["units"]) == expected_units, results[0]["units"]
    assert "" in results[0]["units"]  # the root is always wrapped, holding the tie
    check_against_reference(results)


@pytest.mark.slow
def test_block_policy_matches_unsharded():
    """And each trainer.optimizer (Muon orthogonalises each sharded matrix whole)."""
    results = run_distributed(
        sharded_run, 2, "fsdp2", "block", 1e8, "cpu", OPTIMIZERS[1:]
    )
    assert results[0]["units"] == ["", "h.0", "h.1"]
    for optimizer in (None, *OPTIMIZERS[1:]):
        check_against_reference(results, optimizer)


@pytest.mark.slow
def test_meta_init_equals_cpu_init_weights_and_losses():
    meta = run_distributed(sharded_run, 2, "fsdp2", "block", 1e8, "meta")
    cpu = run_distributed(sharded_run, 2, "fsdp2", "block", 1e8, "cpu")
    for name, value in cpu[0]["init"].items():
        assert torch.equal(meta[0]["init"][name], value), name
    assert meta[0]["losses"] == cpu[0]["losses"]
    check_against_reference(meta)


LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("c_attn", "c_fc"), seed=SEED)


def lora_run(rank, world, backend_name, init_device):
    """LoRA adapters on c_attn and c_fc, built as the model is (one build on meta,
    one on cpu, in the same ranks); their training's losses, weights and counts."""
    torch.manual_seed(rank)  # peft draws from the global generator: init by name
    out = {}
    for device in ("meta", "cpu") if init_device == "both" else (init_device,):
        backend = build_backend(backend_name, "fp32", "cpu")
        policy = build_policy(["block"], block_cls=GPT.block_cls)
        model = build_sharded_model(
            lambda: GPT(CFG, seed=SEED),
            backend,
            policy if world > 1 else None,
            init_device=device,
            init_fn=lambda name, t: init_tensor(name, t.shape, CFG, SEED),
            lora=LORA,
        )
        init = full_state(model)
        losses = train(model, backend, batches(), rank, world)
        out[device] = {
            "losses": losses,
            "init": init,
            "final": full_state(model),
            "counts": trainable_counts(model),
        }
    return out


@pytest.mark.slow
def test_lora_adapters_train_alone_and_sharded_match_one_process():
    """LoRA (peft's layers, added as each block is built): on 2 FSDP2 ranks the
    losses and adapters equal one process's within 1e-5, the base weights are
    bit-identical after training, the adapters' init is the same on meta and cpu
    (by name), and only the adapters train."""
    (ref,) = run_distributed(lora_run, 1, "none", "cpu")
    ranks = run_distributed(lora_run, 2, "fsdp2", "both")
    ref = ref["cpu"]
    d, h = CFG.n_embd, 4 * CFG.n_embd
    per_block = LORA.rank * ((d + 3 * d) + (d + h))  # c_attn (d -> 3d), c_fc (d -> h)
    assert ref["counts"] == (CFG.n_layer * per_block, ref["counts"][1])
    for run in (ranks[0]["meta"], ranks[0]["cpu"]):
        assert run["counts"] == ref["counts"]
        assert run["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
        for name, value in ref["final"].items():
            torch.testing.assert_close(run["final"][name], value, atol=1e-5, rtol=0)
    for name, value in ranks[0]["cpu"]["init"].items():
        assert torch.equal(ranks[0]["meta"]["init"][name], value), name
    adapters = [n for n in ref["init"] if is_adapter(n)]
    assert len(adapters) == 4 * CFG.n_layer
    for name, before in ref["init"].items():  # the base as it was, the adapters not
        assert torch.equal(before, ref["final"][name]) != is_adapter(name), name
    assert ref["losses"][-1] < ref["losses"][0]
