"""Smoke tests of the benchmarks on tiny sizes: each main() runs, its table has the
expected rows and sane figures, and nothing is appended to docs/benchmarks.md."""

from __future__ import annotations

import pytest
import torch

from bench import common, float8, init_memory, mfu


@pytest.fixture
def docs_untouched():
    """Fails the test if docs/benchmarks.md changed (no --append-docs in smoke runs)."""
    before = common.DOCS.read_bytes() if common.DOCS.exists() else None
    yield
    after = common.DOCS.read_bytes() if common.DOCS.exists() else None
    assert after == before, "a smoke run appended to docs/benchmarks.md"


def test_step_time_vs_measured_rows_from_the_runs_summaries(
    docs_untouched, monkeypatch, capsys
):
    """bench.step_time_vs_measured on two runs' summaries (no run started): each
    row's error against the measured step and against the step less the share its
    threads waited for cores others held, and the median and worst of both."""
    from bench import step_time_vs_measured as b

    summaries = iter([
        {"predicted_step_time_s": 0.1, "step_time_s": 0.3, "cpu_wait_others": 0.5,
         "world_size": 2, "num_params": 840_000},
        {"predicted_step_time_s": 0.2, "step_time_s": 0.2, "world_size": 1,
         "num_params": 840_000},
    ])  # fmt: skip
    monkeypatch.setattr(b, "run", lambda overrides, steps: next(summaries))
    first, second = b.main(["--configs", "gpt_fsdp2", "gpt_1rank"])
    assert (first["error"], first["alone ms"], first["error alone"]) == (
        "+200%",
        150.0,
        "+50%",
    )
    assert (second["error"], second["error alone"]) == ("+0%", "+0%")
    assert all(r["stolen"] == "?" or r["stolen"].endswith("%") for r in (first, second))
    out = capsys.readouterr().out
    assert "median |error| 100%, worst 200%; against the step alone" in out
    assert "median 25%, worst 50%" in out

    # Two rounds, the second in reverse order: each config keeps its faster run,
    # with that run's prediction; the first round's errors are said beside.
    runs = []
    summaries = iter([
        {"predicted_step_time_s": 0.1, "step_time_s": 0.3, "world_size": 2,
         "num_params": 1},
        {"predicted_step_time_s": 0.2, "step_time_s": 0.2, "world_size": 1,
         "num_params": 1},
        {"predicted_step_time_s": 0.2, "step_time_s": 0.3, "world_size": 1,
         "num_params": 1},
        {"predicted_step_time_s": 0.1, "step_time_s": 0.12, "world_size": 2,
         "num_params": 1},
    ])  # fmt: skip

    def run(overrides, steps):
        runs.append(overrides)
        return next(summaries)

    monkeypatch.setattr(b, "run", run)
    first, second = b.main(["--configs", "gpt_fsdp2", "gpt_1rank", "--rounds", "2"])
    assert runs == [
        b.CONFIGS[n] for n in ("gpt_fsdp2", "gpt_1rank", "gpt_1rank", "gpt_fsdp2")
    ]
    assert (first["error"], first["rounds ms"]) == ("+20%", "300.0 / 120.0")
    assert (second["error"], second["rounds ms"]) == ("+0%", "200.0 / 300.0")
    out = capsys.readouterr().out
    assert "median |error| 10%, worst 20%" in out
    assert "the first round alone: median |error| 100%, worst 200%" in out

    # --max-drift: after each run a plan-only run times the ops again; a run
    # during which that prediction moved past the share runs again
    runs.clear()
    summaries = iter([
        {"predicted_step_time_s": 0.1, "step_time_s": 0.15, "world_size": 1,
         "num_params": 1},
        {"predicted_step_time_s": 0.13},  # +30%: the machine slowed
        {"predicted_step_time_s": 0.1, "step_time_s": 0.12, "world_size": 1,
         "num_params": 1},
        {"predicted_step_time_s": 0.095},
    ])  # fmt: skip
    (kept,) = b.main(["--configs", "gpt_1rank", "--max-drift", "0.1"])
    one = b.CONFIGS["gpt_1rank"]
    assert runs == [one, [*one, "trainer.plan_only=true"]] * 2
    assert (kept["error"], kept["drift"], kept["tries"]) == ("+20%", "-5%", 2)
    assert "2 runs for 1 configs; still past it: none" in capsys.readouterr().out


