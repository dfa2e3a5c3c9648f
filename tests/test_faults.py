"""Runs that die: SIGKILL after a checkpoint and exact resume, a rank killed mid-step,
elastic restarts that resume by themselves, and a NaN loss that stops the run.

Each test drives ``train.py`` on 2 gloo ranks in a subprocess and waits on its output
(a blocking read of the lines rank 0 prints), never on a timer.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from src.models.gpt import GPT, GPTConfig
from src.trainer.checkpoint import Checkpointer, resolve_resume

ROOT = Path(__file__).resolve().parent.parent
BASE = [
    "model=tiny",
    "data=synthetic",
    "logger=none",
    "trainer.devices=2",
    "trainer.progress=false",
    "trainer.log_every=1",
    "trainer.val_every=0",
    "trainer.batch_size=8",
]

pytestmark = pytest.mark.slow


def command(run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *BASE,
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        command(run_dir, *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, so the test can kill it all
    )


def run_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Run train.py to the end; its output in ``.stdout`` and ``.stderr``."""
    return subprocess.run(
        command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True
    )


def read_until(proc: subprocess.Popen, needle: str) -> list[str]:
    """Lines printed until one contains ``needle`` (fails if the run ends first)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return seen
    proc.wait()
    raise AssertionError(f"run ended without printing {needle!r}:\n{''.join(seen)}")


def worker_pids(pid: int) -> list[int]:
    """The rank processes the launcher started (children of ``pid`` running spawn)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and "spawn_main" in cmdline:
            out.append(int(entry.name))
    return sorted(out)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def tokenized_corpus(tmp_path: Path) -> list[str]:
    """``data=files`` on JSONL written here, with a BPE trained on it."""
    corpus = tmp_path / "corpus.jsonl"
    sources = sorted(Path(json.__file__).parent.glob("*.py"))
    corpus.write_text(
        "".join(json.dumps({"text": p.read_text()}) + "\n" for p in sources)
    )
    return [
        "data=files",
        f"data.paths={corpus}",
        "data.format=jsonl",
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=512",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]


def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted(tmp_path):
    # Dropout draws from the training RNG, which the checkpoint restores; the batches
    # come from a BPE-tokenized corpus in the token cache (built by the first run).
    steps = ["trainer.max_steps=12", "trainer.ckpt_every=4", "model.dropout=0.1"]
    steps += tokenized_corpus(tmp_path)
    straight = tmp_path / "straight"
    first = subprocess.run(
        command(straight, *steps), check=True, cwd=ROOT, capture_output=True, text=True
    )
    assert "token cache: built" in first.stdout
    assert "model.vocab_size=512: follows data.tokenizer=bpe" in first.stdout

    broken = tmp_path / "broken"
    proc = start(broken, *steps)
    assert any(
        "token cache: reusing" in line
        for line in read_until(proc, "checkpoint saved to")
    )
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        command(broken, *steps, "trainer.resume=auto"),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    assert "token cache: reusing" in resumed.stdout
    expected, got = losses(straight), losses(broken)
    assert max(got) == 12
    # Every step logged by either attempt equals the uninterrupted run, bit for bit.
    assert {s: expected[s] for s in got} == got


def test_rank_killed_mid_step_ends_the_job_with_an_error(tmp_path):
    timeout_s = 60
    proc = start(tmp_path, "trainer.max_steps=100000", f"trainer.timeout_s={timeout_s}")
    read_until(proc, "step 3:")
    victims = worker_pids(proc.pid)
    assert len(victims) == 2, victims
    killed_at = time.monotonic()
    os.kill(victims[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=timeout_s + 30)
    elapsed = time.monotonic() - killed_at
    assert proc.returncode != 0
    assert "failed (exit code -9)" in out, out[-2000:]
    assert elapsed < timeout_s, f"took {elapsed:.0f}s to notice the dead rank"


def test_max_restarts_restarts_the_ranks_and_they_resume(tmp_path):
    proc = start(
        tmp_path,
        "trainer.max_steps=16",
        "trainer.ckpt_every=4",
        "trainer.max_restarts=1",
    )
    read_until(proc, "checkpoint saved to")
    os.kill(worker_pids(proc.pid)[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out
    assert max(losses(tmp_path)) == 16
    assert (tmp_path / "checkpoints" / "step_00000016").is_dir()


def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_checkpoint(tmp_path):
    # An absurd learning rate blows the weights up after the first update.
    run = subprocess.run(
        command(
            tmp_path,
            "trainer.max_steps=20",
            "trainer.ckpt_every=1",
            "trainer.lr=1e30",
            "trainer.min_lr=0",
            "trainer.warmup_steps=0",
            "trainer.grad_clip=0",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    assert "non-finite loss" in run.stdout + run.stderr
    assert "at step" in run.stdout + run.stderr
    last = resolve_resume("auto", tmp_path / "checkpoints")
    assert last is not None
    model = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64)
    )
    optimizer = torch.optim.AdamW(model.parameters())
    state = Checkpointer(tmp_path / "checkpoints").load(last, model, optimizer)
    assert state["step"] >= 1


def test_fp16_resume_restores_the_grad_scaler_and_matches(tmp_path):
    """Resume from the middle checkpoint of a finished fp16 run: the loss scale comes
    back with the model, so the resumed steps equal the original ones."""
    steps = ["trainer.max_steps=6", "trainer.ckpt_every=3", "precision=fp16_mixed"]
    straight = tmp_path / "straight"
    subprocess.run(command(straight, *steps), check=True, cwd=ROOT, capture_output=True)
    meta = json.loads((straight / "checkpoints/step_00000003/meta.json").read_text())
    assert meta["extra"]["scaler"]["scale"] > 0

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    os.rename(
        straight / "checkpoints/step_00000003", resumed / "checkpoints/step_00000003"
    )
    run = run_train(resumed, *steps, "trainer.resume=auto")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    got, expected = losses(resumed), losses(straight)
    assert sorted(got) == [4, 5, 6]
    assert got == {s: expected[s] for s in got}


# ----------------------------------------------- one reference run, several faults

# Dropout on: exact resume must also restore the random streams.
REFERENCE = ["trainer.max_steps=6", "model.dropout=0.1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 6-step run with a checkpoint every 2 steps, all kept."""
    run_dir = tmp_path_factory.mktemp("reference")
    run = run_train(run_dir, *REFERENCE, "trainer.ckpt_every=2", "trainer.keep_last=0")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run_dir


def test_damaged_or_mismatched_checkpoint_never_loads(reference, tmp_path):
    """Issue cases 2, 3 and 8: a corrupted newest checkpoint is skipped, saying why; a
    model that does not match the checkpoint is refused naming the first tensor; the
    newest good checkpoint then resumes exactly."""
    shutil.copytree(reference / "checkpoints", tmp_path / "checkpoints")
    shard = tmp_path / "checkpoints/step_00000006/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[4096:4160] = bytes(b ^ 0xFF for b in data[4096:4160])
    shard.write_bytes(bytes(data))

    smaller = run_train(tmp_path, *REFERENCE, "trainer.resume=auto", "model.n_layer=1")
    out = smaller.stdout + smaller.stderr
    assert smaller.returncode != 0
    assert "skipping checkpoint" in out and "step_00000006" in out
    assert "__0_0.distcp fails its checksum" in out
    assert "does not match this run: h.1.ln_1.weight [64]" in out, out[-3000:]
    assert "is in the checkpoint, not in the model" in out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]

    resumed = run_train(tmp_path, *REFERENCE, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "step_00000004 (step 4)" in resumed.stdout
    got, expected = losses(tmp_path), losses(reference)
    assert sorted(got) == [5, 6]
    assert got == {s: expected[s] for s in got}
