"""Checkpoints: round trips, crash safety, pruning, resharding (2 -> 1, 1 -> 2), export.

Multi-process tests run FSDP2 / FSDP1 for real on 2 gloo ranks; single-process tests
use a plain module without a process group (``sharding=none``).
"""

from __future__ import annotations

import json
import pickle
import random
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from src.checkpoint.damage import CheckpointError
from src.checkpoint.dcp import Checkpointer
from src.checkpoint.export import export_consolidated, load_consolidated
from src.checkpoint.folders import complete_checkpoints, resolve_resume
from tests.distributed import HANG_S, run_distributed

D_IN, D_OUT, VOCAB = 8, 4, 32


# ------------------------------------------------------------------- helpers


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, D_OUT)
    )


class TiedLM(nn.Module):
    """Embedding and output head share one weight (as in GPT)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.wte(idx)))


def shard_fsdp2(model: nn.Module) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def make_optim(model: nn.Module, lr: float = 1e-2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return optimizer, scheduler


def train(model, optimizer, scheduler, steps, rank: int = 0) -> list[float]:
    """Deterministic per-(step, rank) batches, like the stateless data pipeline."""
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, D_IN, generator=g), torch.randn(4, D_OUT, generator=g)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_moments(model: nn.Module, optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{k}": full(optimizer.state[p][k])
        for n, p in model.named_parameters()
        for k in ("exp_avg", "exp_avg_sq", "step")
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------- multi-process
# Every 2-rank scenario runs in one launch (starting gloo ranks costs far more than the
# scenarios); each test below asserts on its own scenario's per-rank results.


def _fsdp2_round_trip(rank: int, directory: Path) -> dict:
    ckpt = Checkpointer(directory)
    model = shard_fsdp2(make_model(0))
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(3), rank)
    ckpt.save(3, model, optimizer, scheduler, extra={"tokens_seen": 384})
    saved = {"params": full_params(model), "moments": full_moments(model, optimizer)}
    draw = torch.rand(4)  # what the RNG gives right after the save
    losses = train(model, optimizer, scheduler, range(3, 6), rank)
    final = full_params(model)

    model2 = shard_fsdp2(make_model(1))
    optimizer2, scheduler2 = make_optim(model2, lr=0.5)
    info = ckpt.load(ckpt.latest(), model2, optimizer2, scheduler2)
    restored = {
        "params": full_params(model2),
        "moments": full_moments(model2, optimizer2),
    }
    draw2 = torch.rand(4)
    losses2 = train(model2, optimizer2, scheduler2, range(3, 6), rank)
    return dict(
        info=info,
        saved=saved,
        restored=restored,
        draws=(draw, draw2),
        losses=(losses, losses2),
        final=(final, full_params(model2)),
        lrs=(scheduler.get_last_lr(), scheduler2.get_last_lr()),
    )


def _crash_during_save(rank: int, directory: Path) -> dict:
    ckpt = Checkpointer(directory, keep_last=2)
    model = shard_fsdp2(make_model(0))
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2), rank)
    ckpt.save(2, model, optimizer, scheduler)
    at_2 = full_params(model)
    train(model, optimizer, scheduler, range(2, 3), rank)

    # 1) rank 1's storage writer dies after its first tensor.
    write_item, calls = dcp_fs._write_item, []

    def dying_write_item(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) > 1:
            raise OSError("disk full (injected)")
        return write_item(*args, **kwargs)

    dcp_fs._write_item = dying_write_item
    try:
        ckpt.save(3, model, optimizer, scheduler)
        writer_crash = None
    except RuntimeError as exc:
        writer_crash = str(exc)
    finally:
        dcp_fs._write_item = write_item
    latest_after_writer_crash = ckpt.latest()

    # 2) every shard written, then a failure before the publishing rename.
    def failing_publish(*args):
        raise RuntimeError("killed before publish (injected)")

    if rank == 0:
        ckpt._publish = failing_publish
    try:
        ckpt.save(3, model, optimizer, scheduler)
        publish_crash = None
    except RuntimeError as exc:
        publish_crash = str(exc)
    if rank == 0:
        del ckpt._publish
    leftovers = sorted(p.name for p in directory.iterdir())
    latest_after_publish_crash = ckpt.latest()

    model2 = shard_fsdp2(make_model(1))
    optimizer2, scheduler2 = make_optim(model2)
    info = ckpt.load(ckpt.latest(), model2, optimizer2, scheduler2)
    restored = full_params(model2)

    # The next good save publishes and sweeps the crashed tmp dir away.
    ckpt.save(4, model, optimizer, scheduler)
    return dict(
        writer_crash=writer_crash,
        publish_crash=publish_crash,
        latest_after_writer_crash=latest_after_writer_crash,
        latest_after_publish_crash=latest_after_publish_crash,
        leftovers=leftovers,
        info=info,
        params=(at_2, restored),
        after_next_save=sorted(p.name for p in directory.iterdir()),
    )


def _save_and_export(rank: int, directory: Path) -> dict:
    model = shard_fsdp2(make_model(0))
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2), rank)
    Checkpointer(directory).save(2, model, optimizer, scheduler)
    export_consolidated(model, directory / "model.safetensors")

    tied = TiedLM(0)
    fully_shard(tied.proj)
    fully_shard(tied)  # the tie lives in the root unit, never split
    export_consolidated(tied, directory / "tied.safetensors")
    return dict(
        params=full_params(model),
        moments=full_moments(model, optimizer),
        tied=full_params(tied),
    )


def _load_on_two(rank: int, directory: Path) -> dict:
    model = shard_fsdp2(make_model(1))
    optimizer, scheduler = make_optim(model)
    with pytest.warns(UserWarning, match="RNG states not restored"):
        info = Checkpointer(directory).load(
            directory / "step_00000002", model, optimizer, scheduler
        )
    return dict(
        info=info,
        params=full_params(model),
        moments=full_moments(model, optimizer),
        local_rows=model[0].weight.to_local().shape[0],
        losses=train(model, optimizer, scheduler, range(2, 4), rank=0),
    )


def _fsdp1_round_trip(rank: int, directory: Path) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def build(seed):
        return FSDP(
            make_model(seed),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
            device_id=torch.device("cpu"),  # FSDP1 cannot infer a CPU device
        )

    ckpt = Checkpointer(directory)
    model = build(0)
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2), rank)
    ckpt.save(2, model, optimizer, scheduler)
    losses = train(model, optimizer, scheduler, range(2, 4), rank)
    export_consolidated(model, directory / "fsdp1.safetensors")

    model2 = build(1)
    optimizer2, scheduler2 = make_optim(model2)
    info = ckpt.load(ckpt.latest(), model2, optimizer2, scheduler2)
    losses2 = train(model2, optimizer2, scheduler2, range(2, 4), rank)
    with FSDP.summon_full_params(model), FSDP.summon_full_params(model2):
        params = [
            {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in m.named_parameters()
            }
            for m in (model, model2)
        ]
    return dict(info=info, losses=(losses, losses2), params=params)


def _ddp_to_fsdp2(rank: int, directory: Path) -> dict:
    """A checkpoint does not depend on the backend that wrote it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(make_model(0))
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2), rank)
    path = Checkpointer(directory).save(2, model, optimizer, scheduler)

    sharded = shard_fsdp2(make_model(1))
    optimizer2, scheduler2 = make_optim(sharded)
    info = Checkpointer(directory).load(path, sharded, optimizer2, scheduler2)
    return dict(
        info=info,
        params=(full_params(model.module), full_params(sharded)),
        moments=(
            full_moments(model.module, optimizer),
            full_moments(sharded, optimizer2),
        ),
    )


