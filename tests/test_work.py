"""The model's own ops, traced on fake tensors and timed on this CPU
(src/planner/work.py): what the step-time model computes a probed CPU's step from."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest
import torch

import src.config.schema  # noqa: F401  (registers the base_config schema for compose)
from src.config.run_plan import resolve
from src.harness import compose_config
from src.observe import live_memory
from src.planner import work
from src.planner.step_time import predict
from src.planner.trace import HEAD, block_order
from src.sharding.pipeline import bubble_fraction
from tests.test_step_time import FLOPS, _predict, _profile


def _traced(preset: str, mode: str):
    resolved = resolve(compose_config(f"model={preset}", "data=synthetic"))
    spec, config = resolved.spec, resolved.model_config
    with torch.device("meta"):
        model = spec.build(config, 0)
    classes = spec.block_classes(config)
    seq = resolved.batch.seq_len
    ops = work.traced_ops(model, classes, 2, seq, torch.float32, mode)
    order = block_order(model, classes)

    def flops(region) -> float:
        counts = ops.regions[region]
        return sum(n * ops.calls[key].flops() for key, n in counts.items())

    blocks = {cls: order.count(cls) * flops(cls) for cls in set(order)}
    return resolved, ops, flops(HEAD), blocks, 2 * seq


@pytest.mark.parametrize("preset", ["small", "llama_tiny", "moe_tiny"])
def test_the_traced_matmuls_are_the_family_formulas_flops(preset):
    """Forward and backward of one micro-batch traced: its matmuls' FLOPs (a MoE's
    grouped expert matmuls among them) are the family's 6N per token within 1%;
    with full checkpointing each block runs its forward again, up to the last op
    whose output backward needs (torch's checkpoint stops its recompute there: the
    GPT's MLP output projection is not run again): more, at most 4/3."""
    resolved, ops, head, blocks, tokens = _traced(preset, "none")
    formula = resolved.spec.flops_per_token(resolved.model_config, 0) * tokens
    assert head + sum(blocks.values()) == pytest.approx(formula, rel=0.01)
    names = {call.name for call in ops.calls.values()}
    assert ("aten._grouped_mm" in names) == (preset == "moe_tiny")
    assert not any(n.startswith("prim.") for n in names)  # fake tensors' metadata
    _, _, head_full, blocks_full, _ = _traced(preset, "full")
    assert head_full == head
    for cls, f in blocks.items():
        assert 1.15 * f < blocks_full[cls] <= f * 4 / 3 * (1 + 1e-9)


def test_op_times_are_measured_once_and_a_forged_cache_is_refused(
    tmp_path, monkeypatch
):
    """An op is run once at its shapes and its time kept on disk; read back, it is
    not run again; a cache that is not a table of positive numbers is ignored
    whole; an op past the replay limits is counted instead."""
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with work.Recorder() as recorder:
        torch.mm(a, b)
    [call] = recorder.out.calls.values()
    assert call.kind == "matmul" and call.flops() == 2 * 64 * 32 * 16
    path = tmp_path / "ops.json"
    times = work.OpTimes(path, 1)
    seconds = times(call, lambda c: pytest.fail("counted"))
    assert seconds > 0
    times.save()
    assert json.loads(path.read_text()) == {
        "format": work.TIMES_FORMAT, "ops": {call.key: seconds}, "runs": {},
    }  # fmt: skip

    def refuse(*_):
        raise AssertionError("replayed again")

    monkeypatch.setattr(work, "replay_seconds", refuse)
    assert work.OpTimes(path, 1)(call, refuse) == seconds
    forged = [
        {call.key: seconds},
        {"format": work.TIMES_FORMAT - 1, "ops": {call.key: seconds}, "runs": {}},
        {"format": work.TIMES_FORMAT, "ops": {call.key: "fast"}, "runs": {}},
        {"format": work.TIMES_FORMAT, "ops": {call.key: -1.0}, "runs": {}},
        {"format": work.TIMES_FORMAT, "ops": {call.key: True}, "runs": {}},
        {
            "format": work.TIMES_FORMAT,
            "ops": {call.key: seconds},
            "runs": {"k": {"matmul": 1.0}},
        },
        [seconds],
    ]
    for raw in forged:
        path.write_text(json.dumps(raw))
        assert work.OpTimes(path, 1)(call, lambda c: 7.0) == 7.0
    monkeypatch.setattr(work, "REPLAY_FLOPS", 1.0)
    assert work.OpTimes(None, 1)(call, lambda c: 3.0) == 3.0


@pytest.fixture
def probed(tmp_path, monkeypatch):
    """A 2-core CPU profile with the probe's per-op figure (2 us), its op times in
    ``tmp_path``, each op "replayed" as its FLOPs at the profile's rate plus 1 us,
    the model's own overhead not run (the probe's figure holds)."""
    monkeypatch.setenv("SHARDWRAP_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(work, "model_overhead", lambda *a: None)
    monkeypatch.setattr(
        work, "replay_seconds", lambda call, clock=None: call.flops() / FLOPS + 1e-6
    )
    return replace(_profile(cores=2), traced_op_s=2e-6)


def test_a_probed_cpu_times_the_models_ops_and_shared_cores_use_the_formula(
    probed, tmp_path, monkeypatch
):
    """On a CPU profile with the probe's per-op figure, one rank's compute is the
    traced ops' times (here: each op's FLOPs at the profile's rate, plus 1 us)
    plus the per-op figure for every op, views included, its blocks' as often as
    the model has them; the traced matmuls equal the formula's within 2%, and the
    times are cached beside the profile."""
    terms = {}
    for profile in (_profile(cores=2), probed):
        resolved, plan, _, terms[profile.traced_op_s] = _predict(
            "trainer.devices=1", "sharding=none", profile=profile
        )
    formula, timed = terms[0.0], terms[2e-6]
    assert "activation function" in formula and "other ops" not in formula
    assert timed["matmuls"] == pytest.approx(formula["matmuls"], rel=0.02)
    seq = resolved.batch.seq_len
    ops, blocks = work.run_ops(
        resolved, resolved.batch.batch_size, seq, torch.float32, "none"
    )
    n_ops = sum(
        blocks[region] * (sum(counts.values()) + ops.views.get(region, 0))
        for region, counts in ops.regions.items()
    )
    assert blocks[HEAD] == 1 and n_ops > 100
    assert timed["autograd and modules"] == pytest.approx(n_ops * 2e-6)
    cached = json.loads(next(tmp_path.glob("*-ops-*.json")).read_text())
    assert len(cached["runs"]) == 1 and cached["ops"]
    monkeypatch.setattr(work, "_OPS", {})  # a new process: its totals read back
    monkeypatch.setattr(work, "_TIMES", {})
    monkeypatch.setattr(work, "traced_ops", lambda *a, **k: pytest.fail("traced"))
    again = {t.name: t.seconds for t in predict(resolved, plan, probed).terms}
    assert again == timed
    # eight ranks on two cores: the formula, as measured
    *_, shared = _predict("trainer.devices=8", profile=probed)
    assert "activation function" in shared and "other ops" not in shared


def test_expert_parallelism_is_said_to_be_timed_without_its_shapes(probed):
    """A MoE under EP on a probed CPU: its ops traced as one rank running every
    expert (grouped matmuls among them), and the prediction says so in a note."""
    _, _, step, terms = _predict(
        "trainer.devices=2", "sharding.expert_parallel=2", profile=probed,
        model="moe_tiny",
    )  # fmt: skip
    assert {"matmuls", "other ops", "EP all-to-alls"} <= set(terms)
    assert any("expert parallelism's shapes are not traced" in n for n in step.notes)


def test_a_timed_pipelines_bubble_leaves_out_the_head(probed):
    """PP2 on a probed CPU: the bubble is the schedule's idle share of the stage's
    busy time less its ops outside the blocks (embeddings, head, loss: the other
    stage, which fills and drains the pipeline, runs none of them but an
    embedding); on the formula, where nothing is timed apart, of all of it."""
    resolved, _, _, terms = _predict(
        "trainer.devices=2", "sharding.pipeline_parallel=2", profile=probed
    )
    micro = resolved.pipeline.microbatches
    ops, _ = work.run_ops(
        resolved, resolved.batch.batch_size // micro, resolved.batch.seq_len,
        torch.float32, "none",
    )  # fmt: skip
    head = micro * sum(
        n * (ops.calls[k].flops() / FLOPS + 1e-6) for k, n in ops.regions[HEAD].items()
    )
    busy = sum(v for k, v in terms.items() if not k.startswith(("pipeline", "optim")))
    bubble = bubble_fraction(resolved.pipeline.schedule, 2, micro)
    assert 0 < head < busy
    assert terms["pipeline bubble"] == pytest.approx(
        (busy - head) * bubble / (1 - bubble)
    )


def _grouped_reference(a, b, offs):
    """A grouped matmul group by group: ``offs`` split ``a``'s rows (2-D x 3-D),
    the shared dimension (2-D x 2-D: one output per group), or ``b``'s columns."""
    starts = [0, *offs.tolist()[:-1]]
    parts = list(zip(starts, offs.tolist(), strict=True))
    if a.dim() == 2 and b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(parts)])
    if a.dim() == 2:
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in parts])
    return torch.cat([a[g] @ b[:, s:e] for g, (s, e) in enumerate(parts)], dim=1)


