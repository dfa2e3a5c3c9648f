"""Issue 48, the rest: what reads a live run's checkpoints, a run's rows on resume,
and the end of a run or a sweep under a stop signal (docs/reliability.md)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from src.checkpoint.dcp import Checkpointer
from src.checkpoint.folders import complete_checkpoints, hold, reading
from src.observe.csv_logger import CsvSink
from src.runs import from_run
from src.runs.sweep_plan import never_ran, planned_jobs
from tests.records import said

ROOT = Path(__file__).resolve().parent.parent


def _save(directory: Path, step: int, keep_last: int = 0) -> Path:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Checkpointer(directory, keep_last=keep_last).save(step, model, optimizer)


def test_keep_last_leaves_the_checkpoint_a_reader_holds(tmp_path, caplog, monkeypatch):
    """eval.py and sample.py on a live run with keep_last=1 failed on a checkpoint
    pruned under them: a reader holds the one it reads (a shared flock on its dir)
    and pruning leaves it, said in one line; one pruned before it was held is
    picked again, said in one line."""
    directory = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        _save(directory, step)
    with reading():
        assert hold(directory / "step_00000001")  # this reader's, to its end
        with caplog.at_level(logging.INFO, logger="src.checkpoint.dcp"):
            _save(directory, 3, keep_last=1)
    names = [p.name for p in complete_checkpoints(directory)]
    assert names == ["step_00000001", "step_00000003"]  # step 2 pruned, 1 read
    # the pruner's own line (not torch DCP's records, which carry this tmp path)
    (line,) = said(caplog, "src.checkpoint.dcp", starts="keep_last: ")
    assert (
        line == f"keep_last: {directory}/step_00000001 kept for now: it is being read"
    )
    assert not hold(directory / "step_00000002")  # gone: no hold

    # The pruner acts between the reader's pick and its hold: picked again.
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("{}\n")
    real_hold, picks = from_run.hold, []

    def pruned_first(path: Path) -> bool:
        picks.append(path.name)
        if len(picks) == 1:  # as keep_last would: unmarked, then removed
            (path / "COMPLETE").unlink()
        return real_hold(path)

    monkeypatch.setattr(from_run, "hold", pruned_first)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="src.runs.from_run"), reading():
        run_dir, checkpoint = from_run.find_run(str(tmp_path / "run"))
    _save(directory, 4, keep_last=1)  # no hold left: pruned as ever
    assert [p.name for p in complete_checkpoints(directory)] == ["step_00000004"]
    assert picks == ["step_00000003", "step_00000001"]
    assert checkpoint == directory / "step_00000001"
    (line,) = said(caplog, "src.runs.from_run")
    assert line == (
        f"checkpoint {directory}/step_00000003 was deleted by its live run "
        "(trainer.keep_last) as it was opened; taking the newest one again"
    )


def test_a_resume_counts_each_files_rows_and_sets_a_hand_added_one_aside(
    tmp_path, caplog
):
    """metrics.csv on resume: a row added by hand (no numeric step) is kept in a copy
    of the file and said apart; the rows past the step are counted per file (a
    hand-added row was dropped as the interrupted run's, and the count was the
    JSONL's and the CSV's together)."""
    path = tmp_path / "metrics.csv"
    rows = ["step,loss", "1,4.0", "2,3.0", "note,checked by hand", "3,2.0", "4,1.5"]
    path.write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING, logger="src.observe.loggers"):
        assert CsvSink(path).drop_rows_after(2) == {"metrics.csv": 2}
    (line,) = said(caplog, "src.observe.loggers")
    assert line == (
        f"{path}: 1 damaged row(s) (not a row with a numeric step) dropped; the file "
        "as it was is kept as metrics.csv.damaged-1"
    )
    assert (tmp_path / "metrics.csv.damaged-1").read_text().splitlines() == rows
    assert path.read_text().splitlines() == rows[:3]


def test_a_sweep_stopped_names_its_jobs_that_never_ran(tmp_path):
    """A stop signal once a sweep's job completed (or during one) ends the sweep
    naming the jobs that never ran and how to run them; the completed run is kept as
    one: the signal that came after its last step is said, not taken for a stop
    before its first (it said `stopped ... before the first step` with a traceback,
    exit 143)."""
    config = OmegaConf.create(
        {
            "hydra": {
                "sweeper": {
                    "_target_": "hydra._internal.core_plugins.basic_sweeper."
                    "BasicSweeper",
                    "params": {"model": "tiny"},
                },
                "overrides": {"task": ["trainer.lr=1e-3,2e-3,3e-3", "logger=none"]},
            }
        }
    )
    planned = planned_jobs(config)
    assert len(planned) == 3 and "trainer.lr=0.002" in planned[1]
    optuna = {"hydra": {"sweeper": {"_target_": "x.Optuna", "n_trials": 4}}}
    assert planned_jobs(OmegaConf.create(optuna)) == [None] * 4

    sweep = tmp_path / "sweep"
    run = subprocess.run(
        [sys.executable, "train.py", "-m", "model=tiny", "logger=none"]
        + ["data=synthetic", "data.num_tokens=20000", "trainer.devices=1"]
        + ["trainer.max_steps=2", "trainer.progress=false", "trainer.peak_tflops=1"]
        + ["trainer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        env={**os.environ, "SHARDWRAP_TEST_SIGNAL_AT": "finished:self:SIGTERM"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 143, out[-3000:]
    assert "SIGTERM arrived as the run finished; nothing was stopped" in out
    assert "before the first step" not in out and "Traceback" not in out, out
    assert out.rstrip().splitlines()[-1] == (
        "sweep stopped by SIGTERM: 1 of its 2 jobs never ran: #1 (trainer.lr=0.002); "
        "run them with the same command and trainer.resume=auto (each job resumes its "
        "own run dir: a completed one has nothing to train)"
    )
    assert (sweep / "0" / "summary.json").is_file()
    assert not (sweep / "1" / "metrics.jsonl").exists()  # Hydra made its dir only


@pytest.mark.parametrize("first", [0, 2])
def test_the_never_ran_line_counts_from_the_job_it_names(first):
    from src.runs import sweep_plan as sweep

    sweep._planned[:] = [["a=1", "b=2"], ["a=1", "b=3"], ["a=1", "b=4"]]
    line = never_ran(15, first)
    left = ", ".join(f"#{n} (b={n + 2})" for n in range(first, 3))
    assert line.startswith(f"sweep stopped by SIGTERM: {3 - first} of its 3 jobs ")
    assert f"never ran: {left};" in line
    sweep._planned[:] = []
