"""The research loop around a trained run: continue it on a longer schedule
(``trainer.resume_schedule``), sample from it, evaluate it, compare runs.

Each tiny model is trained once (a module-scoped fixture, in this process as train.py
runs it: the composed config saved as ``.hydra/config.yaml``) and its run dir reused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.config import validate
from src.trainer.launch import prepare, run_rank
from src.trainer.loop import lr_lambda
from src.trainer.resolved import ConfigError
from tests.test_train import make_cfg, read_rows

# A tiny model on 2 MB of the stdlib's sources (byte-level), one rank in this process.
RUN = [
    "logger=none",
    "data.max_bytes=2000000",
    "trainer.devices=1",
    "trainer.max_steps=20",
    "trainer.batch_size=8",
    "trainer.log_every=5",
    "trainer.val_every=10",
    "trainer.val_batches=2",
    "trainer.warmup_steps=4",
    "trainer.ckpt_every=20",
    "trainer.progress=false",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
]
GPT_RUN = ["model=tiny", *RUN]


def train_run(run_dir: Path, *overrides: str) -> dict:
    """What ``python train.py <overrides> hydra.run.dir=<run_dir>`` does, in this
    process: the composed config saved where Hydra saves it, then one rank."""
    cfg = make_cfg(*overrides)
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), hydra_dir / "overrides.yaml")
    cfg, resolved = prepare(cfg, validate(cfg))
    return run_rank(cfg, str(run_dir), resolved)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("gpt_run")
    train_run(run_dir, *GPT_RUN)
    return run_dir


def test_resume_schedule_extend_continues_and_keep_refuses(gpt_run, tmp_path):
    """A 20-step run resumed with max_steps=40: ``keep`` (the default) refuses in one
    line naming the key; ``extend`` continues from step 20 on the 40-step schedule
    and its summary says so."""
    run_dir = tmp_path / "run"
    shutil.copytree(gpt_run, run_dir)
    longer = [*GPT_RUN, "trainer.max_steps=40", "trainer.resume=auto"]
    with pytest.raises(ConfigError) as err:
        train_run(run_dir, *longer)
    line = str(err.value)
    assert "\n" not in line and line.startswith("trainer.max_steps: got 40, but")
    assert "trainer.max_steps=20" in line and "trainer.resume_schedule=extend" in line

    summary = train_run(run_dir, *longer, "trainer.resume_schedule=extend")
    rows = read_rows(run_dir)
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 5, 10, 15, 20, 25, 30, 35, 40]  # 21..40 follow 1..20
    cfg = make_cfg(*longer)
    new = lr_lambda(cfg)
    for r in rows:
        if "lr" in r and r["step"] > 20:  # the lr of step s is the schedule's at s - 1
            assert r["lr"] == pytest.approx(cfg.trainer.lr * new(r["step"] - 1))
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["steps"] == 40 and on_disk["resume"] == summary["resume"]
    resume = summary["resume"]
    assert resume["schedule"] == "extend" and resume["from_step"] == 20
    assert (resume["max_steps_before"], resume["max_steps"]) == (20, 40)
    assert resume["lr_after"] == pytest.approx(cfg.trainer.lr * new(20))
    assert resume["lr_before"] == pytest.approx(cfg.trainer.min_lr)  # the old end