def test_layout_ranking_verdict_with_a_layout_run_again_for_drift(
    docs_untouched, monkeypatch, capsys
):
    """bench.layout_ranking on two layouts' summaries (no run started): tau and
    the predicted fastest; with --max-drift a layout whose prediction moved past
    it during its run (the ops timed again just after) runs again."""
    from types import SimpleNamespace

    from bench import layout_ranking as lr
    from bench import step_time_vs_measured as b

    found = [SimpleNamespace(args=lambda: ""), SimpleNamespace(args=lambda: "x=1")]
    monkeypatch.setattr(lr, "layouts", lambda model: found)
    summaries = iter([
        {"predicted_step_time_s": 0.1, "tokens_per_s": 1000, "predicted_tokens_per_s": 1100},
        {"predicted_step_time_s": 0.102},
        {"predicted_step_time_s": 0.2, "tokens_per_s": 300, "predicted_tokens_per_s": 500},
        {"predicted_step_time_s": 0.3},  # +50%: run again
        {"predicted_step_time_s": 0.2, "tokens_per_s": 450, "predicted_tokens_per_s": 500},
        {"predicted_step_time_s": 0.21},
    ])  # fmt: skip
    runs = []

    def run(overrides, steps):
        runs.append(overrides)
        return next(summaries)

    monkeypatch.setattr(b, "run", run)
    monkeypatch.setattr(lr, "run", run)
    rows = lr.main(["--models", "gpt", "--max-drift", "0.1"])
    assert [r["measured tokens/s"] for r in rows] == [1000, 450]
    assert sum("trainer.plan_only=true" in o for o in runs) == 3 and len(runs) == 6
    out = capsys.readouterr().out
    assert (
        "gpt: tau 1.0 over 2 layouts, the predicted fastest 100% of the fastest" in out
    )


@pytest.mark.slow
def test_init_memory_tiny(docs_untouched):
    # ~80 MB of fp32 parameters in 24 blocks of 3 MiB, on 2 gloo ranks.
    rows = init_memory.main(
        [
            "--n-layer=24",
            "--n-embd=256",
            "--vocab-size=1024",
            "--block-size=64",
            "--ranks=2",
            "--modes",
            "none",
            "cpu",
        ]
    )
    assert [r["mode"] for r in rows] == ["none", "cpu"]
    figures = {
        r["mode"]: {
            k: float(r[k])
            for k in (
                "baseline (GiB)",
                "peak/rank (GiB)",
                "peak - baseline (GiB)",
                "P/N (GiB)",
                "local params (GiB)",
            )
        }
        for r in rows
    }
    for f in figures.values():
        assert f["peak/rank (GiB)"] > f["baseline (GiB)"] > 0
    none, cpu = figures["none"], figures["cpu"]
    # Unsharded: each rank holds all parameters, about twice P/N at 2 ranks.
    assert none["local params (GiB)"] == pytest.approx(2 * none["P/N (GiB)"], rel=0.01)
    assert none["peak - baseline (GiB)"] >= 1.5 * none["P/N (GiB)"]
    # Sharded as built: half the parameters, and a smaller construction peak.
    assert cpu["local params (GiB)"] == pytest.approx(cpu["P/N (GiB)"], rel=0.01)
    assert float(rows[1]["plan estimate/rank (GiB)"]) == pytest.approx(
        cpu["local params (GiB)"], abs=0.002
    )
    assert cpu["peak - baseline (GiB)"] < none["peak - baseline (GiB)"]


