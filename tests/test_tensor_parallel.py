"""Tensor (and sequence) parallelism composed with FSDP2 on one device mesh.

Every run trains the same model on the same global batches (fp32, no dropout), so
each step's global loss must agree with one-process training within 1e-5 whatever
the layout: TP2 on 2 ranks, TP2 x FSDP2 and HSDP x TP (2 x 1 x 2) on 4 ranks, for the
GPT, Llama and a Hugging Face Llama, with full activation checkpointing. Checkpoints
resume across layouts (TP2 x FSDP2 -> FSDP4 -> TP2 x FSDP2), ``trainer.export=hf`` and
``model.pretrained`` work under TP, and so does ``data.packing=documents`` (TP2 x
FSDP2, two micro-batches: the loss is the mean over the global batch's counted
targets, tests/test_documents.py; its CP runs: tests/test_context_parallel.py). Starting ranks is what costs time, so the runs
share one 4-rank and one 2-rank launch (module-scoped fixture); the references run
in this process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file

import eval as eval_py
from src.config.run_plan import resolve
from src.config.validate import validate
from src.harness import CONF_DIR
from src.planner.report import plan_only
from src.runs.from_run import RUN_CONFIG, RUN_OVERRIDES
from src.trainer.launch import run_rank
from src.trainer.loop import train
from tests.distributed import run_distributed
from tests.test_config import assert_fails_naming
from tests.test_train import make_cfg, read_rows

RUN = [
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
    "trainer.ckpt_every=0",
    "sharding.policy=block",
]
FAMILIES = {
    "gpt": ["model=tiny", "model.block_size=32"],
    "llama": [
        "model=llama_tiny",
        "model.max_seq_len=32",
        "model.dim=64",
        "model.n_layers=2",
    ],
    "hf": ["model=hf", "model.config=tiny_llama", "model.block_size=32"],
}
TP2 = ["sharding.tensor_parallel=2"]
AC = ["sharding.activation_checkpointing=full"]
CKPT = ["trainer.ckpt_every=1", "trainer.keep_last=0"]
# data.packing=documents (tests/test_documents.py): byte text, whose documents end
# with EOS; two micro-batches whose counted targets differ across ranks
DOCUMENTS = ["data=text", "data.packing=documents"]
DOCS = [*DOCUMENTS, "trainer.grad_accum=2"]
# LoRA (peft's layers): each adapted layer's halves split as its base layer is
LORA = ["model.lora.rank=4"]
# Muon (its Newton-Schulz on each whole matrix, however the matrix is sharded)
MUON = ["trainer.optimizer=muon"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r}


def resume_from(root: Path, name: str, step: int) -> list[str]:
    return [f"trainer.resume={root / name / 'checkpoints' / f'step_{step:08d}'}"]


def base_of(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """RUN, without its synthetic data keys for a run choosing its own ``data=``."""
    own_data = any(o.startswith("data=") for o in overrides)
    return [o for o in RUN if not (own_data and o.startswith("data"))]


def _train_runs(rank: int, world: int, root: str, runs: dict[str, list[str]]) -> None:
    """Train each named run in turn on the same process group, its config saved as
    train.py saves it (for eval.py). Rank 0 composes each config and sends it to
    the others (Hydra's compose costs more CPU than a tiny run's steps). What
    DTensor warns of its redistributions goes to ``redistribute_<rank>.log``."""
    warned = logging.getLogger("torch.distributed.tensor._redistribute")
    record = logging.FileHandler(Path(root) / f"redistribute_{rank}.log")
    warned.addHandler(record)
    try:
        for name, overrides in runs.items():
            base = base_of(overrides)
            box = [make_cfg(*base, *overrides) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            cfg = box[0]
            if rank == 0:
                (Path(root) / name / ".hydra").mkdir(parents=True, exist_ok=True)
                OmegaConf.save(cfg, Path(root) / name / RUN_CONFIG)
                OmegaConf.save([*base, *overrides], Path(root) / name / RUN_OVERRIDES)
            train(cfg, f"{root}/{name}", torch.device("cpu"), resolve(cfg))
    finally:
        warned.removeHandler(record)
        record.close()


def one_rank(root: Path, name: str, *overrides: str) -> None:
    one = ["sharding=none", "trainer.devices=1"]
    cfg = make_cfg(*base_of(overrides), *one, *overrides)
    run_rank(cfg, str(root / name), validate(cfg))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensor_parallel")


@pytest.fixture(scope="module")
def runs(root) -> Path:
    for family, model in FAMILIES.items():
        export = ["trainer.export=hf"] if family == "llama" else []
        one_rank(root, f"one_{family}", *model, *export)
    one_rank(root, "one_gpt_docs", *FAMILIES["gpt"], *DOCS)
    for family in FAMILIES:
        one_rank(root, f"one_{family}_lora", *FAMILIES[family], *LORA)
    for family in ("gpt", "llama"):
        one_rank(root, f"one_{family}_muon", *FAMILIES[family], *MUON)
    pretrained = [f"model.pretrained={root / 'one_llama' / 'hf'}"]
    one_rank(root, "one_pretrained", *FAMILIES["llama"], *pretrained)
    gpt, llama = FAMILIES["gpt"], FAMILIES["llama"]
    run_distributed(
        _train_runs,
        4,
        str(root),
        {
            **{f"tp2_fsdp2_{f}": [*m, *TP2, *AC] for f, m in FAMILIES.items()},
            "hsdp_tp": [*gpt, *TP2, "sharding.replicate=2"],
            # resume across layouts: TP2 x FSDP2 -> FSDP4 -> TP2 x FSDP2
            "chain_tp": [*gpt, *TP2, *CKPT, "trainer.val_every=4"],
            "chain_fsdp4": [*gpt, *CKPT, *resume_from(root, "chain_tp", 2)],
            "chain_tp_again": [*gpt, *TP2, *resume_from(root, "chain_fsdp4", 3)],
            "export_tp": [*llama, *TP2, "trainer.export=hf"],
            "pretrained_tp": [*llama, *TP2, *pretrained],
            "tp2_fsdp2_gpt_docs": [*gpt, *TP2, *AC, *DOCS],
            "tp2_fsdp2_llama_lora": [*llama, *TP2, *LORA],
            "tp2_fsdp2_hf_lora": [*FAMILIES["hf"], *TP2, *LORA],
            "tp2_fsdp2_llama_muon": [*llama, *TP2, *MUON],
            "hsdp_muon": [*gpt, "sharding.replicate=2", *MUON],
        },
    )
    run_distributed(
        _train_runs,
        2,
        str(root),
        {
            **{f"tp2_{f}": [*m, *TP2] for f, m in FAMILIES.items()},
            "tp2_gpt_no_sp": [*gpt, *TP2, "sharding.sequence_parallel=false"],
            "tp2_gpt_lora": [*gpt, *TP2, *LORA],
        },
    )
    return root


def assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps), got
    for step in steps:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])


@pytest.mark.slow
def test_tensor_parallel_matches_one_rank(runs):
    for family in FAMILIES:
        ref = losses(runs / f"one_{family}")
        assert len(set(ref.values())) == 4, ref  # it trains: every loss differs
        assert_close(losses(runs / f"tp2_{family}"), ref, range(1, 5))
        assert_close(losses(runs / f"tp2_fsdp2_{family}"), ref, range(1, 5))
    gpt = losses(runs / "one_gpt")
    assert_close(losses(runs / "hsdp_tp"), gpt, range(1, 5))
    # the gradient norm, partial over dp_shard x tp, is one all-reduce (the
    # flattened mesh, src/sharding/layout.py), not two in turn; what DTensor
    # cannot merge (a whole parameter gathered from FSDP's strided shard and TP's,
    # in non-ascending order) it still warns of
    logs = [log.read_text() for log in runs.glob("redistribute_*.log")]
    assert len(logs) == 4 and "sequential all_gather" in "".join(logs)
    assert "_NormPartial" not in "".join(logs)
    assert_close(losses(runs / "tp2_gpt_no_sp"), gpt, range(1, 5))
    # documents: GPT's per-row positions sequence-sharded as its tokens (Llama's
    # RoPE under TP: CP2 x TP2 in tests/test_context_parallel.py)
    ref = losses(runs / "one_gpt_docs")
    assert len(set(ref.values())) == 4 and ref != gpt
    assert_close(losses(runs / "tp2_fsdp2_gpt_docs"), ref, range(1, 5))
    # LoRA: a frozen base (a trained one would part from the 1-rank run at step 2)
    lora = {"gpt": "tp2_gpt_lora", "llama": "tp2_fsdp2_llama_lora"}
    for family, run in {**lora, "hf": "tp2_fsdp2_hf_lora"}.items():
        ref = losses(runs / f"one_{family}_lora")
        assert len(set(ref.values())) == 4 and ref != losses(runs / f"one_{family}")
        assert_close(losses(runs / run), ref, range(1, 5))
    # Muon on HSDP (2 x 2) and TP2 x FSDP2; PP2: tests/test_pipeline.py
    for family, run in (("gpt", "hsdp_muon"), ("llama", "tp2_fsdp2_llama_muon")):
        ref = losses(runs / f"one_{family}_muon")
        assert len(set(ref.values())) == 4 and ref != losses(runs / f"one_{family}")
        assert_close(losses(runs / run), ref, range(1, 5))


@pytest.mark.slow
def test_checkpoints_resume_across_tp_layouts(runs):
    gpt = losses(runs / "one_gpt")
    assert_close(losses(runs / "chain_tp"), gpt, range(1, 5))
    assert_close(losses(runs / "chain_fsdp4"), gpt, range(3, 5))
    assert_close(losses(runs / "chain_tp_again"), gpt, range(4, 5))


@pytest.mark.slow
def test_eval_of_a_tensor_parallel_checkpoint_on_one_rank(runs):
    """eval.py's steps in this process on the TP2 x FSDP2 run's last checkpoint, on
    one rank (sample.py drops tensor parallelism the same way): its validation split
    gives the val_loss the run itself measured under TP (loss_parallel)."""
    run = runs / "chain_tp"
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"run={run}", "devices=1"])
    entry = eval_py.evaluate_run(cfg)
    val_loss = json.loads((run / "summary.json").read_text())["val_loss"]
    assert entry["world_size"] == 1 and entry["step"] == 4
    assert abs(entry["loss"] - val_loss) < 1e-5, (entry, val_loss)


@pytest.mark.slow
def test_export_and_pretrained_under_tensor_parallelism(runs):
    def weights(name: str) -> dict[str, torch.Tensor]:
        (path,) = (runs / name / "hf").glob("*.safetensors")
        return load_file(path)

    want, got = weights("one_llama"), weights("export_tp")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        # 4 AdamW steps apart: Adam's normalised update turns the losses' 1e-6
        # rounding differences (other reduction orders) into ~2e-5 on a few weights.
        torch.testing.assert_close(got[name], value, atol=1e-4, rtol=0)
    assert_close(
        losses(runs / "pretrained_tp"), losses(runs / "one_pretrained"), range(1, 5)
    )


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["sharding=fsdp1", "trainer.devices=4", *TP2], "tensor_parallel", "fsdp2"),
        (["sharding=ddp", "trainer.devices=4", *TP2], "tensor_parallel", "fsdp2"),
        (["trainer.devices=4", "sharding.tensor_parallel=3"], "tensor_parallel", "3"),
        (
            ["model=hf", "model.config=tiny_gpt2", "trainer.devices=2", *TP2],
            "tensor_parallel",
            "GPT2LMHeadModel",
        ),
        (
            [
                *FAMILIES["hf"],
                "trainer.devices=2",
                *TP2,
                "sharding.sequence_parallel=true",
            ],
            "sequence_parallel",
            "LlamaForCausalLM",
        ),
        (
            [
                "model=tiny",
                "model.n_head=2",
                "trainer.devices=4",
                "sharding.tensor_parallel=4",
            ],
            "tensor_parallel",
            "model.n_head",
        ),
    ],
)
def test_bad_tensor_parallel_configs_fail_in_one_line(overrides, key, says):
    assert_fails_naming(overrides, f"sharding.{key}", says)


def test_plan_only_knows_tensor_parallelism(tmp_path, capsys):
    def plan(*overrides):
        cfg = make_cfg("model=llama_tiny", "trainer.devices=4", *overrides)
        return plan_only(resolve(cfg), str(tmp_path / "_".join(overrides) or "fsdp"))

    fsdp4 = plan()
    out = capsys.readouterr().out
    tp = plan(*TP2)
    out = capsys.readouterr().out
    assert "2 x 2 mesh (shard x tp)" in out, out
    assert "layers.*.attention.wq (colwise)" in out, out
    # TP2 x FSDP2 holds per rank what FSDP4 holds, give or take the norms (whole on
    # the tp ranks) and the padding of uneven shards.
    assert tp.bytes_per_rank() == pytest.approx(fsdp4.bytes_per_rank(), rel=0.02)
