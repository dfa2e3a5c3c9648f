"""The research loop around a trained run: continue it on a longer schedule
(``trainer.resume_schedule``), sample from it, evaluate it, compare runs.

Each tiny model is trained once (a module-scoped fixture, in this process as train.py
runs it: the composed config saved as ``.hydra/config.yaml``) and its run dir reused.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import eval as eval_py
from src.config.run_plan import RunPlan
from src.config.validate import validate
from src.data.sources import GlobalBatches, TokenStream
from src.errors import ConfigError
from src.models import get_spec
from src.models.generate import KVCache, generate
from src.runs.compare import main as compare_main
from src.runs.compose import open_run
from src.runs.evaluation import EVAL_FILE
from src.runs.from_run import (
    load_model,
    run_tokenizer,
)
from src.trainer.launch import prepare, run_rank, run_ranks
from src.trainer.optimizer import final_lr, lr_lambda
from src.trainer.sampling import SAMPLING_CHANGES, sample_texts, sampling_changes
from tests.commands import in_process
from tests.distributed import HANG_S
from tests.test_researcher_ux import one_config_error
from tests.test_train import ROOT, make_cfg, read_rows, run_cmd

# A tiny model on 2 MB of the stdlib's sources (byte-level), one rank in this process.
RUN = [
    "logger=none",
    "data.max_bytes=2000000",
    "trainer.devices=1",
    "trainer.max_steps=20",
    "trainer.batch_size=8",
    "trainer.log_every=5",
    "trainer.val_every=10",
    "trainer.val_batches=2",
    "trainer.warmup_steps=4",  # no checkpoint key: every run keeps its final step's
    "trainer.progress=false",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
]
GPT_RUN = ["model=tiny", *RUN]


def train_run(run_dir: Path, *overrides: str) -> dict:
    """What ``python train.py <overrides> hydra.run.dir=<run_dir>`` does, in this
    process: the composed config saved where Hydra saves it, then one rank."""
    cfg = make_cfg(*overrides)
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), hydra_dir / "overrides.yaml")
    validate(cfg)
    cfg, resolved = prepare(cfg)
    return run_rank(cfg, str(run_dir), resolved)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("gpt_run")
    train_run(run_dir, *GPT_RUN)
    return run_dir


def test_resume_schedule_extend_continues_and_keep_refuses(
    gpt_run, tmp_path, monkeypatch, capsys
):
    """A 20-step run resumed with max_steps=40: ``keep`` (the default) refuses in one
    line naming the key; ``extend`` continues from step 20 on the 40-step schedule
    and its summary says so."""
    run_dir = tmp_path / "run"
    shutil.copytree(gpt_run, run_dir)
    longer = [*GPT_RUN, "trainer.max_steps=40", "trainer.resume=auto"]
    with pytest.raises(ConfigError) as err:
        train_run(run_dir, *longer)
    line = str(err.value)
    assert "\n" not in line and line.startswith("trainer.max_steps: got 40, but")
    assert "trainer.max_steps=20" in line and "trainer.resume_schedule=extend" in line

    # another optimizer: the checkpoint's state is AdamW's (train.py, before a rank)
    args = (*GPT_RUN, f"hydra.run.dir={run_dir}", "trainer.resume=auto")
    line = one_config_error(
        in_process(monkeypatch, capsys, "train.py", *args, "trainer.optimizer=muon")
    )
    assert line.startswith("trainer.optimizer: 'adamw' was recorded by checkpoint ")
    assert "trainer.init_from=CHECKPOINT" in line

    summary = train_run(run_dir, *longer, "trainer.resume_schedule=extend")
    rows = read_rows(run_dir)
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 5, 10, 15, 20, 25, 30, 35, 40]  # 21..40 follow 1..20
    cfg = make_cfg(*longer)
    new = lr_lambda(cfg)
    for r in rows:
        if "lr" in r and r["step"] > 20:  # the lr of step s is the schedule's at s - 1
            assert r["lr"] == pytest.approx(cfg.trainer.lr * new(r["step"] - 1))
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["steps"] == 40 and on_disk["resume"] == summary["resume"]
    resume = summary["resume"]
    assert resume["schedule"] == "extend" and resume["from_step"] == 20
    assert (resume["max_steps_before"], resume["max_steps"]) == (20, 40)
    assert resume["lr_after"] == pytest.approx(cfg.trainer.lr * new(20))
    assert resume["lr_before"] == pytest.approx(final_lr(cfg.trainer))  # the old end


# ------------------------------------------------------------------- sampling

PROMPT = "import os"  # (Hydra's command line takes no newline escape)
LLAMA_RUN = [
    "model=llama_tiny",
    "model.n_layers=2",
    "model.dim=64",
    "model.max_seq_len=64",
    *RUN,
    "trainer.sample_every=10",  # greedy samples while it trains
    f"trainer.sample_prompts=[{PROMPT!r},'def ']",
    "trainer.sample_tokens=70",
]
HF_RUN = [
    "model=hf",
    "model.config=tiny_llama",
    "model.block_size=64",
    *RUN,
    "trainer.max_steps=2",
    "trainer.ckpt_every=2",
    "trainer.val_every=0",
]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("llama_run")
    train_run(run_dir, *LLAMA_RUN)
    return run_dir


def opened(run_dir: Path, changes: dict) -> tuple[Path, DictConfig, RunPlan]:
    """sample.py's and eval.py's steps before the ranks start: the checkpoint and
    the run's config, changed and prepared."""
    _, checkpoint, cfg, resolved = open_run(str(run_dir), lambda _: changes)
    return checkpoint, cfg, resolved


