"""Sweeps: multirun summary (CSV, Markdown, PNG, wandb), failed jobs, presets, Optuna."""

from __future__ import annotations

import csv
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_class
from omegaconf import OmegaConf

from src.config.cli import exit_on_config_error
from src.errors import ConfigError
from src.harness import compose_config
from src.runs.sweep import (
    STATUS_FILE,
    collect,
    error_line,
    main,
    objective,
    plot,
    run_job,
    summarise,
    swept_keys,
)
from tests.distributed import HANG_S
from tests.records import said
from tests.wandb_offline import read_wandb_offline_run

ROOT = Path(__file__).resolve().parents[1]
# A tiny model for 3 steps: step 1 closes the warm-up window, step 3 reports tokens/s.
TINY = [
    "model=tiny",
    "data=synthetic",
    "data.num_tokens=50000",
    "trainer.max_steps=3",
    "trainer.val_batches=1",
    "trainer.progress=false",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
]


def multirun(sweep_dir: Path, *overrides: str, timeout: float = HANG_S):
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "train.py", "-m", *TINY, *overrides]
        + [f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def markdown_rows(path: Path) -> list[list[str]]:
    """The table's rows (a note may follow the table after a blank line)."""
    lines = path.read_text().split("\n\n")[0].splitlines()
    assert lines[1].startswith("|---")
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_multirun_summary_table_plot_and_one_wandb_run_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    out = multirun(
        sweep,
        "trainer.devices=1",
        "trainer.batch_size=4",
        "sharding=fsdp2",
        "sharding.min_params=1e3,1e4",
        "precision=fp32,bf16_mixed",
        "logger=wandb",
    )
    assert out.returncode == 0, out.stderr[-3000:]

    rows = read_csv(sweep / "sweep_summary.csv")
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert [(r["sharding.min_params"], r["precision"]) for r in rows] == [
        ("1000.0", "fp32"),
        ("1000.0", "bf16_mixed"),
        ("10000.0", "fp32"),
        ("10000.0", "bf16_mixed"),
    ]
    assert "model" not in rows[0]  # constant overrides are not swept values
    for r in rows:
        assert r["status"] == "completed" and r["error"] == ""
        for key in ("tokens_per_s", "mfu", "peak_mem_gib", "init_peak_mem_gib"):
            assert float(r[key]) > 0, (key, r)
        assert 4 < float(r["loss"]) < 7 and 4 < float(r["val_loss"]) < 7
    # A lower threshold makes more units: every Linear of model=tiny vs fewer.
    units = {r["sharding.min_params"]: int(r["wrap_units"]) for r in rows}
    assert units["1000.0"] > units["10000.0"] >= 1
    # The default objective: the lowest val_loss, whatever the throughput.
    best = [r for r in rows if r["best"] == "True"]
    assert len(best) == 1
    assert float(best[0]["val_loss"]) == min(float(r["val_loss"]) for r in rows)

    md = markdown_rows(sweep / "sweep_summary.md")
    assert len(md) == 4
    assert md[0][:4] == ["0", "1000.0", "fp32", "completed"]
    bold = [cell for row in md for cell in row if cell.startswith("**")]
    assert bold == [f"**{float(best[0]['val_loss']):.4f}**"]  # the best val_loss

    width, height = png_size(sweep / "sweep_summary.png")
    assert width > 400 and height > 400
    assert (sweep / "sweep_summary.png").stat().st_size > 10_000

    # One offline wandb run per job, all in the sweep's group, plus the summary run.
    groups = set()
    for job in range(4):
        runs = list((sweep / str(job) / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        run = read_wandb_offline_run(sweep / str(job))
        assert run.get("job_type") is None
        groups.add(run["run_group"])
    assert groups == {"train-sweep"}
    summary_run = read_wandb_offline_run(sweep)
    assert summary_run["job_type"] == "sweep-summary"
    assert summary_run["run_group"] == "train-sweep"
    s = summary_run["summary"]
    assert s["jobs"] == 4 and s["failed"] == 0
    assert s["sweep_summary._type"] == "table-file" and s["sweep_summary.nrows"] == 4
    assert s["sweep_plot._type"] == "image-file"
    assert s["best/tokens_per_s"] == pytest.approx(float(best[0]["tokens_per_s"]))


@pytest.mark.slow
def test_a_failed_job_is_a_row_and_the_others_still_run(tmp_path):
    """2 ranks per job. batch_size=3 fails config validation on 2 ranks (sys.exit(2)
    in the job, before any rank starts); lr=1e30 passes every check and fails inside
    the ranks, mid-job: its loss is not finite at step 2 (a rank's failure, reported
    by the launcher in one line). Both used to end the multirun."""
    sweep = tmp_path / "sweep"
    out = multirun(
        sweep,
        "trainer.devices=2",
        "trainer.batch_size=3,4",
        "trainer.lr=1e-3,1e30",
        "logger=none",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_csv(sweep / "sweep_summary.csv")
    got = {(r["trainer.batch_size"], r["trainer.lr"]): r for r in rows}
    assert sorted(got) == [
        ("3", "0.001"),
        ("3", "1e+30"),
        ("4", "0.001"),
        ("4", "1e+30"),
    ]
    for key in (("3", "0.001"), ("3", "1e+30")):
        assert got[key]["status"] == "failed"
        assert got[key]["error"].startswith("config error: trainer.batch_size: 3 ")
    blown = got[("4", "1e+30")]
    assert blown["status"] == "failed" and blown["tokens_per_s"] == ""
    assert blown["error"].startswith("error: non-finite loss"), blown["error"]
    assert "at step" in blown["error"]
    trained = (sweep / "3" / "metrics.jsonl").read_text().splitlines()
    assert 1 in [json.loads(r)["step"] for r in trained]  # mid-job: step 1 logged
    ok = got[("4", "0.001")]
    assert ok["status"] == "completed" and ok["best"] == "True"
    assert float(ok["tokens_per_s"]) > 0 and int(ok["wrap_units"]) >= 1
    md = (sweep / "sweep_summary.md").read_text()
    assert md.count("| failed |") == 3 and "non-finite loss" in md
    assert png_size(sweep / "sweep_summary.png")[0] > 400
    assert not (sweep / "wandb").exists()  # logger=none: no summary run either

    # The summary can be rebuilt from the sweep dir alone.
    (sweep / "sweep_summary.csv").unlink()
    main([str(sweep), "--no-wandb", "--no-plot"])
    assert read_csv(sweep / "sweep_summary.csv") == rows

    # Issue 48: a second sweep into it is refused before any job, nothing changed
    # (its jobs failed on their used run dirs: the completed one recorded failed).
    before = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
    again = multirun(sweep, "trainer.devices=2", "trainer.batch_size=4", "logger=none")
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.splitlines() == [
        f"config error: hydra.sweep.dir: {sweep} holds a sweep (4 jobs); another "
        "there would record its completed jobs as failed and replace its summary: "
        "sweep into another hydra.sweep.dir, or resume its jobs with "
        "trainer.resume=auto"
    ]
    assert {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_optuna_preset_maximises_the_returned_tokens_per_s(tmp_path):
    sweep = tmp_path / "sweep"
    out = multirun(
        sweep,
        "hydra/sweeper=optuna_throughput",
        "hydra.sweeper.n_trials=2",
        "trainer.devices=1",
        "logger=none",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    rows = read_csv(sweep / "sweep_summary.csv")
    assert len(rows) == 2 and all(r["status"] == "completed" for r in rows)
    assert set(result["best_params"]) == {"sharding.min_params", "trainer.batch_size"}
    best = max(rows, key=lambda r: float(r["tokens_per_s"]))
    assert result["best_value"] == pytest.approx(float(best["tokens_per_s"]))
    assert best["best"] == "True"
    assert 1e3 <= float(best["sharding.min_params"]) <= 1e9


def make_cfg(*overrides: str):
    return compose_config(*overrides)


def _compose(*overrides: str):
    return compose_config(*overrides, return_hydra_config=True)


def test_slurm_launcher_preset_composes():
    cfg = _compose("hydra/launcher=slurm", "hydra.launcher.partition=gpu")
    launcher = cfg.hydra.launcher
    assert launcher._target_ == (
        "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    )
    assert launcher.partition == "gpu"
    assert launcher.tasks_per_node == 1 and launcher.nodes == 1
    for key in ("gpus_per_node", "timeout_min", "cpus_per_task", "mem_gb"):
        assert isinstance(launcher[key], int) and launcher[key] > 0, key
    assert launcher.submitit_folder.endswith("/.submitit/%j")
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"
    # The plugin's schema types the preset: a wrong type fails while composing.
    with pytest.raises(Exception, match="timeout_min"):
        _compose("hydra/launcher=slurm", "hydra.launcher.timeout_min=soon")
    # The default launcher stays the basic one, with the summary callback.
    default = _compose()
    assert default.hydra.launcher._target_.endswith("BasicLauncher")
    assert default.hydra.callbacks.sweep_summary._target_ == (
        "src.runs.sweep.SweepSummary"
    )


def test_optuna_sweeper_preset_composes():
    sweeper = _compose("hydra/sweeper=optuna_throughput").hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper")
    assert sweeper.direction == "maximize"
    assert set(sweeper.params) == {
        "sharding.min_params",
        "trainer.batch_size",
        "sweep.objective",  # fixed: every trial returns tokens/s, which is maximised
    }
    assert sweeper.params["sweep.objective"] == "tokens_per_s"
    assert "log" in sweeper.params["sharding.min_params"]
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler"


def test_objective_in_its_direction_under_the_memory_cap():
    summary = {
        "tokens_per_s": 1000.0,
        "val_loss": 2.5,
        "loss": 2.4,
        "peak_mem_gib": 3.0,
    }
    tps = {"name": "tokens_per_s"}
    assert objective(summary, **tps) == 1000.0
    assert objective(summary, mem_cap_gib=4.0, **tps) == 1000.0
    over = objective(summary, mem_cap_gib=2.5, **tps)
    assert over == pytest.approx(-0.5)
    assert (
        objective({**summary, "peak_mem_gib": 9.0}, mem_cap_gib=2.5, **tps) < over < 0
    )
    assert objective({}, **tps) == -math.inf  # failed or plan-only: no throughput
    assert objective({"tokens_per_s": float("nan")}, **tps) == -math.inf
    # The default: val_loss, minimised; the worst value is then +inf.
    assert objective(summary) == 2.5 and objective(summary, name="loss") == 2.4
    assert objective(summary, mem_cap_gib=2.5) == math.inf
    assert objective({"tokens_per_s": 1000.0}) == math.inf  # no validation
    assert objective(summary, name="val_loss", direction="max") == 2.5
    assert objective({}, name="val_loss", direction="max") == -math.inf


def _fake_sweep(sweep: Path, jobs: list[tuple[dict, dict]], sweep_cfg: dict) -> None:
    """A sweep dir as Hydra and train.py leave it: per job its overrides, config and
    summary.json."""
    for num, (overrides, summary) in enumerate(jobs):
        hydra = sweep / str(num) / ".hydra"
        hydra.mkdir(parents=True)
        (hydra / "overrides.yaml").write_text(
            yaml.safe_dump([f"{k}={v}" for k, v in overrides.items()])
        )
        (hydra / "config.yaml").write_text(
            yaml.safe_dump({"sweep": sweep_cfg, "logger": {"backend": "none"}})
        )
        (hydra / "hydra.yaml").write_text(
            yaml.safe_dump({"hydra": {"job": {"num": num}}})
        )
        (sweep / str(num) / "summary.json").write_text(json.dumps(summary))


LR_SWEEP = [  # an lr sweep where the fastest point has the worst loss
    ({"trainer.lr": "1e-4", "precision": "fp32"}, {"tokens_per_s": 900.0, "loss": 3.1, "val_loss": 3.2}),
    ({"trainer.lr": "1e-3", "precision": "fp32"}, {"tokens_per_s": 800.0, "loss": 2.1, "val_loss": 2.2}),
    ({"trainer.lr": "1e-2", "precision": "fp32"}, {"tokens_per_s": 700.0, "loss": 2.0, "val_loss": 2.4}),
    ({"trainer.lr": "1e-4", "precision": "bf16_mixed"}, {"tokens_per_s": 2000.0, "loss": 5.0, "val_loss": 5.1}),
]  # fmt: skip


@pytest.mark.parametrize(
    "sweep_cfg, best_job, bold",
    [
        ({}, 1, "**2.2000**"),  # default: val_loss, min
        ({"objective": "loss"}, 2, "**2.0000**"),
        ({"objective": "tokens_per_s"}, 3, "**2,000**"),
        ({"objective": "val_loss", "direction": "max"}, 3, "**5.1000**"),
    ],
)
def test_best_point_follows_the_objective(tmp_path, sweep_cfg, best_job, bold):
    sweep = tmp_path / "sweep"
    _fake_sweep(sweep, LR_SWEEP, sweep_cfg)
    rows = summarise(sweep, log_wandb=False, make_plot=False)
    assert [r["job"] for r in rows if r["best"]] == [best_job]
    md = markdown_rows(sweep / "sweep_summary.md")
    header = (sweep / "sweep_summary.md").read_text().splitlines()[0]
    assert "| loss |" in header and "| val_loss |" in header
    assert [c for row in md for c in row if c.startswith("**")] == [bold]


def test_speed_of_a_run_on_a_busy_machine_is_marked(tmp_path):
    """tokens/s and MFU of a run whose windows (or MFU probe) waited for a core are
    marked, and the note under the table says why; the other rows are not."""
    sweep = tmp_path / "sweep"
    busy = [({**o}, {**s, "mfu": 0.1}) for o, s in LR_SWEEP]
    busy[1][1]["cpu_wait_max"] = 0.6  # a window waited 60% of its thread time
    busy[2][1]["probe_cpu_wait"] = 0.3  # the MFU probe did
    busy[3][1].update(cpu_wait_max=0.02, probe_cpu_wait=0.01)  # an idle machine
    del busy[0][1]["mfu"]  # omitted (above its probe's peak): n/a, and why
    _fake_sweep(sweep, busy, {})
    rows = summarise(sweep, log_wandb=False, make_plot=False)
    md = markdown_rows(sweep / "sweep_summary.md")
    header = (sweep / "sweep_summary.md").read_text().splitlines()[0]
    header = [c.strip() for c in header.strip("|").split("|")]
    speed = [[row[header.index(h)] for h in ("tokens/s", "MFU")] for row in md]
    assert speed == [
        ["900", "n/a"],
        ["800 \\*", "10.00% \\*"],
        ["700 \\*", "10.00% \\*"],
        ["2,000", "10.00%"],
    ]
    note, na = (sweep / "sweep_summary.md").read_text().split("\n\n")[1:3]
    assert note.startswith(
        "\\* measured while other processes held the machine's cores"
    )
    assert na.startswith("MFU n/a: the run logged none")
    assert [r["cpu_wait_max"] for r in rows] == [None, 0.6, None, 0.02]
    _fake_sweep(tmp_path / "idle", LR_SWEEP[:1], {})
    summarise(tmp_path / "idle", log_wandb=False, make_plot=False)
    assert "\\*" not in (tmp_path / "idle" / "sweep_summary.md").read_text()


def test_plot_shows_loss_and_colours_points_by_the_swept_keys(tmp_path):
    sweep = tmp_path / "sweep"
    _fake_sweep(sweep, LR_SWEEP, {})
    keys, rows, goal = collect(sweep)
    assert keys == ["trainer.lr", "precision"] and goal == ("val_loss", "min")
    fig = plot(sweep / "p.png", keys, rows, None, goal)
    assert png_size(sweep / "p.png")[0] > 400
    loss_ax, tps_ax, mem_ax = fig.axes
    assert loss_ax.get_ylabel() == "loss" and mem_ax.get_xlabel() == "trainer.lr"
    assert mem_ax.get_xscale() == "log"  # 1e-4 .. 1e-2: a numeric, log x axis
    # x: the first swept key; colour: the other one (one line per precision).
    lines = {ln.get_label(): ln for ln in tps_ax.get_lines()}
    fp32, bf16 = lines["precision=fp32"], lines["precision=bf16_mixed"]
    assert list(fp32.get_xdata()) == [1e-4, 1e-3, 1e-2]
    assert list(bf16.get_xdata()) == [1e-4] and fp32.get_color() != bf16.get_color()
    val = {ln.get_label(): ln for ln in loss_ax.get_lines()}["val_loss: precision=fp32"]
    assert list(val.get_ydata()) == [3.2, 2.2, 2.4]
    # The star is on the best val_loss (job 1), on the loss panel.
    star = next(ln for ln in loss_ax.get_lines() if ln.get_marker() == "*")
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([1e-3], [2.2])
    assert star.get_label() == "best (min val_loss)"


def test_bad_objective_is_one_line():
    from src.config.validate import validate

    for override, key in (
        ("sweep.objective=mfu", "sweep.objective"),
        ("sweep.direction=up", "sweep.direction"),
    ):
        with pytest.raises(ConfigError) as info:
            validate(make_cfg("model=tiny", override))
        assert str(info.value).startswith(key) and "\n" not in str(info.value)


def test_error_line_keeps_the_useful_line():
    assert error_line(ValueError("bad value\nmore")) == "ValueError: bad value"
    report = (
        "rank 1 failed (exit code 1):\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nRuntimeError: out of memory\n'
    )
    assert error_line(SystemExit(report)) == (
        "rank 1 failed (exit code 1): RuntimeError: out of memory"
    )
    try:
        with exit_on_config_error():
            raise ConfigError("trainer.devices", "got 0")
    except SystemExit as err:
        assert err.code == 2
        assert error_line(err) == "config error: trainer.devices: got 0"
    assert error_line(SystemExit(3)) == "exit status 3"


def test_swept_keys_are_the_overrides_that_vary():
    jobs = [
        {"model": "tiny", "a": "1", "b": "x"},
        {"model": "tiny", "a": "2", "b": "x"},
        {"model": "tiny", "a": "1", "b": "y"},
    ]
    assert swept_keys(jobs) == ["a", "b"]
    assert swept_keys(jobs[:1]) == ["model", "a", "b"]


def test_recorded_overrides_keep_their_interpolations(tmp_path):
    """Hydra records an override's ``${...}`` as given: the record reads it as
    written (a ListConfig resolved it against the list itself and failed, so a
    sweep row lost its overrides, and sample.py, eval.py and a resume stopped)."""
    from src.runs.from_run import run_config
    from src.runs.resume import run_record
    from src.runs.sweep import _overrides

    record = tmp_path / ".hydra"
    record.mkdir()
    given = ["trainer.max_steps=2", "trainer.log_every=${trainer.max_steps}"]
    OmegaConf.save(OmegaConf.create(given), record / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"a": 1}), record / "config.yaml")
    assert _overrides(tmp_path)["trainer.log_every"] == "${trainer.max_steps}"
    assert run_record(tmp_path).overrides == given
    assert run_config(tmp_path)[1] == given


def test_run_job_outside_a_multirun_lets_failures_through(tmp_path):
    (tmp_path / "summary.json").write_text('{"tokens_per_s": 5.0, "val_loss": 2.0}')
    cfg = OmegaConf.create({})
    assert run_job(cfg, str(tmp_path), lambda: None) == 2.0  # val_loss by default
    tps = OmegaConf.create({"sweep": {"objective": "tokens_per_s"}})
    assert run_job(tps, str(tmp_path), lambda: None) == 5.0
    with pytest.raises(SystemExit, match="rank 0 failed"):
        run_job(cfg, str(tmp_path), lambda: sys.exit("rank 0 failed"))
    assert not (tmp_path / STATUS_FILE).exists()  # records are for multiruns


def test_a_job_without_its_objective_records_strict_json(
    tmp_path, monkeypatch, caplog, stop_handlers_restored
):
    """A multirun job that completed without ``val_loss`` (``trainer.val_every=0``, a
    plan-only point) scores +inf; its job_status.json was written as ``Infinity``,
    which the summary's strict reader called damaged and left out, one warning per
    job (``python train.py -m model=tiny trainer.plan_only=true
    trainer.devices=2,4``). The record is JSON: the objective null, the row
    completed."""
    import src.runs.sweep as sweep
    from src.files import read_json

    monkeypatch.setattr(sweep, "is_multirun", lambda: True)
    _fake_sweep(tmp_path, [({"trainer.devices": 2}, {"loss": 5.0})], {})
    job = tmp_path / "0"
    assert run_job(OmegaConf.create({}), str(job), lambda: None) == math.inf
    assert read_json(job / STATUS_FILE)["objective"] is None
    with caplog.at_level("WARNING"):
        _, rows, _ = collect(tmp_path)
    assert [m for m in said(caplog) if " is damaged (" in m] == []
    assert rows[0]["status"] == "completed" and rows[0]["loss"] == 5.0


def test_a_sweep_dir_in_use_is_refused_naming_the_holder(tmp_path):
    """Two multiruns into one sweep dir at once: the second is refused, naming the
    PID of the first, before it writes anything there."""
    from src.runs.writable import SWEEP_LOCK, own_sweep_dir

    with own_sweep_dir(str(tmp_path), None):
        assert (tmp_path / SWEEP_LOCK).read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError) as err:
            with own_sweep_dir(str(tmp_path), "auto"):
                pass
    assert str(err.value) == (
        f"hydra.sweep.dir: {tmp_path} is in use by another sweep (PID "
        f"{os.getpid()}); wait for it or stop it, or sweep into another "
        "hydra.sweep.dir"
    )
    with own_sweep_dir(str(tmp_path), None):  # released: free again
        pass
