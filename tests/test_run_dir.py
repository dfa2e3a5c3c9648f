"""A run dir is a run (src/runs/resume.py): a resume composes from what the run
recorded and says or refuses each change before any rank starts; a fresh start never
mixes with a run; each attempt's Hydra output is kept apart; the optimizer takes a
changed learning rate for real; metrics.jsonl has one row per step; the default run
keeps its final checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src.checkpoint.folders import META, incomplete_checkpoints
from src.errors import ConfigError
from src.harness import compose_config
from src.observe.loggers import FileSink
from src.runs.compose import resume_config, take_branch
from src.runs.resume import RECORD, attempt_subdir
from src.trainer.optimizer import apply_hyperparameters, lr_lambda
from tests.commands import in_process, one_rank
from tests.records import said

ROOT = Path(__file__).resolve().parent.parent
RUN = ["model=tiny", "data=synthetic", "logger=none", "trainer.max_steps=6"]


def _composed(*overrides: str):
    """(config, overrides, group choices) as train.py's Hydra job sees them."""
    full = compose_config(*overrides, return_hydra_config=True)
    choices = dict(full.hydra.runtime.choices)
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    return cfg, list(overrides), choices


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run dir as train.py leaves it: the record of the run's first attempt
    (``RUN``), a checkpoint at step 4 recording the config (trainer.lr changed by an
    earlier resume) and metrics rows."""
    cfg, overrides, choices = _composed(*RUN)
    hydra_dir = tmp_path / RECORD
    hydra_dir.mkdir()
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), hydra_dir / "overrides.yaml")
    OmegaConf.save(
        {"hydra": {"runtime": {"choices": choices}}}, hydra_dir / "hydra.yaml"
    )
    step = tmp_path / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved["trainer"]["lr"] = 0.002
    (step / META).write_text(json.dumps({"step": 4, "extra": {"config": saved}}))
    (step / "COMPLETE").write_text("")
    (tmp_path / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    return tmp_path


def _resume(run_dir: Path, *overrides: str):
    """resume_config for a later attempt in ``run_dir`` with this command line."""
    cfg, overrides, choices = _composed(*overrides)
    attempt = f"{RECORD}/attempts/x"
    cfg, user_keys = resume_config(cfg, str(run_dir), overrides, choices, attempt)
    take_branch(cfg, str(run_dir))  # as train.py does, once the config is accepted
    return cfg, user_keys


def test_a_resume_from_the_run_dir_alone_takes_the_checkpoints_config(run_dir, caplog):
    """Nothing retyped: the model and max_steps of the run, the checkpoint's lr; the
    changes typed are said, one line each, and none is said when nothing changed."""
    with caplog.at_level(logging.INFO):
        cfg, user_keys = _resume(run_dir, "trainer.resume=auto")
    assert cfg.model.name == "tiny" and cfg.trainer.max_steps == 6
    assert cfg.trainer.lr == 0.002 and cfg.trainer.resume == "auto"
    # nothing said: no "resuming ... with N change(s)" (the tmp path, named after
    # this test, holds "resume": a word of any line would match it)
    assert "model" in user_keys and said(caplog, "src.runs.compose") == []
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cfg, _ = _resume(
            run_dir, "trainer.resume=auto", "trainer.lr=0.3", "trainer.val_every=1"
        )
    assert (cfg.trainer.lr, cfg.trainer.val_every, cfg.model.n_layer) == (0.3, 1, 2)
    changes = said(caplog, "src.runs.compose")
    assert changes[0].startswith(f"resuming {run_dir} with 2 change(s) to its ")
    assert sorted(changes[1:]) == [
        "  trainer.lr: 0.002 -> 0.3",
        "  trainer.val_every: 100 -> 1",
    ]


@pytest.mark.parametrize(
    ("change", "key", "recorded"),
    [
        ("model.n_layer=1", "model.n_layer", "2"),
        ("model=small", "model.name", "'tiny'"),
        ("data=text", "data.name", "'synthetic'"),
        ("precision=bf16_mixed", "precision.name", "'fp32'"),
        ("trainer.seed=3", "trainer.seed", "0"),
        ("trainer.max_steps=9", "trainer.max_steps", "6"),
    ],
)
def test_a_change_the_checkpoint_cannot_take_is_refused_naming_the_key(
    run_dir, change, key, recorded
):
    with pytest.raises(ConfigError) as err:
        _resume(run_dir, "trainer.resume=auto", change)
    line = str(err.value)
    assert line.startswith(f"{key}: ") and "\n" not in line
    assert recorded in line and "step_00000004" in line


def test_max_steps_changes_with_resume_schedule_extend(run_dir):
    """Refused without extend, saying how; taken with it."""
    with pytest.raises(ConfigError) as err:
        _resume(run_dir, "trainer.resume=auto", "trainer.max_steps=9")
    assert str(err.value).startswith("trainer.max_steps: got 9, but")
    assert "trainer.max_steps=6" in str(err.value)
    cfg, _ = _resume(
        run_dir,
        "trainer.resume=auto",
        "trainer.max_steps=9",
        "trainer.resume_schedule=extend",
    )
    assert cfg.trainer.max_steps == 9


def test_a_fresh_start_in_a_used_run_dir_is_refused_saying_how_to_resume(run_dir):
    with pytest.raises(ConfigError) as err:
        _resume(run_dir)
    line = str(err.value)
    assert line.startswith("trainer.resume: null, but") and "step_00000004" in line
    assert f"python train.py hydra.run.dir={run_dir} trainer.resume=auto" in line


def test_a_record_whose_run_never_trained_gives_way(tmp_path):
    """A first attempt refused before training (no checkpoint, no row) left the
    record: the next attempt that starts becomes the run's record."""
    (tmp_path / RECORD).mkdir()
    (tmp_path / RECORD / "config.yaml").write_text("old: 1\n")
    attempt = tmp_path / RECORD / "attempts" / "x"
    attempt.mkdir(parents=True)
    (attempt / "config.yaml").write_text("new: 1\n")
    cfg, overrides, choices = _composed(*RUN)
    assert resume_config(cfg, str(tmp_path), overrides, choices, f"{RECORD}/attempts/x")
    assert (tmp_path / RECORD / "config.yaml").read_text() == "new: 1\n"