def _greedy_both_ways(device, cfg, resolved, checkpoint, n: int) -> dict:
    """On one rank: greedy texts with and without the KV cache, and the logits of a
    prompt fed whole and in three pieces through the cache."""
    model, _, step = load_model(resolved, checkpoint, device)
    tokenizer = run_tokenizer(cfg)
    kw = dict(max_new_tokens=n, temperature=0.0, device=device, num_samples=2)
    cached = sample_texts(model, resolved, tokenizer, [PROMPT], **kw)[0]
    plain = sample_texts(model, resolved, tokenizer, [PROMPT], kv_cache=False, **kw)[0]
    # Drawn (a 20-step model's greedy text is mostly spaces): the same draws too.
    kw.update(temperature=1.0, seed=3, max_new_tokens=30)
    drawn = [
        sample_texts(model, resolved, tokenizer, [PROMPT], kv_cache=c, **kw)[0]
        for c in (True, False)
    ]
    idx = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(idx)[0]
        cache = KVCache(64)
        parts = [
            model(idx[:, a:b], cache=cache)[0] for a, b in ((0, 25), (25, 39), (39, 40))
        ]
    gap = (torch.cat(parts, dim=1) - whole).abs().max().item()
    return {"step": step, "cached": cached, "plain": plain, "drawn": drawn, "gap": gap}


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_kv_cache_decoding_equals_recomputing(family, gpt_run, llama_run):
    """The trained checkpoint on one FSDP2 rank: greedy decoding with the KV cache
    gives the same tokens as recomputing the window each step, inside the window and
    past it (70 new tokens after 9, window 64); logits through the cache in pieces equal
    the plain forward's."""
    run_dir = {"gpt": gpt_run, "llama": llama_run}[family]
    checkpoint, cfg, resolved = opened(run_dir, SAMPLING_CHANGES)
    out = run_ranks(_greedy_both_ways, 1, 60, cfg, resolved, checkpoint, 70)
    assert out["step"] == 20
    assert out["cached"] == out["plain"]
    assert out["drawn"][0] == out["drawn"][1] and len(set(out["drawn"][0])) == 2
    assert all(
        t.startswith(PROMPT) and len(t) == len(PROMPT) + 70 for t in out["cached"]
    )
    assert out["gap"] < 1e-4
    if family == "llama":  # trained with trainer.sample_every=10: the same text
        rows = [r for r in read_rows(run_dir) if "sample_0" in r]
        assert [r["step"] for r in rows] == [10, 20]
        assert rows[-1]["sample_0"] == out["cached"][0]


