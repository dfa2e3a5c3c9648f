"""The CUDA path, run for real where a GPU is present (``pytest -m cuda``; skipped
elsewhere). ``bench/gpu_check.py`` runs exactly this subset first on a lent GPU machine:
NCCL, the CUDA allocator statistics, bf16 autocast on the GPU, the datasheet peak
behind MFU and the CPU-offloaded export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from src.observe.metrics import lookup_gpu_peak_tflops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ROOT = Path(__file__).resolve().parents[1]


def train(run_dir: Path, *overrides: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline"}
    out = subprocess.run(
        [sys.executable, "train.py", "model=llama_tiny", "data=synthetic"]
        + ["logger=none", "trainer.max_steps=8", "trainer.log_every=4"]
        + ["trainer.val_every=0", "trainer.progress=false", f"hydra.run.dir={run_dir}"]
        + list(overrides),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads((run_dir / "summary.json").read_text())


def test_this_gpu_has_a_datasheet_peak():
    """MFU on this GPU uses the datasheet, not a guess (add the GPU to the table)."""
    name = torch.cuda.get_device_name()
    assert lookup_gpu_peak_tflops(name, torch.bfloat16), name


def test_bf16_training_on_one_gpu_reports_cuda_figures(tmp_path):
    """NCCL process group, bf16 autocast on the GPU, the CUDA allocator's peak and an
    MFU against the datasheet peak, and the export gathered to host memory."""
    summary = train(
        tmp_path / "run",
        "trainer.devices=1",
        "precision=bf16_mixed",
        "trainer.export=true",
    )
    assert summary["loss"] < 5.6  # from ln(256) = 5.55 at init
    assert (
        0
        < summary["peak_mem_gib"]
        < torch.cuda.get_device_properties(0).total_memory / 2**30
    )
    assert 0 < summary["mfu"] < 1
    from src.checkpoint.export import load_consolidated

    state = load_consolidated(tmp_path / "run" / "model.safetensors")
    assert all(t.device.type == "cpu" for t in state.values())
    assert sum(t.numel() for n, t in state.items()) >= summary["num_params"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_match_one(tmp_path):
    """Sharded over 2 GPUs (NCCL) the losses equal one GPU's (fp32, TF32 off)."""
    one = train(tmp_path / "one", "trainer.devices=1")
    two = train(tmp_path / "two", "trainer.devices=2")
    assert abs(one["loss"] - two["loss"]) < 1e-4


def test_profile_window_writes_traces_and_the_cuda_memory_snapshot(tmp_path):
    """trainer.profile on CUDA: a Chrome trace with the units' ranges and the
    allocator's history over the window as a memory_viz pickle."""
    from bench.gpu_check import PROFILE, profile_problems

    train(tmp_path / "run", "trainer.devices=1", *PROFILE)
    assert profile_problems(tmp_path / "run", cuda=True) == []


def test_cuda_oom_writes_a_snapshot_and_stops_with_one_line(tmp_path):
    """A run that cannot fit stops with one line naming the OOM snapshot."""
    from bench.gpu_check import OOM, oom_problems

    run_dir = tmp_path / "oom"
    out = subprocess.run(
        [sys.executable, "train.py", *OOM, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert oom_problems(run_dir, out.stdout + out.stderr, out.returncode) == []
