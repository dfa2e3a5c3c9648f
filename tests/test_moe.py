"""The native MoE family (src/models/moe.py), in process: routing (ties, capacity),
grouped matmuls against the per-expert loop, the auxiliary-loss-free bias update,
the balance loss in the gradient but not the loss's value, and bad keys."""

from __future__ import annotations

import re

import pytest
import torch

from src.config.run_plan import LAYOUT_KEYS
from src.models.moe import (
    MoEConfig,
    MoETransformer,
    after_step,
    grouped_matmul,
    grouped_mm_runs,
    init_tensor,
    moe_layers,
)
from tests.test_config import assert_fails_naming, config_error

CFG = dict(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    multiple_of=16,
    max_seq_len=16,
    num_experts=4,
    top_k=2,
    moe_hidden_dim=16,
)


def tokens(rows=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG["vocab_size"], (rows, CFG["max_seq_len"]), generator=gen)
    return x, torch.roll(x, -1, dims=1)


def test_ties_go_to_the_lower_expert_and_gates_renormalise():
    config = MoEConfig(**CFG)
    model = MoETransformer(config)
    router = moe_layers(model)[0].router
    with torch.no_grad():
        router.gate.weight.zero_()  # every score equal: a tie between all experts
    scores, experts, gates, kept = router(torch.randn(2, 5, config.dim))
    assert (experts == torch.tensor([0, 1])).all()
    assert torch.allclose(gates, torch.full_like(gates, 0.5)) and kept is None
    with torch.no_grad():  # the bias decides the choice, not the gate
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 2.0]))
    config.load_balance = "aux_free"
    _, experts, gates, _ = router(torch.randn(2, 5, config.dim))
    assert (experts == torch.tensor([3, 2])).all()
    assert torch.allclose(gates, torch.full_like(gates, 0.5))


def test_capacity_drops_the_later_tokens_of_a_sequence_and_counts_them():
    config = MoEConfig(**CFG, capacity_factor=1.0)  # 16 * 2 / 4 = 8 per expert
    router = moe_layers(MoETransformer(config))[0].router
    with torch.no_grad():
        router.gate.weight.zero_()  # all tokens choose experts 0 and 1
    _, experts, gates, kept = router(torch.randn(3, 16, config.dim))
    assert (~kept).sum() == 3 * 2 * (16 - 8)
    assert (gates[:, :8] > 0).all() and (gates[:, 8:] == 0).all()


@pytest.mark.skipif(not grouped_mm_runs("cpu", torch.float32), reason="no grouped mm")
def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward():
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(4, 8, 12, requires_grad=True)
    grads = []
    for grouped in (True, False):
        x.grad = w.grad = None
        y = grouped_matmul(x, w, counts, grouped)
        y.sum().backward()  # a zero-stride gradient: made contiguous for grouped mm
        grads.append((y.detach(), x.grad.clone(), w.grad.clone()))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # and a whole model, loss and every gradient
    results = []
    for grouped in (True, False):
        model = MoETransformer(MoEConfig(**CFG, grouped_mm=grouped))
        loss = model(*tokens())[1]
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_balance_loss_enters_the_gradient_not_the_loss_value():
    torch.manual_seed(0)
    losses, grads = [], []
    for balance in ("aux_loss", "none"):
        model = MoETransformer(
            MoEConfig(**CFG, load_balance=balance, aux_loss_coef=1.0)
        )
        loss = model(*tokens())[1]
        loss.backward()
        losses.append(loss.item())
        grads.append(moe_layers(model)[0].router.gate.weight.grad.clone())
    assert losses[0] == losses[1]
    assert not torch.allclose(grads[0], grads[1])


def test_aux_free_bias_moves_towards_balance_from_the_step_counts():
    config = MoEConfig(**CFG, load_balance="aux_free", bias_update_rate=0.01)
    model = MoETransformer(config)
    model(*tokens())[1].backward()
    moe = moe_layers(model)[0]
    counts = moe.stats[: config.num_experts].clone()
    rows = after_step(model)
    bias = moe.router.expert_bias
    expected = 0.01 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(bias, expected.float())
    assert rows["moe/layer0/tokens_max"] == counts.max().item()
    assert rows["moe/layer0/tokens_mean"] == 4 * 16 * 2 / 4
    assert rows["moe/layer0/dropped"] == 0 and rows["moe/dropped"] == 0
    assert 0 < rows["moe/entropy"] <= torch.log(torch.tensor(4.0)).item() + 1e-6
    assert moe.stats is None  # the next step counts afresh
    assert after_step(model) == {}  # nothing routed since


