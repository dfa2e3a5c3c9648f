"""The step-time model (src/planner/step_time.py) term by term on hand-checkable
cases, and the device profiles' cache (src/planner/profiles.py)."""

from __future__ import annotations

import json
import logging
import math

import pytest

import src.config.schema  # noqa: F401  (registers the base_config schema for compose)
from src.config.run_plan import resolve
from src.harness import compose_config
from src.models.gpt import count_params
from src.planner import profiles
from src.planner.profiles import COLLECTIVES, DeviceProfile, Link, gpu_profile
from src.planner.run_estimate import estimate_plan
from src.planner.step_time import (
    OPTIMIZER_BYTES_PER_PARAM,
    STEP_SCALARS_BYTES,
    predict,
    predicted_step,
)
from src.planner.tp_census import census
from src.sharding.pipeline import bubble_fraction

LATENCY, BANDWIDTH = 1e-3, 1e8
FLOPS, MEMORY = 1e9, 1e9


def _profile(cores: int = 0, overlap: bool = False) -> DeviceProfile:
    """Round figures: matmuls 1 GFLOP/s (fp32), attention half that, a copy 1 GB/s,
    the activation function a quarter of it, 1 ms + bytes / 100 MB/s a collective."""
    link = {c: Link(LATENCY, BANDWIDTH) for c in COLLECTIVES}
    return DeviceProfile(
        name="test",
        source="by hand",
        cores=cores,
        matmul={"fp32": {1: FLOPS}, "bf16": {1: 2 * FLOPS}},
        attention={"fp32": {1: FLOPS / 2}, "bf16": {1: FLOPS}},
        memory_bw={1: MEMORY},
        activation_bw={1: MEMORY / 4},
        op_s=1e-6,
        links=link,
        inter_links=link,
        ranks_per_node=8,
        overlap=overlap,
    )


def build_model_params(*overrides: str):
    """The parameters of the model ``overrides`` compose, built on meta."""
    import torch

    resolved = resolve(compose_config(*overrides, "data=synthetic"))
    with torch.device("meta"):
        return list(resolved.spec.build(resolved.model_config, 0).parameters())


def _predict(
    *overrides: str, profile: DeviceProfile | None = None, model: str = "tiny"
):
    cfg = compose_config(f"model={model}", "data=synthetic", "logger=none", *overrides)
    resolved = resolve(cfg)
    plan, _ = estimate_plan(resolved, resolved.world_size)
    step = predict(resolved, plan, profile or _profile())
    return resolved, plan, step, {t.name: t.seconds for t in step.terms}


def test_compute_terms_are_6N_tokens_plus_attention_and_the_recompute():
    """model=tiny (2 layers, width 64, vocabulary 256, 64 tokens), 16 sequences on
    one rank: matmuls 6 N per token (N: every parameter but the position table) at
    the matmul rate, attention 12 L d T per token at the attention rate, GELU over
    4 d per layer and token (5 fp32 widths moved) at its bandwidth, norms, residuals
    (30 d) and the loss (8 V fp32) at the copy's; full checkpointing runs the blocks'
    forward again (a third of their matmuls, the head's left out, and attention,
    and 2 of the activation's 5 widths), selective the activation's alone."""
    resolved, _, step, terms = _predict("trainer.devices=1", "sharding=none")
    config = resolved.model_config
    tokens, layers, width, vocab = 16 * 64, 2, 64, 256
    n = count_params(config) - 64 * width  # the position embedding is a lookup
    assert terms["matmuls"] == pytest.approx(6 * n * tokens / FLOPS)
    attention = 12 * layers * width * 64 * tokens
    assert terms["attention"] == pytest.approx(attention / (FLOPS / 2))
    act = tokens * layers * 4 * width * 5 * 4
    assert terms["activation function"] == pytest.approx(act / (MEMORY / 4))
    rest = tokens * (layers * 30 * width * 4 + 8 * vocab * 4)
    assert terms["norms, residuals, loss"] == pytest.approx(rest / MEMORY)
    assert step.model_flops_per_rank == pytest.approx(6 * n * tokens + attention)
    assert step.total_s == pytest.approx(sum(terms.values()))
    assert step.tokens_per_s == pytest.approx(tokens / step.total_s)
    head = 6 * vocab * width * tokens
    again = (6 * n * tokens - head) / 3 / FLOPS + attention / 3 / (FLOPS / 2)
    again_act = act * 2 / 5 / (MEMORY / 4)
    ac = ("trainer.devices=1", "sharding=none", "sharding.activation_checkpointing")
    _, _, _, full = _predict(*ac[:2], f"{ac[2]}=full")
    assert full["recompute (checkpointing)"] == pytest.approx(again + again_act)
    # every 2nd of 2 blocks: half of that
    every = "sharding.activation_checkpointing_every=2"
    _, _, _, half = _predict(*ac[:2], f"{ac[2]}=full", every)
    assert half["recompute (checkpointing)"] == pytest.approx((again + again_act) / 2)
    _, _, _, selective = _predict(*ac[:2], f"{ac[2]}=selective")
    assert selective["recompute (checkpointing)"] == pytest.approx(again_act)


