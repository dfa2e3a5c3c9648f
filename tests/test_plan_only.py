"""``trainer.plan_only=true``: the wrap plan and per-rank memory estimate of a
multi-billion-parameter model without allocating its parameters (its cost:
python -m bench.plan_time)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import src.config.schema  # noqa: F401  (registers the base_config schema for compose)
from src.config.run_plan import model_config, model_spec, resolve
from src.harness import compose_config
from src.observe import metrics
from src.planner.constants import FORKED_RANK_SAVING, MIB, PROCESS_BYTES
from src.planner.estimate import PARTS
from tests.distributed import HANG_S

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
ESTIMATE_KEYS = tuple(f"{part}_gib" for part in PARTS) + ("total_gib",)

# Runs a command and prints its exit code, output, wall time and peak RSS as JSON.
# A fresh process, so RUSAGE_CHILDREN holds that command's tree alone (pytest's own
# children from earlier tests would otherwise set the maximum).
_MEASURE = textwrap.dedent(
    """
    import json, resource, subprocess, sys, time
    t0 = time.perf_counter()
    proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({
        "rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
        "wall_s": time.perf_counter() - t0,
        "peak_rss": maxrss * (1 if sys.platform == "darwin" else 1024),
    }))
    """
)


def _rss_bytes() -> int:
    """This process's resident set now (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _compose(*overrides: str):
    return compose_config(*overrides)


def _num_params(model: str) -> int:
    cfg = _compose(f"model={model}")
    return model_spec(cfg).num_params(model_config(cfg))


def _check_estimate(estimate: dict, unit_params: list[int], model: str, world: int):
    """The estimate against the preset's parameter count and the plan's units (fp32:
    4 bytes per parameter, AdamW: 2 states; the parts add up to the total; the parts
    themselves are checked byte for byte in tests/test_planner.py)."""
    n = _num_params(model)
    assert sum(unit_params) == n  # every parameter is in exactly one unit
    assert estimate["params_gib"] == pytest.approx(4 * n / world / GIB, rel=0.01)
    assert estimate["optimizer_gib"] == pytest.approx(2 * estimate["params_gib"])
    assert estimate["total_gib"] == pytest.approx(
        sum(estimate[k] for k in ESTIMATE_KEYS[:-1])
    )


@pytest.mark.slow
def test_plan_only_13b_subprocess_allocates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "train.py",
        "trainer.plan_only=true",
        "model=gpt_13b",
        "trainer.devices=8",
        f"hydra.run.dir={run_dir}",
        "logger=none",
    ]
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["rc"] == 0, result["stderr"][-3000:]

    # The plan and the estimate are printed.
    assert "wrap plan:" in result["stdout"]
    assert "(world size 8)" in result["stdout"]
    assert "per-rank training peak estimate" in result["stdout"]
    assert "activations (saved)" in result["stdout"]
    # planned as this command's 8 ranks would start: forked from its rank server
    forked = (PROCESS_BYTES["cpu"] - FORKED_RANK_SAVING["cpu"]) / MIB
    assert re.search(rf"process baseline +{forked:.1f} MiB", result["stdout"])

    # 12.9B fp32 parameters are 47.9 GiB; planning on meta stays at the runtime's size.
    model_bytes = 4 * _num_params("gpt_13b")
    assert model_bytes > 47 * GIB
    assert result["peak_rss"] < 1.5 * GIB, (
        f"peak RSS {result['peak_rss'] / GIB:.2f} GiB"
    )
    assert result["peak_rss"] < model_bytes / 16

    summary = json.loads((run_dir / "summary.json").read_text())
    plan = json.loads((run_dir / "wrap_plan.json").read_text())
    assert summary["world_size"] == 8
    assert summary["wrap_units"] == len(plan)
    _check_estimate(summary, [row["params"] for row in plan], "gpt_13b", 8)
    # ~47.9 GiB over 8 ranks; 2 sequences of 2048 tokens per rank, 40 fp32 blocks
    # of 16 x 4 bytes x 5120 wide activations per token: 50 GiB.
    assert 5.9 < summary["params_gib"] < 6.1
    assert summary["activations_gib"] == pytest.approx(50, rel=0.01)

    # No rank started, no step ran.
    assert not (run_dir / "ranks").exists()
    metrics_file = run_dir / "metrics.jsonl"
    lines = metrics_file.read_text().split() if metrics_file.exists() else []
    assert not any("loss" in json.loads(line) for line in lines)