def test_sample_every_logs_samples_while_training(llama_run):
    """trainer.sample_every=10: greedy samples of both prompts at steps 10 and 20 in
    metrics.jsonl and in the samples table (samples.json; a wandb Table with wandb)."""
    table = json.loads((llama_run / "samples.json").read_text())
    assert [(r["step"], r["prompt"]) for r in table] == [
        (10, PROMPT),
        (10, "def "),
        (20, PROMPT),
        (20, "def "),
    ]
    rows = {r["step"]: r for r in read_rows(llama_run) if "sample_1" in r}
    for r in table:
        key = "sample_0" if r["prompt"] == PROMPT else "sample_1"
        assert rows[r["step"]][key] == r["text"]
        assert r["text"].startswith(r["prompt"]) and len(r["text"]) > len(r["prompt"])


def _hf_both_ways(device, cfg, resolved, checkpoint) -> dict:
    model, _, _ = load_model(resolved, checkpoint, device)
    tokenizer = run_tokenizer(cfg)
    kw = dict(max_new_tokens=30, device=device, num_samples=2)
    model.train()  # as trainer.sample_every finds it
    greedy = sample_texts(model, resolved, tokenizer, [PROMPT], temperature=0, **kw)
    # The root too is left in eval (generate() sets model.hf's): the training step
    # restores train mode only when the root is in eval.
    assert not any(m.training for m in model.modules())
    drawn = sample_texts(model, resolved, tokenizer, [PROMPT], seed=1, **kw)
    idx = torch.tensor([tokenizer.encode_text(PROMPT)])
    plain = generate(model, idx, 30, 64, temperature=0.0, kv_cache=False)
    return {
        "greedy": greedy[0],
        "drawn": drawn[0],
        "plain": tokenizer.decode(plain[0].tolist()),
    }


def test_hf_model_samples_through_generate(tmp_path):
    """A tiny Hugging Face Llama (2 steps, checkpointed): sampling goes through
    transformers' generate() on one rank with the whole model (asked for 2, it says
    so); its greedy text is the one the plain window-recomputing loop gives."""
    run_dir = tmp_path / "hf"
    train_run(run_dir, *HF_RUN)
    changes, note = sampling_changes(get_spec("hf"), 2, "fsdp2")
    assert "generate()" in note and "1 rank" in note
    checkpoint, cfg, resolved = opened(run_dir, changes)
    assert resolved.world_size == 1 and cfg.sharding.backend == "none"
    out = run_ranks(_hf_both_ways, 1, 60, cfg, resolved, checkpoint)
    assert out["greedy"] == [out["plain"]] * 2
    assert all(t.startswith(PROMPT) for t in out["drawn"])
    assert len(set(out["drawn"])) == 2  # two different draws