def test_meta_init_by_name_equals_the_cpu_build():
    config = MoEConfig(**CFG, shared_hidden_dim=8, n_dense_layers=1)
    model = MoETransformer(config, seed=3)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        torch.testing.assert_close(init_tensor(name, t.shape, config, 3), t)
    assert hasattr(model.layers[0], "feed_forward") and len(moe_layers(model)) == 1


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.top_k=9", "model.top_k"),
        ("model.load_balance=magic", "model.load_balance"),
        ("model.capacity_factor=0", "model.capacity_factor"),
        ("model.n_dense_layers=5", "model.n_dense_layers"),
    ],
)
def test_bad_moe_keys_are_named(override, key):
    assert config_error("model=moe_tiny", override).startswith(key + ":")


EP_TP = ("sharding.expert_parallel=2", "sharding.tensor_parallel=2")


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (("sharding.expert_parallel=3",), "ep", "4 shard ranks"),
        (("sharding.expert_parallel=16", "trainer.devices=16"), "ep", "8 experts"),
        (("model=llama_tiny", "sharding.expert_parallel=2"), "ep", "dense model"),
        (
            ("sharding.expert_parallel=2", "sharding.tensor_parallel=4"),
            "ep",
            "tp times",
        ),
        (
            ("sharding.expert_parallel=2", "sharding.context_parallel=2"),
            "ep",
            "context",
        ),
        (
            ("sharding.expert_parallel=2", "sharding.pipeline_parallel=2"),
            "ep",
            "pipeline",
        ),
        (("sharding.expert_parallel=2", "sharding.backend=fsdp1"), "ep", "fsdp2"),
        (
            ("model=hf", "model.config=tiny_qwen3_moe", *EP_TP),
            "tp",
            "replicated_with_grad_allreduce",
        ),
    ],
)
def test_expert_parallel_layouts_not_built_are_refused_naming_the_key(
    overrides, key, says
):
    """Before any rank starts, in one line naming the key: E not dividing the ranks
    or the experts, a dense model, EP with tp not a whole number of tp groups, with
    cp or pp, on fsdp1; Qwen3-MoE's tp plan (its q/k norms' style) under EP x TP."""
    keys = {o.split("=")[0] for o in overrides}
    base = [
        o
        for o in ("model=moe_tiny", "trainer.devices=4")
        if o.split("=")[0] not in keys
    ]
    assert_fails_naming([*base, *overrides], LAYOUT_KEYS[key], says)


def test_interval_line_has_a_short_moe_part():
    from src.observe.metrics import interval_line

    row = {"loss": 5.0, "lr": 1e-3, "moe/load_max_over_mean": 1.5, "moe/dropped": 0}
    assert interval_line(3, row).endswith("experts max/mean 1.50, lr 1.00e-03")
    row["moe/dropped"] = 12
    assert "experts max/mean 1.50 dropped 12, lr" in interval_line(3, row)
    assert "experts" not in interval_line(3, {"loss": 5.0, "lr": 1e-3})


@pytest.mark.parametrize("balance", ["aux_free", "aux_loss"])
def test_activation_checkpointing_recomputes_the_same_block(balance):
    """A checkpointed block (its first forward probing grouped mm, too) gives the
    gradients of a plain one, and counts its routing once."""
    from torch.utils.checkpoint import checkpoint

    config = MoEConfig(**CFG, load_balance=balance, capacity_factor=1.0)
    grads, counts = [], []
    for ac in (True, False):
        grouped_mm_runs.cache_clear()
        model = MoETransformer(config)
        block = model.layers[0]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 16, config.dim, generator=gen, requires_grad=True)
        cos, sin = model.rope(torch.arange(16))
        if ac:
            y = checkpoint(block, x, cos, sin, use_reentrant=False)
        else:
            y = block(x, cos, sin)
        aux = moe_layers(model)[0].aux_loss
        (y.square().mean() + (0 if aux is None else aux)).backward()
        grads.append([x.grad, *(p.grad for p in block.parameters())])
        counts.append(moe_layers(model)[0].stats)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(counts[0], counts[1])