@pytest.mark.parametrize(
    ("model", "world"), [("llama3_8b", 8), ("gpt_70b", 64), ("small", 2)]
)
def test_plan_only_in_process(tmp_path, capsys, model, world):
    from src.planner.report import plan_only

    cfg = _compose(
        "trainer.plan_only=true",
        f"model={model}",
        f"trainer.devices={world}",
        "logger=none",
    )
    rss_before = _rss_bytes()
    peak_resets = metrics._reset_cpu_peak_rss()  # False where the kernel cannot
    plan = plan_only(resolve(cfg), str(tmp_path))
    peak = metrics.cpu_peak_rss_bytes()
    printed = capsys.readouterr().out

    assert not dist.is_initialized()
    assert f"(world size {world})" in printed
    assert "per-rank training peak estimate" in printed
    assert plan.world_size == world
    assert plan.total_numel == _num_params(model)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["wrap_units"] == len(plan.units)
    _check_estimate(summary, [u.numel for u in plan.units], model, world)
    # the predicted step under the estimate, from this CPU's profile
    assert "step time (predicted from cpu: " in printed
    step = re.search(
        r"\n  step +([\d,.]+) ms  ([\d,]+) tokens/s, ([\d,]+) per device", printed
    )
    assert step, printed[-2000:]
    tokens_per_s = summary["predicted_tokens_per_s"]
    assert float(step.group(1).replace(",", "")) == pytest.approx(
        summary["predicted_step_time_s"] * 1e3, abs=0.01
    )
    assert int(step.group(2).replace(",", "")) == round(tokens_per_s)
    assert int(step.group(3).replace(",", "")) == round(tokens_per_s / world)
    if peak_resets and rss_before:
        # Planning on meta: the peak grows by far less than one rank's share of the
        # parameters (llama3_8b: 3.7 GiB per rank; gpt_70b: 4 GiB).
        assert peak - rss_before < 0.25 * GIB, f"{(peak - rss_before) / GIB:.2f} GiB"


def test_trainer_threshold_is_not_truncated(tmp_path):
    """``sharding.min_params`` reaches auto_wrap as a number: half a parameter above a
    block's size, no block is a unit (``int()`` truncation used to make them units)."""
    from src.planner.report import plan_only

    def units(min_params: float) -> dict[str, int]:
        cfg = _compose("trainer.plan_only=true", "model=small", "logger=none")
        cfg.sharding.min_params = min_params
        plan = plan_only(resolve(cfg), str(tmp_path))
        return {u.path: u.numel for u in plan.units}

    block = units(1.5e5)["h.0"]  # the default makes each block a unit
    assert "h.0" in units(block)
    assert "h.0" not in units(block + 0.5)


def test_plan_only_pipeline_plans_each_stage_allocating_nothing(tmp_path, capsys):
    """PP8 x TP8 x FSDP8 of llama3_70b on 512 ranks: each pp rank's stages planned
    (no whole-model build), the worst named in the output and the summary; the peak
    grows by far less than one stage's parameters (8.8B on each pp rank)."""
    from src.planner.report import plan_only
    from tests.test_planner import LLAMA_PP

    cfg = _compose("trainer.plan_only=true", *LLAMA_PP)
    rss_before = _rss_bytes()
    peak_resets = metrics._reset_cpu_peak_rss()
    plan = plan_only(resolve(cfg), str(tmp_path))
    peak = metrics.cpu_peak_rss_bytes()
    printed = capsys.readouterr().out
    assert "pipeline stages (1f1b, 8 micro-batches per micro-step" in printed
    assert printed.count("  pp rank ") == 8
    assert "worst stage: pp rank 0, " in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["worst_pp_rank"] == 0
    assert len(summary["stage_total_gib"]) == 8
    assert summary["total_gib"] == max(summary["stage_total_gib"])
    assert summary["stage_total_gib"] == sorted(summary["stage_total_gib"])[::-1]
    # the worst stage's own plan: the embedding and blocks 0-9 on 64 ranks
    assert [u.path for u in plan.units] == ["", *(f"layers.{i}" for i in range(10))]
    assert plan.world_size == 64
    if peak_resets and rss_before:
        assert peak - rss_before < 0.25 * GIB, f"{(peak - rss_before) / GIB:.2f} GiB"
