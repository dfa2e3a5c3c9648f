"""Fine-tuning through train.py on one rank (in-process): LoRA adapters (peft's) with
the base frozen, and ``trainer.freeze``. What the run says (the header, summary.json),
what its checkpoints hold (the frozen weights as they were), an exact resume, and the
one-line refusals. The sharded twin (2 FSDP2 ranks equal one process) is
tests/test_sharded_parity.py's LoRA test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.commands import PLAN_ONLY, in_process, one_rank

RUN = [
    "model=llama_tiny",
    "model.n_layers=2",
    "data=synthetic",
    "logger=none",
    "trainer.devices=1",
    "trainer.progress=false",
    "trainer.max_steps=4",
    "trainer.log_every=1",
    "trainer.val_every=0",
    "trainer.ckpt_every=2",
    "trainer.keep_last=0",
]
LORA = ["model.lora.rank=4"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_lora_trains_only_its_adapters_says_so_and_resumes_exactly(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    run_dir, again = tmp_path / "run", tmp_path / "again"
    out = one_rank(
        monkeypatch, capsys, "train.py", *RUN, *LORA, f"hydra.run.dir={run_dir}"
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    # rank 4 on wq, wk, wv, wo (dim 128, kv 64) and w1, w2, w3 (hidden 352), 2 blocks
    d, kv, f = 128, 64, 352
    adapter = (d + d) + 2 * (d + kv) + (d + d) + 2 * (d + f) + (f + d)
    assert summary["trainable_params"] == 2 * 4 * adapter
    assert "run: trainable 18.7K of 0.45M params |" in out.stdout
    step2, step4 = (run_dir / "checkpoints" / f"step_0000000{s}" for s in (2, 4))
    before, after = _weights(step2, tmp_path), _weights(step4, tmp_path)
    for name, value in before.items():
        assert torch.equal(value, after[name]) != (".lora_" in name), name
    assert any(".lora_B." in name for name in before)

    resumed = one_rank(
        monkeypatch, capsys, "train.py", *RUN, *LORA, f"hydra.run.dir={again}",
        f"trainer.resume={step2}",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert _losses(again) == {s: v for s, v in _losses(run_dir).items() if s > 2}


@pytest.mark.slow
def test_freeze_keeps_the_matched_parameters_and_trains_the_rest(
    tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    run_dir = tmp_path / "run"
    frozen = "trainer.freeze=[tok_embeddings.*,layers.0.*]"
    out = one_rank(
        monkeypatch, capsys, "train.py", *RUN, frozen, "trainer.health_every=2",
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # per-block health (issue 57 item 7): each block's norms on steps 2 and 4; the
    # blocks' gradient norms make up grad_norm; frozen blocks have none
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    health = {r["step"]: r for r in rows if any(k.startswith("health/") for k in r)}
    assert sorted(health) == [2, 4]
    for row in health.values():
        grads = {k: v for k, v in row.items() if k.endswith("/grad_norm")}
        assert sorted(grads) == ["health/layers.1/grad_norm", "health/norm/grad_norm",
                                 "health/output/grad_norm"]  # fmt: skip
        assert sum(v * v for v in grads.values()) ** 0.5 == pytest.approx(
            row["grad_norm"], rel=1e-5
        )
        assert row["health/tok_embeddings/param_norm"] > 0
        assert "health/layers.0/param_norm" in row
    step2, step4 = (run_dir / "checkpoints" / f"step_0000000{s}" for s in (2, 4))
    before, after = _weights(step2, tmp_path), _weights(step4, tmp_path)
    for name, value in before.items():
        kept = name.startswith(("tok_embeddings.", "layers.0."))
        assert torch.equal(value, after[name]) == kept, name
    assert "trainable" in out.stdout


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (
            ["model.lora.targets=[nothing]"],
            "model.lora.targets: ['nothing'] matches no linear layer of the model",
        ),
        (
            ["sharding.pipeline_parallel=2", "trainer.devices=2"],
            "model.lora.rank: LoRA adapters do not run with sharding.pipeline_parallel=2",
        ),
        (["model.lora.dropout=1.5"], "model.lora.dropout: got 1.5, expected in [0, 1)"),
    ],
)
def test_wrong_lora_settings_are_one_line(monkeypatch, capsys, overrides, line):
    code, out, err = in_process(
        monkeypatch, capsys, "train.py", *RUN, *LORA, *overrides, PLAN_ONLY
    )
    assert code == 2
    assert f"config error: {line}" in out + err


def test_a_freeze_pattern_that_matches_nothing_is_one_line(monkeypatch, capsys):
    code, out, err = in_process(
        monkeypatch, capsys, "train.py", *RUN, "trainer.freeze=[nope.*]", PLAN_ONLY
    )
    assert code == 2
    assert "config error: trainer.freeze: 'nope.*' matches no parameter" in out + err


def test_a_lora_export_is_the_merged_model_and_a_peft_adapter_for_the_base(tmp_path):
    """``trainer.export=hf`` of a LoRA run on a pretrained Hugging Face Llama: the
    export is the merged model (transformers opens it, the same logits as the run's
    model), and its ``adapter/`` dir is a peft adapter that ``PeftModel`` puts on
    the base checkpoint with the same logits again."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from src.build import build_model
    from src.checkpoint.export import PEFT_ADAPTER_DIR, export_model_hf
    from src.config.run_plan import resolve
    from src.data.tokenizer import byte_tokenizer
    from src.sharding import adapted_layers, build_backend
    from src.sharding.lora import ADAPTER
    from tests.test_config import make_cfg

    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=352,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=128, tie_word_embeddings=False,
            rms_norm_eps=1e-5, rope_theta=10000.0,
        )
    ).save_pretrained(base_dir)  # fmt: skip
    cfg = make_cfg(
        "model=llama_tiny", "model.n_layers=2", f"model.pretrained={base_dir}", *LORA
    )
    resolved = resolve(cfg)
    model = build_model(resolved, build_backend("none", "fp32", "cpu")).eval()
    with torch.no_grad():  # a trained adapter: B no longer zero
        for _, layer in adapted_layers(model):
            layer.lora_B[ADAPTER].weight.normal_(0, 0.05)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x)[0]
    out = tmp_path / "hf"
    export_model_hf(
        model, out, resolved.spec.hf, resolved.model_config, byte_tokenizer()
    )
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    adapted = PeftModel.from_pretrained(base, out / PEFT_ADAPTER_DIR).eval()
    with torch.no_grad():
        assert (merged(x).logits - ours).abs().max() < 1e-5
        assert (adapted(x).logits - ours).abs().max() < 1e-5
        with adapted.disable_adapter():  # the base alone: the adapters did change it
            assert (adapted(x).logits - ours).abs().max() > 1e-3
