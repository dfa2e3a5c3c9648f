"""Hugging Face causal LMs under the wrap context (``model=hf model.config=...``):
sharded training equals unsharded on four families, meta init, bad configs."""

from __future__ import annotations

import json

import pytest
import torch

from src.build import build_model
from src.config.cli import CONFIG_ERRORS, one_line
from src.config.run_plan import model_config, model_spec, resolve
from src.config.validate import validate
from src.harness import compose_config
from src.sharding import build_backend, wrap_plan
from src.trainer.optimizer import build_optimizer
from tests.distributed import run_distributed
from tests.records import said

FAMILIES = ["tiny_gpt2", "tiny_llama", "tiny_qwen2", "tiny_gpt_neox"]


def make_cfg(*overrides: str):
    return compose_config(*overrides)


def hf_cfg(name: str, *overrides: str):
    return make_cfg(
        "model=hf", f"model.config={name}", "model.block_size=16", *overrides
    )


def test_block_classes_are_the_models_no_split_modules():
    for name in FAMILIES:
        cfg = hf_cfg(name)
        validate(cfg)
        spec, config = model_spec(cfg), model_config(cfg)
        names = set(config.skeleton()._no_split_modules)
        assert {c.__name__ for c in spec.block_classes(config)} == names


def _losses(model, optimizer, batches) -> list[float]:
    out = []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def _sharded_vs_unsharded(rank: int, world: int, names: list[str]) -> dict:
    """Per family: 3 AdamW steps unsharded and sharded (every rank sees the whole
    batch, so the averaged gradients equal the unsharded ones)."""
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3, 4, 17), generator=gen)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    result = {}
    for name in names:
        cfg = hf_cfg(name, "sharding.policy=block", "trainer.lr=3e-3")
        runs = []
        for backend_name in ("none", "fsdp2"):
            backend = build_backend(backend_name, "fp32", "cpu")
            resolved = resolve(cfg)
            model = build_model(resolved, backend)
            runs.append(
                _losses(model, build_optimizer(model, cfg, resolved.spec), batches)
            )
        units = len(wrap_plan(model, world).units)
        result[name] = (runs, units)
    torch.distributed.barrier()  # both ranks done before either tears down
    return result


@pytest.mark.slow
def test_sharded_losses_equal_unsharded_on_four_families():
    result = run_distributed(_sharded_vs_unsharded, 2, FAMILIES)[0]
    for name, ((plain, sharded), units) in result.items():
        assert units == 3, (name, units)  # 2 decoder layers + the root
        assert plain[-1] < plain[0], name
        for a, b in zip(plain, sharded, strict=True):
            assert abs(a - b) < 1e-5, (name, plain, sharded)


def test_meta_init_builds_every_tensor_from_its_name():
    """Meta build: every parameter and buffer finite, norms at 1, the rotary buffer
    equal to transformers' own, the tied head tied; deterministic by name."""
    cfg = hf_cfg(
        "tiny_qwen2", "model.init_device=meta", "sharding=none", "trainer.devices=1"
    )
    validate(cfg)
    backend = build_backend("none", "fp32", "cpu")
    a, b = (
        build_model(resolve(cfg), backend),
        build_model(resolve(cfg), backend),
    )
    ref = model_spec(cfg).build(model_config(cfg), 0)  # cpu, transformers' init
    for (name, t), (_, u) in zip(
        a.state_dict().items(), b.state_dict().items(), strict=True
    ):
        assert torch.isfinite(t).all() and torch.equal(t, u), name
    assert torch.equal(a.hf.model.rotary_emb.inv_freq, ref.hf.model.rotary_emb.inv_freq)
    assert torch.equal(a.hf.model.norm.weight, torch.ones(64))
    assert a.hf.lm_head.weight is a.hf.model.embed_tokens.weight
    x = torch.randint(0, 256, (2, 16))
    assert abs(a(x, x)[1].item() - ref(x, x)[1].item()) < 0.2  # both near ln(256)


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["model=hf"], "model.config", "missing"),
        (["model=hf", "model.config=/no/such/dir"], "model.config", "tiny_llama"),
        (
            ["model=hf", "model.config=tiny_llama", "model.block_size=4096"],
            "model.block_size",
            "128",
        ),
    ],
)
def test_bad_hf_config_is_one_line(overrides, key, words):
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(make_cfg(*overrides))
    message = one_line(info.value)
    assert message.startswith(key) and words in message and "\n" not in message


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"model_type": "no_such_arch"}, "transformers cannot read"),
        ({"model_type": "vit"}, "not a causal LM"),
    ],
)
def test_config_transformers_cannot_build_is_one_line(tmp_path, config, words):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(make_cfg("model=hf", f"model.config={tmp_path}"))
    message = one_line(info.value)
    assert message.startswith("model.config") and words in message, message
    assert "\n" not in message


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_configs_dtype_never_changes_the_training_dtype(tmp_path, caplog, key):
    """A config.json saying bfloat16 (or float16) under precision=fp32: the
    parameters are float32 (the backend casts from them per ``precision``) and one
    line says the config's dtype is not used."""
    import logging
    import shutil

    from src.models.hf import SHIPPED, HFConfig, build

    for dtype in ("bfloat16", "float16"):
        path = tmp_path / f"{key}_{dtype}"
        shutil.copytree(SHIPPED / "tiny_llama", path)
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, key: dtype}))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="src.models.hf"):
            config = HFConfig(config=str(path), block_size=16)
        # the tmp path (named after this test) holds "dtype": the message's words
        lines = [m for m in said(caplog, "src.models.hf") if " says dtype " in m]
        assert lines == [
            f"model.config: {path} says dtype {dtype}; not used: precision sets "
            "the training dtype (parameters are built in float32)"
        ]
        model = build(config, seed=0)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        with torch.device("meta"):
            assert {p.dtype for p in config.skeleton().parameters()} == {torch.float32}
