"""One training, one wandb run: a resume continues the same wandb run (its id kept in
the run dir), a refused start and "nothing to train" create none; metrics are in the
``train/`` and ``val/`` sections. wandb offline, read back from its own files."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.config.run_plan import resolve
from src.config.validate import validate
from src.errors import ConfigError
from src.observe.keys import wandb_key
from src.observe.loggers import RUN_ID_FILE
from src.trainer.loop import train as train_rank
from tests.distributed import HANG_S, run_distributed
from tests.test_train import run_cmd
from tests.wandb_offline import (
    offline_run_files,
    read_wandb_offline_history,
    read_wandb_offline_run,
)

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _run_cfg(max_steps: int, *overrides: str):
    cfg = make_cfg(
        "model=tiny",
        "data=synthetic",
        "data.num_tokens=5000",
        "trainer.devices=1",
        "trainer.batch_size=4",
        f"trainer.max_steps={max_steps}",
        "trainer.log_every=1",
        "trainer.val_every=2",
        "trainer.val_batches=1",
        "trainer.ckpt_every=2",
        "trainer.progress=false",
        "trainer.peak_tflops=1",
        "logger=wandb",
        "logger.mode=offline",
        "logger.group=sweep-a",
        *overrides,
    )
    validate(cfg)
    return cfg


def _four_starts(rank: int, world: int, run_dir: str) -> dict:
    """Train 2 steps; start again with nothing to train; a resume that is refused
    (another max_steps); a resume that extends the run to 4 steps."""
    cpu = torch.device("cpu")

    def train(cfg, run_dir, cpu):
        return train_rank(cfg, run_dir, cpu, resolve(cfg))

    out = {"first": train(_run_cfg(2), run_dir, cpu)}
    out["runs_after_first"] = len(offline_run_files(run_dir))
    out["nothing"] = train(_run_cfg(2, "trainer.resume=auto"), run_dir, cpu)
    out["runs_after_nothing"] = len(offline_run_files(run_dir))
    try:
        train(_run_cfg(4, "trainer.resume=auto"), run_dir, cpu)
    except ConfigError as err:
        out["refused"] = str(err)
    out["runs_after_refused"] = len(offline_run_files(run_dir))
    extend = ("trainer.resume=auto", "trainer.resume_schedule=extend")
    out["resumed"] = train(_run_cfg(4, *extend), run_dir, cpu)
    return out


@pytest.mark.slow
def test_a_resumed_training_is_one_wandb_run_in_train_and_val_sections(tmp_path):
    run_dir = tmp_path / "run"
    out = run_distributed(_four_starts, 1, str(run_dir))[0]
    assert out["first"]["steps"] == 2 and out["nothing"] == {}
    assert out["refused"].startswith("trainer.max_steps")
    # Neither "nothing to train" nor the refused resume made a wandb run.
    assert out["runs_after_first"] == out["runs_after_nothing"] == 1
    assert out["runs_after_refused"] == 1
    first, second = offline_run_files(run_dir)  # the resume's, same wandb run
    saved = json.loads((run_dir / "wandb" / RUN_ID_FILE).read_text())
    runs = [read_wandb_offline_run(run_dir, f) for f in (first, second)]
    assert [r["run_id"] for r in runs] == [saved["id"], saved["id"]]
    assert first.parent.name.endswith(saved["id"])
    assert second.parent.name.endswith(saved["id"])
    assert runs[1]["display_name"] == runs[0]["display_name"] == saved["name"]

    # Sections: train/ for the step figures, val/ for validation; files keep names.
    histories = [read_wandb_offline_history(run_dir, f) for f in (first, second)]
    steps = [
        sorted({h["_step"] for h in hist if "train/loss" in h}) for hist in histories
    ]
    assert steps == [[1, 2], [3, 4]]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "loss" in r}
    for hist in histories:
        for h in hist:
            assert not any(k in h for k in ("loss", "lr", "val_loss", "mfu"))
            if "train/loss" in h:
                assert h["train/loss"] == pytest.approx(by_step[h["_step"]]["loss"])
                assert h["train/lr"] == pytest.approx(by_step[h["_step"]]["lr"])
    val = {
        h["_step"]: h["val/val_loss"]
        for hist in histories
        for h in hist
        if "val/val_loss" in h
    }
    assert sorted(val) == [2, 4]
    jsonl_val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert val == pytest.approx(jsonl_val)
    assert runs[1]["summary"]["val/val_loss"] == pytest.approx(jsonl_val[4])
    assert runs[1]["summary"]["train/steps"] == 4
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4

    # eval.py logs to a wandb run of its own in the training run's group, linked by
    # the training run's id in its config; the training run's files are untouched.
    # What train.py's Hydra saves, eval.py reads; without the group (a job name's
    # group is not in the config): eval.py takes the one run_id.json records.
    (run_dir / ".hydra").mkdir()
    composed = _run_cfg(4)
    composed.logger.group = None
    OmegaConf.save(composed, run_dir / ".hydra" / "config.yaml")
    before = sorted(p.stat().st_mtime_ns for p in offline_run_files(run_dir))
    out = run_cmd([sys.executable, "eval.py", f"run={run_dir}"], timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(p.stat().st_mtime_ns for p in offline_run_files(run_dir)) == before
    eval_dir = run_dir / "wandb" / "eval"
    (eval_file,) = offline_run_files(eval_dir)
    evaluated = read_wandb_offline_run(eval_dir, eval_file)
    assert evaluated["run_id"] != saved["id"]
    assert evaluated["run_group"] == runs[0]["run_group"] == saved["group"] == "sweep-a"
    assert evaluated["display_name"] == f"eval:{saved['name']}"
    linked = evaluated["config"]["update"]["training_run"]
    assert linked == {"id": saved["id"], "name": saved["name"], "dir": str(run_dir)}
    assert evaluated["summary"]["eval/step"] == 4
    assert f"wandb sync {eval_dir}/wandb/offline-run-*" in out.stdout + out.stderr


def test_wandb_sections():
    assert wandb_key("loss") == "train/loss"
    assert wandb_key("tokens_per_s") == "train/tokens_per_s"
    assert wandb_key("val_loss") == "val/val_loss"
    assert wandb_key("train/loss") == "train/loss"  # already in a section
    assert wandb_key("best/mfu") == "best/mfu"


class _Run:
    """What WandbSink uses of a wandb run, recorded (no wandb process)."""

    def __init__(self, resume: dict | None) -> None:
        self.resume = resume
        self.id, self.name = (resume or {}).get("id", "new-id"), "train:x"
        self.group = "train"
        self.rows: list = []
        self.summary: dict = {}
        self.exit_code = None

    def log(self, row: dict, step: int) -> None:
        self.rows.append((step, row))
        self.summary.update(row)  # wandb's summary: each key's last logged value

    def finish(self, exit_code: int) -> None:
        self.exit_code = exit_code


def test_wandb_sink_starts_at_begin_and_resumes_only_a_resumed_run(tmp_path):
    from src.observe.loggers import WandbSink

    started: list[_Run] = []

    def start(resume):
        started.append(_Run(resume))
        return started[-1]

    never = WandbSink(start, tmp_path)
    never.log({"num_params": 10}, step=0)
    never.finish(exit_code=0)  # nothing to train: never begun, no run
    assert started == [] and not (tmp_path / "wandb").exists()

    first = WandbSink(start, tmp_path)
    first.log({"num_params": 10}, step=0)  # kept until begin, then replayed
    first.begin(resumed=False)
    first.log({"loss": 2.0, "val_loss": 2.5, "mfu": 0.4, "sample_0": "text"}, step=1)
    # the summary is ours: no mfu (the last window had none) and no val_loss here
    first.log_summary({"loss": 2.0, "steps": 1})
    first.finish(exit_code=0)
    run = started[-1]
    assert run.resume is None and run.exit_code == 0
    assert run.rows == [
        (0, {"train/num_params": 10}),
        (
            1,
            {
                "train/loss": 2.0,
                "val/val_loss": 2.5,
                "train/mfu": 0.4,
                "train/sample_0": "text",
            },
        ),
    ]
    summary = {"train/loss": 2.0, "train/steps": 1, "train/sample_0": "text"}
    assert run.summary == summary
    saved = json.loads((tmp_path / "wandb" / RUN_ID_FILE).read_text())
    inode = tmp_path.stat().st_ino  # which dir wrote it: a copy's resume is not it
    assert saved == {
        "id": "new-id",
        "name": "train:x",
        "group": "train",
        "run_dir_inode": inode,
    }

    again = WandbSink(start, tmp_path)
    again.begin(resumed=True)  # from a checkpoint of this run dir: the same run
    assert started[-1].resume == saved
    # wandb gives a resumed run its summary back: an old MFU must not outlive it
    started[-1].summary.update({"train/mfu": 0.4, "train/loss": 2.0, "eval/loss": 3.0})
    again.log({"loss": 1.5}, step=2)
    again.log_summary({"loss": 1.5, "steps": 2})
    assert started[-1].summary == {
        "train/loss": 1.5,
        "train/steps": 2,
        "eval/loss": 3.0,  # eval.py's record in the same run stays
    }
    fresh = WandbSink(start, tmp_path)
    fresh.begin(resumed=False)  # a new training in a used run dir: a new run
    assert started[-1].resume is None and len(started) == 3

    # A copied run dir (its run_id.json too): its resume is a wandb run of its own,
    # recorded in the copy; the original's record stays.
    copy = tmp_path.parent / f"{tmp_path.name}-copy"
    shutil.copytree(tmp_path, copy)
    copied = WandbSink(start, copy)
    copied.begin(resumed=True)
    assert started[-1].resume is None and len(started) == 4
    record = json.loads((copy / "wandb" / RUN_ID_FILE).read_text())
    assert record["run_dir_inode"] == copy.stat().st_ino != inode
    assert json.loads((tmp_path / "wandb" / RUN_ID_FILE).read_text())["id"] == "new-id"
    moved = tmp_path.parent / f"{tmp_path.name}-moved"
    copy.rename(moved)  # a move keeps the dir (its inode): the same wandb run
    WandbSink(start, moved).begin(resumed=True)
    assert started[-1].resume == record