def _async_save(rank: int, directory: Path) -> dict:
    """An asynchronous save whose writes are held back until released: training goes
    on meanwhile, and nothing is published before the writes finished."""
    ckpt = Checkpointer(directory, keep_last=2, async_save=True)
    model = shard_fsdp2(make_model(0))
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2), rank)
    ckpt.save(2, model, optimizer, scheduler)
    train(model, optimizer, scheduler, range(2, 4), rank)  # waits for step 2 first
    at_4 = full_params(model), full_moments(model, optimizer)

    release, write_item = threading.Event(), dcp_fs._write_item

    def held_write_item(*args, **kwargs):
        release.wait()
        return write_item(*args, **kwargs)

    dcp_fs._write_item = held_write_item
    try:
        path = ckpt.save(4, model, optimizer, scheduler)
        losses = train(model, optimizer, scheduler, range(4, 6), rank)
        in_flight = {
            "published": path.exists(),
            "latest": ckpt.latest().name,
            "tmp": sorted(p.name for p in directory.iterdir()),
        }
        release.set()
        ckpt.wait()
    finally:
        release.set()
        dcp_fs._write_item = write_item
    model2 = shard_fsdp2(make_model(1))
    optimizer2, scheduler2 = make_optim(model2)
    info = ckpt.load(ckpt.latest(), model2, optimizer2, scheduler2)
    return {
        "in_flight": in_flight,
        "losses_while_writing": losses,
        "info": info,
        "saved": at_4,
        "restored": (full_params(model2), full_moments(model2, optimizer2)),
        "moved_on": any(
            not torch.equal(at_4[0][k], v) for k, v in full_params(model).items()
        ),
    }


