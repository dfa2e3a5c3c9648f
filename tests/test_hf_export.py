"""``trainer.export=hf`` for the native families: GPT as transformers' GPT2LMHeadModel
(Conv1D transposes, tied head), the run's tokenizer next to the weights (byte and
BPE, opened by AutoTokenizer) and the tokenizer's special ids in config.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from src.build import build_model
from src.checkpoint.export import export_model_hf
from src.config.cli import CONFIG_ERRORS, one_line
from src.config.run_plan import resolve
from src.config.validate import validate
from src.data.sources import tokenizer_of
from src.data.tokenizer import BPE_EOS, byte_tokenizer
from src.sharding import build_backend
from src.trainer.loop import train
from tests.distributed import HANG_S, run_distributed
from tests.records import said

ROOT = Path(__file__).resolve().parents[1]
TEXT = 'héllo wörld,\n\t"quoted" zß€ 😀 <0x00> <|end>\x00 and more text. ' * 3


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out.logits


@pytest.mark.parametrize(
    "preset, shape, architecture",
    [
        ("tiny", "model.dropout=0.0", "GPT2LMHeadModel"),
        ("llama_tiny", "model.n_layers=2", "LlamaForCausalLM"),
    ],
)
def test_native_family_exports_with_the_byte_tokenizer_and_loads_back(
    tmp_path, preset, shape, architecture
):
    """One process: the native model's logits equal those of the transformers model
    opened from its export (GPT: GPT2LMHeadModel, Conv1D transposes, tied head),
    AutoTokenizer encodes as the byte tokenizer, config.json has its ids; and the
    export loads back into the native model (model.pretrained)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = [f"model={preset}", shape, "sharding=none", "trainer.devices=1"]
    cfg = make_cfg(*common)
    validate(cfg)
    resolved = resolve(cfg)
    model = build_model(resolved, build_backend("none", "fp32", "cpu")).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ours = _logits(model, x)
    out = tmp_path / "hf"
    export_model_hf(
        model, out, resolved.spec.hf, resolved.model_config, byte_tokenizer()
    )
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == architecture
    assert (ours - _logits(exported, x)).abs().max() < 1e-5
    if preset == "tiny":
        assert exported.lm_head.weight is exported.transformer.wte.weight  # tied

    saved = json.loads((out / "config.json").read_text())
    assert saved["eos_token_id"] == 0  # the byte tokenizer ends documents with NUL
    assert saved["bos_token_id"] is None and saved["pad_token_id"] is None
    tok = AutoTokenizer.from_pretrained(out)
    assert tok(TEXT)["input_ids"] == list(TEXT.encode())  # = the run's byte ids
    assert tok.eos_token_id == 0 and tok.decode(list(TEXT.encode())) == TEXT

    # And back: the export as model.pretrained of the native model (GPT's Conv1D
    # weights transposed again on load).
    back_cfg = make_cfg(*common, f"model.pretrained={out}")
    validate(back_cfg)
    back = build_model(resolve(back_cfg), build_backend("none", "fp32", "cpu"))
    assert (ours - _logits(back.eval(), x)).abs().max() < 1e-6


def test_gpt_export_refuses_a_shape_gpt2_cannot_hold():
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(make_cfg("model=tiny", "model.bias=false", "trainer.export=hf"))
    message = one_line(info.value)
    assert (
        message.startswith("trainer.export: model.bias=false") and "\n" not in message
    )


def _train_and_export(rank: int, world: int, run_dir: str, overrides: list) -> dict:
    cfg = make_cfg(*overrides)
    train(cfg, run_dir, torch.device("cpu"), validate(cfg))
    tokenizer = tokenizer_of(cfg.data)
    # The export loaded back into the sharded GPT (each rank reads the transpose of
    # its own slices): its logits, to compare with GPT2LMHeadModel's.
    back = make_cfg(*overrides, f"model.pretrained={run_dir}/hf")
    model = build_model(resolve(back), build_backend("fsdp2", "fp32", "cpu"))
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    return {
        "eos": tokenizer.eos_id,
        "ids": tokenizer.encode([TEXT.encode()])[0],
        "x": x,
        "logits": _logits(model.eval(), x),
    }