@pytest.mark.parametrize("tp", [1, 2])
def test_the_fit_search_proposes_expert_parallelism_for_an_moe_model(tp):
    """Between the peaks of EP1 and EP8 on 8 ranks, only splitting the experts fits:
    the search proposes sharding.expert_parallel, and its estimate is that of the
    run with it; with TP2 too (the ep group whole tp groups)."""
    from src.config.run_plan import OVERRIDES, resolve, with_overrides
    from src.planner.run_estimate import estimate_plan
    from src.planner.search import search
    from src.planner.settings import EP
    from tests.test_config import make_cfg

    cfg = make_cfg(
        "model=moe_tiny",
        "model.moe_hidden_dim=512",
        "trainer.devices=8",
        "trainer.mem_margin=0",
        f"sharding.tensor_parallel={tp}",
    )
    _, plain = estimate_plan(resolve(cfg), 8)
    split = with_overrides(cfg, {OVERRIDES[EP]: 8})
    _, est8 = estimate_plan(resolve(split), 8)
    assert est8.total < plain.total
    budget = (plain.total + est8.total) // 2
    best, _ = search(resolve(cfg), [EP], budget, 8)
    settings = best.settings()
    assert settings[OVERRIDES[EP]] > 1, settings
    proposed = with_overrides(cfg, settings)
    _, est = estimate_plan(resolve(proposed), 8)
    assert est.total == best.estimate.total
    assert search(resolve(cfg), [], budget, 8)[0] is None