def _two_rank_scenarios(rank: int, world_size: int, root: str) -> dict:
    root = Path(root)
    return {
        "round_trip": _fsdp2_round_trip(rank, root / "round_trip"),
        "crash": _crash_during_save(rank, root / "crash"),
        "export": _save_and_export(rank, root / "export"),
        "one_to_two": _load_on_two(rank, root / "one_rank"),
        "fsdp1": _fsdp1_round_trip(rank, root / "fsdp1"),
        "ddp": _ddp_to_fsdp2(rank, root / "ddp"),
        "async": _async_save(rank, root / "async"),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("two_ranks")
    # Source of the 1 -> 2 reshard: one process, no process group, plain module.
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2))
    Checkpointer(root / "one_rank").save(2, model, optimizer, scheduler)
    ranks = run_distributed(_two_rank_scenarios, 2, str(root))
    return dict(
        root=root,
        one_rank=(full_params(model), full_moments(model, optimizer)),
        ranks=ranks,
    )


@pytest.mark.slow
def test_fsdp2_round_trip_is_bit_exact(two_ranks):
    directory = two_ranks["root"] / "round_trip"
    for ranks in two_ranks["ranks"]:
        r = ranks["round_trip"]
        assert r["info"] == {"step": 3, "tokens_seen": 384}
        assert_same(r["saved"]["params"], r["restored"]["params"])
        assert_same(r["saved"]["moments"], r["restored"]["moments"])
        assert torch.equal(*r["draws"])  # per-rank RNG restored
        assert r["losses"][0] == r["losses"][1]  # fp32, bit for bit
        assert_same(*r["final"])
        assert r["lrs"][0] == r["lrs"][1]
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000003"]
    assert sorted(p.name for p in (directory / "step_00000003" / "rng").iterdir()) == [
        "rank_00000.safetensors",
        "rank_00001.safetensors",
    ]


@pytest.mark.slow
def test_crash_during_save_keeps_previous_checkpoint(two_ranks):
    directory = two_ranks["root"] / "crash"
    for ranks in two_ranks["ranks"]:
        r = ranks["crash"]
        assert "disk full (injected)" in r["writer_crash"]  # raised on both ranks
        assert r["publish_crash"] is not None
        assert r["latest_after_writer_crash"] == directory / "step_00000002"
        assert r["latest_after_publish_crash"] == directory / "step_00000002"
        # The partial save is on disk (every shard and the DCP index) but ignored.
        assert r["leftovers"] == [".tmp.step_00000003", "step_00000002"]
        assert r["info"] == {"step": 2}
        assert_same(*r["params"])
        # keep_last=2 and the crashed tmp dir swept.
        assert r["after_next_save"] == ["step_00000002", "step_00000004"]


