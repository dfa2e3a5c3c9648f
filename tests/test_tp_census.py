"""What tensor parallelism dispatches and sends, counted on the model on meta
(src/planner/tp_census.py): the count the step-time model prices."""

from __future__ import annotations

import pytest

from src.build import build_model
from src.config.run_plan import resolve
from src.harness import compose_config
from src.planner.inputs import plan_backend
from src.planner.tp_census import TPCensus, by_blocks, census, count
from src.planner.trace import outer_blocks


def _plan(*overrides: str, model: str = "small"):
    cfg = compose_config(
        f"model={model}", "data=synthetic", "logger=none", "trainer.devices=2",
        "sharding.tensor_parallel=2", *overrides,
    )  # fmt: skip
    return resolve(cfg)


def _whole(plan) -> TPCensus:
    """Every block run: what :func:`by_blocks` must equal."""
    import torch
    from torch.distributed.tensor.parallel import loss_parallel

    def step(model) -> None:
        tokens = torch.zeros(1, plan.batch.seq_len, dtype=torch.long, device="meta")
        with loss_parallel():
            model(tokens, tokens)[1].backward()

    with plan_backend(plan) as backend:
        return count(build_model(plan, backend, init_device="meta"), step)


def test_gpt_under_sequence_parallelism_sends_what_its_plan_says():
    """The default GPT (4 blocks, sequence parallel): per block, forward gathers the
    sequence before attention and the MLP and scatters after each (2 + 2),
    backward the reverse; outside them the embeddings' two scatters and the head's
    gather, and the vocabulary-parallel loss's 3 all-reduces. Its partial
    gradients: each block's two norms' weights and biases and its fused qkv's
    weight and bias (whole on every tp rank), and the final norm's two. Counted
    on two blocks, the same as all four run; bytes of one row of 128 tokens."""
    plan = _plan()
    counted = census(plan)
    layers, width, seq = 4, 128, plan.batch.seq_len
    assert counted == _whole(plan)
    assert counted.collectives["all_gather"][0] == 4 * layers + 3
    assert counted.collectives["reduce_scatter"][0] == 4 * layers + 3
    assert counted.collectives["all_reduce"][0] == 3
    # every gather moves one full (1, seq, width) fp32 activation
    assert counted.collectives["all_gather"][1] == (4 * layers + 3) * seq * width * 4
    assert counted.partial_grads[0] == 6 * layers + 2
    assert counted.dtensor_ops > 0


@pytest.mark.parametrize(
    "overrides, model",
    [
        (("sharding.sequence_parallel=false",), "small"),
        (("sharding.activation_checkpointing=full",), "llama_tiny"),
        (
            (
                "sharding.activation_checkpointing=full",
                "sharding.activation_checkpointing_every=2",
                "model.n_layers=5",
            ),
            "llama_tiny",
        ),
    ],
)
def test_a_layout_counts_as_all_its_blocks_run(overrides, model):
    """Without sequence parallelism the row-wise outputs are all-reduced (2 per
    block forward, 2 backward); full checkpointing's recompute sends its forward's
    collectives again. Two blocks of each class stand for all of them (of each
    class and checkpointing: every other block of five checkpointed)."""
    plan = _plan(*overrides, model=model)
    counted = census(plan)
    assert counted == _whole(plan)
    plain = census(_plan(model=model))
    if "sharding.sequence_parallel=false" in overrides:
        assert set(counted.collectives) == {"all_reduce"}
        assert counted.collectives["all_reduce"][0] == 4 * 4 + 3 + 3
    else:
        assert counted.collectives["all_gather"][0] > plain.collectives["all_gather"][0]
        assert counted.dtensor_ops > plain.dtensor_ops


def test_counts_add_and_a_model_without_tp_has_none():
    """A block's count is two counts' difference; no census without TP."""
    a = TPCensus(3, {"all_gather": (2, 10)}, (1, 4))
    b = TPCensus(1, {"all_reduce": (1, 8)}, (0, 0))
    assert a.plus(b, 2) == TPCensus(
        5, {"all_gather": (2, 10), "all_reduce": (2, 16)}, (1, 4)
    )
    assert a.plus(a, -1) == TPCensus(0, {"all_gather": (0, 0)}, (0, 0))
    assert census(resolve(compose_config("model=small", "trainer.devices=2"))) is None


