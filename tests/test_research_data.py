"""What a researcher reaches for around the data (issue 49): split sizes checked
before any rank starts for every source, a val_loss sweep that has no validation
refused, runs compared across tokenizers and sweeps, data mixtures, best checkpoints
and early stopping."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from subprocess import CompletedProcess

import numpy as np
import pytest

from src.config.validate import validate
from src.errors import ConfigError
from src.runs.compare import STEM as COMPARE_STEM
from src.runs.compare import compare
from src.trainer.launch import prepare
from tests import commands
from tests.commands import in_process
from tests.records import said
from tests.test_researcher_ux import ONE_RANK, one_config_error
from tests.test_train import make_cfg


def test_a_split_too_small_is_named_before_any_rank_for_every_source(
    tmp_path, monkeypatch, capsys
):
    """``data=synthetic`` and ``data=tokens`` had no split-size check: a split
    smaller than one window stopped inside a rank (``ValueError: data.num_tokens:
    split has 19 tokens``). Now one line naming the key that sizes it (train.py
    in-process up to its refusal, tests/commands.py)."""
    monkeypatch.setenv("SHARDWRAP_CACHE", str(tmp_path / "cache"))
    args = [*ONE_RANK, "data=synthetic", "data.num_tokens=20000"]
    out = in_process(
        monkeypatch, capsys, "train.py", *args, "data.val_fraction=0.001",
        f"hydra.run.dir={tmp_path}/a",
    )  # fmt: skip
    line = one_config_error(out)
    assert line.startswith(
        "data.val_fraction: 0.001 gives a validation split of 20 tokens, fewer than "
        "one window (a window is the model's sequence length + 1 = 65 tokens)"
    )
    assert not (tmp_path / "a" / "ranks").exists()  # no rank started

    def refusal(*overrides: str) -> str:
        cfg = make_cfg(*overrides)
        with pytest.raises(ConfigError) as err:
            validate(cfg)  # as train.py does, before prepare
            prepare(cfg, set())
        return str(err.value)

    line = refusal("data=synthetic", "data.num_tokens=40")
    assert line.startswith("data.num_tokens: the training split has 38 tokens, fewer")
    good, short = tmp_path / "train.bin", tmp_path / "val.bin"
    np.arange(1000, dtype=np.uint16).tofile(good)
    np.arange(30, dtype=np.uint16).tofile(short)
    tokens = ["data=tokens", f"data.train_path={good}", f"data.val_path={short}"]
    line = refusal(*tokens)
    assert line.startswith("data.val_path: the validation split has 30 tokens, fewer")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    line = refusal(*tokens[:2], f"data.val_path={tmp_path}/odd.bin")
    assert line.startswith("data.val_path: ") and "has 3 bytes" in line
    cfg = make_cfg("data=synthetic", "data.num_tokens=20000", "data.val_fraction=0")
    prepare(cfg, set())  # no validation split: nothing to check


@pytest.mark.slow
def test_a_val_loss_sweep_without_validation_is_refused_in_one_line(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """``sweep.objective=val_loss`` (the default) and ``data.val_fraction=0``: every
    job would score the worst value. The job is refused before it starts, one line
    naming the key, and its row says why. (In-process: the sweep's one job is
    refused before it would train.)"""
    sweep = tmp_path / "sweep"
    monkeypatch.setenv("SHARDWRAP_CACHE", str(tmp_path / "cache"))
    out = CompletedProcess([], *in_process(
        monkeypatch, capsys, "train.py", "-m", *ONE_RANK, "data=synthetic",
        "data.num_tokens=20000", "data.val_fraction=0", "logger=none",
        f"hydra.sweep.dir={sweep}",
    ))  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = (
        "config error: data.val_fraction: 0 gives no val_loss, the sweep's objective "
        "(sweep.objective=val_loss): set data.val_fraction > 0, or sweep.objective=loss"
    )
    assert want in out.stderr.splitlines()
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [(r["status"], r["error"]) for r in rows] == [("failed", want)]
    assert not (sweep / "0" / "ranks").exists()


# ------------------------------------------------------------------ comparing

SMALL = [
    *ONE_RANK,
    "data=files",
    "data.paths=<stdlib>/json/*.py",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.val_every=4",
    "trainer.val_batches=1",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
    "logger=none",
]


@pytest.mark.slow
def test_compare_a_sweep_dir_defaults_and_runs_of_other_tokenizers(
    tmp_path, caplog, monkeypatch, capsys, stop_handlers_restored
):
    """``python -m src.runs.compare runs/sweep`` (and ``runs/sweep/*``, which also
    matches multirun.yaml and the summary's files) compares the sweep's jobs and
    plots their curves; a run beside them that did not set the swept key shows the
    value it ran with; a BPE run beside byte-level ones is not ranked against them.
    (The runs train on one rank in-process, tests/commands.py.)"""
    from src.runs.compare import main as compare_main

    cache, sweep, bpe = tmp_path / "cache", tmp_path / "sweep", tmp_path / "bpe"
    out = one_rank(
        monkeypatch, capsys, "train.py", "-m", *SMALL, "trainer.lr=1e-3,3e-3",
        f"hydra.sweep.dir={sweep}", cache=cache,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    out = one_rank(
        monkeypatch, capsys, "train.py", *SMALL, "data.tokenizer=bpe",
        "data.bpe_vocab_size=300", f"hydra.run.dir={bpe}", cache=cache,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr

    def compared(*args: Path) -> list[dict]:
        dest = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        with caplog.at_level("INFO"):
            compare_main([*map(str, args), "--out", str(dest)])
        assert (dest / "compare.png").stat().st_size > 10_000  # every run's curves
        return list(csv.DictReader((dest / "compare.csv").open()))

    rows = compared(sweep)
    assert [r["job"] for r in rows] == ["0", "1"]
    assert [r["trainer.lr"] for r in rows] == ["0.001", "0.003"]
    best = min(rows, key=lambda r: float(r["val_loss"]))
    assert [r["best"] for r in rows] == [str(r is best) for r in rows]
    assert "tokenizer" not in rows[0]  # one tokenizer: no column
    assert compared(*sorted(sweep.glob("*"))) == rows  # the glob's files left out
    assert f"{sweep}/multirun.yaml: not a run dir, left out" in said(
        caplog, "src.runs.compare"
    )

    caplog.clear()
    rows = compared(sweep, bpe)
    assert [r["job"] for r in rows] == ["sweep/0", "sweep/1", "bpe"]
    default_lr = str(make_cfg().trainer.lr)
    assert [r["trainer.lr"] for r in rows] == ["0.001", "0.003", default_lr]
    data = json.loads((bpe / "data.json").read_text())
    assert [r["tokenizer"] for r in rows] == [
        "byte (256 tokens)", "byte (256 tokens)",
        f"bpe ({data['vocab_size']} tokens) {Path(data['tokenizer_file']).name}",
    ]  # fmt: skip
    assert not any(r["best"] == "True" for r in rows)
    table = (tmp_path / "out2" / "compare.md").read_text()
    assert "**" not in table  # no bold best
    warned = said(caplog, "src.runs.sweep", starts="no best run marked")
    assert warned == [
        "no best run marked: the runs use different tokenizers (byte (256 tokens): 2 "
        f"run(s); {rows[2]['tokenizer']}: 1 run(s)), so their losses and tokens/s do "
        "not compare"
    ]


def one_rank(monkeypatch, capsys, script: str, *args: str, cache: Path):
    """:func:`tests.test_researcher_ux.run` in-process, the run on its one rank
    (tests/commands.py)."""
    monkeypatch.setenv("SHARDWRAP_CACHE", str(cache))
    return commands.one_rank(monkeypatch, capsys, script, *args)


# ------------------------------------------------- best checkpoints, early stopping

WARMUP = 4  # validations at steps <= WARMUP are not counted by early stopping
EARLY = [
    *ONE_RANK,
    "data=synthetic",  # random tokens: val_loss stops improving within steps
    "data.num_tokens=20000",
    "logger=none",
    "trainer.max_steps=40",
    f"trainer.warmup_steps={WARMUP}",
    "trainer.val_every=2",
    "trainer.val_batches=1",
    "trainer.log_every=2",
    "trainer.peak_tflops=1",
    "trainer.keep_last=1",
    "trainer.keep_best=2",
]


def _val_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def _kept(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))


def _expected_kept(vals: dict[int, float], last: int) -> list[int]:
    """The newest checkpoint (keep_last=1) and the 2 steps of the lowest val_loss."""
    best = sorted(vals, key=lambda s: (vals[s], -s))[:2]
    return sorted({last, *best})


@pytest.mark.slow
def test_best_checkpoints_and_early_stopping_across_resume_and_branch(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """``trainer.keep_best=2 trainer.early_stop_patience=2``: training stops after 2
    validations without a lower val_loss (one console line, the summary, the closing
    line); the 2 best checkpoints survive ``keep_last=1``; a resume has nothing to
    train; ``eval.py ckpt=best`` scores the best checkpoint (its val_loss again); a
    branch from an older best keeps the best of its own timeline."""
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    out = one_rank(
        monkeypatch, capsys,
        "train.py", *EARLY, "trainer.early_stop_patience=2",
        f"hydra.run.dir={run_dir}", cache=cache,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    vals = _val_losses(run_dir)
    best, since, stop = None, 0, None
    for step, value in vals.items():  # the rule, applied to the logged val_loss
        best, since = (
            (step, 0)
            if best is None or value < vals[best]
            else (best, since + (step > WARMUP))
        )
        if since == 2:
            stop = step
            break
    assert stop is not None and stop < 40 and max(vals) == stop
    line = (
        f"step {stop}: stopping early: val_loss has not improved on "
        f"{vals[best]:.4f} (step {best}) for 2 validations "
        "(trainer.early_stop_patience=2)"
    )
    assert line in out.stdout
    assert (
        f"stopped early (best val_loss {vals[best]:.4f} at step {best})" in out.stdout
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == stop
    assert summary["early_stop"] == {
        "step": stop, "best_val_loss": vals[best], "best_step": best, "patience": 2,
    }  # fmt: skip
    assert summary["best_checkpoint"]["path"].endswith(f"step_{best:08d}")
    assert _kept(run_dir) == _expected_kept(vals, stop)

    again = one_rank(
        monkeypatch,
        capsys,
        "train.py",
        f"hydra.run.dir={run_dir}",
        "trainer.resume=auto",
        cache=cache,
    )
    assert again.returncode == 0, again.stderr
    assert "(it stopped early: trainer.early_stop_patience=2)" in again.stdout

    scored = one_rank(
        monkeypatch, capsys, "eval.py", f"run={run_dir}", "ckpt=best", cache=cache
    )
    assert scored.returncode == 0, scored.stderr
    entry = json.loads((run_dir / "eval.json").read_text())[-1]
    assert entry["checkpoint"].endswith(f"step_{best:08d}")
    assert entry["loss"] == pytest.approx(vals[best], abs=1e-5)
    monkeypatch.setenv("SHARDWRAP_CACHE", str(cache))
    line = one_config_error(  # in-process up to its refusal (tests/commands.py)
        in_process(
            monkeypatch, capsys, "eval.py", f"run={entry['checkpoint']}", "ckpt=best"
        )
    )
    assert line.startswith("ckpt: best picks among a run's checkpoints")

    # A branch from the older of the two best: the set-aside timeline's best are not
    # its own; the best it keeps are those of its own val_loss.
    older = min(s for s in _kept(run_dir) if s != stop)
    branch = one_rank(
        monkeypatch, capsys,
        "train.py", f"hydra.run.dir={run_dir}",
        f"trainer.resume={run_dir}/checkpoints/step_{older:08d}",
        "trainer.early_stop_patience=0", f"trainer.max_steps={stop + 2}",
        "trainer.resume_schedule=extend", cache=cache,
    )  # fmt: skip
    assert branch.returncode == 0, branch.stderr
    vals = _val_losses(run_dir)
    assert max(vals) == stop + 2
    assert _kept(run_dir) == _expected_kept(vals, stop + 2)
    (aside,) = (run_dir / "branches").iterdir()
    assert all(s > older for s in _kept(aside))


# ------------------------------------------------------------------- mixtures

MIX = [
    *ONE_RANK,
    "logger=none",
    "data=files",
    "data.paths=[<stdlib>/json/*.py,<stdlib>/email/*.py]",
    "data.weights=[3,1]",
    "trainer.max_steps=8",
    "trainer.ckpt_every=4",
    "trainer.keep_last=0",
    "trainer.log_every=2",
    "trainer.val_every=4",
    "trainer.val_batches=2",
    "trainer.peak_tflops=1",
]


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def _val_rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith("val")}
        for r in map(json.loads, lines)
        if "val_loss" in r
    }


@pytest.mark.slow
def test_a_data_mixture_samples_by_weight_logs_its_shares_and_resumes_exactly(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    """``data.paths=[a,b] data.weights=[3,1]``: each glob a source of its own token
    cache entry, sampled by weight; the realised shares in metrics.jsonl and the
    summary; a resume from the middle (into another run dir) gives the same losses
    and shares as the run that went through. Wrong weights: one line."""
    cache, run_dir, again = tmp_path / "cache", tmp_path / "run", tmp_path / "again"
    out = one_rank(
        monkeypatch, capsys, "train.py", *MIX, f"hydra.run.dir={run_dir}", cache=cache
    )
    assert out.returncode == 0, out.stderr
    record = json.loads((run_dir / "data.json").read_text())
    assert [(s["name"], s["paths"], s["weight"]) for s in record["mix"]] == [
        ("json", "<stdlib>/json/*.py", 0.75), ("email", "<stdlib>/email/*.py", 0.25),
    ]  # fmt: skip
    assert all(s["train_tokens"] > 0 and s["val_tokens"] > 0 for s in record["mix"])
    rows = _rows(run_dir)
    for row in rows.values():
        assert row["share/json"] + row["share/email"] == pytest.approx(1)
    mix = json.loads((run_dir / "summary.json").read_text())["data_mix"]
    assert mix["json"]["tokens"] + mix["email"]["tokens"] == 8 * 16 * 64
    assert mix["json"]["share"] == rows[8]["share/json"]
    assert 0.6 < mix["json"]["share"] < 0.9  # 128 rows drawn at 0.75
    assert {n: m["weight"] for n, m in mix.items()} == {"json": 0.75, "email": 0.25}
    # each source's validation loss beside the mixed one: 2 x 16 windows, 24 json and
    # 8 email, all of 64 targets, so the mixed loss is their 3:1 mean
    vals = _val_rows(run_dir)
    assert sorted(vals) == [4, 8]
    for row in vals.values():
        json_loss, email_loss = row["val/json/loss"], row["val/email/loss"]
        assert json_loss != email_loss
        assert row["val_loss"] == pytest.approx(0.75 * json_loss + 0.25 * email_loss)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val/email/loss"] == vals[8]["val/email/loss"]
    last = vals[8]
    closing = (
        f"val_loss {last['val_loss']:.4f} (json {last['val/json/loss']:.4f}, "
        f"email {last['val/email/loss']:.4f})"
    )
    assert closing in out.stdout + out.stderr

    resumed = one_rank(
        monkeypatch, capsys,
        "train.py", *MIX, f"hydra.run.dir={again}",
        f"trainer.resume={run_dir}/checkpoints/step_00000004", cache=cache,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    later = _rows(again)
    assert sorted(later) == [6, 8]
    for step in (6, 8):
        for key in ("loss", "share/json", "share/email"):
            assert later[step][key] == rows[step][key]
    assert _val_rows(again)[8] == vals[8]
    # compare: a column per source
    table = compare([run_dir, again], tmp_path / "compare", make_plot=False)
    assert [r["val/json/loss"] for r in table] == [vals[8]["val/json/loss"]] * 2
    header = (tmp_path / "compare" / f"{COMPARE_STEM}.md").read_text().splitlines()[0]
    assert "| val json | val email |" in header
    assert json.loads((again / "summary.json").read_text())["data_mix"] == mix

    for bad, why in (
        ("data.weights=[1]", "got [1], expected a list of one weight per glob"),
        ("data.weights=[1,0]", "got 0 in [1, 0], expected numbers > 0"),
    ):
        cfg = make_cfg(
            *MIX[4:5], "data.paths=['<stdlib>/json/*.py','<stdlib>/email/*.py']", bad
        )
        with pytest.raises(ConfigError, match=f"^data.weights: {re.escape(why)}"):
            validate(cfg)


def test_early_stopping_min_delta_and_warmup_validations_not_counted(tmp_path):
    """``trainer.early_stop_min_delta``: a val_loss better by no more than it is no
    improvement; validations at steps inside ``trainer.warmup_steps`` are not counted
    (issue 57 item 8). The keys reach the trainer's Best from the config."""
    from src.config.validate import validate
    from src.harness import compose_config
    from src.trainer.best import Best

    best = Best.start(0, 3, tmp_path, None, min_delta=0.05, warmup=20)
    for step, loss in [(10, 5.0), (20, 5.1), (30, 4.97), (40, 4.96)]:
        best.seen(step, loss)
        assert not best.exhausted, step  # 20: in warmup; 30, 40: by less than 0.05
    best.seen(50, 4.99)
    assert best.exhausted and (best.best, best.best_step, best.since) == (5.0, 10, 3)
    plain = Best.start(0, 2, tmp_path, None)  # the defaults: every validation counts
    for step, loss in [(10, 5.0), (20, 5.1), (30, 4.97)]:
        plain.seen(step, loss)
    assert (plain.best, plain.since) == (4.97, 0)
    cfg = compose_config("trainer.early_stop_min_delta=0.01")
    assert cfg.trainer.early_stop_min_delta == 0.01
    with pytest.raises(Exception, match="trainer.early_stop_min_delta"):
        validate(compose_config("trainer.early_stop_min_delta=-1"))