def test_fsdp_collectives_per_unit_and_their_overlap():
    """FSDP2 on 2 ranks: each unit gathered in forward and again in backward (the
    root once), its gradients reduce-scattered once; each collective 1 ms + half
    the unit's bytes / 100 MB/s. Where the profile overlaps, a unit costs the larger
    of its compute and its collectives, the first gather exposed."""
    _, plan, step, terms = _predict("trainer.devices=2")
    want = 0.0
    for unit in plan.units:
        one = LATENCY + 0.5 * unit.numel * 4 / BANDWIDTH
        want += (1 if unit.path == "" else 2) * one + one
    assert terms["FSDP all-gather + reduce-scatter"] == pytest.approx(want)
    # two micro-batches: the gathers twice, the reduce-scatter once (grad_sync last)
    _, plan, _, accum = _predict("trainer.devices=2", "trainer.grad_accum=2")
    assert accum["FSDP all-gather + reduce-scatter"] == pytest.approx(
        want + sum(
            (1 if u.path == "" else 2) * (LATENCY + 0.5 * u.numel * 4 / BANDWIDTH)
            for u in plan.units
        )
    )  # fmt: skip
    _, _, over, overlapped = _predict(
        "trainer.devices=2", profile=_profile(overlap=True)
    )
    assert overlapped["FSDP all-gather + reduce-scatter"] < want
    assert "overlapped with compute" in over.table()


