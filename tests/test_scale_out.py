"""Scaling out: HSDP on a 2-D mesh, checkpoints across layouts, two torchrun agents.

Every scenario trains the same tiny GPT on the same global batches (fp32, no dropout),
so each step's global loss must agree with one-process training within 1e-5 whatever
the layout. Starting ranks (importing torch) is what costs time on a small machine, so
the scenarios share as few launches as possible (module-scoped fixtures): one torchrun
pair, one 4-rank and one 2-rank launch, and 1-rank runs in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor, Replicate, Shard

from src.config.run_plan import resolve
from src.config.validate import validate
from src.models import GPT, GPTConfig
from src.planner.report import plan_only
from src.sharding import (
    ParallelLayout,
    build_backend,
    build_sharded_model,
    wrap,
    wrap_plan,
)
from src.trainer.launch import run_rank
from src.trainer.loop import train
from tests.distributed import HANG_S, free_port, run_distributed
from tests.test_train import ROOT, make_cfg, read_rows

# 4 steps of model=tiny on 8 sequences a step; checkpoints at steps 2 and 4.
RUN = [
    "model=tiny",
    "logger=none",
    "data=synthetic",
    "data.num_tokens=20000",
    "trainer.max_steps=4",
    "trainer.batch_size=8",
    "trainer.log_every=1",
    "trainer.val_every=0",
    "trainer.warmup_steps=2",
    "trainer.progress=false",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
    "trainer.ckpt_every=2",
    "sharding.min_params=2e4",
]
HSDP = ["sharding.replicate=2"]
FULL = ["sharding.replicate=1"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


def resume_from(root: Path, name: str) -> list[str]:
    """Continue from run ``name``'s step-2 checkpoint, writing no checkpoint of its own."""
    step_2 = root / name / "checkpoints" / "step_00000002"
    return [
        f"trainer.resume={step_2}",
        "trainer.ckpt_every=0",
        "trainer.ckpt_final=false",
    ]


def _train_runs(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> None:
    """Train each named run in turn on the same process group."""
    for name, overrides in runs.items():
        cfg = make_cfg(*RUN, *overrides)
        train(cfg, f"{root}/{name}", torch.device("cpu"), resolve(cfg))


def _layout_facts(rank: int, world: int) -> dict:
    """What HSDP actually built: mesh, placements, FSDP1 strategy, local bytes."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    facts = {}
    for name in ("fsdp2", "fsdp1"):
        layout = ParallelLayout(world, dp_replicate=2)
        backend = build_backend(name, "fp32", "cpu", layout=layout)
        model = build_sharded_model(lambda: wrap(GPT(cfg)), backend, None)
        if name == "fsdp2":
            weight = model.lm_head.weight
            facts["mesh"] = weight.device_mesh.mesh_dim_names
            facts["mesh_shape"] = tuple(weight.device_mesh.shape)
            facts["placements"] = weight.placements
            facts["local_bytes"] = sum(
                p.to_local().numel() * p.element_size() for p in model.parameters()
            )
            facts["plan_bytes"] = wrap_plan(model, layout).bytes_per_rank()
            facts["all_dtensor"] = all(
                isinstance(p, DTensor) for p in model.parameters()
            )
        else:
            facts["fsdp1_strategies"] = {
                m.sharding_strategy
                for m in model.modules()
                if isinstance(m, FullyShardedDataParallel)
            }
    return facts


def _four_ranks(rank: int, world: int, root: str) -> dict:
    facts = _layout_facts(rank, world)
    _train_runs(
        rank,
        world,
        root,
        {
            "hsdp": HSDP,
            "full4": FULL,
            "hsdp_fsdp1": ["sharding=fsdp1", *HSDP, "trainer.ckpt_every=0"],
            "full4_from_hsdp": FULL + resume_from(Path(root), "hsdp"),
            "hsdp_from_one": HSDP + resume_from(Path(root), "one"),
            "hsdp_from_two": HSDP + resume_from(Path(root), "torchrun"),
            "hsdp_from_full4": HSDP + resume_from(Path(root), "full4"),
        },
    )
    return facts


def one_rank(root: Path, name: str, *overrides: str) -> None:
    """``trainer.devices=1``: the rank runs in this process, as train.py runs it."""
    cfg = make_cfg(*RUN, "sharding=none", "trainer.devices=1", *overrides)
    run_rank(cfg, str(root / name), validate(cfg))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scale_out")


@pytest.fixture(scope="module")
def torchrun_run(root) -> list[str]:
    """train.py under two torchrun agents (one rank each, as on two nodes) that meet
    through a c10d rendezvous on localhost; returns the agents' output on failure."""
    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
            + ["--nproc_per_node=1", "--rdzv_backend=c10d"]
            + [f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=multinode"]
            + [f"--rdzv_conf=is_host={int(node == 0)}"]
            + [str(ROOT / "train.py"), *RUN, f"hydra.run.dir={root / 'torchrun'}"],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=HANG_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    return [out if a.returncode else "" for a, out in zip(agents, outputs, strict=True)]


@pytest.fixture(scope="module")
def layouts(root, torchrun_run) -> dict:
    """Every layout's run, in the order the checkpoints they resume from are written:
    1 rank, then 4 ranks (HSDP 2x2, 4-way full; resuming from 1, 2 and 4 ranks), then
    2 ranks and 1 rank resuming from HSDP. The 2-rank writer is the torchrun run."""
    assert not any(torchrun_run), "\n".join(torchrun_run)
    one_rank(root, "one")
    facts = run_distributed(_four_ranks, 4, str(root))[0]
    run_distributed(
        _train_runs,
        2,
        str(root),
        {
            "two": FULL,
            "two_from_hsdp": resume_from(root, "hsdp"),
            # FSDP1 with every rank a replica (a shard group of one rank)
            "two_fsdp1_replicas": ["sharding=fsdp1", *HSDP, "trainer.ckpt_every=0"],
        },
    )
    one_rank(root, "one_from_hsdp", *resume_from(root, "hsdp"))
    return {"facts": facts, "ref": losses(root / "one")}


def assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])


