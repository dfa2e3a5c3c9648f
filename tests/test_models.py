"""The model registry: specs, the Hydra schema per family, and a user's own model
plugged in from config alone (``model=custom model._target_=...``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from src.config.cli_help import is_schema_option, user_options
from src.config.run_plan import model_config, model_spec, resolve
from src.config.validate import validate
from src.harness import compose_config
from src.models import families, get_spec
from src.sharding import wrap
from src.trainer.loop import train
from src.trainer.optimizer import build_optimizer
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PRESETS = [p for p in user_options("model") if not is_schema_option(p)]


def make_cfg(*overrides: str):
    return compose_config(*overrides)


# A user's own model, as docs/models.md shows it: any nn.Module whose constructor takes
# vocab_size and block_size (and model.args), and whose forward returns (logits, loss).
class TinyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    block_cls = TinyBlock  # optional: for sharding.policy=block

    def __init__(self, vocab_size: int, block_size: int, dim: int = 32, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(block_size, dim))
        self.blocks = nn.ModuleList(wrap(TinyBlock(dim)) for _ in range(depth))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx, targets=None):
        x = self.embed(idx) + self.pos[: idx.size(1)]
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


CUSTOM = ["model=custom", "model._target_=tests.test_models.TinyLM"]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_into_its_family(preset):
    needs = {"custom": CUSTOM[1:], "hf": ["model.config=tiny_llama"]}  # no default
    cfg = make_cfg(f"model={preset}", *needs.get(preset, []))
    validate(cfg)
    spec = model_spec(cfg)
    assert spec.name in families() and cfg.model.name == preset
    config = model_config(cfg)
    assert isinstance(config, spec.config_cls)
    assert spec.seq_len(config) >= 1 and spec.vocab_size(config) >= 1


def test_family_schema_types_the_model_node():
    """The schema is the family's own config dataclass (+ the shared keys): every
    field of GPTConfig is a model key, with its type."""
    spec = get_spec("gpt")
    cfg = make_cfg("model=tiny", "model.n_layer=3")
    assert cfg.model.family == "gpt"
    fields = set(spec.config_cls.__dataclass_fields__)
    assert fields <= set(cfg.model.keys())
    assert model_config(cfg).n_layer == 3


def test_no_decay_rule_by_name_matches_parameter_rank():
    """The GPT's no-decay rule (by canonical name) puts exactly the 1-D parameters
    (biases, LayerNorm gains) in the no-decay group, without a second model."""
    cfg = make_cfg("model=tiny")
    spec = model_spec(cfg)
    model = spec.build(model_config(cfg), 0)
    for name, p in model.named_parameters():
        assert spec.no_decay(name) == (p.dim() < 2), name


def test_custom_model_builds_from_config_alone():
    cfg = make_cfg(*CUSTOM, "+model.args.dim=16", "model.vocab_size=64")
    validate(cfg)
    spec, config = model_spec(cfg), model_config(cfg)
    model = spec.build(config, 0)
    assert isinstance(model, TinyLM) and model.embed.weight.shape == (64, 16)
    assert spec.block_classes(config) == (TinyBlock,)
    n = sum(p.numel() for p in model.parameters())
    assert spec.flops_per_token(config, 8) == 6 * n
    decay, no_decay = build_optimizer(model, cfg, resolve(cfg).spec).param_groups
    assert {id(p) for p in no_decay["params"]} == {
        id(p)
        for n, p in model.named_parameters()
        if n.endswith("bias") or ".norm." in n
    }


def _train_rank(rank: int, world: int, cfg, run_dir: str):
    return train(cfg, run_dir, torch.device("cpu"), resolve(cfg))


@pytest.mark.slow
def test_custom_model_trains_sharded_on_two_ranks(tmp_path):
    cfg = make_cfg(
        *CUSTOM,
        "sharding.policy=block",
        "data=synthetic",
        "data.num_tokens=20000",
        "logger=none",
        "trainer.max_steps=8",
        "trainer.batch_size=8",
        "trainer.log_every=1",
        "trainer.val_every=0",
        "trainer.warmup_steps=1",
        "trainer.lr=1e-2",
        "trainer.progress=false",
        "trainer.peak_tflops=1",
        "model.block_size=32",
    )
    validate(cfg)
    summary = run_distributed(_train_rank, 2, cfg, str(tmp_path))[0]
    assert summary["wrap_units"] == 3  # two blocks + the root
    rows = [
        json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        ["model=llama_tiny"],
        ["model=hf", "model.config=tiny_llama", "trainer.export=hf"],
    ],
    ids=["llama_tiny", "hf"],
)
def test_train_py_runs_the_family_on_two_ranks(tmp_path, model):
    """``python train.py model=...`` end to end on 2 ranks: loss goes down, throughput,
    MFU (FLOPs from the spec) and memory are logged; ``trainer.export=hf`` writes a
    directory transformers opens."""
    from tests.test_train import read_rows, run_cmd

    run_dir = tmp_path / "run"
    out = run_cmd(
        [sys.executable, "train.py", *model, "trainer.devices=2", "logger=none"]
        + ["trainer.max_steps=6"]
        + ["trainer.batch_size=8", "trainer.log_every=1", "trainer.val_every=0"]
        + ["trainer.warmup_steps=1", "trainer.lr=1e-2", "trainer.progress=false"]
        + ["trainer.peak_tflops=1", f"hydra.run.dir={run_dir}"]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in read_rows(run_dir) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(rows[-1][k] > 0 for k in ("tokens_per_s", "mfu", "peak_mem_gib"))
    if "trainer.export=hf" in model:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
        assert hf.config.model_type == "llama"