def test_documents_tiny(docs_untouched):
    """bench.documents' speed table at one short sequence (its memory runs, two
    train.py processes, left out): documents count less attention than stream."""
    from bench import documents

    argv = ["--seq-lens", "128", "--tokens", "256", "--steps", "1", "--pairs", "1"]
    rows = documents.main([*argv, "--memory-seq", "0", "--peak-seconds", "0.02"])
    stream, within = rows
    assert (stream["packing"], within["packing"]) == ("stream", "documents")
    assert (
        float(within["span (keys/query)"]) < float(stream["span (keys/query)"]) == 128
    )
    assert float(within["attn GFLOP/step"]) < float(stream["attn GFLOP/step"])
    assert float(within["tokens/s"].replace(",", "")) > 0 and within["MFU"].endswith(
        "%"
    )


def test_mfu_tiny(docs_untouched):
    threads = torch.get_num_threads()
    try:
        rows = mfu.main(
            [
                "--n-layer=1",
                "--n-embd=64",
                "--n-head=2",
                "--vocab-size=256",
                "--seq-len=32",
                "--batch-size=2",
                "--steps=2",
                "--warmup=1",
                "--peak-seconds=0.02",
                "--dtypes",
                "fp32",
            ]
        )
    finally:
        torch.set_num_threads(threads)
    assert [r["dtype"] for r in rows] == ["fp32"]
    row = rows[0]
    assert row["tokens/step"] == 64
    assert float(row["tokens/s"]) > 0
    assert float(row["achieved GFLOP/s"]) > 0
    median = row["MFU (median step)"]  # n/a where a busy machine's probe read low
    assert median.startswith("n/a (above") or 0 < float(median.rstrip("%")) <= 100


def test_plan_vs_measured_ordinary_compares_the_closing_lines_figures(
    tmp_path, docs_untouched
):
    """--ordinary with a stored measured peak (no run): the row puts the launcher's
    planned_peak_gib for that train.py command beside it, a MoE model included."""
    import json

    from bench import plan_vs_measured as b

    name = "hf mixtral (MoE)"
    store = tmp_path / "measured.json"
    key = json.dumps(["ordinary", name, b.ORDINARY[name], 3])
    store.write_text(json.dumps({key: 0.5}))
    (row,) = b.main(["--ordinary", "--configs", name, "--measured", str(store)])
    planned = float(row["planned GiB"])
    assert row["measured GiB"] == "0.500"
    error = float(row["measured vs planned"].rstrip("%")) / 100
    assert error == pytest.approx(0.5 / planned - 1, abs=0.002)
    # --holdout: the configurations kept out of the benchmark, the same comparison;
    # --audit: configurations as users type them, a row with its own steps included
    for flag, table, name, measured in (
        ("--holdout", b.HOLDOUT, "gpt 4x384 TP2 no SP, 4 ranks", 0.45),
        ("--audit", b.AUDIT, "gpt 8x512, validation", 0.8),
    ):
        key = json.dumps(["ordinary", name, table[name], 3])
        store.write_text(json.dumps({key: measured}))
        argv = ["--ordinary", flag, "--configs", name, "--measured", str(store)]
        (row,) = b.main(argv)
        assert row["measured GiB"] == f"{measured:.3f}", flag
        assert float(row["planned GiB"]) > 0, flag


@pytest.mark.slow
def test_overhead_tiny(docs_untouched):
    """bench.overhead's trainer and minimal-spawn sides, one short run each: the same
    losses step for step, and each side's CPU, sys CPU and page faults per step
    (the allocator's cost, which load barely moves; their ratio across sides spreads
    too widely in a short run to assert one: test_config checks the heap's reuse)."""
    from bench import overhead

    rows = overhead.main(
        ["--steps=10", "--warmup=5", "--log-every=5", "--repeats=1",
         "--minimal", "spawn"]
    )  # fmt: skip
    trainer, minimal, median = rows
    assert (trainer["side"], minimal["side"], median["repeat"]) == (
        "trainer", "minimal-spawn", "median")  # fmt: skip
    assert float(minimal["max dloss"]) < 1e-5
    # one window each: the paired ratio is that window's, no quartiles
    assert median["paired windows"] == minimal["paired windows"]
    assert float(median["paired windows"]) > 0 and median["paired IQR"] == "-"
    assert trainer["paired windows"] == "-"
    for row in rows[:2]:
        assert float(row["page faults/step"].replace(",", "")) >= 0
        assert float(row["CPU s/step"]) > float(row["sys CPU s/step"]) >= 0


