"""Hugging Face inputs that used to be wrong in quiet ways (issue 26): MoE weights in
the layout save_pretrained writes, models that are not causal, and a config
directory's own code (``model.trust_remote_code``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from src.build import build_model
from src.checkpoint.export import export_model_hf
from src.config.cli import CONFIG_ERRORS, one_line
from src.config.run_plan import resolve
from src.config.validate import validate
from src.sharding import build_backend
from src.trainer.optimizer import build_optimizer
from tests.distributed import run_distributed
from tests.records import said
from tests.test_pretrained import (
    logits_of_transformers,
    make_cfg,
    save_tiny,
)
from tests.test_pretrained import pretrained_error as config_error

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
        model = build_model(resolved, backend).eval()
        experts = [p for n, p in model.named_parameters() if "experts" in n]
        with torch.no_grad():
            loaded = model(inputs)[0]
        r = {"load": (loaded - logits_of_transformers(Path(src), inputs)).abs().max()}
        optimizer = build_optimizer(model, cfg, resolved.spec)
        model.train()
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            trained = model(inputs)[0]
        export_model_hf(model, out, resolved.spec.hf, resolved.model_config)
        r["export"] = (trained - logits_of_transformers(Path(out), inputs)).abs().max()
        r["moved"] = (trained - loaded).abs().max()
        r["expert_share"] = sum(p.to_local().numel() for p in experts) / sum(
            p.numel() for p in experts
        )
        results[src] = r
    # FSDP1's sharded tensors: a group assembled from every rank's shards.
    src, out = cases[-1]
    cfg = make_cfg("model=hf", f"model.pretrained={src}", "sharding=fsdp1")
    resolved = resolve(cfg)
    model = build_model(resolved, build_backend("fsdp1", "fp32", "cpu")).eval()
    with torch.no_grad():
        ours = model(inputs)[0]
    out = f"{out}_fsdp1"
    export_model_hf(model, out, resolved.spec.hf, resolved.model_config)
    results["fsdp1"] = {
        "load": (ours - logits_of_transformers(Path(src), inputs)).abs().max(),
        "export": (ours - logits_of_transformers(Path(out), inputs)).abs().max(),
    }
    return results


def save_fused(src: Path, dst: Path) -> Path:
    """``src``'s model saved with the names and fused experts transformers 5 holds in
    memory (``mlp.experts.gate_up_proj`` [E, 2I, H]), which it opens as well."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_moe_weights_round_trip_in_save_pretrained_layout(tmp_path):
    """Mixtral and Qwen3-MoE (one tensor per expert on disk, fused in memory) on 2
    ranks with FSDP2: load -> logits equal -> a step -> export in save_pretrained's
    layout -> from_pretrained -> logits equal; the same from their fused in-memory
    layout (issue 57/13); and Qwen3-MoE's load and export with FSDP1."""
    from transformers import AutoModelForCausalLM

    cases, per_expert = [], {}
    for name in MOE:
        src = save_tiny(tmp_path / name, name)
        assert any(".experts.0." in n for n in tensor_names(src))  # per expert
        fused = save_fused(src, tmp_path / f"{name}_fused")
        assert any(n.endswith("experts.gate_up_proj") for n in tensor_names(fused))
        for directory in (src, fused):
            validate(make_cfg("model=hf", f"model.pretrained={directory}"))
            cases.append((str(directory), str(tmp_path / f"{directory.name}_out")))
            per_expert[str(directory)] = src
    results = run_distributed(_moe_round_trips, 2, cases)
    for r in results:
        assert r["fsdp1"]["load"] < 1e-5 and r["fsdp1"]["export"] < 1e-5, r
    for src, out in cases:
        for r in results:
            assert r[src]["load"] < 1e-5 and r[src]["export"] < 1e-5, (src, r)
            assert r[src]["moved"] > 1e-4  # the step changed the weights
            assert 0.4 < r[src]["expert_share"] < 0.6  # each rank holds half
        # exported in save_pretrained's layout whichever layout it was read from
        assert tensor_names(Path(out)) == tensor_names(per_expert[src])
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


