"""Pipeline parallelism (``sharding.pipeline_parallel``) on the same mesh as FSDP2 and
tensor parallelism.

Every run trains the same model on the same global batches (fp32, no dropout, 4
blocks so that interleaved schedules get one block per stage), so each step's global
loss must agree with one-process training within 1e-5 whatever the layout: PP2 (1F1B)
on 2 ranks, PP2 (interleaved 1F1B) x FSDP2 and PP2 x TP2 on 4 ranks, for GPT (its
embedding tied to the head across the first and last stage), Llama and a Hugging Face
Llama (cut by transformers' own pipeline plan). A PP2 x FSDP2 checkpoint resumes
exactly on FSDP over 4 ranks. One 4-rank and one 2-rank launch hold all the runs; the
references run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.test_config import assert_fails_naming
from tests.test_tensor_parallel import (
    CKPT,
    _train_runs,
    assert_close,
    losses,
    one_rank,
    resume_from,
)
from tests.test_train import read_rows

HF_TINY_LLAMA = Path(__file__).resolve().parents[1] / "conf/hf_configs/tiny_llama"


def families(root: Path) -> dict[str, list[str]]:
    """Each family with 4 blocks (the HF config a copy of tiny_llama's with 4)."""
    hf = root / "tiny_llama_4"
    if not hf.exists():
        hf.mkdir(parents=True)
        config = json.loads((HF_TINY_LLAMA / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return {
        "gpt": ["model=tiny", "model.block_size=32", "model.n_layer=4"],
        "llama": [
            "model=llama_tiny",
            "model.max_seq_len=32",
            "model.dim=64",
            "model.n_layers=4",
        ],
        # pipeline stages are built on meta and initialised by name: the reference too
        "hf": [
            "model=hf",
            f"model.config={hf}",
            "model.block_size=32",
            "model.init_device=meta",
        ],
    }


PP2 = ["sharding.pipeline_parallel=2"]
INTERLEAVED = [*PP2, "sharding.pp_schedule=interleaved_1f1b"]
TP2 = ["sharding.tensor_parallel=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    fams = families(root)
    for family, model in fams.items():
        one_rank(root, f"one_{family}", *model)
    gpt = fams["gpt"]
    run_distributed(
        _train_runs,
        4,
        str(root),
        {
            **{f"interleaved_fsdp2_{f}": [*m, *INTERLEAVED] for f, m in fams.items()},
            **{f"pp2_tp2_{f}": [*m, *PP2, *TP2] for f, m in fams.items()},
            # PP2 x FSDP2 (validation too) -> FSDP over the 4 ranks, from step 2
            "chain_pp": [*gpt, *PP2, *CKPT, "trainer.val_every=2"],
            "chain_fsdp": [
                *gpt,
                *CKPT,
                "trainer.val_every=2",
                *resume_from(root, "chain_pp", 2),
            ],
        },
    )
    run_distributed(
        _train_runs,
        2,
        str(root),
        {f"pp2_{f}": [*m, *PP2, "sharding.pp_microbatches=4"] for f, m in fams.items()},
    )
    return root


@pytest.mark.slow
def test_pipeline_matches_one_rank(runs):
    for family in ("gpt", "llama", "hf"):
        ref = losses(runs / f"one_{family}")
        assert len(set(ref.values())) == 4, ref  # it trains: every loss differs
        for layout in ("pp2", "interleaved_fsdp2", "pp2_tp2"):
            assert_close(losses(runs / f"{layout}_{family}"), ref, range(1, 5))


@pytest.mark.slow
def test_gradient_norm_spans_the_stages(runs):
    """The logged gradient norm is the whole model's (both stages, the tied
    embedding counted once), so clipping acts as without pipelining."""

    def norms(name):
        return [r["grad_norm"] for r in read_rows(runs / name) if "grad_norm" in r]

    for family in ("gpt", "hf"):
        want = norms(f"one_{family}")
        for layout in ("pp2", "interleaved_fsdp2"):
            got = norms(f"{layout}_{family}")
            assert got == pytest.approx(want, abs=1e-5), (layout, family)


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_on_fsdp(runs):
    gpt = losses(runs / "one_gpt")
    assert_close(losses(runs / "chain_pp"), gpt, range(1, 5))
    assert_close(losses(runs / "chain_fsdp"), gpt, range(3, 5))

    def val(name):
        return {
            r["step"]: r["val_loss"] for r in read_rows(runs / name) if "val_loss" in r
        }

    # validation through the pipeline equals validation of the same weights on FSDP
    assert sorted(val("chain_pp")) == [2, 4] and sorted(val("chain_fsdp")) == [4]
    assert abs(val("chain_pp")[4] - val("chain_fsdp")[4]) < 1e-5


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["sharding=fsdp1", "trainer.devices=4", *PP2], "pipeline_parallel", "fsdp2"),
        (["sharding=ddp", "trainer.devices=4", *PP2], "pipeline_parallel", "fsdp2"),
        (
            ["trainer.devices=4", *PP2, "sharding.pp_schedule=zbv"],
            "pp_schedule",
            "gloo",
        ),
        (["trainer.devices=4", *PP2, "sharding.pp_split=[1,2]"], "pp_split", "summing"),
        (["trainer.devices=3", *PP2], "pipeline_parallel", "3 devices"),
        (
            ["model=hf", "model.config=tiny_gpt2", "trainer.devices=2", *PP2],
            "pipeline_parallel",
            "GPT2LMHeadModel",
        ),
        (
            ["trainer.devices=4", *PP2, "sharding.pp_microbatches=1"],
            "pp_microbatches",
            "2",
        ),
        (
            ["model=tiny", "trainer.devices=2", *INTERLEAVED],
            "pipeline_parallel",
            "4 stages",
        ),
    ],
)
def test_bad_pipeline_configs_fail_in_one_line(overrides, key, says):
    assert_fails_naming(overrides, f"sharding.{key}", says)


def test_what_pipelining_does_not_do_yet_fails_in_one_line():
    overrides = ["trainer.devices=2", *PP2, "trainer.sample_every=10"]
    assert_fails_naming(overrides, "trainer.sample_every", "pipeline_parallel")