@pytest.mark.slow
def test_overhead_ab_foreach_arm_trains_the_same(docs_untouched):
    """bench.overhead --ab with AdamW's foreach implementation beside torch's CPU
    default (one 2-rank launch, 2 steps each): the same losses to the bit, each arm
    timed."""
    from bench import overhead

    argv = ["--ab", "--ab-arms", "minimal", "minimal+foreach",
            "--steps=2", "--warmup=1", "--log-every=1"]  # fmt: skip
    plain, foreach = overhead.main(argv)
    assert (plain["arm"], foreach["arm"]) == ("minimal", "minimal+foreach")
    assert foreach["max dloss vs first"] == "0.0e+00"
    assert float(foreach["CPU ms/step, both ranks (median)"]) > 0


def test_context_parallel_bench_one_rank_row(docs_untouched, monkeypatch):
    """bench.context_parallel's table on its one-rank layout alone (the CP2 x FSDP2
    measurement runs in tests/test_context_parallel.py's 4-rank launch): figures
    measured and planned, the ratio against itself 1."""
    from bench import context_parallel

    monkeypatch.setattr(context_parallel, "LAYOUTS", ((1, 1),))
    argv = ["--seq", "256", "--layers", "1", "--steps", "1", "--batch-size", "2"]
    (row,) = context_parallel.main(argv)
    assert row["layout"] == "1 rank" and row["vs 1 rank"] == "1.00"
    assert float(row["activations/rank (MiB)"]) > 0
    assert float(row["planned (MiB)"]) > 0
    assert 0 < float(row["final loss"]) < 10


def test_expert_parallel_bench_two_layouts(docs_untouched):
    """bench.expert_parallel, one timed step at 32 tokens (each layout one 2-rank
    launch, ~12 s): FSDP2 and EP2 end on the same loss, only EP2 moves bytes by
    all-to-all, and each row has its throughput and peak."""
    from bench import expert_parallel

    argv = ["--steps", "1", "--warmup", "1", "--override", "model.max_seq_len=32"]
    fsdp, ep = expert_parallel.main(argv)
    # printed to 5 decimals: equal losses may round 1e-5 apart
    assert abs(float(fsdp["final loss"]) - float(ep["final loss"])) <= 1.5e-5
    assert float(fsdp["all-to-all MiB/step/rank"]) == 0
    assert float(ep["all-to-all MiB/step/rank"]) > 0
    for row in (fsdp, ep):
        assert float(row["tokens/s"].replace(",", "")) > 0
        assert float(row["peak RSS/rank (GiB)"]) > 0


def test_float8_bench_tiny(docs_untouched):
    """bench.float8 on the default GPT, 2 steps: every table has its rows, and the
    all-gather counter sees float8 all-gather move about half of bf16's bytes (the
    float8 weights at 1 byte, the norms and the root at 2) and float8 without it
    exactly bf16's."""
    tables = float8.main(["--models", "small", "--steps", "2", "--parity-steps", "2"])
    assert [len(t) for t in tables.values()] == [1, 1, 3]
    ratios = [float(r["vs bf16_mixed"]) for r in tables["gathered"]]
    assert ratios[0] == ratios[1] == 1.0 and 0.5 < ratios[2] < 0.6, ratios
    for p in float8.PRECISIONS:
        assert 0 < float(tables["numerics"][0][f"final loss {p}"]) < 6


def test_published_command_is_shell_quoted(tmp_path, monkeypatch):
    # The recorded command must reproduce the run when pasted into a shell.
    monkeypatch.setattr(common, "DOCS", tmp_path / "benchmarks.md")
    argv = ["--override", "model.name=a b", "--append-docs"]
    common.publish([{"x": 1}], "T", bench="overhead", argv=argv, append=True)
    text = (tmp_path / "benchmarks.md").read_text()
    assert "Command: `python -m bench.overhead --override 'model.name=a b'`" in text
