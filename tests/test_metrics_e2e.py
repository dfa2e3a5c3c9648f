"""End to end: train.py on 2 ranks with logger=wandb (offline), history read back from
the offline run's own files, and the figures checked for plausibility."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import HANG_S
from tests.wandb_offline import read_wandb_offline_history, read_wandb_offline_run

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_rank_run_logs_plausible_metrics_to_offline_wandb(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "model=tiny",
            "data=synthetic",
            "trainer.devices=2",
            "trainer.max_steps=8",
            "trainer.log_every=2",
            "trainer.val_every=8",
            "trainer.progress=false",
            "logger=wandb",
            "logger.mode=offline",
            "logger.group=e2e",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    # wandb: the same figures in its train/ and val/ sections.
    history = [
        {k.partition("/")[2] if k.startswith(("train/", "val/")) else k: v
         for k, v in h.items()}
        for h in read_wandb_offline_history(tmp_path)
    ]  # fmt: skip
    jsonl = [
        json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    by_step = {h["_step"]: h for h in history}
    assert sorted(by_step) == sorted({r["step"] for r in jsonl})

    plan = json.loads((tmp_path / "wrap_plan.json").read_text())
    rows = plan["rows"] if isinstance(plan, dict) else plan
    model_bytes_per_rank = sum(r["bytes_per_rank"] for r in rows)
    model_gib_per_rank = model_bytes_per_rank / 2**30

    timed = [h for h in history if "tokens_per_s" in h]
    assert timed, "no throughput window was logged"
    for h in timed:
        assert h["tokens_per_s"] > 0 and h["tokens_per_s_per_rank"] > 0
        assert h["tokens_per_s"] == pytest.approx(2 * h["tokens_per_s_per_rank"])
        assert 0 < h.get("mfu", 1) <= 1  # omitted above 100% (a busy machine's probe)
        assert h["step_time_s"] > 0
    for h in history:
        if "loss" in h:
            assert 0 < h["loss"] < 10 and h["lr"] > 0 and h["grad_norm"] >= 0
            assert h["peak_mem_gib"] >= model_gib_per_rank
            assert h["peak_mem_gib"] >= h["peak_mem_gib_min"] > 0
    init = next(h for h in history if "init_peak_mem_gib" in h)
    assert init["init_peak_mem_gib"] >= model_gib_per_rank
    assert any("val_loss" in h for h in history)

    run_record = read_wandb_offline_run(tmp_path)
    assert run_record["summary"]["val/val_loss"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["world_size"] == 2
    # The planner's estimate, computed once by the launcher, beside the measured peak
    # (the same quantity) in every sink, and in the closing line.
    planned = summary["planned_peak_gib"]
    assert 0.5 < summary["peak_mem_gib"] / planned < 1.5
    wandb_summary = run_record["summary"]
    assert wandb_summary["train/planned_peak_gib"] == planned
    assert "train/peak_mem_gib" in wandb_summary
    assert all(r["planned_peak_gib"] == planned for r in jsonl if "peak_mem_gib" in r)
    assert f"planned {planned:.3f} GiB, measured " in run.stdout