def test_grouped_matmuls_replay_every_token_of_each_expert():
    """Each grouped matmul of the MoE's forward and backward (offs at dispatch: a
    positional argument) is replayed with its tokens split evenly over the
    experts, on the dimension that form splits, and computes what the experts one
    by one would; its FLOPs are theirs."""
    _, ops, *_ = _traced("moe_tiny", "none")
    grouped = [c for c in ops.calls.values() if c.name == "aten._grouped_mm"]
    assert {(len(c.tensors()[0][1]), len(c.tensors()[1][1])) for c in grouped} >= {
        (2, 3), (2, 2)
    }  # fmt: skip
    for call in grouped:
        args, kwargs = work._inputs(call)
        a, b, offs = args[0], args[1], args[2] if len(args) > 2 else kwargs["offs"]
        sizes = torch.diff(offs, prepend=torch.zeros(1, dtype=offs.dtype))
        assert offs[-1] == work._grouped_rows(a, b) > 0 and (sizes == sizes[0]).all()
        torch.testing.assert_close(
            call.func(*args, **kwargs), _grouped_reference(a, b, offs)
        )
        per_group = _grouped_reference(
            torch.ones_like(a), torch.ones_like(b), offs
        )  # each output element sums one group's shared dimension
        assert call.flops() == 2 * per_group.sum().item()


