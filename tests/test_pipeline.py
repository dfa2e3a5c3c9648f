"""Pipeline parallelism (``sharding.pipeline_parallel``) on the same mesh as FSDP2 and
tensor parallelism.

Every run trains the same model on the same global batches (fp32, no dropout, 4
blocks so that interleaved schedules get one block per stage), so each step's global
loss must agree with one-process training within 1e-5 whatever the layout: PP2 (1F1B)
on 2 ranks (GPipe too, for GPT), PP2 (interleaved 1F1B) x FSDP2 and PP2 x TP2 on 4
ranks, for GPT (its embedding tied to the head across the first and last stage),
Llama and a Hugging Face Llama (cut by transformers' own pipeline plan); so does
interleaved PP2 x HSDP with gradient accumulation, from ``model.pretrained``. A PP2 x
FSDP2 checkpoint resumes exactly on FSDP over 4 ranks, and that run's checkpoint on
PP2 x TP2. A PP run on text exports (``trainer.export``: the trained weights
exactly), samples while it trains, and its run dir opens in ``eval.py`` and
``sample.py`` without stages. With ``data.packing=documents`` (each stage given its
micro-batch's document ids) PP2 trains and validates with Llama's losses on one
rank (its RoPE positions restart in the second stage too). One 4-rank and one 2-rank launch hold all the runs; the
references and the tools run in this process.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import eval as eval_py
import sample as sample_py
from src.build import build_model, make_backend
from src.checkpoint.export import load_consolidated
from src.config.validate import validate
from src.harness import CONF_DIR
from src.runs.compose import open_run
from src.runs.from_run import load_model
from src.trainer.launch import run_rank, run_ranks
from src.trainer.sampling import SAMPLING_CHANGES
from tests.distributed import run_distributed
from tests.test_config import assert_fails_naming
from tests.test_tensor_parallel import (
    CKPT,
    MUON,
    RUN,
    _train_runs,
    assert_close,
    losses,
    one_rank,
    resume_from,
)
from tests.test_train import make_cfg, read_rows

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
ACCUM = ["trainer.grad_accum=2"]
# A PP run on text (byte-level): validation, samples and the export of its weights.
TEXT = [
    "data=text",
    "data.max_bytes=100000",
    "trainer.val_every=2",
    "trainer.sample_every=2",
    "trainer.sample_tokens=12",
    "trainer.export=hf",
]

# data.packing=documents (tests/test_documents.py) on byte text: two micro-steps
# whose counted targets differ, each split into the pipeline's two micro-batches
DOCS = [
    "data=text",
    "data.max_bytes=100000",
    "data.packing=documents",
    *ACCUM,
    "trainer.val_every=2",
]

# A Hugging Face model sampling while it trains (its own generate(), no validation).
HF_TEXT = [
    "data=text",
    "data.max_bytes=100000",
    "trainer.sample_every=2",
    "trainer.sample_tokens=8",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    fams = families(root)
    for family, model in fams.items():
        export = ["trainer.export=hf"] if family == "gpt" else []
        one_rank(root, f"one_{family}", *model, *export)
    gpt = fams["gpt"]
    # from one_gpt's export, with grad_accum=2 (its micro-steps draw other rows)
    from_export = [f"model.pretrained={root / 'one_gpt' / 'hf'}", *ACCUM]
    one_rank(root, "one_gpt_accum", *gpt, *from_export)
    one_rank(root, "one_llama_docs", *fams["llama"], *DOCS)
    one_rank(root, "one_llama_muon", *fams["llama"], *MUON)
    # as one_rank, RUN's synthetic data keys left out (as _train_runs does)
    own_data = [o for o in RUN if not o.startswith("data")]
    hf_text = make_cfg(
        *own_data, "sharding=none", "trainer.devices=1", *fams["hf"], *HF_TEXT
    )
    run_rank(hf_text, str(root / "one_hf_text"), validate(hf_text))
    tp_runs = {f"pp2_tp2_{f}": [*m, *PP2, *TP2] for f, m in fams.items()}
    tp_runs["pp2_tp2_gpt"].append("trainer.export=true")  # gathered across TP too
    run_distributed(
        _train_runs,
        4,
        str(root),
        {
            **{f"interleaved_fsdp2_{f}": [*m, *INTERLEAVED] for f, m in fams.items()},
            **tp_runs,
            # interleaved PP2 x HSDP (each stage replicated over its 2 ranks) from
            # pretrained weights, grad_accum=2; exported and validated at the end
            "hsdp_pp2": [
                *gpt,
                *INTERLEAVED,
                "sharding.replicate=2",
                *from_export,
                "trainer.export=true",
                "trainer.val_every=4",
            ],
            # PP2 x FSDP2 (validation too) -> FSDP over the 4 ranks, from step 2
            "chain_pp": [*gpt, *PP2, *CKPT, "trainer.val_every=2"],
            "chain_fsdp": [
                *gpt,
                *CKPT,
                "trainer.val_every=2",
                *resume_from(root, "chain_pp", 2),
            ],
            # -> PP2 x TP2 from FSDP4's step 3
            "chain_pp_tp": [*gpt, *PP2, *TP2, *resume_from(root, "chain_fsdp", 3)],
        },
    )
    run_distributed(
        _train_runs,
        2,
        str(root),
        {
            **{
                f"pp2_{f}": [*m, *PP2, "sharding.pp_microbatches=4"]
                for f, m in fams.items()
            },
            "pp2_text": [*gpt, *PP2, *TEXT],
            # transformers' generate() on the model gathered from the stages
            "pp2_hf_text": [*fams["hf"], *PP2, *HF_TEXT],
            # every schedule offered trains on gloo: GPipe too
            "pp2_gpipe_gpt": [*gpt, *PP2, "sharding.pp_schedule=gpipe"],
            "pp2_llama_docs": [*fams["llama"], *PP2, *DOCS],
            "pp2_llama_muon": [*fams["llama"], *PP2, *MUON],
        },
    )
    return root


@pytest.mark.slow
def test_pipeline_matches_one_rank(runs):
    for family in ("gpt", "llama", "hf"):
        ref = losses(runs / f"one_{family}")
        assert len(set(ref.values())) == 4, ref  # it trains: every loss differs
        for layout in ("pp2", "interleaved_fsdp2", "pp2_tp2"):
            assert_close(losses(runs / f"{layout}_{family}"), ref, range(1, 5))
    assert_close(losses(runs / "pp2_gpipe_gpt"), losses(runs / "one_gpt"), range(1, 5))
    # Muon: each stage's matrices orthogonalised whole, its head by the vocabulary
    ref = losses(runs / "one_llama_muon")
    assert len(set(ref.values())) == 4 and ref != losses(runs / "one_llama")
    assert_close(losses(runs / "pp2_llama_muon"), ref, range(1, 5))


@pytest.mark.slow
def test_documents_under_pipelining_match_one_rank(runs):
    """Each stage masks and positions its micro-batch by its document ids; the loss
    and the validation loss are the means over the counted targets, however they
    fall on the pipeline's micro-batches."""

    def values(name: str, key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in read_rows(runs / name) if key in r}

    ref = losses(runs / "one_llama_docs")
    assert len(set(ref.values())) == 4 and ref != losses(runs / "one_llama")
    assert_close(losses(runs / "pp2_llama_docs"), ref, range(1, 5))
    val = values("one_llama_docs", "val_loss")
    assert_close(values("pp2_llama_docs", "val_loss"), val, (2, 4))


