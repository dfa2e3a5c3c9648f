"""The profiler window and the run's log, end to end: one ``train.py`` run on 2 CPU
ranks with ``trainer.profile=true`` (src/observe/profiling.py, src/observe/logs.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import HANG_S
from tests.wandb_offline import read_wandb_offline_records

ROOT = Path(__file__).resolve().parent.parent


def _names(trace: dict) -> set[str]:
    return {e.get("name", "") for e in trace["traceEvents"] if e.get("ph") == "X"}


@pytest.mark.slow
def test_profile_window_traces_memory_table_artifact_and_train_log(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "trainer.profile=true",
            "trainer.max_steps=12",
            "trainer.log_every=4",
            "trainer.val_every=12",
            "trainer.val_batches=1",
            "data=synthetic",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    prof = tmp_path / "profile"

    # One Chrome trace per rank, with FSDP2's collectives and every block's ranges.
    for rank in (0, 1):
        names = _names(json.loads((prof / f"rank{rank}.pt.trace.json").read_text()))
        assert any(n.startswith("FSDP::all_gather (h.") for n in names), rank
        assert any(n.startswith("FSDP::post_backward_reduce (h.") for n in names)
        assert "c10d::_reduce_scatter_base_" in names
        for block in range(4):  # model=small: 4 blocks, each a unit
            assert f"unit:h.{block}:forward" in names
            assert f"unit:h.{block}:backward" in names
        # The CPU memory timeline: bytes in use over the window.
        mem = json.loads((prof / f"rank{rank}.memory_timeline.json").read_text())
        assert len(mem["times_us"]) == len(mem["allocated_bytes"]) > 100
        assert mem["times_us"] == sorted(mem["times_us"])
        assert mem["peak_bytes"] == max(mem["allocated_bytes"]) > 0

    # Rank 0's table, on the console and in train.log; the rows are plausible.
    log = (tmp_path / "train.log").read_text()
    head = re.search(r"profile of steps 5-7 \(rank 0, ([\d.]+) ms/step\)", run.stdout)
    assert head and head.group(0) in log
    step_ms = float(head.group(1))
    rows = {r["part"]: r for r in json.loads((tmp_path / "profile.json").read_text())}
    for part in ("forward h.0", "backward h.3", "all-gather", "reduce-scatter"):
        assert 0 < rows[part]["ms_per_step"] <= step_ms, part
        assert f"| {part} | " in run.stdout and f"| {part} | " in log
    assert 0 < rows["optimizer step"]["ms_per_step"] < step_ms
    assert (prof / "summary.md").read_text().startswith(head.group(0))

    # The folder as a wandb artifact of the (offline) run.
    artifacts = [
        r["artifact"]
        for r in read_wandb_offline_records(tmp_path)
        if r.get("type") == "artifact" and r["artifact"]["type"] == "profile"
    ]
    assert len(artifacts) == 1
    files = {c["path"] for c in artifacts[0]["manifest"]["contents"]}
    assert {"rank0.pt.trace.json", "rank1.pt.trace.json", "summary.md"} <= files

    # train.log holds what the console showed, minus the progress bar; the
    # per-interval line is in train.log though the bar showed it on the console.
    bar = re.compile(r"^train:\s+\d+%")
    shown = [
        line.strip()
        for line in (run.stdout + run.stderr).replace("\r", "\n").splitlines()
        if line.strip() and not bar.match(line.strip())
    ]
    assert "finished 12 steps" in run.stdout
    missing = [line for line in shown if line not in log]
    assert not missing, missing
    assert re.search(r"step 8: loss [\d.]+, [\d,]+ tok/s, .*mfu .*lr ", log)
    assert "step 8: loss" not in run.stdout
    assert re.search(r"run: 0\.\d+M params \| fsdp2, 5 units \| fp32 \|", run.stdout)


def test_unit_ranges_pass_a_dtensor_output_that_no_gradient_reaches(one_rank_mesh):
    """A root returning (vocabulary-sharded logits, loss), as under tensor
    parallelism's loss_parallel: its backward range closes and the backward runs
    (autograd's zeros for the logits were plain tensors and failed in the DTensor
    graph)."""
    import torch
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from src.observe.profiling import UnitRanges

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            weight = distribute_tensor(torch.randn(4, 8), one_rank_mesh, [Shard(1)])
            self.weight = nn.Parameter(weight)

        def forward(self, x, targets):
            logits = x.redistribute(one_rank_mesh, [Replicate()]) @ self.weight
            loss = nn.functional.cross_entropy(logits, targets)
            return logits, loss.to_local().clone()

    head = Head()
    ranges = UnitRanges({"": head})
    x = distribute_tensor(torch.randn(3, 4), one_rank_mesh, [Shard(0)])
    try:
        with loss_parallel():
            _, loss = head(x.requires_grad_(), torch.tensor([1, 2, 3]))
            loss.backward()
        assert not ranges.open  # the backward range opened and closed
    finally:
        ranges.remove()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()
