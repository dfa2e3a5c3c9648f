"""Hugging Face inputs that used to be wrong in quiet ways (issue 26): MoE weights in
the layout save_pretrained writes, models that are not causal, and a config
directory's own code (``model.trust_remote_code``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from src.config import CONFIG_ERRORS, one_line, validate
from src.sharding import build_backend
from src.trainer.export import export_hf
from src.trainer.loop import build_model, build_optimizer
from src.trainer.resolved import resolve
from tests.distributed import run_distributed
from tests.test_pretrained import logits_of_transformers, make_cfg, save_tiny

MOE = ("tiny_mixtral", "tiny_qwen3_moe")


def tensor_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names


def _moe_round_trips(rank: int, world: int, cases: list[tuple[str, str]]) -> dict:
    """Per architecture: load save_pretrained's layout sharded, logits as
    transformers'; one step; export; transformers' logits of the export as ours."""
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = x[:, :-1], x[:, 1:]
    results = {}
    for src, out in cases:
        cfg = make_cfg(
            "model=hf",
            f"model.pretrained={src}",
            "model.block_size=16",
            "sharding.policy=block",
            "trainer.lr=1e-2",
        )
        resolved = resolve(cfg)
        backend = build_backend("fsdp2", "fp32", "cpu")
        model = build_model(cfg, backend, resolved).eval()
        experts = [p for n, p in model.named_parameters() if "experts" in n]
        with torch.no_grad():
            loaded = model(inputs)[0]
        r = {"load": (loaded - logits_of_transformers(Path(src), inputs)).abs().max()}
        optimizer = build_optimizer(model, cfg)
        model.train()
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            trained = model(inputs)[0]
        hf, config = resolved.spec.hf, resolved.model_config
        export_hf(
            model,
            out,
            hf.to_hf_name,
            hf.hf_config(config),
            hf.converting_model(config),
        )
        r["export"] = (trained - logits_of_transformers(Path(out), inputs)).abs().max()
        r["moved"] = (trained - loaded).abs().max()
        r["expert_share"] = sum(p.to_local().numel() for p in experts) / sum(
            p.numel() for p in experts
        )
        results[src] = r
    return results


@pytest.mark.slow
def test_moe_weights_round_trip_in_save_pretrained_layout(tmp_path):
    """Mixtral and Qwen3-MoE (one tensor per expert on disk, fused in memory) on 2
    ranks: load -> logits equal -> a step -> export in save_pretrained's layout ->
    from_pretrained -> logits equal."""
    from transformers import AutoModelForCausalLM

    cases = []
    for name in MOE:
        src = save_tiny(tmp_path / name, name)
        assert any(".experts.0." in n for n in tensor_names(src))  # per expert
        validate(make_cfg("model=hf", f"model.pretrained={src}"))
        cases.append((str(src), str(tmp_path / f"{name}_out")))
    results = run_distributed(_moe_round_trips, 2, cases)
    for src, out in cases:
        for r in results:
            assert r[src]["load"] < 1e-5 and r[src]["export"] < 1e-5, (src, r)
            assert r[src]["moved"] > 1e-4  # the step changed the weights
            assert 0.4 < r[src]["expert_share"] < 0.6  # each rank holds half
        assert tensor_names(Path(out)) == tensor_names(Path(src))
        _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info.values()), info  # nothing missing, unexpected, ...


def test_moe_checkpoint_with_fewer_experts_names_an_expert_tensor(tmp_path):
    """The shape check speaks the on-disk layout: a 4-expert Mixtral checkpoint for
    an 8-expert config is named by its on-disk router name."""
    from transformers import AutoConfig

    src = save_tiny(tmp_path / "src", "tiny_mixtral")
    config = AutoConfig.from_pretrained(src)
    config.num_local_experts = 8
    config.save_pretrained(tmp_path / "cfg")
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(
            make_cfg(
                "model=hf",
                f"model.config={tmp_path / 'cfg'}",
                f"model.pretrained={src}",
            )
        )
    message = one_line(info.value)
    assert message.startswith("model.pretrained:") and "\n" not in message
    assert message == (
        "model.pretrained: shape mismatch at model.layers.0.block_sparse_moe.gate."
        "weight: checkpoint (4, 64) vs model (8, 64)"
    )