def test_by_blocks_keeps_two_of_each_class():
    """The runs see at most two blocks of a class (a 70B model counts as fast as a
    small one)."""
    plan = _plan()
    seen = []

    def step(model) -> None:
        seen.append(
            len(outer_blocks(model, plan.spec.block_classes(plan.model_config)))
        )

    with plan_backend(plan) as backend:
        model = build_model(plan, backend, init_device="meta")
        blocks = outer_blocks(model, plan.spec.block_classes(plan.model_config))
        by_blocks(model, blocks, step)
    assert seen == [2, 1]


@pytest.mark.parametrize("model", ["small", "hf"])
def test_only_the_blocks_counted_are_tensor_parallelised(model, monkeypatch, tmp_path):
    """The census tensor-parallelises the two blocks of each kind it runs, not the
    rest it drops (their TP was its whole cost on a deep model), and counts as the
    whole model would: GPT's blocks, parallelised as each is built (with LoRA's
    adapters), and a transformers Llama's, parallelised with its root. Where the
    blocks kept are not the first built, it builds the whole model instead."""
    import json
    import shutil

    from torch.distributed.tensor import DTensor

    from src.harness import CONF_DIR
    from src.planner import tp_census
    from src.sharding import tensor_parallel

    if model == "hf":  # transformers' Llama, 4 layers
        shutil.copytree(CONF_DIR / "hf_configs" / "tiny_llama", tmp_path / "c")
        config = json.loads((tmp_path / "c" / "config.json").read_text())
        config["num_hidden_layers"] = layers = 4
        (tmp_path / "c" / "config.json").write_text(json.dumps(config))
        overrides = [f"model.config={tmp_path / 'c'}"]
    else:
        overrides = [f"model.n_layer={(layers := 8)}", "model.lora.rank=4"]
    plan = _plan(*overrides, model=model)
    split: dict = {}  # id -> each parameter tensor parallelism split (kept alive)
    parallelize_module = tensor_parallel.parallelize_module

    def recorded(target, *args, **kwargs):
        out = parallelize_module(target, *args, **kwargs)
        split.update({id(p): p for p in target.parameters() if isinstance(p, DTensor)})
        return out

    monkeypatch.setattr(tensor_parallel, "parallelize_module", recorded)
    monkeypatch.setattr(tp_census, "_CACHE", {})
    counted = census(plan)
    shallow = len(split)
    split.clear()
    assert counted == _whole(plan)
    whole = len(split)
    per_block, rest = divmod(whole - shallow, layers - 2)
    assert per_block > 0 and rest == 0, (whole, shallow)
    if model == "hf":
        return
    monkeypatch.setattr(tp_census, "_CACHE", {})
    monkeypatch.setattr(tp_census, "_beyond_two", lambda blocks, kinds: [])
    split.clear()
    assert census(plan) == counted
    assert len(split) == shallow + whole  # the shallow build, then the whole


def test_a_model_that_cannot_run_on_meta_is_said_not_guessed(monkeypatch):
    """No TP lines and a note naming why; the census fails once per key, not at
    every prediction of a search."""
    from src.planner import tp_census
    from src.planner.run_estimate import estimate_plan
    from src.planner.step_time import predict
    from tests.test_step_time import _profile

    calls = []

    def fails(plan):
        calls.append(plan)
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")

    monkeypatch.setattr(tp_census, "_CACHE", {})
    monkeypatch.setattr(tp_census, "_census", fails)
    plan = _plan()
    wrap, _ = estimate_plan(plan, plan.world_size)
    for _ in range(2):
        step = predict(plan, wrap, _profile())
    names = {t.name for t in step.terms}
    assert not {"TP collectives", "DTensor dispatch (TP)"} & names
    assert any(
        "does not run on the meta device (Tensor.item()" in n for n in step.notes
    )
    assert len(calls) == 1