@pytest.mark.slow
def test_async_save_lets_training_go_on_and_publishes_after_the_write(two_ranks):
    for r in (ranks["async"] for ranks in two_ranks["ranks"]):
        # While the writes were held, two more steps trained and nothing was published.
        assert len(r["losses_while_writing"]) == 2 and r["moved_on"]
        assert r["in_flight"] == {
            "published": False,
            "latest": "step_00000002",
            "tmp": [".tmp.step_00000004", "step_00000002"],
        }
        # Published after the write, holding step 4's state (staged at save time).
        assert r["info"] == {"step": 4}
        assert_same(r["saved"][0], r["restored"][0])
        assert_same(r["saved"][1], r["restored"][1])


# A process that dies while its background write is held: the previous checkpoint
# stays the one that resume=auto takes.
_CRASH_IN_FLIGHT = """
import os, sys, threading
import torch, torch.distributed.checkpoint.filesystem as dcp_fs
from src.checkpoint.dcp import Checkpointer
from tests.test_checkpoint import make_model, make_optim, train
ckpt = Checkpointer(sys.argv[1], async_save=True)
model = make_model(0)
optimizer, scheduler = make_optim(model)
train(model, optimizer, scheduler, range(2))
ckpt.save(2, model, optimizer, scheduler)
ckpt.wait()
held = threading.Event()
def held_write_item(*args, **kwargs):
    held.set()
    threading.Event().wait()  # never released
dcp_fs._write_item = held_write_item
ckpt.save(3, model, optimizer, scheduler)
held.wait()
os._exit(3)  # dies with the step-3 write in flight
"""


def test_crash_with_a_background_write_in_flight_keeps_the_previous(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _CRASH_IN_FLIGHT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 3, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp.step_00000003",
        "step_00000002",
    ]
    assert resolve_resume("auto", tmp_path) == tmp_path / "step_00000002"
    model = make_model(1)
    optimizer, scheduler = make_optim(model)
    assert Checkpointer(tmp_path).load(
        tmp_path / "step_00000002", model, optimizer
    ) == {"step": 2}


@pytest.mark.slow
def test_reshard_2_to_1_and_export(two_ranks):
    directory = two_ranks["root"] / "export"
    expected = two_ranks["ranks"][0]["export"]
    assert_same(expected["params"], two_ranks["ranks"][1]["export"]["params"])

    # 2 -> 1: one process, no process group, plain module.
    model = make_model(1)
    optimizer, scheduler = make_optim(model)
    with pytest.warns(UserWarning, match="RNG states not restored"):
        info = Checkpointer(directory).load(
            directory / "step_00000002", model, optimizer, scheduler
        )
    assert info == {"step": 2}
    assert_same(expected["params"], full_params(model))
    assert_same(expected["moments"], full_moments(model, optimizer))

    # Export: one file of fp32 tensors equal to the unsharded model's, no pickle.
    path = directory / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected["params"])
    assert_same(expected["params"], load_consolidated(path))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}

    # Tied weights: written once; loading hands back both names sharing one tensor.
    tied_path = directory / "tied.safetensors"
    with safe_open(tied_path, framework="pt") as f:
        assert sorted(f.keys()) == ["proj.bias", "proj.weight", "wte.weight"]
    state = load_consolidated(tied_path)
    assert state["head.weight"] is state["wte.weight"]
    assert torch.equal(state["wte.weight"], expected["tied"]["wte.weight"])
    fresh = TiedLM(5)
    fresh.load_state_dict(state)  # strict: every name is present
    assert_same(full_params(fresh), expected["tied"])


@pytest.mark.slow
def test_reshard_1_to_2(two_ranks):
    params, moments = two_ranks["one_rank"]
    for ranks in two_ranks["ranks"]:
        r = ranks["one_to_two"]
        assert r["info"] == {"step": 2}
        assert r["local_rows"] == 8  # really sharded: half of the 16 rows
        assert_same(params, r["params"])
        assert_same(moments, r["moments"])
        assert all(torch.isfinite(torch.tensor(r["losses"])))