@pytest.mark.slow
def test_hsdp_matches_one_rank_and_full_sharding(root, layouts):
    ref = layouts["ref"]
    assert len(ref) == 4 and len(set(ref.values())) == 4
    for name in ("two", "hsdp", "full4", "hsdp_fsdp1", "two_fsdp1_replicas"):
        assert_close(losses(root / name), ref, range(1, 5))
    facts = layouts["facts"]
    # FSDP2: a 2-D (replicate, shard) mesh, parameters replicated over dim 0 and
    # sharded over dim 1; FSDP1: the hybrid strategy on every unit.
    assert facts["mesh"] == ("dp_replicate", "dp_shard") and facts["mesh_shape"] == (
        2,
        2,
    )
    assert tuple(facts["placements"]) == (Replicate(), Shard(0))
    assert facts["all_dtensor"]
    assert facts["fsdp1_strategies"] == {ShardingStrategy.HYBRID_SHARD}
    # The plan's bytes per rank are those of 2-way (shard group) sharding, as built.
    assert facts["plan_bytes"] == facts["local_bytes"]


@pytest.mark.slow
def test_checkpoints_load_across_layouts(root, layouts):
    for name in (
        "full4_from_hsdp",  # HSDP 2x2 -> 4-way full sharding, 2 ranks, 1 rank
        "two_from_hsdp",
        "one_from_hsdp",
        "hsdp_from_full4",  # and the reverse
        "hsdp_from_two",
        "hsdp_from_one",
    ):
        assert_close(losses(root / name), layouts["ref"], (3, 4))


@pytest.mark.slow
def test_two_torchrun_agents_train_like_a_local_two_rank_run(root, layouts):
    run_dir = root / "torchrun"
    # Same world size, same reduction order: the very same losses as 2 local ranks.
    assert losses(run_dir) == losses(root / "two")
    # Both ranks wrote their shards into the one run dir.
    step_4 = run_dir / "checkpoints" / "step_00000004"
    assert (step_4 / "COMPLETE").is_file()
    assert sorted(p.name for p in (step_4 / "rng").iterdir()) == [
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]
    assert len(list(step_4.glob("*.distcp"))) == 2


def test_plan_only_shows_the_2d_layout_and_shard_group_bytes(tmp_path, capsys):
    # Twice the global batch on twice the ranks: the same micro-batch per rank, so
    # the two estimates peak at the same moment and their parts compare one to one.
    cfg = make_cfg("model=tiny", "trainer.devices=8", "trainer.batch_size=32", *HSDP)
    hsdp = plan_only(resolve(cfg), str(tmp_path / "hsdp"))
    assert "world size 8: 2 x 4 mesh (replicate x shard)" in capsys.readouterr().out
    cfg = make_cfg("model=tiny", "trainer.devices=4")
    full = plan_only(resolve(cfg), str(tmp_path / "full"))
    # 8 ranks as 2 x 4 hold per rank what 4-way full sharding holds.
    assert hsdp.bytes_per_rank() == full.bytes_per_rank()
    summary = json.loads((tmp_path / "hsdp" / "summary.json").read_text())
    assert (summary["world_size"], summary["replicate"], summary["shard_size"]) == (
        8,
        2,
        4,
    )
    # The estimate's sharded parts are those of 4-way sharding too.
    full_summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    # (Gradients are counted at the peak's moment: here the loss backward, before
    # any unit has its gradients, so they are 0 in both.)
    for part in ("params_gib", "grads_gib", "optimizer_gib"):
        assert summary[part] == full_summary[part], part
    assert summary["params_gib"] > 0 and summary["optimizer_gib"] > 0
