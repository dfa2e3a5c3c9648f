"""The fault-handling pieces in one process (no ranks): run-dir lock, stop signals,
pre-rank checks, metrics bookkeeping. tests/test_faults.py drives them end to end."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from src.checkpoint.folders import drop_partial
from src.errors import ConfigError, RunDirBusy
from src.observe.loggers import METRICS_FILE, Logger
from src.trainer.faults import (
    StopNow,
    StopRequest,
    requested,
    run_dir_lock,
    start_time,
    stop_signal,
    stopped_at_once,
)
from src.trainer.launch import _quiet_launcher_logs, preflight
from tests.commands import in_process
from tests.records import said


def test_run_dir_lock_refuses_a_live_holder_and_takes_over_a_dead_ones(tmp_path):
    with run_dir_lock(tmp_path) as stale:
        assert stale is None
        # A second open of the lock file is another holder, even in this process.
        with pytest.raises(
            RunDirBusy, match=f"in use by another run \\(PID {os.getpid()} on "
        ):
            with run_dir_lock(tmp_path):
                pass
    assert (tmp_path / "run.lock").read_text() == ""  # released
    # A holder that died without releasing: recorded, but no flock held.
    (tmp_path / "run.lock").write_text(json.dumps({"host": "h", "pid": 1, "job": None}))
    with run_dir_lock(tmp_path) as stale:
        assert stale == {"host": "h", "pid": 1, "job": None}
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_a_lock_is_not_taken_over_while_a_rank_of_its_run_lives(tmp_path, monkeypatch):
    """Issue 48 item 4: the launcher died (its flock is gone) but a rank it recorded
    in run.lock still runs (here: this very process, its PID and start time): the
    run dir is in use, for a start (one line naming the PID) and for a resume's
    check; a recorded rank that is not that process any more (another start time:
    its PID reused) does not count, nor a damaged line."""
    from src.runs.resume import in_use
    from src.trainer import faults

    monkeypatch.setattr(faults, "ORPHAN_GRACE_S", 0.0)
    me = os.getpid()
    with faults.run_dir_lock(tmp_path):
        faults.record_rank(tmp_path)
        assert faults.live_ranks(tmp_path)[0]["pid"] == me
        assert not in_use(tmp_path)  # this process holds it
    holder = {"host": "h", "pid": 1, "job": None}
    rank = {**holder, "host": socket.gethostname(), "rank": 1, "pid": me}
    lock = tmp_path / "run.lock"
    lock.write_text(
        "\n".join(json.dumps(x) for x in [holder, {**rank, "start": start_time(me)}])
    )
    assert in_use(tmp_path)
    with pytest.raises(RunDirBusy, match=f"launcher is gone but rank.*PID {me} on"):
        with run_dir_lock(tmp_path):
            pass
    assert json.loads(lock.read_text().splitlines()[0]) == holder  # untouched
    reused = {**rank, "start": start_time(me) - 1}
    lock.write_text(f"{json.dumps(holder)}\n{json.dumps(reused)}\n{{not json\n")
    assert not in_use(tmp_path)
    with run_dir_lock(tmp_path) as stale:
        assert stale == holder


def test_first_stop_signal_is_remembered_and_handlers_restored():
    before = signal.getsignal(signal.SIGTERM)
    forwarded = []
    with StopRequest(forward=forwarded.append):
        os.kill(os.getpid(), signal.SIGTERM)
        assert requested() == signal.SIGTERM
        assert stop_signal(torch.device("cpu")) == signal.SIGTERM
        assert forwarded == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before
    with StopRequest():
        assert requested() == 0


def test_a_second_stop_signal_raises_in_the_reporting_process_and_names_the_skip(
    tmp_path,
):
    """The launcher's second signal is StopNow (then ignored while it reports); what
    the interrupted save left goes: its tmp dir, and a step being replaced gets its
    old copy back. The line names the skipped step and the newest checkpoint."""
    before = signal.getsignal(signal.SIGHUP)
    with StopRequest(at_once="raise"):
        os.kill(os.getpid(), signal.SIGHUP)
        assert requested() == signal.SIGHUP
        with pytest.raises(StopNow) as now:
            os.kill(os.getpid(), signal.SIGINT)
        assert now.value.signum == signal.SIGINT
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGHUP) is before

    checkpoints = tmp_path / "checkpoints"
    for name in ["step_00000002", ".old.step_00000004", ".tmp.step_00000004"]:
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "COMPLETE").write_text("")
        (checkpoints / name / "meta.json").write_text("{}")
    assert drop_partial(checkpoints) == [checkpoints / ".tmp.step_00000004"]
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    (checkpoints / ".tmp.step_00000005").mkdir()
    assert stopped_at_once(signal.SIGINT, str(tmp_path)) == (
        "stopped at once by a second SIGINT: the checkpoint of step 5 it was writing "
        f"is skipped (removed); the newest checkpoint is {checkpoints}/step_00000004; "
        f"resume with python train.py hydra.run.dir={tmp_path} trainer.resume=auto"
    )
    assert stopped_at_once(signal.SIGTERM, str(tmp_path / "none")) == (
        "stopped at once by a second SIGTERM: no checkpoint written; nothing to resume"
    )


def test_an_unparsable_rank_error_file_is_not_a_traceback(tmp_path):
    """A full disk leaves a rank's error file empty: the elastic agent's parser fails
    (the launcher then reports the full disk in one line); its own traceback of that
    ("Failed to parse reply file") is not logged."""
    _quiet_launcher_logs()
    error_file = tmp_path / "error.json"
    error_file.write_text("")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    parser_log = logging.getLogger(ProcessFailure.__module__)
    parser_log.addHandler(handler)
    try:
        with pytest.raises(ValueError):
            ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    finally:
        parser_log.removeHandler(handler)
    assert records == []


def test_preflight_checks_the_run_dir_is_writable(tmp_path, caplog):
    """The run dir and its checkpoints/ are checked before any rank (a checkpoints/
    that is a file was found by the save after training); a damaged summary.json is
    kept aside at the start, said in one line (it was found at the end, and replaced)."""
    import logging

    from src.observe.attempts import set_aside_damaged_summary

    preflight(str(tmp_path))
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="hydra.run.dir: .* is not writable"):
        preflight(str(tmp_path / "a.txt"))
    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(ConfigError) as err:
        preflight(str(tmp_path))
    assert str(err.value) == (
        f"hydra.run.dir: {tmp_path}/checkpoints is not writable: it is not a "
        "directory (a save writes step_N dirs there)"
    )
    (tmp_path / "summary.json").write_text('{"steps": 4, "attempts": [')
    with caplog.at_level(logging.WARNING, logger="src.observe.attempts"):
        set_aside_damaged_summary(tmp_path)
    (line,) = said(caplog, "src.observe.attempts")
    assert line.startswith(f"{tmp_path}/summary.json is damaged (")
    assert line.endswith(
        f"kept as {tmp_path}/summary.json.damaged-1; this run's summary leaves out "
        "the attempts it recorded"
    )
    assert not (tmp_path / "summary.json").exists()
    assert (tmp_path / "summary.json.damaged-1").read_text().endswith("[")
    set_aside_damaged_summary(tmp_path)  # none: nothing to do


def test_rows_past_the_resumed_step_are_dropped(tmp_path):
    rows = [{"step": s, "loss": float(s)} for s in range(1, 6)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo'
    (tmp_path / METRICS_FILE).write_text(text)
    logger = Logger.files(tmp_path)
    assert logger.drop_rows_after(3) == {METRICS_FILE: 3}  # 4, 5, the torn line
    logger.log({"loss": 4.5}, step=4)
    logger.finish(0)
    steps = [json.loads(r)["step"] for r in (tmp_path / METRICS_FILE).open()]
    assert steps == [1, 2, 3, 4]


def test_a_full_disk_at_start_up_is_one_line_with_the_free_space(tmp_path, monkeypatch):
    """Issue 48 item 3: creating an empty file succeeds on a full disk, so the
    writability probe writes and syncs; ENOSPC there is said with the free space
    (the full disk itself: tests/test_faults.py's /dev/full run)."""
    import errno

    from src import files as util

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(util.os, "fsync", full)
    assert util.unwritable(tmp_path) == (
        f"no space left on device ({util.free_space(tmp_path)} free)"
    )


def test_no_run_bigger_than_the_machine(tmp_path, monkeypatch, capsys):
    """Issue 48 item 5: model=gpt_70b on this machine is refused before any rank
    starts (train.py in-process, tests/commands.py), in one line with the planner's
    figure, this machine's memory and the cheapest fit (none here); the tiny model
    fits, and trainer.memory_check=false insists; ranks far past the cores are
    said, as many as twice them are not."""
    from src.config.validate import validate
    from src.harness import compose_config
    from src.planner.constants import available_memory
    from src.planner.run import machine_check, oversubscribed
    from src.planner.run_estimate import estimate_plan

    code, _, err = in_process(
        monkeypatch, capsys, "train.py", "model=gpt_70b", "logger=none",
        "trainer.progress=false", f"hydra.run.dir={tmp_path}/big",
    )  # fmt: skip
    assert code == 2, err[-2000:]
    (line,) = err.splitlines()
    assert line.startswith(
        "config error: trainer.memory_check: the planner's estimate of this run, "
    )
    assert " per rank x 2 ranks = " in line and "this machine's MemAvailable, " in line
    assert "no change of sharding, precision or pipeline fits" in line
    assert line.endswith("set trainer.memory_check=false to start it anyway")
    assert not (tmp_path / "big" / "checkpoints").exists()
    # nothing is written into a run dir before the run is admitted (it left data.json)
    assert not (tmp_path / "big" / "data.json").exists()

    def check(*overrides: str, ranks: int) -> None:
        cfg = compose_config("model=tiny", "trainer.grad_accum=1", *overrides)
        resolved = validate(cfg)
        _, est = estimate_plan(resolved, resolved.world_size)
        machine_check(resolved, est, ranks)

    check(ranks=2)  # the default run on the tiny model
    have = available_memory()[0]
    huge = have // (300 << 20) + 1  # ranks of ~0.35 GiB past this machine's memory
    with pytest.raises(ConfigError) as err:
        check(ranks=huge)
    assert "is more than this machine's MemAvailable, " in str(err.value)
    check("trainer.memory_check=false", ranks=huge)

    cores = len(os.sched_getaffinity(0))
    assert oversubscribed(2 * cores) is None
    assert oversubscribed(2 * cores + 1).startswith(
        f"trainer.devices: {2 * cores + 1} ranks share this machine's {cores} CPU core"
    )
