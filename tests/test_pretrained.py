"""Pretrained weights in, trained weights out (``model.pretrained``,
``trainer.export=hf``), never whole on a rank; bad input is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from src.build import build_model
from src.checkpoint.export import export_hf
from src.config.cli import CONFIG_ERRORS, one_line
from src.config.run_plan import model_config, model_spec, resolve
from src.config.validate import validate
from src.harness import compose_config
from src.sharding import build_backend
from src.trainer.loop import train
from src.trainer.optimizer import build_optimizer
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(*overrides: str):
    return compose_config(*overrides)


def save_tiny(directory: Path, name: str = "tiny_qwen2", seed: int = 1) -> Path:
    """A tiny transformers model saved by save_pretrained (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ROOT / "conf" / "hf_configs" / name)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def logits_of_transformers(directory: Path, x: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(x).logits


def _round_trip(rank: int, world: int, src: str, out: str, run_dir: str) -> dict:
    # model.config defaults to the pretrained directory; the run's block_size (16)
    # is shorter than the config's 128 positions.
    overrides = ["model=hf", f"model.pretrained={src}", "model.block_size=16"]
    cfg = make_cfg(*overrides, "sharding.policy=block", "trainer.lr=1e-2")
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = x[:, :-1], x[:, 1:]
    resolved = resolve(cfg)
    model = build_model(resolved, build_backend("fsdp2", "fp32", "cpu")).eval()
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        loaded = model(inputs)[0]
    result = {"load": (loaded - logits_of_transformers(Path(src), inputs)).abs().max()}
    optimizer = build_optimizer(model, cfg, resolved.spec)
    model.train()
    losses = []
    for _ in range(3):
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        trained = model(inputs)[0]
    spec, config = model_spec(cfg), model_config(cfg)
    export_hf(model, out, spec.hf.to_hf_name, spec.hf.hf_config(config))
    result["export"] = (trained - logits_of_transformers(Path(out), inputs)).abs().max()
    result.update(losses=losses, local=local, total=total)
    # The trainer's own path: load, train 2 steps, trainer.export=hf.
    run = make_cfg(
        *overrides,
        "trainer.export=hf",
        "trainer.max_steps=2",
        "trainer.batch_size=4",
        "trainer.val_every=0",
        "trainer.progress=false",
        "trainer.peak_tflops=1",
        "logger=none",
        "data=synthetic",
        "data.num_tokens=5000",
    )
    result["summary"] = train(run, run_dir, torch.device("cpu"), validate(run))
    return result


@pytest.mark.slow
def test_round_trip_load_sharded_train_export_reload(tmp_path):
    src = save_tiny(tmp_path / "src")
    out, run_dir = tmp_path / "out", tmp_path / "run"
    results = run_distributed(_round_trip, 2, str(src), str(out), str(run_dir))
    for r in results:
        assert r["load"] < 1e-5 and r["export"] < 1e-5, r
        assert r["losses"][-1] < r["losses"][0]
        assert r["local"] < 0.6 * r["total"]  # each rank holds about half
    assert {p.name for p in out.iterdir()} >= {"config.json"}
    assert not (out / "sharded").exists()
    exported = run_dir / "hf"
    assert (exported / "config.json").is_file()
    x = torch.randint(0, 256, (1, 16))
    assert torch.isfinite(logits_of_transformers(exported, x)).all()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("hf") / "llama", "tiny_llama")


def pretrained_error(*overrides: str) -> str:
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(make_cfg(*overrides))
    message = one_line(info.value)
    assert "\n" not in message
    return message


def test_missing_pretrained_dir_is_one_line(tmp_path):
    message = pretrained_error("model=hf", f"model.pretrained={tmp_path}/nothing")
    assert message.startswith("model.pretrained: no such directory")
    message = pretrained_error(
        "model=hf", "model.config=tiny_llama", f"model.pretrained={tmp_path}"
    )
    assert message.startswith("model.pretrained: no .safetensors files")


def test_shape_mismatch_names_the_first_parameter_and_both_shapes(tiny_llama_dir):
    """llama_tiny (dim 128) from a Hugging Face Llama of width 64: the embedding is
    the first parameter whose shape differs."""
    message = pretrained_error(
        "model=llama_tiny", "model.n_layers=2", f"model.pretrained={tiny_llama_dir}"
    )
    assert message == (
        "model.pretrained: shape mismatch at model.embed_tokens.weight: "
        "checkpoint (256, 64) vs model (256, 128)"
    )


def test_checkpoint_with_more_layers_than_the_model_is_refused(tiny_llama_dir):
    message = pretrained_error(
        "model=llama_tiny",
        "model.dim=64",
        "model.n_layers=1",
        "model.multiple_of=16",
        f"model.pretrained={tiny_llama_dir}",
    )
    assert message.startswith("model.pretrained:")
    assert (
        "'model.layers.1.input_layernorm.weight', which the configured model has not"
        in message
    )