@pytest.mark.slow
def test_hsdp_accumulation_and_pretrained_weights_under_pipelining(runs):
    """Interleaved PP2 x replicate=2 on 4 ranks with grad_accum=2, its stages reading
    their own tensors of a Hugging Face export (model.pretrained; GPT's tied
    embedding read by both end stages), matches one rank from the same weights."""
    ref = losses(runs / "one_gpt_accum")
    assert ref[1] != losses(runs / "one_gpt")[1]
    assert_close(losses(runs / "hsdp_pp2"), ref, range(1, 5))


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
def test_pipeline_checkpoint_resumes_across_layouts(runs):
    gpt = losses(runs / "one_gpt")
    assert_close(losses(runs / "chain_pp"), gpt, range(1, 5))
    assert_close(losses(runs / "chain_fsdp"), gpt, range(3, 5))
    assert_close(losses(runs / "chain_pp_tp"), gpt, range(4, 5))

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
        (["trainer.devices=2", "sharding.pp_split=[1,1]"], "pp_split", "no pipeline"),
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
        # torch's Interleaved1F1B splits M into max(1, M // P) equal rounds and
        # raised on the ranks (a traceback per rank) for M=5 over P=2
        (
            [
                "model=tiny",
                "model.n_layer=4",
                "trainer.devices=2",
                "trainer.batch_size=10",
                *INTERLEAVED,
                "sharding.pp_microbatches=5",
            ],
            "pp_microbatches",
            "multiple of 2",
        ),
    ],
)
def test_bad_pipeline_configs_fail_in_one_line(overrides, key, says):
    assert_fails_naming(overrides, f"sharding.{key}", says)


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["trainer.devices=2", "precision=fp16_mixed"], "precision.name", "pipeline"),
        (
            ["trainer.devices=4", *TP2, "sharding.sequence_parallel=true"],
            "sharding.sequence_parallel",
            "pipeline_parallel",
        ),
    ],
)
def test_what_pipelining_does_not_do_yet_fails_in_one_line(overrides, key, says):
    assert_fails_naming([*overrides, *PP2], key, says)