def test_fsdp_units_and_tp_ops_cost_the_probes_time_each():
    """A profile's framework figures: each FSDP unit costs ``fsdp_unit_s`` per
    micro-batch (FSDP2 and FSDP1; none without sharding) and its collectives move
    at ``fsdp_bandwidth`` (the hooks run unsharded too: HSDP of 1-rank replicas),
    under TP each op DTensor dispatches costs ``dtensor_op_s`` and each collective
    it sends ``dtensor_comm_s`` beyond its link (the model's census), each parameter
    tensor of
    FSDP2 (DTensors) ``dtensor_param_s`` in the optimizer step (not FSDP1's flat
    parameters, not DDP's) and every backend's ``param_s``; ranks wait for each
    other ``sync_wait`` of their compute (not a pipeline's stages: its bubble is
    that); the step's small all-reduces are the
    loss's (every run of 2 ranks), the norm's (parameters split) and the routers'
    (MoE); a profile without them (a GPU's datasheet) has none of these lines."""
    from dataclasses import replace

    bw = BANDWIDTH / 3
    framework = replace(
        _profile(), fsdp_unit_s=1e-3, dtensor_op_s=1e-5, dtensor_comm_s=1e-3,
        fsdp_bandwidth=bw,
        dtensor_param_s=1e-4, param_s=2e-5, sync_wait=0.1,
    )  # fmt: skip
    _, plan, _, fsdp = _predict("trainer.devices=2", profile=framework)
    compute = ("matmuls", "attention", "activation function",
               "norms, residuals, loss", "op dispatch")  # fmt: skip
    assert fsdp["waiting for the slower rank"] == pytest.approx(
        0.1 * sum(fsdp[k] for k in compute)
    )
    small = LATENCY + STEP_SCALARS_BYTES / BANDWIDTH  # 2 ranks: one exchange
    assert fsdp["step all-reduces"] == pytest.approx(2 * small, rel=0.01)
    assert fsdp["FSDP hooks and copies"] == pytest.approx(len(plan.units) * 1e-3)
    tensors = sum(1 for _ in build_model_params("model=tiny"))
    assert sum(u.tensors for u in plan.units) == tensors
    assert fsdp["optimizer on DTensors"] == pytest.approx(tensors * 1e-4)
    assert fsdp["optimizer per tensor"] == pytest.approx(tensors * 2e-5)
    one = {u.path: LATENCY + 0.5 * u.numel * 4 / bw for u in plan.units}
    want = sum((1 if p == "" else 2) * t + t for p, t in one.items())
    assert fsdp["FSDP all-gather + reduce-scatter"] == pytest.approx(want)
    # measured slower beside compute: each unit's share its compute covers
    # (the step's compute split by parameters) moves at that bandwidth
    busy_bw = bw / 2
    _, plan, _, loaded = _predict(
        "trainer.devices=2", profile=replace(framework, fsdp_loaded_bandwidth=busy_bw)
    )
    busy_s = sum(loaded[k] for k in compute)
    total = sum(u.numel for u in plan.units)
    want = 0.0
    for u in plan.units:
        times = 2 if u.path else 1  # gathers; and one scatter
        free = (times + 1) * (LATENCY + 0.5 * u.numel * 4 / bw)
        busy = (times + 1) * (LATENCY + 0.5 * u.numel * 4 / busy_bw)
        beside = min(1.0, busy_s * u.numel / total / busy)
        want += beside * busy + (1 - beside) * free
    assert 0 < want - fsdp["FSDP all-gather + reduce-scatter"]
    assert loaded["FSDP all-gather + reduce-scatter"] == pytest.approx(want)
    _, plan, _, accum = _predict(
        "trainer.devices=2", "trainer.grad_accum=2", "sharding=fsdp1",
        profile=framework,
    )  # fmt: skip
    assert accum["FSDP hooks and copies"] == pytest.approx(2 * len(plan.units) * 1e-3)
    assert "optimizer on DTensors" not in accum  # FSDP1's flat parameters
    resolved, plan, _, tp = _predict(
        "trainer.devices=2", "sharding.tensor_parallel=2", profile=framework
    )
    counted = census(resolved)
    assert tp["DTensor dispatch (TP)"] == pytest.approx(counted.dtensor_ops * 1e-5)
    rows = resolved.batch.batch_size  # one micro-batch: every row on each tp rank
    want = sum(
        n * (LATENCY + COLLECTIVES[k] * 0.5 * nbytes * rows / n / BANDWIDTH + 1e-3)
        for k, (n, nbytes) in counted.collectives.items()
    )
    assert tp["TP collectives"] == pytest.approx(want)
    n, nbytes = counted.partial_grads
    each = LATENCY + 2 * 0.5 * nbytes / n / BANDWIDTH + 1e-3
    assert n and tp["TP gradient all-reduces"] == pytest.approx(n * each)
    # HSDP with one rank per replica: nothing sharded, every unit's hooks still run
    _, plan, _, hsdp = _predict(
        "trainer.devices=2", "sharding.replicate=2", profile=framework
    )
    assert "FSDP all-gather + reduce-scatter" not in hsdp
    assert hsdp["FSDP hooks and copies"] == pytest.approx(len(plan.units) * 1e-3)
    _, _, _, ddp = _predict("trainer.devices=2", "sharding=ddp", profile=framework)
    assert ddp["optimizer per tensor"] == pytest.approx(tensors * 2e-5)
    assert ddp["step all-reduces"] == pytest.approx(small, rel=0.01)  # loss alone
    _, _, _, moe = _predict("trainer.devices=2", profile=framework, model="moe_tiny")
    assert moe["step all-reduces"] == pytest.approx(3 * small, rel=0.01)

    _, _, _, alone = _predict(
        "trainer.devices=1", "sharding=none", profile=framework
    )  # fmt: skip
    assert not {"step all-reduces", "waiting for the slower rank"} & set(alone)
    _, _, _, pp = _predict(
        "trainer.devices=2", "sharding.pipeline_parallel=2", profile=framework
    )  # its stages' waits are its bubble's
    assert "waiting for the slower rank" not in pp and "pipeline bubble" in pp
    _, _, _, plain = _predict("trainer.devices=2")
    lines = {"FSDP hooks and copies", "DTensor dispatch (TP)", "optimizer on DTensors"}
    assert not {"optimizer per tensor", "waiting for the slower rank"} & set(plain)
    assert not lines & {*ddp, *plain}