@pytest.mark.slow
def test_trainer_exports_the_bpe_tokenizer_and_its_eos(tmp_path):
    """The trainer's path on 2 ranks (FSDP2: the Conv1D transposes are written from
    each rank's slices): model=tiny on a text file with a BPE, trainer.export=hf."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    run_dir = tmp_path / "run"
    overrides = [
        "model=tiny",
        "model.vocab_size=320",  # the launcher would make it follow the BPE's 300
        "data=files",
        f"data.paths={corpus}",
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=300",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.devices=2",
        "trainer.batch_size=4",
        "trainer.max_steps=2",
        "trainer.val_every=0",
        "trainer.progress=false",
        "trainer.peak_tflops=1",
        "trainer.export=hf",
        "logger=none",
    ]
    # The launcher builds the token cache (and the BPE) before the ranks start.
    from src.data.sources import prepare_data

    prepare_data(make_cfg(*overrides).data, verbose=False)
    result = run_distributed(_train_and_export, 2, str(run_dir), overrides)[0]
    out = run_dir / "hf"
    saved = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert saved["eos_token_id"] == result["eos"] == tok.convert_tokens_to_ids(BPE_EOS)
    assert tok.eos_token == BPE_EOS and saved["bos_token_id"] is None
    assert tok(TEXT)["input_ids"] == result["ids"].tolist()  # as the run encodes
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert (_logits(model, result["x"]) - result["logits"]).abs().max() < 1e-5


#: Every family's export (issue 49 item 1): the native GPT and Llama, and each tiny
#: transformers config in conf/hf_configs.
EXPORTED = [
    ["model=tiny"],
    ["model=llama_tiny", "model.n_layers=2"],
    *(
        ["model=hf", f"model.config={p.name}"]
        for p in sorted((ROOT / "conf" / "hf_configs").iterdir())
    ),
]
PROMPT = "def main():\n    return 42  # héllo, wörld"


def _opens_and_generates(out: Path, prompt_ids: list[int]) -> None:
    """``out`` opens with AutoTokenizer and AutoModelForCausalLM, the prompt's ids
    round-trip, config.json has the KV cache on, and greedy generate continues it
    (with the cache, as without)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == prompt_ids and tok.decode(ids[0]) == PROMPT
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.use_cache is True
    new = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert new.shape == (1, ids.shape[1] + 4) and (new[0, : ids.shape[1]] == ids).all()
    plain = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert (plain == new).all()


@pytest.mark.parametrize(
    "overrides",
    EXPORTED,
    ids=lambda o: o[len(o) - 1 if o[0] == "model=hf" else 0].split("=")[-1],
)
def test_every_family_export_opens_encodes_and_generates(tmp_path, overrides):
    """One process, no training: each family's export (byte tokenizer) opens with
    AutoTokenizer (Qwen2's is rebuilt by transformers from the vocabulary alone: the
    byte-level vocabulary makes it encode as the run) and AutoModelForCausalLM, and
    generates from a prompt whose ids are the run's."""
    cfg = make_cfg(*overrides, "sharding=none", "trainer.devices=1")
    validate(cfg)
    resolved = resolve(cfg)
    model = build_model(resolved, build_backend("none", "fp32", "cpu"))
    tokenizer = byte_tokenizer()
    export_model_hf(
        model, tmp_path / "hf", resolved.spec.hf, resolved.model_config, tokenizer
    )
    _opens_and_generates(tmp_path / "hf", tokenizer.encode_text(PROMPT))
    if overrides[0] == "model=hf":  # the model's own config keeps training's choice
        assert resolved.model_config.hf_config.use_cache is False