def _trained_and_exported(device, cfg, resolved, checkpoint, run_dir) -> dict:
    """On one rank: the checkpoint's weights loaded by name into the model without
    stages, and the run's export (HF safetensors through model.pretrained, or the
    consolidated file), each by name; whether every tensor is equal."""
    model, _, step = load_model(resolved, checkpoint, device)
    trained = model.state_dict()
    if (run_dir / "hf").is_dir():
        hf = replace(resolved, pretrained=str(run_dir / "hf"))
        exported = build_model(hf, make_backend(hf, device)).state_dict()
    else:
        exported = load_consolidated(run_dir / "model.safetensors")
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {
        "step": step,
        "names": sorted(params - set(exported)),  # what the export lacks
        "unequal": sorted(
            n for n in params if not torch.equal(trained[n], exported[n])
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("run", ["pp2_text", "hsdp_pp2", "pp2_tp2_gpt"])
def test_export_of_a_pipeline_run_is_the_trained_weights(runs, run):
    """trainer.export=hf (PP2 on 2 ranks) and =true (PP2 x HSDP, PP2 x TP2 on 4
    ranks): the weights gathered from the stages equal, bit for bit, the final
    checkpoint's (DCP, by name) loaded into the model without stages, GPT's tied
    head included."""
    one = {"trainer.devices": 1, "sharding.backend": "none"}
    changes = {**SAMPLING_CHANGES, **one}
    _, checkpoint, cfg, resolved = open_run(str(runs / run), lambda _: changes)
    out = run_ranks(_trained_and_exported, 1, 60, cfg, resolved, checkpoint, runs / run)
    assert out == {"step": 4, "names": [], "unequal": []}


@pytest.mark.slow
def test_eval_and_sample_open_a_pipeline_run(runs):
    """eval.py on one rank gives the val_loss the PP run (and the PP2 x HSDP run)
    measured through its stages; sample.py's greedy text is the one the run sampled
    at its last step (trainer.sample_every, decoded by the model gathered from the
    stages)."""
    run = runs / "pp2_text"
    rows = read_rows(run)
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    samples = {r["step"]: r["sample_0"] for r in rows if "sample_0" in r}
    assert sorted(val) == [2, 4] and sorted(samples) == [2, 4]
    hsdp = runs / "hsdp_pp2"
    hsdp_val = json.loads((hsdp / "summary.json").read_text())["val_loss"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        entry = eval_py.evaluate_run(compose("eval", [f"run={run}", "devices=1"]))
        hsdp_entry = eval_py.evaluate_run(compose("eval", [f"run={hsdp}", "devices=1"]))
        greedy = ["num_samples=1", "temperature=0", "max_new_tokens=12"]
        texts = sample_py.main(compose("sample", [f"run={run}", *greedy]))
    assert entry["step"] == 4 and abs(entry["loss"] - val[4]) < 1e-5, (entry, val)
    assert abs(hsdp_entry["loss"] - hsdp_val) < 1e-5, (hsdp_entry, hsdp_val)
    assert texts == [samples[4]]


@pytest.mark.slow
def test_hf_model_samples_while_it_trains_under_pipelining(runs):
    """trainer.sample_every for a Hugging Face model under PP2: generate() on the
    model gathered from the stages (an FSDP2 root never run forward, its embeddings
    and head sharded: transformers calls past the root's hooks) gives one rank's
    greedy text; it failed on every rank with a DTensor AssertionError."""

    def samples(name):
        return {
            r["step"]: r["sample_0"] for r in read_rows(runs / name) if "sample_0" in r
        }

    assert_close(
        losses(runs / "pp2_hf_text"), losses(runs / "one_hf_text"), range(1, 5)
    )
    want = samples("one_hf_text")
    assert sorted(want) == [2, 4] and samples("pp2_hf_text") == want