def sample_cli(run: Path, *overrides: str) -> tuple[str, list[str]]:
    """``python sample.py run=<run> ...``: its console output and the samples."""
    out = run_cmd(
        [sys.executable, "sample.py", f"run={run}", *overrides], timeout=HANG_S
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    samples = text.split(" samples from ", 1)[1].split("\n", 1)[1]
    return text, samples.split("\n---------------\n")[:-1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_sample_py_on_two_ranks(family, gpt_run, llama_run):
    """sample.py from the run dir on 2 FSDP2 ranks (the checkpoint was written by
    1): three sampled texts, each the prompt and 40 new bytes."""
    run_dir = {"gpt": gpt_run, "llama": llama_run}[family]
    prompt = "import os"
    text, samples = sample_cli(
        run_dir, "devices=2", "max_new_tokens=40", f"prompt='{prompt}'"
    )
    assert "3 samples from" in text and "(step 20, 2 ranks)" in text
    assert len(samples) == 3 and len(set(samples)) == 3, samples
    for sample in samples:
        assert sample.startswith(prompt)
        assert len(sample.encode()) >= len(prompt) + 40  # bytes; U+FFFD is 3


# ----------------------------------------------------------------- evaluation


@pytest.mark.slow
def test_eval_py_on_two_ranks_reproduces_the_runs_val_loss(gpt_run):
    """eval.py on the run's own validation split, 2 ranks (the run trained on 1):
    the loss is the run's last val_loss (fp32, within 1e-5), appended to eval.json."""
    out = run_cmd(
        [sys.executable, "eval.py", f"run={gpt_run}", "devices=2"], timeout=HANG_S
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    val_loss = json.loads((gpt_run / "summary.json").read_text())["val_loss"]
    entry = json.loads((gpt_run / "eval.json").read_text())[-1]
    assert abs(entry["loss"] - val_loss) < 1e-5, (entry, val_loss)
    assert entry["world_size"] == 2 and entry["step"] == 20
    assert (entry["data"], entry["split"], entry["batches"]) == ("text", "val", 2)
    assert f"loss {entry['loss']:.4f}" in out.stdout + out.stderr


def test_eval_on_other_files_reads_them_with_the_runs_tokenizer(gpt_run):
    """eval.py's steps in this process, with data=files on other text (all of it, the
    default split for data given; every window of it): a finite loss a trained model beats a uniform guess on, its perplexity,
    the record appended after the others."""
    paths = f"{sysconfig.get_paths()['stdlib']}/json/*.py"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "eval",
            [f"run={gpt_run}", "data=files", f"data.paths='{paths}'", "batches=all"],
        )
    before = (
        len(json.loads((gpt_run / EVAL_FILE).read_text() or "[]"))
        if (gpt_run / EVAL_FILE).is_file()
        else 0
    )
    entry = eval_py.evaluate_run(cfg)
    entries = json.loads((gpt_run / EVAL_FILE).read_text())
    assert len(entries) == before + 1 and entries[-1] == entry
    assert entry["data"] == "files" and entry["paths"] == paths
    # data= given: every token of it is scored (split=all), and the record says so
    assert entry["split"] == "all" and entry["split_tokens"] == entry["data_tokens"]
    assert 0 < entry["loss"] < math.log(256)  # better than uniform over bytes
    assert entry["perplexity"] == pytest.approx(math.exp(entry["loss"]))


@pytest.mark.parametrize("cache", ["{tmp}/file/cache", "/proc"])
def test_eval_py_refuses_an_unwritable_cache_dir_in_one_line(gpt_run, tmp_path, cache):
    """eval.py on other data must build their token cache: a cache dir that cannot be
    made (under a regular file) is refused before anything is prepared, one that
    exists but takes no file (/proc; as a shared read-only cache) where the entry
    would be built. One line naming the key, exit 2, the eval history untouched."""
    (tmp_path / "file").write_text("")
    paths = f"{sysconfig.get_paths()['stdlib']}/json/*.py"
    history = gpt_run / EVAL_FILE
    before = history.read_bytes() if history.is_file() else None
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "eval",
            [f"run={gpt_run}", "data=files", f"data.paths='{paths}'"]
            + [f"data.cache_dir={cache.format(tmp=tmp_path)}"],
        )
    with pytest.raises(SystemExit) as exit_:
        eval_py.evaluate_run(cfg)
    line = exit_.value.__notes__[0]
    assert exit_.value.code == 2 and "\n" not in line, line
    assert line.startswith("config error: data.cache_dir: the token cache writes to ")
    assert line.endswith("set data.cache_dir to a writable directory"), line
    assert (history.read_bytes() if history.is_file() else None) == before


def test_only_the_dirs_a_command_writes_are_checked(tmp_path, monkeypatch):
    """sample.py writes no wandb files and no existing token cache (open_run checks
    wandb's dirs only for eval.py, which logs as the run did): an unwritable
    WANDB_DATA_DIR does not stop it; an existing cache dir is checked where an entry
    is built, not before."""
    from src.runs.writable import check_writable

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "file" / "wandb"))
    cfg = make_cfg(*GPT_RUN, "logger=wandb", "data.cache_dir=/proc")
    check_writable(cfg, wandb=False)
    with pytest.raises(ConfigError, match=r"^WANDB_DATA_DIR: wandb writes to "):
        check_writable(cfg)