def test_the_wait_grows_as_the_compute_between_synchronisations_shrinks():
    """With the probe's exponent, the ranks' wait is ``sync_wait x (c / burst) **
    exponent`` of the compute, ``c`` the compute between two of the step's
    synchronisations (each FSDP unit's gathers and scatter, the step's
    all-reduces, TP's collectives...): a layout that meets more often waits a
    larger share, at most all of its compute; exponent 0 keeps the flat share.
    The exponent is fitted through the probe's two (compute between
    synchronisations, share) points as they ran, in [-1, 0]."""
    from dataclasses import replace

    from src.planner.profiles import _wait_exponent

    compute = ("matmuls", "attention", "activation function",
               "norms, residuals, loss", "op dispatch")  # fmt: skip
    burst = 0.008  # the probe's compute between its synchronisations
    curved = replace(
        _profile(), sync_wait=0.1, sync_wait_exponent=-0.5, sync_burst_s=burst
    )
    shares = {}
    for name, layout in (("fsdp", []), ("tp", ["sharding.tensor_parallel=2"])):
        resolved, plan, step, terms = _predict(
            "trainer.devices=2", *layout, profile=curved
        )
        busy = sum(terms[k] for k in compute)
        syncs = sum(t.syncs for t in step.terms)
        want = 0.1 * (busy / syncs / burst) ** -0.5
        assert terms["waiting for the slower rank"] == pytest.approx(
            min(1.0, want) * busy
        )
        shares[name] = terms["waiting for the slower rank"] / busy
        if name == "fsdp":  # each unit: a gather (two under resharding), a scatter
            per_unit = sum(3 if u.path else 2 for u in plan.units)
            assert syncs == per_unit + 2  # the loss's and the norm's all-reduces
    assert shares["tp"] > shares["fsdp"]
    _, _, _, flat = _predict(
        "trainer.devices=2", profile=replace(curved, sync_wait_exponent=0.0)
    )
    busy = sum(flat[k] for k in compute)
    assert flat["waiting for the slower rank"] == pytest.approx(0.1 * busy)
    # through the two points as they ran (the short rounds: whole passes)
    assert _wait_exponent((0.01, 0.1), (0.0025, 0.1 * 4**0.3)) == pytest.approx(-0.3)
    assert _wait_exponent((0.01, 0.1), (0.0025, 0.0)) == 0.0  # no wait: flat
    assert _wait_exponent((0.01, 0.1), (0.0025, 0.05)) == 0.0  # less: flat, not up
    assert _wait_exponent((0.01, 0.01), (0.001, 10.0)) == -1.0  # at most constant
    assert _wait_exponent((0.01, 0.1), (0.0099, 0.3)) == 0.0  # one burst: no slope