def _overhead(monkeypatch, resolved) -> tuple[float, float] | None:
    """``resolved``'s model overhead figures, measured now (not the process's)."""
    monkeypatch.setattr(work, "_OVERHEAD", {})
    return work.model_overhead(resolved, 16, "none", 1)


def _no_memory_read(monkeypatch) -> None:
    """A sample reads no memory: glibc's mallinfo2 walks the heap, whose fragments
    a long-lived test worker has many of (1 ms a sample in the suite)."""
    monkeypatch.setattr(live_memory.LiveMemory, "sample", lambda self: None)


def test_a_models_own_overhead_is_run_on_its_head_and_first_blocks(monkeypatch):
    """The model's per-op time beyond its ops comes from a real run of its head and
    first block (the later blocks left on meta, the tied head still tied, every
    value the family's init); Python the model runs between its ops raises it by
    that time over its ops; a family without an init, one past the size limit, or
    one whose init fails has none (the probe's figure holds)."""
    resolved = resolve(compose_config("model=tiny", "data=synthetic"))
    spec, config = resolved.spec, resolved.model_config
    classes = tuple(spec.block_classes(config))
    with torch.device("meta"):
        model = spec.build(config, 0)
    assert work._materialize(model, classes, spec.init_tensor, config)
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    assert all(p.device.type == "cpu" for p in blocks[0].parameters())
    assert all(p.device.type == "meta" for b in blocks[1:] for p in b.parameters())
    for name, p in model.named_parameters():
        if p.device.type == "cpu":
            torch.testing.assert_close(
                p.data, spec.init_tensor(name, p.shape, config, 0)
            )  # fmt: skip
    assert model.lm_head.weight is model.wte.weight

    _no_memory_read(monkeypatch)
    plain = _overhead(monkeypatch, resolved)[0]
    assert 0 <= plain < 1e-3
    # 10 ms a forward: the other worker's load moved a step's wall and its ops'
    # own time (two different steps) apart by ~2 ms in CI, past a 2 ms spin
    spin, ops = 10e-3, []
    materialize = work._materialize

    def slowed(model, *args):
        done = materialize(model, *args)

        def busy(*_):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < spin:
                pass

        model.register_forward_pre_hook(busy)
        ops.append(model)
        return done

    monkeypatch.setattr(work, "_materialize", slowed)
    slow = _overhead(monkeypatch, resolved)[0]
    with work._OpClock() as clock:
        _, loss = ops[0](*[torch.zeros(1, 16, dtype=torch.long)] * 2)
        loss.backward()
    # seen, and not far past it: the other worker's load stretches a wall-clock
    # figure taken at another moment (3x once in the suite), never shrinks it
    assert 0.5 * spin / clock.ops < slow - plain < 5 * spin / clock.ops
    monkeypatch.setattr(work, "_materialize", materialize)
    monkeypatch.setattr(work, "OVERHEAD_NUMEL", 10)
    assert _overhead(monkeypatch, resolved) is None
    no_init = replace(resolved, spec=replace(spec, init_tensor=None))
    monkeypatch.setattr(work, "OVERHEAD_NUMEL", 2**30)
    assert _overhead(monkeypatch, no_init) is None

    def broken(*_):
        raise RuntimeError("no value for this buffer")

    failing = replace(resolved, spec=replace(spec, init_tensor=broken))
    assert _overhead(monkeypatch, failing) is None


