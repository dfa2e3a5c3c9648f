"""The layout search (src/planner/layouts.py): plan-only's fastest layouts that fit,
each a command line that runs as printed; ``trainer.layout=fastest``. In-process."""

from __future__ import annotations

import json
import re

import pytest
from omegaconf import OmegaConf

import src.config.schema  # noqa: F401  (registers the base_config schema for compose)
from src.config.run_plan import resolve, with_overrides
from src.config.validate import validate
from src.errors import ConfigError
from src.harness import compose_config

BASE = ("model=llama_tiny", "data=synthetic", "trainer.devices=4", "logger=none")


def test_plan_only_lists_fastest_layouts_that_run_as_printed(tmp_path, capsys):
    from src.planner.report import plan_only

    plan_only(resolve(compose_config(*BASE, "trainer.plan_only=true")), str(tmp_path))
    printed = capsys.readouterr().out
    layouts = json.loads((tmp_path / "summary.json").read_text())["layouts"]
    assert 1 <= len(layouts) <= 5
    speeds = [x["predicted_tokens_per_s"] for x in layouts]
    assert speeds == sorted(speeds, reverse=True)
    lines = re.findall(
        r"\n  (\d)\. ([\d,]+) tokens/s per device, ([\d.]+) GiB: (.*)", printed
    )
    assert len(lines) == len(layouts), printed[-1500:]
    points = int(re.search(r"\((\d+) points predicted", printed).group(1))
    assert points > 50  # TP, HSDP, PP schedules, checkpointing, grad_accum
    seen = set()
    for (_, per_device, gib, args), rec in zip(lines, layouts, strict=True):
        assert int(per_device.replace(",", "")) == round(
            rec["predicted_tokens_per_s"] / 4
        )
        assert float(gib) == pytest.approx(rec["peak_gib"], abs=0.005)
        overrides = [] if args == "(as set)" else args.split()
        assert overrides == [f"{k}={v}" for k, v in rec["overrides"].items()]
        run = validate(compose_config(*BASE, *overrides))  # composes and validates
        assert run.world_size == 4
        seen.add((run.layout.dp_replicate, run.layout.tp, run.layout.pp))
    assert len(seen) > 1  # more than one layout of the ranks among the fastest


def test_layout_fastest_trains_the_first_and_records_it(caplog):
    from src.trainer.launch import _fastest_layout

    cfg = compose_config(*BASE, "trainer.layout=fastest")
    with caplog.at_level("INFO"):
        sets, record = _fastest_layout(resolve(cfg), say=True)
    out = with_overrides(cfg, sets)
    run = resolve(out)
    said = [r.message for r in caplog.records if "trainer.layout=fastest" in r.message]
    assert len(said) == 1
    for key, value in record["overrides"].items():
        assert f"{key}={value}" in said[0]
        assert OmegaConf.select(out, key) == value  # the config the ranks get
    assert record["predicted_tokens_per_s"] > 0 and record["peak_gib"] > 0
    assert run.world_size == 4


def test_layout_wrong_value_names_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.layout.*as_set, fastest"):
        validate(compose_config(*BASE, "trainer.layout=quickest"))


def test_every_layout_the_search_lists_passes_the_runs_checks(tmp_path):
    """All the layouts the search finds fitting (``every=True``; MoE on 2 ranks: EP,
    TP, HSDP, checkpointing) pass what a run checks before its ranks start:
    validation and ``prepare`` (the planner's units, where selective checkpointing
    of a block that expert parallelism splits is refused: the search listed it)."""
    from src.planner.constants import machine_budget_bytes
    from src.planner.layouts import layout_search
    from src.trainer.launch import prepare

    base = ("model=moe_tiny", "data=synthetic", "trainer.devices=2", "logger=none")
    resolved = validate(compose_config(*base))
    found, _ = layout_search(resolved, 2, machine_budget_bytes(2), every=True)
    assert len(found) > 5
    assert any("sharding.expert_parallel=2" in lay.args() for lay in found)
    for lay in found:
        cfg = compose_config(*base, *lay.args().split())
        validate(cfg)
        prepare(cfg, None, run_dir=str(tmp_path))