@pytest.mark.slow
def test_readme_qwen2_export_round_trips(tmp_path):
    """The README's command (1 rank, 2 steps): the Qwen2 export encodes prompts and
    generates, and says nothing about a tokenizer mismatch."""
    from tests.test_config import run_train

    out = run_train(
        "model=hf", "model.config=tiny_qwen2", "trainer.export=hf",
        "trainer.devices=1", "trainer.max_steps=2", "trainer.val_every=0",
        "trainer.progress=false", "logger=none", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "AutoTokenizer opens" not in out.stdout + out.stderr
    _opens_and_generates(tmp_path / "hf", byte_tokenizer().encode_text(PROMPT))


def test_export_warns_when_autotokenizer_encodes_unlike_the_run(tmp_path, caplog):
    """A BPE whose merges cross Qwen2's digit split (``42`` one token): transformers
    rebuilds Qwen2's tokenizer with its own pre-tokenization, which encodes the probe
    text otherwise; the export says so in one warning. Llama's export opens the
    tokenizer as written: no warning."""
    import logging

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from src.data.tokenizer import Tokenizer

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    vocab["42"] = len(vocab)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("4", "2")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    tokenizer = Tokenizer("bpe-257", len(vocab), vocab["Ċ"], hf)
    for family, warned in [("tiny_qwen2", True), ("tiny_llama", False)]:
        cfg = make_cfg("model=hf", f"model.config={family}", "sharding=none",
                       "trainer.devices=1")  # fmt: skip
        resolved = resolve(cfg)
        model = build_model(resolved, build_backend("none", "fp32", "cpu"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="src.checkpoint.export"):
            export_model_hf(
                model, tmp_path / family, resolved.spec.hf, resolved.model_config,
                tokenizer,
            )  # fmt: skip
        lines = said(caplog, "src.checkpoint.export")
        expected = [
            f"trainer.export=hf: AutoTokenizer opens {tmp_path / family} as "
            "Qwen2Tokenizer, which encodes "
        ]
        assert [x[: len(expected[0])] for x in lines] == (expected if warned else [])


def test_exports_during_training_and_of_any_checkpoint_after(tmp_path):
    """``trainer.export_every`` writes each step's export into exports/step_N/ (issue
    57/6), the last one equal to the run's final ``trainer.export``; export.py writes
    any checkpoint of the run after it ended, as the trainer does (the same tensors),
    into its step's export dir or ``out``; a bad key of export.py is one line."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
            timeout=HANG_S, env=env,
        )  # fmt: skip

    trained = run(
        "train.py", "model=tiny", "data=text", "trainer.devices=1", "logger=none",
        "trainer.max_steps=2", "trainer.val_every=0", "trainer.progress=false",
        "trainer.ckpt_every=1", "trainer.export=hf", "trainer.export_every=1",
        f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    steps = sorted(p.name for p in (run_dir / "exports").iterdir())
    assert steps == ["step_00000001", "step_00000002"]

    def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
        (file,) = hf_dir.glob("*.safetensors")
        return load_file(file)

    final = tensors(run_dir / "hf")
    last = tensors(run_dir / "exports" / "step_00000002" / "hf")
    first = tensors(run_dir / "exports" / "step_00000001" / "hf")
    assert all(torch.equal(final[k], last[k]) for k in final)
    assert any(not torch.equal(final[k], first[k]) for k in final)  # a step apart

    step1 = run_dir / "checkpoints" / "step_00000001"
    tool = run("export.py", f"run={step1}", f"out={tmp_path / 'tool'}")
    assert tool.returncode == 0, tool.stderr
    assert f"(step 1) to {tmp_path / 'tool' / 'hf'}" in tool.stdout
    again = tensors(tmp_path / "tool" / "hf")
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)

    bad = run("export.py", f"run={run_dir}", "format=onnx")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "config error: format: got 'onnx', expected one of: hf, safetensors"
    )