@pytest.mark.parametrize("n_tokens", [65, 100, 1000, 4097])
def test_covering_batches_leave_no_token_out(n_tokens):
    """``batches=all``: the fewest fixed batches whose windows hold every token."""
    stream = TokenStream(np.arange(n_tokens), n_tokens, "test")
    windows = GlobalBatches(stream, 3, 64, 0)

    def covered(n: int) -> set[int]:
        batches = windows.val_batches(n, 0, 1)
        return {int(t) for x, y in batches for t in (*x.flatten(), *y.flatten())}

    n = windows.covering_batches()
    assert covered(n) == set(range(n_tokens))
    assert n == 1 or covered(n - 1) != set(range(n_tokens))


# ------------------------------------------------------------------ comparing


def test_compare_two_runs_table_and_plot(gpt_run, llama_run, tmp_path):
    """``python -m src.runs.compare`` on two runs: the sweep summary's table (the
    overrides that differ, each run's final figures) and one plot over steps."""
    compare_main([str(gpt_run), str(llama_run), "--out", str(tmp_path)])
    table = (tmp_path / "compare.md").read_text()
    rows = list(csv.DictReader((tmp_path / "compare.csv").open()))
    assert [r["job"] for r in rows] == [gpt_run.name, llama_run.name]
    assert [r["model"] for r in rows] == ["tiny", "llama_tiny"]  # a differing key
    for row, run_dir in zip(rows, (gpt_run, llama_run), strict=True):
        summary = json.loads((run_dir / "summary.json").read_text())
        assert float(row["val_loss"]) == pytest.approx(summary["val_loss"])
        assert f"{summary['val_loss']:.4f}" in table
    assert sum(r["best"] == "True" for r in rows) == 1  # by val_loss, the default
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_sample_and_eval_open_a_run_on_ranks_its_batch_does_not_split_over(gpt_run):
    """A run of 8 sequences per batch opened on 3 ranks: sample.py reads no batch
    and starts (it was refused, ``trainer.batch_size: 8 must split ... over 3
    data-parallel rank(s)``, a key sample.py has not: ``python sample.py run=<a PP2 x
    TP2 run> devices=3``); eval.py's batch is its ``batch_size=`` (devices=3
    batch_size=6 was refused the same way), and one that does not split is refused
    naming eval.py's own key."""
    from src.runs.evaluation import eval_changes

    changes, _ = sampling_changes(get_spec("gpt"), 3, "fsdp2")
    assert opened(gpt_run, changes)[2].world_size == 3

    def eval_on(devices: int, batch_size: int | None):
        want = {"devices": devices, "batch_size": batch_size, "data": None}
        return open_run(
            str(gpt_run), lambda run: eval_changes(OmegaConf.create(want), run)
        )

    _, _, cfg, resolved = eval_on(3, 6)
    assert resolved.world_size == 3 and cfg.trainer.batch_size == 6
    for batch_size, key in ((None, "devices"), (4, "batch_size")):
        with pytest.raises(ConfigError) as err:
            eval_on(3, batch_size)
        assert err.value.key == key and "give batch_size= a multiple of 3" in str(
            err.value
        )


def test_a_one_process_run_opens_on_several_ranks(tmp_path):
    """A ``sharding=none`` run, sampled or evaluated with ``devices=2``: its model is
    sharded over the ranks (FSDP2; DCP loads any layout). Both were refused with
    train.py's keys: ``trainer.devices: sharding=none trains one process, got 2
    devices; use trainer.devices=1 or sharding=fsdp2/fsdp1/ddp``."""
    from src.runs.evaluation import eval_changes

    run_dir = tmp_path / "none"
    train_run(run_dir, *GPT_RUN, "sharding=none", "trainer.max_steps=2")
    changes, _ = sampling_changes(get_spec("gpt"), 2, "none")
    _, cfg, resolved = opened(run_dir, changes)
    assert resolved.world_size == 2 and cfg.sharding.backend == "fsdp2"
    want = OmegaConf.create({"devices": 2, "batch_size": None, "data": None})
    _, _, cfg, resolved = open_run(str(run_dir), lambda run: eval_changes(want, run))
    assert resolved.world_size == 2 and cfg.sharding.backend == "fsdp2"
    one, _ = sampling_changes(get_spec("gpt"), 1, "none")  # one rank: as it trained
    assert opened(run_dir, one)[1].sharding.backend == "none"
