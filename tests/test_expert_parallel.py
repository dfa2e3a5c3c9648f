"""Expert parallelism (src/sharding/expert_parallel.py) on the native MoE family, for
real on 4 CPU ranks (one launch that checks several things together):

- EP2 x FSDP2 (each expert on one of 2 ranks, FSDP-sharded over the other 2) trains
  with the fp32 losses of one rank within 1e-5, routing included (the
  auxiliary-loss-free bias and per-sequence capacity are on);
- its checkpoint resumes on FSDP4 alone (no expert parallelism), and that run's
  checkpoint resumes on EP2 again, each continuing the losses within 1e-5: experts
  are stored as whole ``[num_experts, ...]`` tensors whatever the layout;
- the MoE metrics are in metrics.jsonl, the same on every layout;
- the planner's peak per rank is within 10% of the measured one on the EP run.

The routing, grouped mm and bias update are unit-tested in tests/test_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from src.config.validate import validate
from src.resolved import resolve
from src.trainer.launch import prepare, run_rank, run_ranks
from src.trainer.loop import train
from tests.distributed import HANG_S
from tests.test_config import make_cfg

RUN = [
    "model=moe_tiny",
    "model.max_seq_len=32",
    "model.load_balance=aux_free",
    "model.bias_update_rate=0.01",
    "model.capacity_factor=1.5",
    "sharding.policy=block",
    "data=synthetic",
    "data.num_tokens=20000",
    "logger=none",
    "trainer.max_steps=4",
    "trainer.batch_size=8",
    "trainer.log_every=1",
    "trainer.val_every=0",
    "trainer.progress=false",
    "trainer.peak_tflops=1",
    "trainer.lr=3e-3",
    "trainer.warmup_steps=1",
]


def _cfg(*overrides: str):
    cfg = make_cfg(*RUN, *overrides)
    validate(cfg)
    return cfg


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


EP = ("sharding.expert_parallel=2", "trainer.ckpt_every=2")


def _layouts(device: torch.device, root: str, planned) -> dict:
    """EP2 x FSDP2 for 4 steps (checkpoints at 2 and 4; ``planned``: its config and
    run object as the launcher prepared them, with the planner's peak), FSDP4
    resumed from its step 2 (checkpoint each step), EP2 resumed from that run's
    step 3."""
    root_dir = Path(root)
    cfg, resolved = planned
    summaries = {"ep": train(cfg, str(root_dir / "ep"), device, resolved)}
    runs = {
        "fsdp": (
            "sharding.expert_parallel=1",
            "trainer.ckpt_every=1",
            f"trainer.resume={root_dir / 'ep' / 'checkpoints' / 'step_00000002'}",
        ),
        "back": (
            "sharding.expert_parallel=2",
            f"trainer.resume={root_dir / 'fsdp' / 'checkpoints' / 'step_00000003'}",
        ),
    }
    for name, overrides in runs.items():
        cfg = _cfg("trainer.devices=4", *overrides)
        summaries[name] = train(cfg, str(root_dir / name), device, resolve(cfg))
    return summaries


def test_expert_parallel_equals_one_rank_and_checkpoints_cross_layouts(tmp_path):
    ref_dir = tmp_path / "one"
    cfg = _cfg("trainer.devices=1")
    run_rank(cfg, str(ref_dir), validate(cfg))
    cfg = _cfg("trainer.devices=4", *EP)
    planned = prepare(cfg, validate(cfg), user_keys=set())
    # as train.py starts its ranks (the planner models those processes)
    summary = run_ranks(_layouts, 4, HANG_S, str(tmp_path), planned)["ep"]

    one, ep = _rows(ref_dir), _rows(tmp_path / "ep")
    fsdp, back = _rows(tmp_path / "fsdp"), _rows(tmp_path / "back")
    assert sorted(ep) == [1, 2, 3, 4] and sorted(fsdp) == [3, 4] and sorted(back) == [4]
    for step in (1, 2, 3, 4):
        assert abs(ep[step]["loss"] - one[step]["loss"]) < 1e-5, step
    for step in (3, 4):  # EP2 -> FSDP4
        assert abs(fsdp[step]["loss"] - ep[step]["loss"]) < 1e-5, step
    assert abs(back[4]["loss"] - ep[4]["loss"]) < 1e-5  # FSDP4 -> EP2

    # routing metrics: in metrics.jsonl, counted over all ranks, the same on every
    # layout (tokens per expert are whole numbers: equal, not close)
    E, tokens = 8, 8 * 32 * 2  # experts, assignments per step (batch x T x top_k)
    for step in (1, 4):
        row = ep[step]
        for layer in (0, 1):
            p = f"moe/layer{layer}/"
            assert row[p + "tokens_mean"] == tokens / E
            assert row[p + "tokens_max"] == one[step][p + "tokens_max"]
            assert row[p + "dropped"] == one[step][p + "dropped"]
            assert abs(row[p + "entropy"] - one[step][p + "entropy"]) < 1e-5
        assert row["moe/load_max_over_mean"] >= 1.0
    assert back[4]["moe/layer1/tokens_max"] == ep[4]["moe/layer1/tokens_max"]

    # the planner's closing line on the EP run: within 10% of the measured peak
    planned, measured = summary["planned_peak_gib"], summary["peak_mem_gib"]
    assert abs(measured / planned - 1) < 0.10, (planned, measured)
