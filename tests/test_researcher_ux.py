"""What a researcher ran in issue 49 and got wrong or too late: data checks before
any rank starts (a validation split too small, none at all, a BPE smaller than
asked), mistyped options and paths in one line, a learning rate without its
``min_lr``, notices without file paths, the docs' lists, and ``tokens_seen``
across a resume (metrics.jsonl, the closing line, wandb's x-axis)."""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from src.config.cli_help import is_schema_option, user_options
from src.config.schema import LR_SCHEDULES, MIN_LR_RATIO, ShardingConfig
from src.config.validate import validate
from src.data.sources import prepare_data, tokenizer_of
from src.observe.logs import capture_warnings
from src.registry import key_help
from src.trainer.optimizer import final_lr, lr_lambda
from tests.commands import in_process
from tests.distributed import HANG_S
from tests.records import records, said
from tests.test_config import assert_fails_naming, make_cfg
from tests.test_token_cache import cfg_for, write_corpus
from tests.wandb_offline import offline_run_files, read_wandb_offline_records

ROOT = Path(__file__).resolve().parents[1]
JSON_CORPUS = "data.paths=<stdlib>/json/*.py"  # 48 KB: 24 tokens at 0.0005
ONE_RANK = [
    "model=tiny",
    "trainer.devices=1",
    "sharding=none",
    "trainer.progress=false",
]


def run(script: str, *args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "SHARDWRAP_CACHE": str(cache)}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=ROOT,
        env=env,
    )


def one_config_error(out: subprocess.CompletedProcess | tuple[int, str, str]) -> str:
    """The one line a refused command prints (exit status 2); ``out``: a process,
    or :func:`tests.commands.in_process`'s (status, stdout, stderr)."""
    code, stdout, stderr = (
        out if isinstance(out, tuple) else (out.returncode, out.stdout, out.stderr)
    )
    lines = stderr.strip().splitlines()
    assert code == 2, stderr + stdout
    assert len(lines) == 1 and lines[0].startswith("config error: "), stderr
    assert "Traceback" not in stderr + stdout
    return lines[0].removeprefix("config error: ")


def test_mistakes_are_one_line_naming_the_key_and_the_fix(
    tmp_path, monkeypatch, capsys
):
    """Each command run in-process up to its refusal (tests/commands.py)."""
    monkeypatch.setenv("SHARDWRAP_CACHE", str(tmp_path / "cache"))

    def command(script: str, *args: str) -> tuple[int, str, str]:
        return in_process(monkeypatch, capsys, script, *args)

    line = one_config_error(command("train.py", "model=tinyy"))
    real = [o for o in user_options("model") if not is_schema_option(o)]
    assert line == f"model: no option 'tinyy', expected one of: {', '.join(real)}"
    assert "base_gpt" not in line and "llama3_1b" in line

    line = one_config_error(
        command("eval.py", f"run={tmp_path}", "data.paths=/x/*.txt")
    )
    assert line.startswith("data.paths: no data= option is chosen to hold it: add ")
    assert "data=files" in line

    line = one_config_error(command("train.py", "trainer.schedule=cosin"))
    assert line == (
        "trainer.schedule: got 'cosin', expected one of: " + ", ".join(LR_SCHEDULES)
    )

    line = one_config_error(
        command("train.py", "trainer.optimizer=muon", "sharding=fsdp1")
    )
    assert line.startswith("trainer.optimizer: muon orthogonalises each weight matrix")

    missing = tmp_path / "no" / "such" / "step_00000100"
    args = [f"hydra.run.dir={tmp_path}/a", f"trainer.resume={missing}"]
    line = one_config_error(command("train.py", *args))
    assert line == f"trainer.resume: '{missing}': no such file or directory"

    # Too small a validation split: named before any rank starts (it was a
    # ValueError inside a rank naming neither the split nor the key).
    args = ["model=tiny", "trainer.progress=false", "data=files", JSON_CORPUS]
    args.append("data.val_fraction=0.0005")
    line = one_config_error(command("train.py", *args, f"hydra.run.dir={tmp_path}/b"))
    assert line.startswith(
        "data.val_fraction: 0.0005 gives a validation split of 24 tokens, fewer "
        "than one window (a window is the model's sequence length + 1 = 65 tokens)"
    )
    assert "data.val_fraction=0 to train without a validation split" in line
    assert not (tmp_path / "b" / "ranks").exists()  # no rank started