@pytest.mark.slow
def test_fsdp1_round_trip(two_ranks):
    for ranks in two_ranks["ranks"]:
        r = ranks["fsdp1"]
        assert r["info"] == {"step": 2}
        assert r["losses"][0] == r["losses"][1]
        assert_same(*r["params"])
    # Exported names are canonical: no _fsdp_wrapped_module prefixes.
    exported = load_consolidated(two_ranks["root"] / "fsdp1" / "fsdp1.safetensors")
    assert_same(exported, r["params"][0])


@pytest.mark.slow
def test_ddp_checkpoint_loads_into_fsdp2(two_ranks):
    for ranks in two_ranks["ranks"]:
        r = ranks["ddp"]
        assert r["info"] == {"step": 2}
        assert_same(*r["params"])
        assert_same(*r["moments"])


# ------------------------------------------------------------ single process


def test_single_process_round_trip(tmp_path):
    ckpt = Checkpointer(tmp_path)
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(3))
    random.seed(7)
    np.random.seed(7)
    np.random.randn()  # leaves a cached Gaussian in numpy's state
    path = ckpt.save(3, model, optimizer, scheduler, extra={"betas": (0.9, 0.95)})
    draws = torch.rand(3), random.random(), np.random.randn(2)
    losses = train(model, optimizer, scheduler, range(3, 5))

    model2 = make_model(1)
    optimizer2, scheduler2 = make_optim(model2, lr=0.3)
    assert ckpt.load(path, model2, optimizer2, scheduler2) == {
        "step": 3,
        "betas": (0.9, 0.95),
    }
    assert torch.equal(torch.rand(3), draws[0])
    assert random.random() == draws[1]
    assert np.array_equal(np.random.randn(2), draws[2])
    assert optimizer2.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again
    assert train(model2, optimizer2, scheduler2, range(3, 5)) == losses
    assert_same(full_params(model), full_params(model2))
    assert_same(full_moments(model, optimizer), full_moments(model2, optimizer2))


def test_a_checkpoint_from_before_a_param_group_flag_resumes(tmp_path):
    """A group setting the code added since a checkpoint was saved (build_optimizer's
    ``no_decay`` flag) keeps this run's value; the rest loads as saved: an older
    run's checkpoint is not called damaged, and training goes on as it would."""
    ckpt = Checkpointer(tmp_path)
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    train(model, optimizer, scheduler, range(2))
    path = ckpt.save(2, model, optimizer, scheduler)
    losses = train(model, optimizer, scheduler, range(2, 4))

    model2 = make_model(1)
    optimizer2, scheduler2 = make_optim(model2)
    optimizer2.param_groups[0]["no_decay"] = False  # a flag the saver did not have
    assert ckpt.load(path, model2, optimizer2, scheduler2)["step"] == 2
    assert optimizer2.param_groups[0]["no_decay"] is False
    assert train(model2, optimizer2, scheduler2, range(2, 4)) == losses


def save_steps(ckpt: Checkpointer, steps):
    """Train a fresh model one step at a time, saving after each."""
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    for step in steps:
        train(model, optimizer, scheduler, [step])
        ckpt.save(step, model, optimizer, scheduler)
    return model, optimizer, scheduler