def test_ddp_pipeline_and_oversubscribed_cpu_terms(monkeypatch):
    """DDP all-reduces its fp32 gradients once a step (2 x half the bytes on 2
    ranks); PP2 idles the bubble's share of the step; 8 ranks on a 2-core profile
    each get a quarter of one core's rates, said."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # cores // ranks threads
    _, plan, _, ddp = _predict("trainer.devices=2", "sharding=ddp")
    grads = plan.bytes_per_rank()
    assert ddp["DDP all-reduce"] == pytest.approx(LATENCY + grads / BANDWIDTH)
    assert ddp["optimizer step"] == pytest.approx(
        OPTIMIZER_BYTES_PER_PARAM * grads / 4 / MEMORY
    )
    resolved, _, step, pp = _predict(
        "trainer.devices=2",
        "sharding.pipeline_parallel=2",
        "sharding.pp_microbatches=4",
    )
    bubble = bubble_fraction(resolved.pipeline.schedule, 2, 4)
    busy = sum(
        v for k, v in pp.items() if k not in ("pipeline bubble", "optimizer step")
    )
    assert pp["pipeline bubble"] == pytest.approx(busy * bubble / (1 - bubble))
    _, _, alone, one = _predict(
        "trainer.devices=1", "sharding=none", profile=_profile(2)
    )
    _, _, shared, eight = _predict("trainer.devices=8", profile=_profile(2))
    assert eight["matmuls"] == pytest.approx(one["matmuls"] / 8 * 4)  # 1/8 the work
    assert any(
        "8 ranks x 1 thread(s) share 2 cores: each rank gets 1/4 " in n
        for n in shared.notes
    )
    assert not alone.notes


def test_gpu_profiles_are_datasheets_and_say_so():
    h100 = gpu_profile("h100_80gb")
    assert h100.source == "datasheet, not calibrated"
    assert h100.matmul["bf16"][1] == pytest.approx(989.4e12)
    assert gpu_profile("rtx_9999") is None
    _, _, step, _ = _predict("trainer.devices=8", "precision=bf16_mixed", profile=h100)
    assert "H100 (datasheet, not calibrated)" in step.table()
    # a plan for an accelerator without a profile says so, and predicts nothing
    cfg = compose_config("model=tiny", "trainer.mem_budget_gib=l40s")
    resolved = resolve(cfg)
    plan, _ = estimate_plan(resolved, resolved.world_size)
    assert predicted_step(resolved, plan) == (
        None, "no device profile for 'l40s' (datasheets: B200, H200, H100, A100)"
    )  # fmt: skip


def test_the_cpu_profile_is_cached_per_machine_and_a_bad_file_is_measured_again(
    tmp_path, monkeypatch, caplog
):
    """Measured once and written; read back (no probe); measured again when the
    machine's identity changes, and when the file is damaged or forged (one line)."""
    monkeypatch.setenv("SHARDWRAP_PROFILE_DIR", str(tmp_path))
    probes = []

    def probe():
        probes.append(1)
        return _profile(cores=2)

    first = profiles.cpu_profile(probe)
    assert len(probes) == 1 and "measured now" in first.source
    again = profiles.cpu_profile(probe)
    assert len(probes) == 1 and again.source.startswith("probe, cached in")
    assert again.links == first.links and again.matmul == first.matmul
    [path] = tmp_path.glob("cpu-*.json")

    identity = profiles.cpu_identity()
    monkeypatch.setattr(profiles, "cpu_identity", lambda: {**identity, "torch": "0.0"})
    profiles.cpu_profile(probe)
    assert len(probes) == 2 and len(list(tmp_path.glob("cpu-*.json"))) == 2
    monkeypatch.setattr(profiles, "cpu_identity", lambda: identity)

    raw = json.loads(path.read_text())
    forged = [
        "{not json",
        json.dumps({**raw, "op_s": "fast"}),
        json.dumps({**raw, "matmul": {"fp32": {"1": -1.0}, "bf16": {"1": 1.0}}}),
        json.dumps({**raw, "links": {}}),
        json.dumps({**raw, "fsdp_unit_s": -1e-3}),
        json.dumps({**raw, "fsdp_bandwidth": True}),
        json.dumps({**raw, "fsdp_loaded_bandwidth": -5.0}),
        json.dumps({**raw, "traced_op_s": "1us"}),
        json.dumps({**raw, "ddp_bandwidth": -1.0}),
        json.dumps({**raw, "param_s": None}),
        json.dumps({**raw, "sync_wait": -0.1}),
        json.dumps({**raw, "sync_wait_exponent": 0.5}),
        json.dumps([raw]),
    ]
    for text in forged:
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=profiles.__name__):
            profiles.cpu_profile(probe)
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"device profile {path} refused (") and "\n" not in line
        assert json.loads(path.read_text())["identity"] == identity  # written again
    assert len(probes) == 2 + len(forged)