@pytest.mark.slow
def test_no_validation_split_and_tokens_seen_across_a_resume(
    tmp_path, monkeypatch, capsys
):
    """``data.val_fraction=0`` trains without validation, said at the start and in
    the summary; ``tokens_seen`` counts every step's tokens across a resume that
    halves the batch (metrics.jsonl, summary, closing line, wandb's x-axis); eval.py
    of that run's missing val split is one line naming data.val_fraction."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    first = run(
        "train.py",
        *ONE_RANK,
        "data=files",
        JSON_CORPUS,
        "data.val_fraction=0",
        "trainer.max_steps=4",
        "trainer.log_every=2",
        "trainer.val_every=2",
        "logger.x_axis=tokens_seen",
        f"hydra.run.dir={run_dir}",
        cache=cache,
    )
    assert first.returncode == 0, first.stderr
    assert "training without a validation split (data.val_fraction=0)" in first.stdout
    assert "validation none: data.val_fraction=0" in first.stdout  # closing line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["validation"] == "none: data.val_fraction=0"
    assert "val_loss" not in summary and summary["tokens_seen"] == 4 * 16 * 64
    shutil.copytree(run_dir, tmp_path / "before")  # the run as it was, for compare

    again = run(
        "train.py",
        f"hydra.run.dir={run_dir}",
        "trainer.resume=auto",
        "trainer.max_steps=6",
        "trainer.resume_schedule=extend",
        "trainer.batch_size=8",
        cache=cache,
    )
    assert again.returncode == 0, again.stderr
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seen = {r["step"]: r["tokens_seen"] for r in rows if "tokens_seen" in r}
    assert seen == {1: 1024, 2: 2048, 4: 4096, 6: 4096 + 2 * 8 * 64}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tokens_seen"] == 5120
    assert "tokens seen 5,120" in again.stdout
    # The summary describes both attempts (issue 49 item 4): each one's steps and
    # seconds, the totals, and the speed the first measured (the 2-step resume's
    # only window is its warm-up, never reported).
    first_try, second_try = summary["attempts"]
    assert (first_try["start_step"], first_try["end_step"]) == (0, 4)
    assert (second_try["start_step"], second_try["end_step"]) == (4, 6)
    assert summary["steps_trained"] == 6 and "measured_s" not in second_try
    total = first_try["wall_time_s"] + second_try["wall_time_s"]
    assert summary["wall_time_s"] == pytest.approx(total)
    assert summary["tokens_per_s"] == pytest.approx(first_try["tokens_per_s"])
    assert summary.get("mfu") == first_try.get("mfu")
    assert f"finished 6 steps in {total:.0f} s (2 attempts: " in again.stdout
    for run_file in offline_run_files(run_dir):  # each attempt's wandb records
        records = read_wandb_offline_records(run_dir, run_file)
        axes = {
            r["metric"].get("glob_name"): r["metric"].get("step_metric")
            for r in records
            if r.get("type") == "metric"
        }
        assert axes["train/*"] == axes["val/*"] == "train/tokens_seen"
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    assert history[-1]["train/tokens_seen"] == 5120

    monkeypatch.setenv("SHARDWRAP_CACHE", str(cache))
    line = one_config_error(
        in_process(monkeypatch, capsys, "eval.py", f"run={run_dir}")
    )
    assert line.startswith("data.val_fraction: 0: there is no validation split")

    # compare.py, run from elsewhere, shows what the resume changed as columns (issue
    # 57/3), each run as it ended, and ranks them by the figure asked for
    out = subprocess.run(
        [sys.executable, str(ROOT / "compare.py"), "before", "run", "--no-plot"]
        + ["--out", "cmp", "--metric", "loss"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["job"]: r for r in csv.DictReader(open(tmp_path / "cmp/compare.csv"))}
    assert {k: rows["before"][k] for k in RESUMED} == {
        "trainer.max_steps": "4",
        "trainer.batch_size": "16",
        "trainer.resume_schedule": "keep",
    }
    assert {k: rows["run"][k] for k in RESUMED} == {
        "trainer.max_steps": "6",
        "trainer.batch_size": "8",
        "trainer.resume_schedule": "extend",
    }
    assert (rows["before"]["tokens_seen"], rows["run"]["tokens_seen"]) == (
        "4096",
        "5120",
    )
    best = [job for job, r in rows.items() if r["best"] == "True"]
    losses = {job: float(r["loss"]) for job, r in rows.items()}
    assert best == [min(losses, key=losses.get)]


RESUMED = ("trainer.max_steps", "trainer.batch_size", "trainer.resume_schedule")


def test_a_bpe_smaller_than_asked_says_so_and_is_named_by_its_size(tmp_path, caplog):
    cfg = cfg_for(
        tmp_path,
        write_corpus(tmp_path, "text"),
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=2048",
    )
    with caplog.at_level(logging.INFO, logger="src"):
        meta = prepare_data(cfg.data, verbose=True, progress=False)
    size = meta["vocab_size"]
    assert size < 2048
    warned = [r.getMessage() for r in records(caplog) if r.levelno == logging.WARNING]
    assert warned == [
        f"data.bpe_vocab_size=2048: the training split yields only {size} tokens "
        f"(the BPE ran out of pairs to merge); the tokenizer has {size}"
    ]
    cached = said(caplog, "src.data.token_cache", starts="token cache: ")
    assert f"bpe-{size}, vocab {size}" in cached[0]
    assert tokenizer_of(cfg.data).name == f"bpe-{size}"  # the export's name too


def test_min_lr_follows_lr_unless_set():
    for lr in (1e-4, 3e-4, 3e-3):  # 1e-4 failed on min_lr, 3e-4 was flat
        cfg = make_cfg(f"trainer.lr={lr}")
        validate(cfg)
        assert final_lr(cfg.trainer) == pytest.approx(lr * MIN_LR_RATIO)
        end = lr_lambda(cfg)(cfg.trainer.max_steps)
        assert end == pytest.approx(MIN_LR_RATIO)  # a cosine, not a flat line
    set_ = make_cfg("trainer.lr=1e-3", "trainer.min_lr=0")
    assert lr_lambda(set_)(set_.trainer.max_steps) == 0
    assert_fails_naming(
        ["trainer.lr=1e-4", "trainer.min_lr=3e-4"],
        "trainer.min_lr",
        "expected a number in [0, trainer.lr=0.0001], or null",
    )


def test_the_projects_warnings_are_plain_lines(caplog):
    """A warning raised by src/ (the reshard notice of a checkpoint loaded on another
    number of ranks) is its message alone; a library's keeps Python's form."""
    # logging keeps the first captureWarnings(True)'s hook: an earlier test of this
    # worker's (under pytest's own warning capture, since undone) would leave it stale
    logging.captureWarnings(False)
    capture_warnings()
    notice = "checkpoint step_00000004 was written by 2 ranks and is loaded on 1"
    ours = str(ROOT / "src" / "checkpoint" / "dcp.py")
    # filters an earlier test of this worker left (torch's, the project's) do not apply
    with (
        caplog.at_level(logging.WARNING, logger="py.warnings"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("always")
        warnings.warn_explicit(notice, UserWarning, ours, 396)
        warnings.warn_explicit("old", FutureWarning, "/lib/torch/x.py", 7)
    first, second = records(caplog, "py.warnings")
    assert first.getMessage() == notice
    assert second.getMessage().startswith("/lib/torch/x.py:7: FutureWarning")
    logging.captureWarnings(False)


def test_docs_and_help_list_what_runs():
    readme = (ROOT / "README.md").read_text()
    for option in user_options("model"):
        if not is_schema_option(option):
            assert f"`{option}`" in readme, option
    schedules = key_help(ShardingConfig, "pp_schedule")
    assert "zbv" not in schedules and "1f1b" in schedules  # zbv is refused


def test_run_figures_weigh_attempts_and_keep_a_disturbed_probe_out(tmp_path, caplog):
    """The run's tokens/s is tokens over seconds of every measured window; its MFU
    leaves out an attempt whose peak probe was disturbed (the resume's 0.75 against
    the first attempt's 0.2); earlier attempts are read from summary.json as data."""
    from src.observe.attempts import earlier_attempts, run_figures

    first = {"start_step": 0, "end_step": 100, "wall_time_s": 40.0,
             "measured_steps": 90, "measured_s": 30.0, "tokens_per_s": 300.0,
             "world_size": 2, "mfu": 0.2}  # fmt: skip
    short = {"start_step": 100, "end_step": 110, "wall_time_s": 6.0,
             "measured_steps": 5, "measured_s": 2.0, "tokens_per_s": 600.0,
             "world_size": 1, "mfu": 0.75, "probe_contended": True}  # fmt: skip
    figures = run_figures([first, short])
    assert figures["wall_time_s"] == 46.0 and figures["steps_trained"] == 110
    assert figures["tokens_per_s"] == pytest.approx((300 * 30 + 600 * 2) / 32)
    assert figures["tokens_per_s_per_rank"] == pytest.approx((150 * 30 + 600 * 2) / 32)
    assert figures["step_time_s"] == pytest.approx(32 / 95)
    assert figures["mfu"] == pytest.approx(0.2)
    # Only disturbed probes: their figure, weighted by measured seconds.
    again = {**first, "probe_contended": True}
    assert run_figures([again, short])["mfu"] == pytest.approx((6 + 1.5) / 32)
    no_peak = {k: v for k, v in first.items() if k != "mfu"}  # no MFU measured
    assert "mfu" not in run_figures([no_peak]) and "tokens_per_s" in run_figures(
        [no_peak]
    )
    assert "tokens_per_s" not in run_figures([{**first, "measured_s": 0.0}])

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"attempts": [first, short]}))
    assert earlier_attempts(tmp_path, 0) == []  # a fresh start
    assert earlier_attempts(tmp_path, 100) == [first]  # resumed from step 100
    assert earlier_attempts(tmp_path, 110) == [first, short]
    summary.write_text(json.dumps({"attempts": [{**first, "measured_s": "30"}]}))
    with caplog.at_level(logging.WARNING, logger="src.observe.attempts"):
        assert earlier_attempts(tmp_path, 110) == []
    (line,) = said(caplog, "src.observe.attempts")
    assert line.startswith(f"{summary}: earlier attempts left out of the summary (")