def test_keep_last_prunes_and_latest_ignores_incomplete(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    model, optimizer, scheduler = save_steps(ckpt, (1, 2, 3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_00000002",
        "step_00000003",
    ]
    # A newer dir without the completion marker (e.g. copied half-way) is ignored.
    (tmp_path / "step_00000009").mkdir()
    assert ckpt.latest() == tmp_path / "step_00000003"
    # keep_last=0 keeps everything.
    keep_all = Checkpointer(tmp_path, keep_last=0)
    keep_all.save(4, model, optimizer, scheduler)
    assert [p.name for p in sorted(tmp_path.glob("step_*"))][:3] == [
        "step_00000002",
        "step_00000003",
        "step_00000004",
    ]


def test_resolve_resume(tmp_path):
    run_dir = tmp_path / "run"
    directory = run_dir / "checkpoints"
    assert resolve_resume(None, directory) is None
    assert resolve_resume("auto", directory) is None  # fresh run: nothing yet
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    ckpt = Checkpointer(directory)
    ckpt.save(1, model, optimizer, scheduler)
    ckpt.save(2, model, optimizer, scheduler)
    newest = directory / "step_00000002"
    assert resolve_resume("auto", directory) == newest
    assert resolve_resume(str(directory / "step_00000001"), "/elsewhere").name == (
        "step_00000001"
    )
    assert resolve_resume(str(directory), "/elsewhere") == newest
    assert resolve_resume(str(run_dir), "/elsewhere") == newest
    with pytest.raises(FileNotFoundError, match="trainer.resume"):
        resolve_resume(str(tmp_path / "nope"), directory)
    (directory / "step_00000002" / "COMPLETE").unlink()
    with pytest.raises(FileNotFoundError, match="trainer.resume"):
        resolve_resume(str(directory / "step_00000002"), directory)


def test_damaged_checkpoints_are_named_and_auto_takes_the_newest_good(tmp_path):
    """Issue cases 3 and 8: a flipped or truncated shard never loads; auto falls back."""
    ckpt = Checkpointer(tmp_path, keep_last=0)
    model, optimizer, scheduler = save_steps(ckpt, (1, 2, 3))
    shard = tmp_path / "step_00000003" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
    shard.write_bytes(bytes(data))
    shard2 = tmp_path / "step_00000002" / "__0_0.distcp"
    shard2.write_bytes(shard2.read_bytes()[:-10])
    assert ckpt.verify(tmp_path / "step_00000001") is None
    assert ckpt.verify(shard.parent) == "__0_0.distcp fails its checksum (corrupted)"
    assert "__0_0.distcp has" in ckpt.verify(shard2.parent)
    skipped = []
    found = resolve_resume(
        "auto", tmp_path, ckpt.verify, lambda p, why: skipped.append(p.name)
    )
    assert found.name == "step_00000001"
    assert skipped == ["step_00000003", "step_00000002"]
    with pytest.raises(CheckpointError, match="step_00000003 is damaged: .*checksum"):
        ckpt.load(shard.parent, model, optimizer, scheduler)
    (tmp_path / "step_00000001" / "rng" / "rank_00000.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match="no usable checkpoint.*rank_00000.safetensors is missing"
    ):
        resolve_resume("auto", tmp_path, ckpt.verify)


def test_load_into_another_model_names_the_first_mismatch(tmp_path):
    """Issue case 2: extra, missing and reshaped tensors are one-line errors."""
    ckpt = Checkpointer(tmp_path)
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    path = ckpt.save(1, model, optimizer, scheduler)

    def load_into(other: nn.Module) -> str:
        with pytest.raises(CheckpointError) as err:
            ckpt.load(path, other, *make_optim(other))
        assert "\n" not in str(err.value)
        return str(err.value)

    smaller = nn.Sequential(*list(make_model(0))[:3])  # last Linear dropped
    assert "3.weight [4, 16] is in the checkpoint, not in the model" in (
        load_into(smaller)
    )
    bigger = nn.Sequential(*make_model(0), nn.Linear(D_OUT, 2))
    assert "4.weight [2, 4] is in the model, not the checkpoint" in load_into(bigger)
    other = make_model(0)
    other[2] = nn.Linear(16, 16, bias=False)
    assert "2.bias [16] is in the checkpoint, not in the model" in load_into(other)
    wider = make_model(0)
    wider[3] = nn.Linear(16, 5)
    assert "3.weight is [4, 16] in the checkpoint and [5, 16] in the model" in (
        load_into(wider)
    )


def test_saving_a_step_again_replaces_it(tmp_path):
    ckpt = Checkpointer(tmp_path)
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    ckpt.save(1, model, optimizer, scheduler, extra={"v": 1})
    ckpt.save(1, model, optimizer, scheduler, extra={"v": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert ckpt.load(ckpt.latest(), model, optimizer, scheduler)["v"] == 2


def test_bad_extra_is_rejected_before_writing(tmp_path):
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    with pytest.raises(TypeError, match="JSON"):
        Checkpointer(tmp_path).save(1, model, optimizer, extra={"x": object()})
    with pytest.raises(ValueError, match="step"):
        Checkpointer(tmp_path).save(1, model, optimizer, extra={"step": 7})
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_load_refuses_pickled_code(tmp_path, capsys):
    ckpt = Checkpointer(tmp_path)
    model = make_model(0)
    optimizer, scheduler = make_optim(model)
    path = ckpt.save(1, model, optimizer, scheduler)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(
        CheckpointError, match=r"\.metadata has \d+ bytes, \d+ were written"
    ):
        ckpt.load(path, model, optimizer, scheduler)
    # Checksums are no defence against a crafted file: the unpickler is.
    with pytest.raises(CheckpointError, match="it names builtins.print"):
        ckpt.load(path, model, optimizer, scheduler, verify=False)
    assert "must never run" not in capsys.readouterr().out


def test_export_single_process_ties_once(tmp_path):
    model = TiedLM(0)
    export_consolidated(model, tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        assert "head.weight" not in f.keys()
    state = load_consolidated(tmp_path / "m.safetensors")
    assert_same(state, dict(model.state_dict()))


#: A 4-step run of one FSDP2 rank, checkpointed at steps 2 and 4.
ONE_RANK_RUN = (
    "model=tiny",
    "logger=none",
    "data=synthetic",
    "data.num_tokens=20000",
    "trainer.devices=1",
    "trainer.max_steps=4",
    "trainer.batch_size=4",
    "trainer.log_every=1",
    "trainer.val_every=0",
    "trainer.progress=false",
    "trainer.peak_tflops=1",
    "trainer.ckpt_every=2",
)


def one_rank(*overrides: str, run_dir: Path) -> dict[int, float]:
    """:data:`ONE_RANK_RUN` in this process as train.py runs it: its loss per step."""
    from src.config.validate import validate
    from src.trainer.launch import run_rank
    from tests.test_train import make_cfg, read_rows

    cfg = make_cfg(*ONE_RANK_RUN, *overrides)
    run_rank(cfg, str(run_dir), validate(cfg))
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


def test_trainer_async_checkpoints_publish_and_resume_exactly(tmp_path):
    """The loop with ``trainer.ckpt_async=true`` (one FSDP2 rank, run in this process
    as train.py runs it): every checkpoint is published by the end of the run, and a
    run resumed from one continues bit for bit."""
    straight = one_rank("trainer.ckpt_async=true", run_dir=tmp_path / "straight")
    ckpts = tmp_path / "straight" / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == [
        "step_00000002",
        "step_00000004",
    ]
    step_2 = ckpts / "step_00000002"
    resumed = one_rank(
        "trainer.ckpt_async=true", f"trainer.resume={step_2}", run_dir=tmp_path / "r"
    )
    assert resumed == {3: straight[3], 4: straight[4]}


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer.optimizer=muon", "trainer.schedule=wsd", "trainer.warmup_steps=1"),
        ("trainer.optimizer=lion", "trainer.schedule=linear", "trainer.warmup_steps=1"),
    ],
)
def test_each_optimizer_and_schedule_resumes_exactly(tmp_path, overrides):
    """Muon (its matrices' momentum and AdamW's moments for the rest) and Lion in
    the distributed checkpoint: a resume continues bit for bit."""
    straight = one_rank(*overrides, run_dir=tmp_path / "straight")
    step_2 = tmp_path / "straight" / "checkpoints" / "step_00000002"
    resumed = one_rank(*overrides, f"trainer.resume={step_2}", run_dir=tmp_path / "r")
    assert resumed == {3: straight[3], 4: straight[4]}