def test_pretrained_and_export_need_a_hugging_face_adapter(tiny_llama_dir):
    # Every native family has one (GPT's is GPT2LMHeadModel); a user's own model not.
    custom = ["model=custom", "model._target_=tests.test_models.TinyLM"]
    message = pretrained_error(*custom, f"model.pretrained={tiny_llama_dir}")
    assert message.startswith("model.pretrained:") and "'custom'" in message
    assert pretrained_error(*custom, "trainer.export=hf").startswith(
        "trainer.export: hf needs a Hugging Face adapter"
    )
    # GPT has one: a Llama checkpoint is refused for its names, not for the family.
    message = pretrained_error("model=tiny", f"model.pretrained={tiny_llama_dir}")
    assert (
        message.startswith("model.pretrained:")
        and "which the configured model has not" in message
    )
    assert pretrained_error("trainer.export=onnx").startswith("trainer.export: got")


def test_llama_family_loads_hugging_face_llama_weights(tiny_llama_dir):
    """The Llama family's adapter: a transformers Llama checkpoint of the same shape
    loads into our Llama (one process), logits equal."""
    cfg = make_cfg(
        "model=llama_tiny",
        "model.dim=64",
        "model.n_layers=2",
        "model.multiple_of=16",
        "model.norm_eps=1e-6",
        f"model.pretrained={tiny_llama_dir}",
        "sharding=none",
        "trainer.devices=1",
    )
    validate(cfg)
    model = build_model(resolve(cfg), build_backend("none", "fp32", "cpu")).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ours = model(x)[0]
    assert (ours - logits_of_transformers(tiny_llama_dir, x)).abs().max() < 1e-5


def test_pretrained_vocabulary_does_not_follow_the_tokenizer(tiny_llama_dir):
    """A checkpoint fixes the vocabulary: the tokenizer must fit in it, not resize it."""
    from src.data.sources import follow_tokenizer_vocab

    cfg = make_cfg("model=hf", f"model.pretrained={tiny_llama_dir}")
    resolved = resolve(cfg)
    follow_tokenizer_vocab(
        cfg, resolved.spec, resolved.model_config, {"vocab_size": 100}, set()
    )
    assert cfg.model.vocab_size is None  # the checkpoint's 256 stays
    with pytest.raises(CONFIG_ERRORS) as info:
        follow_tokenizer_vocab(
            cfg, resolved.spec, resolved.model_config, {"vocab_size": 300}, set()
        )
    assert "use the model's own tokenizer" in one_line(info.value)


def _byte_tokenizer_json(path: Path, extra: int = 0) -> None:
    """A byte-level tokenizer.json of 256 + ``extra`` ids (the byte ``\\n`` ends a
    document)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab.update({f"<extra_{i}>": 256 + i for i in range(extra)})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.save(str(path))


def test_pretrained_dir_with_a_tokenizer_uses_it_by_default(tmp_path, caplog):
    """``model=hf model.pretrained=DIR`` with DIR/tokenizer.json: data.tokenizer is DIR
    (a line says so; the recorded config and data.json hold it); data.tokenizer on the
    command line keeps the user's; a tokenizer.json bigger than the embedding is one
    line (issue 57 item 1)."""
    import logging

    from src.trainer.launch import prepare

    model_dir = save_tiny(tmp_path / "llama", "tiny_llama")  # vocabulary 256
    _byte_tokenizer_json(model_dir / "tokenizer.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def main():\n    return 42\n" * 400)
    args = ("model=hf", f"model.pretrained={model_dir}", "data=files",
            f"data.paths={corpus}", f"data.cache_dir={tmp_path}/cache",
            "data.eos_token='Ċ'", "sharding=none", "trainer.devices=1",
            "logger=none")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="src.data.sources"):
        cfg, plan = prepare(make_cfg(*args), set(), run_dir=str(tmp_path / "run"))
    assert cfg.data.tokenizer == str(model_dir)
    assert plan.run_config["data"]["tokenizer"] == str(model_dir)  # the recorded one
    assert plan.data_record is not None
    assert str(model_dir) in str(plan.data_record.fields["tokenizer"])
    assert any(
        r.getMessage().startswith(f"data.tokenizer={model_dir}: the pretrained model's")
        for r in caplog.records
    )
    cfg, _ = prepare(make_cfg(*args, "data.tokenizer=byte"), {"data.tokenizer"})
    assert cfg.data.tokenizer == "byte"  # the user's choice stays
    _byte_tokenizer_json(model_dir / "tokenizer.json", extra=44)  # 300 ids
    with pytest.raises(CONFIG_ERRORS) as info:
        prepare(make_cfg(*args), user_keys=set())
    message = one_line(info.value)
    assert "\n" not in message and message.startswith("model.pretrained: vocabulary")
    assert "does not fit its own weights" in message