def test_a_logged_steps_memory_sampling_is_timed_on_the_same_run(monkeypatch):
    """The overhead run also runs the model with the live-memory sampler's hooks
    attached, as a logged step has them: what that adds per op is its samples'
    time over the run's ops; the sampler's file is closed after."""
    resolved = resolve(compose_config("model=tiny", "data=synthetic"))
    _no_memory_read(monkeypatch)
    fds = len(os.listdir("/proc/self/fd"))
    sampling = _overhead(monkeypatch, resolved)[1]
    assert len(os.listdir("/proc/self/fd")) == fds  # its sampler's file closed
    assert 0 <= sampling < 1e-3
    calls = []

    def slow_sample(self):
        calls.append(1)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-3:
            pass

    monkeypatch.setattr(live_memory.LiveMemory, "sample", slow_sample)
    slow_sampling = _overhead(monkeypatch, resolved)[1]
    per_run = len(calls) / work.OVERHEAD_REPEATS  # attach's own sample included
    assert per_run > 10
    _no_memory_read(monkeypatch)
    monkeypatch.setattr(work, "OVERHEAD_REPEATS", 1)
    ops = work._overhead_runs(resolved, 16, "none", 1)[3]
    # seen, and not far past it: the other xdist worker's load stretches the run
    # with the slow sampler (1.8x once in CI), never shrinks it
    expected = 1e-3 * per_run / ops
    assert 0.5 * expected < slow_sampling - sampling < 5 * expected
