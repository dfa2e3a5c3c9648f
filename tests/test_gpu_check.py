"""bench/gpu_check.py cannot rot: its --dry-run runs every step on CPU with tiny shapes."""

from __future__ import annotations

import json
import sys

import pytest

from bench import gpu_check


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_the_report(tmp_path):
    # --skip-tests: inside pytest on CPU the nested `pytest -m cuda` only skips.
    report = gpu_check.main([str(tmp_path), "--dry-run", "--skip-tests"])
    assert [s["step"] for s in report["steps"]] == [
        "eager-plan",
        "eager",
        "compile-plan",
        "compile",
        "tp2-plan",
        "tp2",
        "float8-plan",
        "float8",
        "profile",
    ]  # fmt: skip  (the OOM leg runs on a GPU only)
    assert all(s["ok"] for s in report["steps"]), report["steps"]
    planned = [s["step"] for s in report["steps"] if s["step"].endswith("-plan")]
    ran = [s for s in report["steps"] if s["step"] in planned and "skipped" not in s]
    assert [s["step"] for s in ran] == ["eager-plan"]  # dry run: the first stands
    eager, compiled, tp2, f8 = report["runs"]
    for row in (eager, compiled, tp2, f8):
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
        assert row["peak_mem_gib"] > 0 and row["plan_estimate_gib"] > 0
    # Per-unit compile and activation checkpointing change no number that matters.
    assert compiled["loss"] == pytest.approx(eager["loss"], abs=1e-4)
    # TP2 on 2 ranks trains the same model on the same global batch as 1 rank.
    assert tp2["loss"] == pytest.approx(eager["loss"], abs=1e-4)
    # float8 (compiled) tracks the same model within float8's 2% (test_float8.py)
    assert f8["loss"] == pytest.approx(eager["loss"], rel=0.02)
    assert report["compile_speedup"] > 0 and report["tp2_vs_eager"] > 0
    assert report["float8_vs_compile"] > 0
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| eager | ok |" in table and "| compile | ok |" in table
    assert "| tp2 | ok |" in table and "| float8 | ok |" in table
    assert "float8 tokens/s over compile:" in table


def test_a_failed_step_is_recorded_and_the_check_goes_on(tmp_path):
    status = gpu_check.run_step(
        "boom",
        [
            sys.executable,
            "-c",
            "import sys; print('step 1'); sys.exit('boom: it broke')",
        ],
        tmp_path,
        timeout=60,
    )
    assert status["ok"] is False and status["error"] == "boom: it broke"
    assert "step 1" in (tmp_path / "boom.log").read_text()