def test_the_probe_measures_every_figure_of_a_profile(tmp_path, monkeypatch):
    """The real probe (a few seconds: two rank processes): every rate positive, at
    one thread and at every core, each collective's latency and bandwidth between
    two processes, FSDP's time per unit and DTensor's per op (>= 0: what is left
    of the measured extra once the modelled collectives are taken off); cached as
    measured."""
    monkeypatch.setenv("SHARDWRAP_PROFILE_DIR", str(tmp_path))
    found = profiles.cpu_profile()
    cores = profiles.available_cores()
    assert found.cores == cores and found.name.endswith(f", {cores} cores")
    for table in (*found.matmul.values(), *found.attention.values()):
        assert set(table) == {1, cores} and min(table.values()) > 0
    assert set(found.memory_bw) == set(found.activation_bw) == {1, cores}
    assert found.op_s > 0 and set(found.links) == set(COLLECTIVES)
    assert all(k.latency_s > 0 and k.bandwidth > 0 for k in found.links.values())
    assert found.fsdp_unit_s >= 0 and found.dtensor_comm_s >= 0
    assert found.dtensor_op_s > 0
    assert found.fsdp_bandwidth > 0 and found.ddp_bandwidth > 0
    assert 0 < found.fsdp_loaded_bandwidth <= found.fsdp_bandwidth
    assert found.traced_op_s >= 0 and found.ddp_bucket_s >= 0
    # the ranks' wait: a share of their compute, past 1 on a loaded machine
    assert 0 < found.param_s < 1e-3
    assert math.isfinite(found.sync_wait) and found.sync_wait >= 0
    assert -1 <= found.sync_wait_exponent <= 0 and found.sync_burst_s > 0
    back = profiles.cpu_profile()
    assert back.matmul == found.matmul and back.fsdp_unit_s == found.fsdp_unit_s


@pytest.mark.parametrize("preset", ["small", "llama_tiny", "moe_tiny"])
def test_a_familys_forward_ops_are_what_its_forward_dispatches(preset):
    """``ModelSpec.forward_ops`` (the dispatch term's count) against the ops a real
    forward of the family's tiny preset dispatches (two sequences): within 10%."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from src.planner.search import n_blocks

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    resolved = resolve(compose_config(f"model={preset}", "data=synthetic"))
    spec, config = resolved.spec, resolved.model_config
    model = spec.build(config, 0)
    idx = torch.randint(0, spec.vocab_size(config), (2, resolved.batch.seq_len))
    with torch.no_grad(), Count():
        model(idx, idx)
    block, outside = spec.forward_ops
    assert Count.ops == pytest.approx(block * n_blocks(resolved) + outside, rel=0.1)
