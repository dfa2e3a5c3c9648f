"""What a researcher reaches for around the data (issue 49): split sizes checked
before any rank starts for every source, a val_loss sweep that has no validation
refused, runs compared across tokenizers and sweeps, data mixtures, best checkpoints
and early stopping."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from src.config.validate import validate
from src.errors import ConfigError
from src.trainer.launch import prepare
from tests.test_researcher_ux import ONE_RANK, one_config_error, run
from tests.test_train import make_cfg


def test_a_split_too_small_is_named_before_any_rank_for_every_source(tmp_path):
    """``data=synthetic`` and ``data=tokens`` had no split-size check: a split
    smaller than one window stopped inside a rank (``ValueError: data.num_tokens:
    split has 19 tokens``). Now one line naming the key that sizes it."""
    cache = tmp_path / "cache"
    args = [*ONE_RANK, "data=synthetic", "data.num_tokens=20000"]
    out = run(
        "train.py", *args, "data.val_fraction=0.001", f"hydra.run.dir={tmp_path}/a",
        cache=cache,
    )  # fmt: skip
    line = one_config_error(out)
    assert line.startswith(
        "data.val_fraction: 0.001 gives a validation split of 20 tokens, fewer than "
        "one window (a window is the model's sequence length + 1 = 65 tokens)"
    )
    assert not (tmp_path / "a" / "ranks").exists()  # no rank started

    def refused(*overrides: str) -> str:
        cfg = make_cfg(*overrides)
        with pytest.raises(ConfigError) as err:
            prepare(cfg, validate(cfg), set())
        return str(err.value)

    line = refused("data=synthetic", "data.num_tokens=40")
    assert line.startswith("data.num_tokens: the training split has 38 tokens, fewer")
    good, short = tmp_path / "train.bin", tmp_path / "val.bin"
    np.arange(1000, dtype=np.uint16).tofile(good)
    np.arange(30, dtype=np.uint16).tofile(short)
    tokens = ["data=tokens", f"data.train_path={good}", f"data.val_path={short}"]
    line = refused(*tokens)
    assert line.startswith("data.val_path: the validation split has 30 tokens, fewer")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    line = refused(*tokens[:2], f"data.val_path={tmp_path}/odd.bin")
    assert line.startswith("data.val_path: ") and "has 3 bytes" in line
    cfg = make_cfg("data=synthetic", "data.num_tokens=20000", "data.val_fraction=0")
    prepare(cfg, validate(cfg), set())  # no validation split: nothing to check


def test_a_val_loss_sweep_without_validation_is_refused_in_one_line(tmp_path):
    """``sweep.objective=val_loss`` (the default) and ``data.val_fraction=0``: every
    job would score the worst value. The job is refused before it starts, one line
    naming the key, and its row says why."""
    sweep = tmp_path / "sweep"
    out = run(
        "train.py", "-m", *ONE_RANK, "data=synthetic", "data.num_tokens=20000",
        "data.val_fraction=0", "logger=none", f"hydra.sweep.dir={sweep}",
        cache=tmp_path / "cache",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    want = (
        "config error: data.val_fraction: 0 gives no val_loss, the sweep's objective "
        "(sweep.objective=val_loss): set data.val_fraction > 0, or sweep.objective=loss"
    )
    assert want in out.stderr.splitlines()
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [(r["status"], r["error"]) for r in rows] == [("failed", want)]
    assert not (sweep / "0" / "ranks").exists()