def test_each_attempt_after_the_first_writes_its_hydra_files_apart(tmp_path):
    assert attempt_subdir(str(tmp_path)) == RECORD
    (tmp_path / RECORD).mkdir()
    (tmp_path / RECORD / "config.yaml").write_text("")
    assert attempt_subdir(str(tmp_path)).startswith(f"{RECORD}/attempts/")


def test_a_step_dir_that_is_no_checkpoint_is_named_with_why(tmp_path):
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / META).write_text("{}")
    (tmp_path / ".tmp.step_00000003").mkdir()
    [(path, why)] = incomplete_checkpoints(tmp_path)
    assert path.name == "step_00000002" and why.startswith("no COMPLETE marker")


def test_a_resumed_optimizer_takes_the_runs_hyperparameters():
    """The checkpoint's param groups and scheduler come back with its lr; the run's
    own (changed) lr, schedule, weight decay and betas are then applied. Unchanged,
    the resumed step's lr is the checkpoint's, bit for bit."""
    old = compose_config("trainer.max_steps=10", "trainer.warmup_steps=2")
    new = compose_config(
        "trainer.max_steps=10",
        "trainer.warmup_steps=2",
        "trainer.lr=0.3",
        "trainer.weight_decay=0.5",
        "trainer.betas=[0.8,0.9]",
    )

    def optimizer(cfg, steps: int = 0):  # as the Trainer builds them
        model = torch.nn.Linear(2, 2)
        groups = [
            {"params": [model.weight], "weight_decay": cfg.trainer.weight_decay},
            {"params": [model.bias], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=cfg.trainer.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        for _ in range(steps):
            opt.step()
            sched.step()
        return opt, sched

    opt, sched = optimizer(old, steps=4)
    saved = (opt.state_dict(), sched.state_dict(), sched.get_last_lr())
    for cfg, lr in ((old, saved[2][0]), (new, 0.3 * lr_lambda(new)(4))):
        opt, sched = optimizer(cfg)
        opt.load_state_dict(saved[0])
        sched.load_state_dict(saved[1])
        apply_hyperparameters(opt, sched, cfg)
        assert [g["lr"] for g in opt.param_groups] == [lr, lr]
        assert sched.get_last_lr() == [lr, lr]
        decay = [g["weight_decay"] for g in opt.param_groups]
        assert decay == [cfg.trainer.weight_decay, 0.0]
        assert opt.param_groups[0]["betas"] == tuple(cfg.trainer.betas)
        opt.step()
        sched.step()  # the scheduler goes on from the run's numbers
        assert opt.param_groups[0]["lr"] == pytest.approx(
            cfg.trainer.lr * lr_lambda(cfg)(5)
        )


def test_metrics_jsonl_has_one_row_per_step(tmp_path):
    """Validation merges into its step's row; a resume's rows past its step go, and
    an earlier run's duplicate rows of one step become one."""
    sink = FileSink(tmp_path)
    sink.log({"loss": 2.0}, step=1)
    sink.log({"loss": 1.5}, step=2)
    sink.log({"val_loss": 1.7}, step=2)
    sink.finish(0)
    rows = [
        json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5, "val_loss": 1.7}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lr": 0.1}\n{"step": 3, "loss": 1.0}\n{"st')
    sink = FileSink(tmp_path)
    assert sink.drop_rows_after(2) == {"metrics.jsonl": 2}  # step 3, the torn row
    sink.log({"init_peak_mem_gib": 0.5}, step=2)  # a resume's first row, at its step
    sink.log({"loss": 1.1}, step=3)
    sink.finish(0)
    rows = [
        json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1] == {
        "step": 2,
        "loss": 1.5,
        "val_loss": 1.7,
        "lr": 0.1,
        "init_peak_mem_gib": 0.5,
    }


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _digest(run_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((run_dir / RECORD).glob("*.yaml"))
    }


@pytest.mark.slow
def test_train_then_resume_from_the_run_dir_alone(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """``python train.py`` keeps its final checkpoint with no checkpoint key set;
    ``hydra.run.dir=DIR trainer.resume=auto`` then trains further with the run's own
    config (nothing retyped) and a changed learning rate, applied for real; a fresh
    start there is refused in one line before any rank starts; no attempt rewrites
    the run's record. (A model change refused: tests/test_faults.py's damaged
    checkpoint test, and in-process above.)"""
    where = f"hydra.run.dir={tmp_path}"

    def train(*args: str) -> subprocess.CompletedProcess:  # one rank, in-process
        return one_rank(monkeypatch, capsys, "train.py", *args)

    first = train(
        *RUN,
        "trainer.max_steps=4",
        "trainer.devices=1",
        "trainer.progress=false",
        "trainer.log_every=1",
        "trainer.val_every=2",
        "trainer.batch_size=4",
        "trainer.peak_tflops=1",
        where,
    )
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert (tmp_path / "checkpoints" / "step_00000004" / "COMPLETE").is_file()
    record = _digest(tmp_path)

    more = [where, "trainer.resume=auto", "trainer.max_steps=6"]
    more += ["trainer.resume_schedule=extend", "trainer.lr=0.03"]
    resumed = train(*more)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert "  trainer.lr: 0.003 -> 0.03" in out
    assert "  trainer.max_steps: 4 -> 6" in out
    assert "step_00000004 (step 4)" in out
    rows = [
        json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # one row per step
    assert "val_loss" in rows[2] and "loss" in rows[2]
    cfg = compose_config(*RUN, "trainer.lr=0.03")
    assert rows[5]["lr"] == pytest.approx(0.03 * lr_lambda(cfg)(4))

    code, _, err = in_process(monkeypatch, capsys, "train.py", where)  # in-process
    assert code == 2
    assert err.strip().startswith("config error: trainer.resume: null, but")
    assert len(err.strip().splitlines()) == 1
    assert _digest(tmp_path) == record
    assert len(list((tmp_path / RECORD / "attempts").iterdir())) == 2


def test_eval_says_its_split_and_scores_all_of_given_data():
    """eval.py's ``split``: null is the run's val split, or all of ``data=`` given;
    ``all`` is accepted, anything else is one line naming the key."""
    from hydra import compose, initialize_config_dir

    from src.config.validate import validate_eval
    from src.runs.evaluation import eval_split

    def eval_cfg(*overrides: str):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            return compose("eval", ["run=x", *overrides])

    assert eval_split(eval_cfg()) == "val"
    assert eval_split(eval_cfg("data=files", "data.paths=x")) == "all"
    assert eval_split(eval_cfg("data=files", "data.paths=x", "split=val")) == "val"
    validate_eval(eval_cfg("split=all"))
    with pytest.raises(ConfigError) as err:
        validate_eval(eval_cfg("split=test"))
    assert str(err.value).startswith("split: got 'test'")


# A directory the run cannot write. Tests run as root, to whom a chmod 0o500 dir is
# writable (and os.access says yes even on /proc): the unwritable dirs here are under
# a regular file, or on /proc, where not even root can create anything.
NOT_A_DIR = "{tmp}/file/run"  # a missing parent that is a regular file
MISSING_UNDER_PROC = "/proc/none/run"  # a missing parent that cannot be created
READ_ONLY = "/proc"  # an existing dir nothing can be created in


def _start(monkeypatch, tmp_path: Path, *args: str) -> tuple[int, str]:
    """train.py's command line run in-process up to its job: Hydra composes
    conf/config.yaml (its callbacks included) from ``args``; the job itself must not
    run. (exit status, stderr)."""
    import hydra

    from src.config.cli import run_cli

    @hydra.main(
        config_path=str(ROOT / "conf"), config_name="config", version_base="1.3"
    )
    def main(cfg) -> None:
        raise AssertionError("the job ran")

    (tmp_path / "file").write_text("")
    flags = [a for a in args if a.startswith("-")]  # before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    monkeypatch.setattr(sys, "argv", ["train.py", *flags, *RUN, *overrides])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        run_cli(main)
    return exit_.value.code, exit_.value.__notes__[0]


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        ([f"hydra.run.dir={NOT_A_DIR}"], {}, "hydra.run.dir"),
        ([f"hydra.run.dir={MISSING_UNDER_PROC}"], {}, "hydra.run.dir"),
        ([f"hydra.run.dir={READ_ONLY}"], {}, "hydra.run.dir"),
        (
            ["-m", f"hydra.sweep.dir={MISSING_UNDER_PROC}", "trainer.lr=1,2"],
            {},
            "hydra.sweep.dir",
        ),
        (["data=text", f"data.cache_dir={NOT_A_DIR}"], {}, "data.cache_dir"),
        (["logger=wandb"], {"HOME": MISSING_UNDER_PROC}, "WANDB_DATA_DIR"),
        (["logger=wandb"], {"WANDB_CACHE_DIR": NOT_A_DIR}, "WANDB_CACHE_DIR"),
        (
            ["sharding.compile=true"],
            {"TORCHINDUCTOR_CACHE_DIR": READ_ONLY},
            "TORCHINDUCTOR_CACHE_DIR",
        ),
    ],
)
def test_an_unwritable_dir_is_one_line_naming_the_key_before_hydra_logs(
    monkeypatch, tmp_path, args, env, key
):
    """Hydra's job logging set-up used to fail over 53 lines on an unwritable run dir,
    and an unwritable cache dir or HOME ended in ``[Errno 2] ... '/proc/none'`` or
    late in a rank (wandb): now one line naming the key (or environment variable) to
    change, exit 2, before Hydra makes the run dir or its train.log."""
    run_dir = tmp_path / "run"
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(tmp=tmp_path))
    args = [a.format(tmp=tmp_path) for a in args]
    code, line = _start(monkeypatch, tmp_path, f"hydra.run.dir={run_dir}", *args)
    assert code == 2
    assert line.startswith(f"config error: {key}: ") and "\n" not in line, line
    assert f"set {key} to a writable directory" in line
    if args == [f"hydra.run.dir={tmp_path}/file/run"]:
        assert line == (
            f"config error: hydra.run.dir: the run writes to {tmp_path}/file/run: "
            f"{tmp_path}/file is not a directory; set hydra.run.dir to a writable "
            "directory"
        )
    if env.get("HOME"):
        assert f"(or HOME, {env['HOME']}: it is there by default)" in line
    assert not (run_dir / "train.log").exists() and not (run_dir / ".hydra").exists()


def test_dirs_that_can_be_written_pass_and_a_resume_checks_its_own(tmp_path):
    """No false alarm: writable dirs (missing ones are created, as their writers
    would). A resume is checked against the config it resumes (``continue_run``),
    not the command line's defaults."""
    from src.runs.compose import continue_run
    from src.runs.writable import check_writable

    cfg = compose_config(*RUN, "data=text", f"data.cache_dir={tmp_path}/a/cache")
    check_writable(cfg, ("hydra.run.dir", str(tmp_path / "b" / "run"), "the run"))
    assert (tmp_path / "a" / "cache").is_dir() and (tmp_path / "b" / "run").is_dir()
    (tmp_path / "file").write_text("")
    cfg.data.cache_dir = str(tmp_path / "file" / "cache")
    with pytest.raises(ConfigError, match=r"^data.cache_dir: the token cache writes"):
        continue_run(cfg, str(tmp_path / "b" / "run"))


def _dead_pid() -> int:
    """The PID of a process that has ended (a writer killed mid-write)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_start_removes_what_interrupted_writes_left_and_nothing_else(
    tmp_path, caplog
):
    """A full disk (or a kill) mid-write leaves the checkpoint being saved
    (``.tmp.step_N``) and atomic_path's ``<file>.tmp-<PID>`` files behind. The next
    start in the run dir removes them, in one line naming each and why; it touches no
    other name, and no temporary file whose writer is alive."""
    from src.trainer.faults import remove_interrupted_writes

    dead, alive = _dead_pid(), os.getpid()
    mark = f".tmp-shardwrap-{dead}"  # atomic_path's marker (src/files.py)
    ckpts = tmp_path / "checkpoints"
    for name in (".tmp.step_00000006", "step_00000004", ".old.step_00000004"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "meta.json").write_text("{}")
    left = [
        "checkpoints/.tmp.step_00000006",
        "checkpoints/.old.step_00000004",  # its step_N was replaced: an old copy
        f"metrics.jsonl{mark}",
        f"summary.json{mark}",
        f"wandb/run_id.json{mark}",
        f"profile/rank0.memory_timeline.json{mark}",
    ]
    kept = [
        "checkpoints/step_00000004/meta.json",
        f"eval.json.tmp-shardwrap-{alive}",  # eval.py writing it now
        "notes.tmp",
        "summary.json.tmp-x1",
        f"data.json{mark}.bak",
        ".hydra/config.yaml",
        f"checkpoints/step_00000004/meta.json{mark}",  # not a run-dir writer's
        # The user's own files (issue 48): another tool's temporary names, and
        # anything in a folder of theirs, marker or not, is never looked at.
        "notes.txt.tmp-20240101",
        f"summary.json.tmp-{dead}",
        "src/model.py.tmp-424242",
        f"src/model.py{mark}",
        f".hydra/config.yaml{mark}",
    ]
    for name in left[2:] + kept[1:]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / f"dir{mark}").mkdir()  # atomic_path writes files, not dirs
    kept.append(f"dir{mark}")
    with caplog.at_level(logging.WARNING, logger="src.trainer.faults"):
        removed = remove_interrupted_writes(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in removed) == sorted(left)
    for name in left:
        assert not (tmp_path / name).exists(), name
    for name in kept:
        assert (tmp_path / name).exists(), name
    (line,) = said(caplog, "src.trainer.faults")
    assert line.startswith(
        "removed what writes that did not finish (a full disk, a killed run) left in "
        f"{tmp_path}: checkpoints/.old.step_00000004, checkpoints/.tmp.step_00000006, "
    ), line
    assert all(name in line for name in left)
    assert remove_interrupted_writes(tmp_path) == []  # the next start: nothing


def test_the_token_cache_removes_what_killed_builds_left(tmp_path, caplog):
    """A token-cache build or a BPE training killed (or stopped by a full disk)
    leaves ``tokens-<key>.tmp-*`` dirs and ``bpe-<key>.json.tmp-<PID>``; the next
    opening of the cache removes them in one line, but not a build in progress (its
    entry's lock is held) and no other name."""
    import fcntl

    from src.data.token_cache import token_cache
    from tests.test_token_cache import cfg_for, write_corpus

    cfg = cfg_for(tmp_path, write_corpus(tmp_path, "text"))
    cache = tmp_path / "cache"
    cache.mkdir()
    left = [
        "bpe-0a1b.json.tmp-shardwrap-4321",
        "tokens-0a1b.tmp-1234abcd",
        "tokens-0a1b.tmp-damaged-5678abcd",
    ]
    kept = ["tokens-busy.tmp-0000abcd", "other.tmp-1234", "tokens-0a1b.lock"]
    for name in left[1:] + kept[:1]:
        (cache / name).mkdir()
        (cache / name / "train.bin").write_bytes(b"\0")
    for name in left[:1] + kept[1:]:
        (cache / name).write_text("x")
    with open(cache / "tokens-busy.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a build in progress
        with caplog.at_level(logging.WARNING, logger="src.data.token_cache"):
            token_cache(cfg.data, verbose=True, progress=False)
    assert sorted(p.name for p in cache.iterdir() if p.name in left) == []
    for name in kept:
        assert (cache / name).exists(), name
    (line,) = said(caplog, "src.data.token_cache", starts="token cache: removed ")
    assert line == (
        "token cache: removed what interrupted builds (killed, or a full disk) left "
        f"in {cache}: {', '.join(left[1:])}, {left[0]}"
    )


def _files(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` and its bytes (None: a directory)."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


@pytest.mark.slow
def test_a_command_writes_nothing_into_a_run_it_does_not_own(
    tmp_path, monkeypatch, capsys
):
    """Issue 48 item 3: a run dir is written only once its lock is held, and never
    inside another run. A resume, and a fresh start with other data, of a run dir
    in use are refused in one line with nothing in the run dir written (data.json
    was, by prepare, before the refusal), no corpus tokenized; a run dir inside a
    run's checkpoints (a checkpoint, or a new name there) or its record is refused
    before Hydra creates it; a train.log that is a directory is one line, not a
    traceback of Hydra's logging set-up. (Those two are train.py's command line run
    in-process up to its job, :func:`_start`: the refusals are its Hydra callback's.)"""
    from src.trainer.faults import run_dir_lock

    victim = tmp_path / "victim"
    step = victim / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / META).write_text("{}")
    (victim / "data.json").write_text('{"paths": "the run\'s own"}')
    (victim / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("other data\n" * 50)
    other = ["data=text", f"data.paths={corpus}", f"data.cache_dir={tmp_path}/c"]
    with run_dir_lock(victim):
        before = _files(victim)
        for extra in (["trainer.resume=auto"], [*other, "trainer.resume=auto"], other):
            # One rank: refused before any rank starts, it starts no rank server
            # either (its imports, seconds of CPU, for nothing; src/entry.py).
            run = _train(*RUN, "trainer.devices=1", f"hydra.run.dir={victim}", *extra)
            assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
            assert "Traceback" not in run.stdout + run.stderr
            (line,) = [x for x in run.stderr.splitlines() if x.startswith("error:")]
            assert f"run dir {victim} is in use by another run (PID " in line
            after = _files(victim)
            # Hydra's own files of the attempt (docs/reliability.md, Limits) and
            # its log; nothing of the run's, nothing changed
            new = {k for k in after if k not in before}
            assert all(k.startswith((".hydra", "train.log")) for k in new), new
            assert {k: after[k] for k in before} == before
        assert not list(tmp_path.glob("c/*"))  # nothing tokenized (the dir checked)

    for inside, where in (
        (step, f"is inside the checkpoint {step}"),
        (victim / "checkpoints" / "new", f"is inside the run {victim} (its "),
        (step / "rng", f"is inside the checkpoint {step}"),
        (victim / ".hydra" / "x", f"is inside the run {victim} (its .hydra/x)"),
    ):
        before = _files(victim)
        capsys.readouterr()
        code, line = _start(monkeypatch, tmp_path, f"hydra.run.dir={inside}")
        assert code == 2 and capsys.readouterr() == ("", f"{line}\n"), line
        assert line.startswith(f"config error: hydra.run.dir: {inside} {where}")
        assert "\n" not in line and _files(victim) == before

    (tmp_path / "b" / "train.log").mkdir(parents=True)
    code, line = _start(monkeypatch, tmp_path, f"hydra.run.dir={tmp_path / 'b'}")
    assert code == 2 and capsys.readouterr() == ("", f"{line}\n"), line
    assert line == (
        f"config error: hydra.run.dir: the run writes to {tmp_path / 'b'}: train.log "
        "is a directory, not the file the run writes there; it writes only to its "
        "own regular files there: remove it (or set hydra.run.dir to another "
        "directory)"
    )


def _timeline(run_dir: Path, steps: int, logged: int) -> None:
    """The fixture's run with checkpoints step_1..``steps`` (each recording the
    fixture's config), metrics rows 0..``logged`` (and a row cut short) in
    metrics.jsonl and metrics.csv, and an export."""
    meta = json.loads((run_dir / "checkpoints" / "step_00000004" / META).read_text())
    for step in range(1, steps + 1):
        path = run_dir / "checkpoints" / f"step_{step:08d}"
        path.mkdir(exist_ok=True)
        (path / META).write_text(json.dumps({**meta, "step": step}))
        (path / "COMPLETE").write_text("")
    rows = [json.dumps({"step": s, "loss": 9.0 - s}) for s in range(logged + 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + '\n{"st')
    csv = "step,loss\n" + "".join(f"{s},{9.0 - s}\n" for s in range(logged + 1))
    (run_dir / "metrics.csv").write_text(csv)
    (run_dir / "hf").mkdir()


def _steps(path: Path) -> list:
    """The step of each row of a metrics.jsonl (None: a row cut short)."""
    rows = path.read_text().splitlines()
    return [json.loads(r)["step"] if r.endswith("}") else None for r in rows]


def test_a_resume_before_the_newest_checkpoint_sets_the_newer_timeline_aside(
    run_dir, caplog
):
    """Issue 48 item 2: a resume of an older checkpoint of the run is a branch, said
    in one line: the newer checkpoints, the rows past it (metrics.jsonl and the
    CSV), summary.json and the export move to branches/<time>_after_step_N/ (not
    deleted, not mixed), so pruning and resume=auto see the branch alone; a
    set-aside cut short by a kill is finished by the next command there."""
    from src.runs.branches import BRANCH_RECORD, BRANCHES

    _timeline(run_dir, steps=4, logged=4)
    (run_dir / "summary.json").write_text('{"steps": 6, "loss": 1.0}')
    old = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    ckpts = run_dir / "checkpoints"
    before = _files(run_dir)
    with pytest.raises(ConfigError, match="model.n_layer: 2 was recorded"):
        _resume(run_dir, f"trainer.resume={ckpts}/step_00000002", "model.n_layer=1")
    assert _files(run_dir) == before  # a refused branch moves nothing
    with caplog.at_level(logging.INFO):
        cfg, _ = _resume(run_dir, f"trainer.resume={ckpts}/step_00000002", "logger=csv")
    assert cfg.trainer.resume.endswith("step_00000002")
    (branch,) = (run_dir / BRANCHES).iterdir()
    assert branch.name.endswith("_after_step_2")
    (line,) = said(caplog, starts="trainer.resume: a branch ")
    assert line == (
        "trainer.resume: a branch from step 2 (step_00000002, while the run's "
        "newest checkpoint is step_00000004): what the run dir held after it (2 "
        "checkpoints step_00000003..step_00000004, metrics.jsonl: 3 rows, "
        f"summary.json, metrics.csv: 2 rows, hf) is moved to {branch}; "
        "trainer.keep_last and trainer.resume=auto see only this branch"
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in (branch / "checkpoints").iterdir()) == [
        "step_00000003",
        "step_00000004",
    ]
    # every row is in one place, byte for byte: up to the branch point here
    kept = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert kept == old[:3] and (branch / "metrics.jsonl").read_text() == "".join(
        old[3:]
    )
    assert (run_dir / "metrics.csv").read_text().splitlines()[-1] == "2,7.0"
    assert (branch / "metrics.csv").read_text().splitlines() == [
        "step,loss",
        "3,6.0",
        "4,5.0",
    ]
    assert (branch / "summary.json").read_text() == '{"steps": 6, "loss": 1.0}'
    assert (branch / "hf").is_dir() and not (run_dir / "hf").exists()
    assert not (run_dir / "summary.json").exists()
    assert json.loads((branch / BRANCH_RECORD).read_text())["complete"] is True
    caplog.clear()
    with caplog.at_level(logging.INFO):  # the branch's own newest: no branch
        _resume(run_dir, "trainer.resume=auto")
    assert said(caplog, starts="trainer.resume: a branch ") == []
    assert len(list(branch.parent.iterdir())) == 1

    # A set-aside at step 1 killed after its record: the next command finishes it
    # before it looks at the run (resume=auto then takes step_1).
    cut = run_dir / BRANCHES / "x_after_step_1"
    cut.mkdir()
    (cut / BRANCH_RECORD).write_text('{"after_step": 1, "complete": false}')
    cfg, _ = _resume(run_dir, "trainer.resume=auto")
    assert [p.name for p in ckpts.iterdir()] == ["step_00000001"]
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["step_00000002"]
    assert _steps(run_dir / "metrics.jsonl") == [0, 1]
    assert _steps(cut / "metrics.jsonl") == [2]
    assert json.loads((cut / BRANCH_RECORD).read_text())["complete"] is True


def test_another_runs_checkpoint_into_a_dir_holding_a_run_is_refused(
    run_dir, tmp_path_factory
):
    """Issue 48 item 2: nothing in the run dir moves; into an empty dir it is a
    resume (and a retry of that resume, cut short before its first checkpoint, is
    one too)."""
    other = tmp_path_factory.mktemp("other")
    step = other / "checkpoints" / "step_00000006"
    step.mkdir(parents=True)
    meta = json.loads((run_dir / "checkpoints" / "step_00000004" / META).read_text())
    (step / META).write_text(json.dumps({**meta, "step": 6}))
    (step / "COMPLETE").write_text("")
    before = _files(run_dir)
    with pytest.raises(ConfigError) as err:
        _resume(run_dir, f"trainer.resume={step}")
    line = str(err.value)
    assert line.startswith(
        f"trainer.resume: {step} is not a checkpoint of this run "
        f"({run_dir / 'checkpoints'}) but another's, and {run_dir} holds a run "
        "(checkpoint step_00000004 and metrics.jsonl up to step 4)"
    )
    assert "resume it into a new dir" in line and "\n" not in line
    assert _files(run_dir) == before

    fresh = tmp_path_factory.mktemp("fresh")
    cfg, overrides, choices = _composed(*RUN, f"trainer.resume={step}")
    (fresh / RECORD).mkdir()  # Hydra's, of the first attempt
    cfg, _ = resume_config(cfg, str(fresh), overrides, choices, RECORD)
    assert cfg.trainer.resume == str(step)
    # the attempt logged rows and was killed before its first checkpoint
    (fresh / "metrics.jsonl").write_text('{"step": 6}\n{"step": 7}\n')
    assert _resume(fresh, f"trainer.resume={step}")[0].trainer.resume == str(step)


def test_a_completed_run_says_so_and_a_longer_one_branches_at_its_checkpoint(
    run_dir, caplog
):
    """Issue 48 item 2: a run that completed its 6 steps with its newest checkpoint
    at step 4 (trainer.ckpt_final=false): resume=auto trains nothing and touches
    nothing (it retrained from the checkpoint, or from step 1 without one, and
    replaced metrics.jsonl and summary.json); more steps are a branch from step 4."""
    from src.runs.branches import BRANCHES, Completed

    _timeline(run_dir, steps=4, logged=6)
    (run_dir / "summary.json").write_text('{"steps": 6, "loss": 1.0}')
    before = _files(run_dir)
    with caplog.at_level(logging.INFO), pytest.raises(Completed):
        _resume(run_dir, "trainer.resume=auto")
    assert said(caplog)[-1].startswith(
        f"nothing to train: {run_dir} completed its 6 steps (summary.json; its "
        "newest checkpoint: step_00000004, trainer.ckpt_final=false); its records "
        "are kept"
    )
    assert _files(run_dir) == before
    hidden = run_dir.parent / f"{run_dir.name}-checkpoints"
    (run_dir / "checkpoints").rename(hidden)  # none at all: the same
    with pytest.raises(Completed, match="its newest checkpoint: none"):
        _resume(run_dir, "trainer.resume=auto")
    (run_dir / "summary.json").write_text('{"steps": 6, "stopped": {"step": 6}}')
    _resume(run_dir, "trainer.resume=auto")  # a stopped run is no completed one

    hidden.rename(run_dir / "checkpoints")
    shutil.rmtree(run_dir / "hf")
    _timeline(run_dir, steps=4, logged=6)
    (run_dir / "summary.json").write_text('{"steps": 6, "loss": 1.0}')
    cfg, _ = _resume(
        run_dir,
        "trainer.resume=auto",
        "trainer.max_steps=8",
        "trainer.resume_schedule=extend",
    )
    assert cfg.trainer.max_steps == 8
    (branch,) = (run_dir / BRANCHES).iterdir()
    assert branch.name.endswith("_after_step_4")
    assert _steps(run_dir / "metrics.jsonl") == [0, 1, 2, 3, 4]
    assert _steps(branch / "metrics.jsonl") == [5, 6, None]  # and the torn row
    assert (branch / "summary.json").is_file()
    assert not (branch / "checkpoints").exists()


# train.py, its process SIGKILLed as step N begins (one rank: the launching process)
_KILLED_AT = """
import os, runpy, signal, sys
from src.trainer.loop import Trainer
step = Trainer.step
def killed(self, s):
    if s == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, s)
Trainer.step = killed
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def _run_files(run_dir: Path) -> dict[str, bytes | None]:
    """:func:`_files` but for what any command adds (Hydra's attempt, its log)."""
    skip = (".hydra", "train.log", "run.lock")
    return {k: v for k, v in _files(run_dir).items() if not k.startswith(skip)}


@pytest.mark.slow
def test_a_run_dir_holds_one_timeline(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """Issue 48 item 2's repros, one rank each: a run to step 6 (a checkpoint each
    step); a resume of its step 2 with keep_last=1 killed in step 4 sets steps 3-6
    aside, and resume=auto then goes on with the branch (keep_last had kept the
    old step_6 and deleted the branch's own, and auto said "nothing to train"); a
    completed run without its last checkpoint says it completed. (Another run's
    checkpoint into a dir holding a run, refused untouched: in-process,
    test_another_runs_checkpoint_into_a_dir_holding_a_run_is_refused.)"""

    def train(*args: str) -> subprocess.CompletedProcess:  # in-process
        return one_rank(monkeypatch, capsys, "train.py", *args)

    run = tmp_path / "A"
    base = [*RUN, "trainer.devices=1", "trainer.progress=false"]
    base += ["trainer.log_every=1", "trainer.peak_tflops=1"]
    first = train(
        *base, "trainer.ckpt_every=1", "trainer.keep_last=10", f"hydra.run.dir={run}"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3, 4, 5, 6]
    shutil.copytree(run, tmp_path / "C")
    for step in (5, 6):  # C: a completed run whose newest checkpoint is step 4
        shutil.rmtree(tmp_path / "C" / "checkpoints" / f"step_{step:08d}")

    ckpts = run / "checkpoints"
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_AT, f"hydra.run.dir={run}"]
        + [f"trainer.resume={ckpts}/step_00000002", "trainer.keep_last=1"],
        cwd=ROOT,
        env={**os.environ, "KILL_AT": "4", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    (line,) = [x for x in killed.stdout.splitlines() if "branch" in x]
    (branch,) = (run / "branches").iterdir()
    assert line.startswith(
        "trainer.resume: a branch from step 2 (step_00000002, while the run's newest "
        "checkpoint is step_00000006): what the run dir held after it (4 "
        "checkpoints step_00000003..step_00000006, metrics.jsonl: 4 rows, "
        f"summary.json) is moved to {branch};"
    )
    assert [p.name for p in ckpts.iterdir()] == ["step_00000003"]  # keep_last=1
    moved = sorted(p.name for p in (branch / "checkpoints").iterdir())
    assert moved == [f"step_{s:08d}" for s in (3, 4, 5, 6)]
    assert (branch / "metrics.jsonl").read_text() == "".join(rows[3:])
    aside = _files(branch)

    auto = train(f"hydra.run.dir={run}", "trainer.resume=auto")
    out = auto.stdout + auto.stderr
    assert auto.returncode == 0, out[-2000:]
    assert "branch" not in out and "dropped" not in out and "nothing" not in out
    assert "resumed from" in out and "step_00000003 (step 3)" in out
    assert [p.name for p in ckpts.iterdir()] == ["step_00000006"]
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3, 4, 5, 6]
    assert (run / "metrics.jsonl").read_text().startswith("".join(rows[:2]))
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    assert _files(branch) == aside

    done = tmp_path / "C"
    before = _run_files(done)
    again = train(f"hydra.run.dir={done}", "trainer.resume=auto")
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.startswith(f"nothing to train: {done} completed its 6 steps")
    assert _run_files(done) == before


@pytest.mark.slow
def test_a_run_keeps_its_data_and_tokenizer(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """Issue 48 item 1's repros on a BPE run: its corpus rewritten (size and mtime
    kept) and a file added, the resume is refused in one line naming both, before
    anything is tokenized or recorded; eval.py scores the changed files but says so
    and records run_data=false (and names the damaged checkpoint it passes over);
    with the corpus and the BPE cache deleted sample.py decodes with the run's own
    tokenizer file (never trained again); a tokenizer file that is not the run's is
    refused naming it. (Each command in-process, tests/commands.py.)"""
    corpus, cache, run = tmp_path / "corpus", tmp_path / "cache", tmp_path / "run"
    corpus.mkdir()
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    for i in range(3):
        lines = [" ".join(words[(i + j + k) % 8] for k in range(9)) for j in range(150)]
        (corpus / f"{i}.txt").write_text("\n".join(lines))
    data = ["data=files", f"data.paths={corpus}/*.txt", f"data.cache_dir={cache}"]
    data += ["data.tokenizer=bpe", "data.bpe_vocab_size=300"]
    first = one_rank(
        monkeypatch, capsys, "train.py", *RUN[:1], "logger=none", *data, "trainer.max_steps=2", "trainer.devices=1",
        "trainer.progress=false", "trainer.ckpt_every=1", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    record = (run / "data.json").read_bytes()
    assert json.loads(record)["eos_token"] == "<|endoftext|>"
    built = sorted(p.name for p in cache.iterdir())

    target = corpus / "1.txt"
    st = os.stat(target)
    target.write_text(target.read_text().replace("alpha", "ALPHA"))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    (corpus / "3.txt").write_text("omega " * 50)
    code, _, err = in_process(
        monkeypatch, capsys, "train.py", f"hydra.run.dir={run}", "trainer.resume=auto"
    )
    assert code == 2, err[-2000:]
    assert err.splitlines() == [
        f"config error: data.paths: the run trained on other data: {target} (its "
        f"contents changed), {corpus}/3.txt (added); a resume keeps the "
        "checkpoint's data and tokenizer (restore the files, or train another in a "
        "new hydra.run.dir)"
    ]
    assert (run / "data.json").read_bytes() == record
    assert sorted(p.name for p in cache.iterdir() if "digests" not in p.name) == [
        n for n in built if "digests" not in n
    ]

    newest = run / "checkpoints" / "step_00000002"
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + b"?")  # damaged: skipped, and said
    scored = one_rank(monkeypatch, capsys, "eval.py", f"run={run}", "batches=1")
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert "eval: the run's data changed since it trained on it: " in scored.stdout
    assert (
        f"skipping checkpoint {newest}: {shard.name} fails its checksum (corrupted); "
        "reading the newest intact one" in scored.stdout
    )
    record = json.loads((run / "eval.json").read_text())[-1]
    assert record["run_data"] is False and record["step"] == 1

    shutil.rmtree(corpus)
    for bpe in cache.glob("bpe-*"):
        bpe.unlink()
    sample = ["max_new_tokens=4", "num_samples=1", "prompt=alpha beta"]
    sampled = one_rank(monkeypatch, capsys, "sample.py", f"run={run}", *sample)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert "\nalpha beta" in sampled.stdout
    assert not list(cache.glob("bpe-*"))  # read from the run, not trained again

    (run / "tokenizer.json").write_text("{}")
    code, _, err = in_process(monkeypatch, capsys, "sample.py", f"run={run}", *sample)
    assert code == 2
    assert err.startswith(
        f"config error: run: {run}/tokenizer.json is not the tokenizer the run "
        "trained with (SHA-256 "
    )
    assert len(err.splitlines()) == 1


def test_a_recorded_config_is_data_checked_where_it_is_read(run_dir):
    """Issue 48: a forged meta.json's config is refused before any rank, naming the
    file (it named only the key; a value of the wrong kind was a TypeError traceback);
    an error of the command line's own change names no file; a path inside a run
    that is not one of its checkpoints is not read with that run's config (eval.py
    filed a nested run's score in the parent's eval.json)."""
    from src.runs.from_run import find_run

    meta = run_dir / "checkpoints" / "step_00000004" / META
    record = json.loads(meta.read_text())
    for section, key, value, error in [
        ("model", "n_layer", -3, "model.n_layer: must be a positive integer, got -3"),
        ("trainer", "lr", "abc", f"trainer.resume: {meta} records a config that"),
    ]:
        forged = json.loads(json.dumps(record))
        forged["extra"]["config"][section][key] = value
        meta.write_text(json.dumps(forged))
        with pytest.raises(ConfigError) as err:
            _resume(run_dir, "trainer.resume=auto")
        assert str(err.value).startswith(error), err.value
        assert str(meta) in str(err.value)
    meta.write_text(json.dumps(record))
    with pytest.raises(ConfigError) as err:
        _resume(run_dir, "trainer.resume=auto", "trainer.lr=-1")
    assert str(err.value) == "trainer.lr: got -1.0, expected > 0"

    nested = run_dir / "sub" / "checkpoints" / "step_00000001"
    nested.mkdir(parents=True)
    (nested / "COMPLETE").write_text("")
    for path in (run_dir / "sub", nested):
        with pytest.raises(ConfigError) as err:
            find_run(str(path))
        assert str(err.value) == (
            f"run: {path} is inside the run {run_dir} (the nearest dir above it with "
            "a .hydra/config.yaml) but not one of its checkpoints: it would be read "
            "with that run's config and its records would go there; give the run "
            "dir of train.py that saved it"
        )
