"""One training, one wandb run: a resume continues the same wandb run (its id kept in
the run dir), a refused start and "nothing to train" create none; metrics are in the
``train/`` and ``val/`` sections. wandb offline, read back from its own files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from src.config.validate import validate
from src.errors import ConfigError
from src.observe.loggers import RUN_ID_FILE, wandb_key
from src.resolved import resolve
from src.trainer.loop import train as train_rank
from tests.distributed import run_distributed
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
    assert saved == {"id": "new-id", "name": "train:x"}

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