@pytest.mark.parametrize(
    "overrides, ratio, says",
    [
        # 8 experts, top 2, T = 32: capacity ceil(1.5 * 32 * 2 / 8) = 12 per expert
        # per sequence; a rank's 4 experts take at most 48 of a sequence's 64
        # assignments, each rank's balanced share is 32 of them: 1.5x
        (("model.capacity_factor=1.5",), 1.5, "capacity 12"),
        (("model.capacity_factor=8",), 2.0, "capacity 64"),  # capped at the group's
        ((), 1.25, "no capacity: assumed 1.25x"),
        (("model.capacity_factor=1.5", "sharding.tensor_parallel=2"), 1.5, "capacity"),
    ],
)
def test_the_planned_expert_dispatch_states_its_bound(overrides, ratio, says):
    """The estimate's expert dispatch part: the rows a rank receives above its own
    share (balanced), under the bound the note states, kept in every MoE layer, and
    one layer's send and receive buffers; it is a part of the EP run's estimate."""
    from src.config.run_plan import resolve
    from src.planner.activations import ep_dispatch
    from src.planner.inputs import run_shape
    from src.planner.run_estimate import estimate_plan
    from tests.test_config import make_cfg

    cfg = make_cfg(
        "model=moe_tiny",
        "model.max_seq_len=32",
        "trainer.batch_size=8",
        "trainer.devices=4",
        "sharding.expert_parallel=2",
        *overrides,
    )
    resolved = resolve(cfg)
    shape = run_shape(resolve(cfg), 4)
    tp = resolved.layout.tp
    # the ep group's sequences x T x top_k, over the group's 2 ranks
    group = shape.micro_batch * (2 // tp)
    balanced = group * 32 * 2 / 2
    d = ep_dispatch(resolved, shape)
    assert says in d.note and f"{ratio:.2f}x its own {balanced:.0f} rows" in d.note
    per_row = (64 + 4 * 64) * 4  # dim + 4 x moe_hidden_dim, fp32
    assert d.saved == int((ratio - 1) * balanced * per_row * 2)  # 2 MoE layers
    assert d.buffers == int((1 + ratio) * balanced * 64 * 4)
    _, est = estimate_plan(resolve(cfg), 4)
    assert est.parts["experts"] >= d.saved and "experts" in est.notes


@pytest.mark.parametrize("every, kept", [(1, 0), (2, 1)])
def test_ep_dispatch_counts_only_the_moe_layers_checkpointing_keeps(every, kept):
    """Under full activation checkpointing a checkpointed MoE layer keeps its input
    only: the extra received rows are saved in the layers it keeps (every
    ``ac_every``-th block recomputed, the fewest counted) and live again, one layer's,
    while a checkpointed block's backward recomputes it (in the buffers term)."""
    from src.config.run_plan import resolve
    from src.planner.activations import ep_dispatch
    from src.planner.inputs import run_shape
    from tests.test_config import make_cfg

    def dispatch(*more):
        cfg = make_cfg("model=moe_tiny", "model.max_seq_len=32",
                       "trainer.batch_size=8", "trainer.devices=2",
                       "sharding.expert_parallel=2", *more)  # fmt: skip
        resolved = resolve(cfg)
        return ep_dispatch(resolved, run_shape(resolved, 2))

    plain = dispatch()
    ac = dispatch(
        "sharding.activation_checkpointing=full",
        f"sharding.activation_checkpointing_every={every}",
    )
    one_layer = plain.saved // 2  # moe_tiny: 2 MoE layers
    assert ac.saved == one_layer * kept
    assert ac.buffers == plain.buffers + one_layer
    assert f"kept in {kept} of 2 MoE layers" in ac.note


def test_a_collapsed_layer_is_said_once_after_its_windows():
    """src/observe/routing.py: a layer above the ratio at COLLAPSE_WINDOWS logged
    steps in a row is one line naming it (once); a dip below restarts its count."""
    from src.observe.routing import COLLAPSE_WINDOWS, RoutingWatch

    watch = RoutingWatch()
    key0, key1 = "moe/layer0/load_max_over_mean", "moe/layer1/load_max_over_mean"
    lines = []
    values1 = [3.9, 1.2, 3.9, 3.9, 3.9, 3.9, 3.9]  # a dip after the first window
    for i, v1 in enumerate(values1):
        lines += watch.see({key0: 1.1, key1: v1, "moe/load_max_over_mean": v1}, i * 5)
    assert watch.above == {0: 0, 1: len(values1) - 2}
    (line,) = lines
    step = 5 * (1 + COLLAPSE_WINDOWS)
    assert line.startswith(f"step {step}: MoE routing collapsed in layer 1: ")
    assert "3.90x its share" in line and "model.aux_loss_coef" in line
    assert watch.collapsed == {1: {"step": step, "max_over_mean": 3.9}}
    assert watch.metrics() == {"moe/collapsed_layers": 1}
    assert RoutingWatch().metrics() == {}  # a dense model logs no such column


def test_a_run_whose_routing_collapses_says_so_in_its_log_and_summary(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """moe_tiny without balancing collapses in its warmup (one expert takes every
    token: 4.00x its share, 8 experts top 2): the run says so, once per layer, in
    train.log and summary.json (``routing_collapse``), and logs
    ``moe/collapsed_layers``. (train.py on its one rank, in-process:
    tests/commands.py.)"""
    import json

    from tests.commands import in_process

    code, out, err = in_process(
        monkeypatch, capsys, "train.py",
        "model=moe_tiny", "model.load_balance=none", "trainer.devices=1",
        "trainer.max_steps=12", "trainer.log_every=4", "trainer.warmup_steps=4",
        "trainer.val_every=0", "logger=none", "trainer.progress=false",
        f"hydra.run.dir={tmp_path}", one_rank=True,
    )  # fmt: skip
    assert code == 0, err[-3000:]
    printed = (out + err).splitlines()
    said = [ln for ln in printed if "MoE routing collapsed" in ln]
    assert len(said) == 2, printed[-30:]
    for layer, line in enumerate(said):
        found = re.fullmatch(
            rf"step 12: MoE routing collapsed in layer {layer}: its busiest expert "
            r"took (\d\.\d\d)x its share of the tokens at the last 3 logged steps "
            r"\(above 2x\); raise model.aux_loss_coef or model.bias_update_rate, or "
            r"see docs/models.md \(routing balance\)",
            line,
        )
        assert found and float(found.group(1)) > 3.5, line  # 4.00: every token
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["routing_collapse"].keys() == {"0", "1"}
    # the planner's predicted step beside the measured one (src/planner/step_time.py)
    predicted, measured = summary["predicted_step_time_s"], summary["step_time_s"]
    assert predicted > 0 and measured > 0
    assert summary["predicted_tokens_per_s"] == pytest.approx(16 * 128 / predicted)
    closing = [ln for ln in printed if ln.startswith("finished 12 steps")]
    assert (
        f"step time predicted {predicted * 1e3:,.1f} ms, measured "
        f"{measured * 1e3:,.1f} ms ({measured / predicted - 1:+.0%})" in closing[0]
    )
    assert all(v["step"] == 12 for v in summary["routing_collapse"].values())
    rows = [
        json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["moe/collapsed_layers"] for r in rows if "loss" in r] == [0, 0, 0, 2]


def test_aux_free_adds_the_complementary_sequence_loss_at_its_coefficient():
    """DeepSeek-V3: the bias, and the sequence-wise loss at aux_loss_coef (0: none),
    in the gradient only; moe_deepseek_v3 carries the published 0.001 and 0.0001."""
    from src.harness import compose_config

    grads = {}
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        config = MoEConfig(**CFG, load_balance="aux_free", aux_loss_coef=coef)
        model = MoETransformer(config)
        model(*tokens())[1].backward()
        grads[coef] = moe_layers(model)[0].router.gate.weight.grad.clone()
        assert (moe_layers(model)[0].aux_loss is None) == (coef == 0)
    assert not torch.allclose(grads[0.0], grads[1.0])
    m = compose_config("model=moe_deepseek_v3").model
    assert (m.load_balance, m.bias_update_rate, m.aux_loss_coef) == (
        "aux_free", 0.001, 0.0001,
    )  # fmt: skip