def test_models_that_are_not_causal_are_refused(tmp_path):
    """BERT (BertLMHeadModel, is_decoder=false) sees later tokens: refused by the
    probe, named encoder-only; BART is an encoder-decoder config; BERT with
    is_decoder=true is causal and builds."""
    from transformers import BartConfig, BertConfig

    small = dict(vocab_size=256, max_position_embeddings=128, hidden_size=32)
    BertConfig(
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, **small
    ).save_pretrained(tmp_path / "bert")
    message = config_error("model=hf", f"model.config={tmp_path / 'bert'}")
    assert message.startswith("model.config: 'bert' in "), message
    assert "encoder-only config (is_decoder=false)" in message
    assert "see the future" in message
    BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, **small).save_pretrained(
        tmp_path / "bart"
    )
    message = config_error("model=hf", f"model.config={tmp_path / 'bart'}")
    assert message.startswith("model.config: 'bart' in ")
    assert "encoder-decoder config" in message
    BertConfig(
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        is_decoder=True,
        **small,
    ).save_pretrained(tmp_path / "bert_decoder")
    validate(make_cfg("model=hf", f"model.config={tmp_path / 'bert_decoder'}"))


CUSTOM_CONFIG = """
from pathlib import Path
from transformers import LlamaConfig

Path("{directory}", "ran").write_text("the directory's code ran")


class TinyCustomConfig(LlamaConfig):
    model_type = "{model_type}"
"""

CUSTOM_MODEL = """
from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


def custom_code_dir(directory: Path, model_type: str) -> Path:
    """tiny_llama's config with its own classes (auto_map), whose code leaves a file
    named ``ran`` in ``directory`` when it runs."""
    import json

    from tests.test_pretrained import ROOT

    directory.mkdir()
    config = json.loads((ROOT / "conf/hf_configs/tiny_llama/config.json").read_text())
    config.update(
        model_type=model_type,
        auto_map={
            "AutoConfig": "configuration_tiny.TinyCustomConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
        },
    )
    (directory / "config.json").write_text(json.dumps(config))
    code = CUSTOM_CONFIG.replace("{model_type}", model_type)
    code = code.replace("{directory}", str(directory))  # transformers copies the code
    (directory / "configuration_tiny.py").write_text(code)
    (directory / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    return directory


def test_a_config_directorys_code_runs_only_when_trusted(tmp_path, caplog):
    """model.trust_remote_code=false (default): a config with auto_map is refused,
    whatever its model type, and its code never runs; true: its classes build the
    model and the run says so."""
    for model_type in ("tiny_custom_26", "llama"):  # unknown and known to transformers
        directory = custom_code_dir(tmp_path / model_type, model_type)
        message = config_error("model=hf", f"model.config={directory}")
        assert message.startswith("model.trust_remote_code: "), message
        assert "auto_map: AutoConfig, AutoModelForCausalLM" in message
        assert "model.trust_remote_code=true" in message
        assert not (directory / "ran").exists()
    directory = tmp_path / "tiny_custom_26"
    cfg = make_cfg(
        "model=hf",
        f"model.config={directory}",
        "model.trust_remote_code=true",
        "sharding=none",
        "trainer.devices=1",
    )
    with caplog.at_level("WARNING", logger="src.models.hf"):
        validate(cfg)
    assert (directory / "ran").exists()
    (line,) = said(caplog, "src.models.hf", starts="model.trust_remote_code=true")
    assert line.startswith("model.trust_remote_code=true: running the code in ")
    model = build_model(resolve(cfg), build_backend("none", "fp32", "cpu"))
    assert type(model.hf).__name__ == "TinyCustomForCausalLM"
    x = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(model(x, x)[1])
