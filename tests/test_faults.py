"""Runs that die or are disturbed (docs/reliability.md): SIGKILL after a checkpoint
and exact resume, a rank killed or stopped mid-step, elastic restarts and SLURM
requeues that resume by themselves, a NaN loss, SIGTERM, a second run in the same run
dir, damaged or mismatched checkpoints, a full disk, resume bookkeeping.

Each test drives ``train.py`` on 2 gloo ranks in a subprocess and waits on its output
(a blocking read of the lines rank 0 prints) or polls a file with a deadline, never
on a timer; a command refused before any rank starts runs in this process. Runs
compared with one uninterrupted run share it (the ``reference`` fixture), and a check
that needs a run already made rides on it. The "case N" names are those of issue 17.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch

from src.checkpoint.dcp import Checkpointer
from src.checkpoint.folders import resolve_resume
from src.models import get_spec
from src.models.gpt import GPT, GPTConfig
from src.trainer.faults import start_time
from src.trainer.launch import cpu_threads
from src.trainer.optimizer import build_optimizer
from tests.commands import in_process
from tests.distributed import HANG_S, free_port
from tests.test_config import make_cfg

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
    # No CPU matmul probe: under load it took seconds, which a rank waits out at
    # its first collective (the hang tests' timeouts are a few seconds).
    "trainer.peak_tflops=1",
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


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """A run :func:`start` began in its own session is killed, with its process
    group, when its test ends: a test that fails before it stops the run (a
    ``max_steps=100000`` one) left it training on the machine's cores."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def start(run_dir: Path, *overrides: str, signal_at: str = "") -> subprocess.Popen:
    """train.py in the background; ``signal_at``: SHARDWRAP_TEST_SIGNAL_AT (faults.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARDWRAP_TEST_SIGNAL_AT": signal_at}
    proc = subprocess.Popen(
        command(run_dir, *overrides),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, so the test can kill it all
    )
    _STARTED.append(proc)
    return proc


def run_train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """Run train.py to the end; its output in ``.stdout`` and ``.stderr``."""
    return subprocess.run(
        command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True
    )


def refused(monkeypatch, capsys, run_dir: Path, *overrides: str) -> CompletedProcess:
    """train.py refused before any rank starts, run in this process as ``python
    train.py`` runs it (tests/commands.py; a real process's config error:
    tests/test_sweep.py)."""
    args = [*BASE, f"hydra.run.dir={run_dir}", *overrides]
    code, out, err = in_process(monkeypatch, capsys, "train.py", *args)
    return CompletedProcess(["train.py", *args], code, out, err)


def read_until(proc: subprocess.Popen, needle: str) -> list[str]:
    """Lines printed until one contains ``needle`` (fails if the run ends first)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return seen
    proc.wait()
    raise AssertionError(f"run ended without printing {needle!r}:\n{''.join(seen)}")


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry.name)] = cmdline
    return out


def worker_pids(pid: int) -> list[int]:
    """The rank processes the launcher started: forked by its rank server (a child
    the launcher forked from itself; src/entry.py), its only child with children."""
    return sorted(rank for server in rank_servers(pid) for rank in children(server))


def rank_servers(pid: int) -> list[int]:
    """The launcher's children that have children: its rank server (the resource
    tracker, its other child, starts none)."""
    return [child for child in children(pid) if children(child)]


def loss_rows(run_dir: Path) -> list[tuple[int, float]]:
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def losses(run_dir: Path) -> dict[int, float]:
    return dict(loss_rows(run_dir))


def one_line_error(out: str) -> str:
    """The error line of a failed run; fails if a traceback was printed instead."""
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


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


def test_an_export_killed_midway_leaves_no_half_export_and_a_resume_finishes_it(
    tmp_path,
):
    """Issue 48 item 6: ``trainer.export=hf`` is written beside ``hf/`` and renamed
    into place; SIGKILL to every process once the weights are written (rank 1, at
    the export's hook) leaves no ``hf/``; the resume removes the half export, says
    the run's export is missing and writes it ("nothing to train" alone, before)."""
    steps = ["trainer.max_steps=2", "trainer.export=hf"]
    proc = start(tmp_path, *steps, signal_at="export:group:SIGKILL")
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    assert "checkpoint saved to" in out and "exported" not in out, out[-3000:]
    half = tmp_path / "hf.tmp-shardwrap-dir"
    assert list(half.glob("*.safetensors")) and not (tmp_path / "hf").exists()

    resumed = run_train(tmp_path, *steps, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "hf.tmp-shardwrap-dir" in resumed.stderr  # removed, in one line
    assert "nothing to train" in resumed.stdout
    assert f"trainer.export=hf: {tmp_path / 'hf'} is missing: exporting" in (
        resumed.stdout
    )
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    assert "sharded" not in names and not half.exists()


def test_rank_killed_mid_step_ends_the_job_with_an_error(tmp_path):
    timeout_s = 60
    proc = start(tmp_path, "trainer.max_steps=100000", f"trainer.timeout_s={timeout_s}")
    read_until(proc, "step 3:")
    victims = worker_pids(proc.pid)
    assert len(victims) == 2, victims
    killed_at = time.monotonic()
    os.kill(victims[-1], signal.SIGKILL)
    # Timed to the line that says so, not to the exit of every process.
    read_until(proc, "failed (exit code -9)")
    elapsed = time.monotonic() - killed_at
    rest, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode != 0
    assert elapsed < timeout_s, f"took {elapsed:.0f}s to notice the dead rank"
    # Issue 48: the killed ranks leave no semaphore to the resource tracker, whose
    # warning followed the failure's line (tqdm's lock: src/observe/logs.py)
    assert "leaked semaphore" not in rest, rest[-2000:]


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
        timeout=HANG_S,
    )
    assert run.returncode != 0
    assert "non-finite loss" in run.stdout + run.stderr
    assert "at step" in run.stdout + run.stderr
    last = resolve_resume("auto", tmp_path / "checkpoints")
    assert last is not None
    model = GPT(
        GPTConfig(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64)
    )
    # As the trainer builds it (its groups and their flags; its schedule adds
    # initial_lr to every group): loading checks the saved groups against these keys.
    optimizer = build_optimizer(model, make_cfg("model=tiny"), get_spec("gpt"))
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = Checkpointer(tmp_path / "checkpoints").load(last, model, optimizer)
    assert state["step"] >= 1


def test_an_elastic_restart_resumes_fp16_exactly_with_its_grad_scaler(tmp_path):
    """trainer.max_restarts restarts the ranks and they resume: rank 1 kills itself
    during step 6, after the step-4 checkpoint (the restarted ranks do not; killed by
    this test after reading the checkpoint's line, it raced the remaining steps of a
    tiny model on a busy machine). The restarted ranks name the failure and say
    truthfully what they resume from; in fp16 the loss scale comes back with the
    model, so every step equals the uninterrupted run's."""
    steps = ["trainer.max_steps=8", "trainer.ckpt_every=4", "precision=fp16_mixed"]
    straight = tmp_path / "straight"
    subprocess.run(command(straight, *steps), check=True, cwd=ROOT, capture_output=True)
    meta = json.loads((straight / "checkpoints/step_00000004/meta.json").read_text())
    assert meta["extra"]["scaler"]["scale"] > 0

    restarted = tmp_path / "restarted"
    proc = start(
        restarted, *steps, "trainer.max_restarts=1", signal_at="step6:self:SIGKILL"
    )
    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, out[-3000:]
    assert re.search(
        rf"elastic restart 1 of 1 after rank 1 on {socket.gethostname()} failed "
        r"\(exit code -9\): killed by SIGKILL; resuming from the newest good checkpoint",
        out,
    ), out[-3000:]
    assert "resumed from" in out and "(step 4)" in out, out[-3000:]
    assert max(losses(restarted)) == 8
    assert (restarted / "checkpoints" / "step_00000008").is_dir()
    assert losses(restarted) == losses(straight)


# ----------------------------------------------- one reference run, several faults

# Dropout on: exact resume must also restore the random streams.
REFERENCE = ["trainer.max_steps=6", "model.dropout=0.1"]


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run the faulted ones are compared with: its run dir, and the
    overrides each of them takes: REFERENCE, batches from a BPE-tokenized corpus
    whose token cache this run builds (the others reuse it)."""

    dir: Path
    args: tuple[str, ...]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    """An uninterrupted 6-step run with a checkpoint every 2 steps, all kept."""
    args = (*REFERENCE, *tokenized_corpus(tmp_path_factory.mktemp("corpus")))
    run_dir = tmp_path_factory.mktemp("reference")
    run = run_train(run_dir, *args, "trainer.ckpt_every=2", "trainer.keep_last=0")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "token cache: built" in run.stdout
    assert "model.vocab_size=512: follows data.tokenizer=bpe" in run.stdout
    return Reference(run_dir, args)


def test_ranks_die_with_their_launcher_and_the_run_then_resumes_exactly(
    reference, tmp_path
):
    """Issue 48 item 4: ``kill -9`` of the launcher alone (the OOM killer, a user)
    ends its ranks and the rank server within seconds, instead of leaving them
    training; the lock recorded the ranks (PID, start time) while they ran. Rank 1
    sends the SIGKILL during step 5, after the step-4 checkpoint (sent by this test
    after reading the checkpoint's line, it raced the remaining steps of a tiny model),
    then waits for the launcher to tell it to stop, which it never does: only its
    death with the launcher ends it. The documented resume then takes the stale lock
    over, saying whose it was, and every step logged by either attempt equals the
    uninterrupted run, bit for bit (dropout's random stream restored, the batches
    from the reused token cache)."""
    steps = [*reference.args, "trainer.ckpt_every=2"]
    proc = start(tmp_path, *steps, signal_at="step5:launcher:SIGKILL")
    seen = read_until(proc, "step 1:")
    ranks = worker_pids(proc.pid)
    servers = rank_servers(proc.pid)
    assert len(ranks) == 2 and len(servers) == 1, (ranks, servers)
    lines = (tmp_path / "run.lock").read_text().splitlines()
    recorded = sorted(json.loads(line)["pid"] for line in lines[1:])
    assert recorded == ranks, lines
    rest, _ = proc.communicate(timeout=HANG_S)
    out = "".join(seen) + rest
    assert proc.returncode == -signal.SIGKILL, out[-3000:]
    deadline = time.monotonic() + 20  # SIGKILLs, by the kernel: milliseconds
    while living := [p for p in ranks + servers if start_time(p) is not None]:
        assert time.monotonic() < deadline, f"outlived their launcher: {living}"
        time.sleep(0.05)
    assert "token cache: reusing" in out
    assert "checkpoint saved to" in out and "step 6:" not in out, out[-3000:]
    assert max(losses(tmp_path)) <= 5
    assert "leaked semaphore" not in out, out[-2000:]  # the tracker unlinks them

    resumed = run_train(tmp_path, *steps, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"run dir lock of PID {proc.pid} on" in resumed.stdout
    assert "resumed from" in resumed.stdout
    assert "token cache: reusing" in resumed.stdout
    assert loss_rows(tmp_path) == loss_rows(reference.dir)


def test_damaged_or_mismatched_checkpoint_never_loads(
    reference, monkeypatch, capsys, tmp_path
):
    """Cases 2, 3, 8 and 9: a model that is not the checkpoint's is refused in one
    line naming the key and the recorded value, before any rank starts; a corrupted
    newest checkpoint is skipped, saying why; the newest good checkpoint then resumes
    exactly, replacing the rows the first run logged past it; then there is nothing
    left to train. (A different max_steps refused: tests/test_run_dir.py; a model
    that does not match a checkpoint's tensors: tests/test_checkpoint.py.)"""
    shutil.copytree(reference.dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "run.lock").unlink()
    shard = tmp_path / "checkpoints/step_00000006/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[4096:4160] = bytes(b ^ 0xFF for b in data[4096:4160])
    shard.write_bytes(bytes(data))

    args = [*reference.args, "trainer.resume=auto"]
    smaller = refused(monkeypatch, capsys, tmp_path, *args, "model.n_layer=1")
    assert smaller.returncode == 2
    assert smaller.stderr.startswith(
        "config error: model.n_layer: 2 was recorded by checkpoint "
        f"{tmp_path}/checkpoints/step_00000006, got 1"
    )
    assert len(smaller.stderr.splitlines()) == 1 and "Traceback" not in smaller.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]

    # It replaces the corrupted checkpoint of step 6 as it goes.
    resumed = run_train(tmp_path, *args, "trainer.ckpt_every=2")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "skipping checkpoint" in resumed.stdout
    assert "step_00000006: __0_0.distcp fails its checksum" in resumed.stdout
    assert "step_00000004 (step 4)" in resumed.stdout
    assert "dropped 2 rows past step 4" in resumed.stdout
    # Each step once, and the resumed ones equal the uninterrupted run, bit for bit.
    assert loss_rows(tmp_path) == loss_rows(reference.dir)

    summary = (tmp_path / "summary.json").read_bytes()
    done = run_train(tmp_path, *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "nothing to train: the checkpoint is at step 6" in done.stdout
    assert (tmp_path / "summary.json").read_bytes() == summary


def test_a_signal_to_any_process_stops_the_run_and_every_stop_resumes_exactly(
    reference, monkeypatch, capsys, tmp_path
):
    """One stop path, whoever gets the signal, in a chain of runs on one run dir: SIGTERM
    and SIGINT to rank 1 alone, SIGHUP to the launcher alone (a closed terminal), each
    mid-step (rank 1 sends them at a named step): every rank ends that step, one
    checkpoint is written, the launcher says the one line, summary.json says the run
    stopped, and the exit status is 128 + signal. Then two Ctrl-Cs, the second while
    the stop's checkpoint is being written, and the same with two SIGTERMs to rank 1:
    one line says it was skipped, nothing half-written stays, and the newest
    checkpoint is named. Then SIGTERM to the launcher alone and a SLURM requeue
    (:func:`_sigterm_to_the_launcher_and_a_requeue`); the whole run equals the
    uninterrupted one, bit for bit."""
    checkpoints = tmp_path / "checkpoints"
    args = [*reference.args, "trainer.resume=auto"]
    for step, signal_at, signum in [
        (1, "step1:self:SIGTERM", signal.SIGTERM),
        (2, "step2:self:SIGINT", signal.SIGINT),
        (3, "step3:launcher:SIGHUP", signal.SIGHUP),
    ]:
        run = run_with_signal(tmp_path, signal_at, *args)
        out = run.stdout
        assert run.returncode == 128 + signum, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        name = signal.Signals(signum).name
        assert out.strip().splitlines()[-1] == (
            f"stopped by {name} at step {step}: checkpoint {checkpoints}/"
            f"step_{step:08d}; resume with python train.py hydra.run.dir={tmp_path} "
            "trainer.resume=auto"
        )
        assert out.count("stopped by") == 1, out[-3000:]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["stopped"] == {
            "by": name,
            "step": step,
            "checkpoint": str(checkpoints / f"step_{step:08d}"),
        }
        assert max(losses(tmp_path)) == step

    # A second signal while step 4's checkpoint is being written, after a first one
    # mid-step: Ctrl-C twice (the launcher gets both), then SIGTERM twice to rank 1
    # alone (the launcher learns it from how the rank ended).
    for signal_at, signum in [
        ("step4,checkpoint4", signal.SIGINT),
        ("step4:self,checkpoint4:self", signal.SIGTERM),
    ]:
        run = run_with_signal(tmp_path, signal_at, *args)
        out = run.stdout
        assert run.returncode == 128 + signum, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        stops = [line for line in out.splitlines() if "stopped" in line]
        assert stops == [
            f"stopped at once by a second {signal.Signals(signum).name}: the "
            "checkpoint of step 4 it was writing is skipped (removed); the newest "
            f"checkpoint is {checkpoints}/step_00000003; resume with "
            f"python train.py hydra.run.dir={tmp_path} trainer.resume=auto"
        ]
        assert sorted(p.name for p in checkpoints.iterdir()) == [
            "step_00000002",
            "step_00000003",
        ]

    _sigterm_to_the_launcher_and_a_requeue(monkeypatch, capsys, tmp_path, reference)
    assert loss_rows(tmp_path) == loss_rows(reference.dir)
    assert "stopped" not in json.loads((tmp_path / "summary.json").read_text())


def _sigterm_to_the_launcher_and_a_requeue(monkeypatch, capsys, run_dir, reference):
    """Cases 1 and 5, on a run dir whose newest checkpoint is step 3: a second run on
    the busy run dir refuses in one line naming the holder; SIGTERM to the launcher
    alone (sent by rank 1 during step 5, as a scheduler would: a signal from this test
    after reading a step's line raced the remaining steps of a tiny model) ends the
    step, writes a checkpoint (ckpt_every is 0), exits 143 with one line; a SLURM
    requeue resumes by itself and loses no step."""
    args = [*reference.args, "trainer.resume=auto"]
    proc = start(run_dir, *args, signal_at="step5:launcher")
    # Stopped while its ranks train, it keeps the lock while the second run tries.
    # (Stopped as soon as the lock was taken, its rendezvous store could time out
    # connecting to itself while a second train.py started on a loaded machine.)
    read_until(proc, "resumed from")
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        second = refused(monkeypatch, capsys, run_dir, *args, "trainer.seed=1")
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    assert second.returncode == 1
    line = one_line_error(second.stdout + second.stderr)
    assert f"is in use by another run (PID {proc.pid} on" in line

    out, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "Traceback" not in out
    assert out.strip().splitlines()[-1] == (
        f"stopped by SIGTERM at step 5: checkpoint {run_dir}/checkpoints/"
        f"step_00000005; resume with python train.py hydra.run.dir={run_dir} "
        "trainer.resume=auto"
    )
    assert max(losses(run_dir)) == 5

    # The requeued job is signalled again, during its last step: the run is complete,
    # so it ends as one (exit 0, no resume line, no requeue).
    env = {
        **os.environ,
        "SLURM_RESTART_COUNT": "1",
        "SLURM_JOB_ID": "42",
        "SHARDWRAP_TEST_SIGNAL_AT": "step6:launcher",
    }
    requeued = subprocess.run(
        command(run_dir, *reference.args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert requeued.returncode == 0, requeued.stdout[-2000:] + requeued.stderr[-2000:]
    assert "SLURM job 42 requeued" in requeued.stdout
    assert "(step 5)" in requeued.stdout
    ends = requeued.stdout + requeued.stderr
    assert "SIGTERM arrived as the run finished; nothing was stopped" in ends
    assert "resume with" not in ends


def test_a_rank_killed_under_two_torchrun_agents_is_one_line_naming_it(
    reference, tmp_path
):
    """Two torchrun agents (one rank each, as on two nodes); rank 1 is killed (SIGKILL,
    by itself, mid-step 3). The surviving rank says in one line which rank is gone,
    its PID and host, and why: its connection closed (not a timeout: the run's
    trainer.timeout_s is 600 s). Each agent exits 1; the dead rank's agent has only
    torchrun's own summary (SIGKILL, no traceback of ours). The step-2 checkpoint
    then resumes exactly on a local launch."""
    port = free_port()
    ranks = [o for o in BASE if not o.startswith("trainer.devices")]
    overrides = [*ranks, *reference.args, "trainer.ckpt_every=2", "trainer.keep_last=0"]
    env = {
        **os.environ,
        "SHARDWRAP_TEST_SIGNAL_AT": "step3:self:SIGKILL",
        # An agent's one rank would take every core; a rank of the reference's local
        # launch, its share: other matmul splits, other last bits of the weights.
        "OMP_NUM_THREADS": str(cpu_threads(2)),
    }
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2"]
            + ["--nproc_per_node=1", "--rdzv_backend=c10d"]
            + [f"--rdzv_endpoint=localhost:{port}", "--rdzv_id=faults"]
            + [f"--rdzv_conf=is_host={int(node == 0)}", str(ROOT / "train.py")]
            + [*overrides, f"hydra.run.dir={tmp_path}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for node in range(2)
    ]
    try:
        outs = [agent.communicate(timeout=600)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert [a.returncode for a in agents] == [1, 1], "\n".join(outs)[-6000:]
    survivor = [out for out in outs if "stopped responding" in out or "error: " in out]
    assert len(survivor) == 1, "\n".join(outs)[-6000:]
    out = survivor[0]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    host = socket.gethostname()
    assert len(errors) == 1, out[-3000:]
    assert re.fullmatch(
        rf"error: rank 1 \(PID \d+ on {host}, exited\) is gone: its connection "
        rf"closed during a collective \(.+\) \(rank 0 on {host} failed; traceback: "
        rf"{tmp_path}/ranks/rank0_error.txt\)",
        errors[0],
    ), errors[0]
    assert "[rank0]:" not in out and "timed out" not in out, out[-3000:]
    (dead,) = [o for o in outs if o is not out]
    assert "Signal 9 (SIGKILL)" in dead and "error: " not in dead, dead[-3000:]

    resumed = run_train(
        tmp_path, *reference.args, "trainer.ckpt_every=2", "trainer.resume=auto"
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "(step 2)" in resumed.stdout
    assert loss_rows(tmp_path) == loss_rows(reference.dir)


def run_with_signal(
    run_dir: Path, signal_at: str, *overrides: str
) -> subprocess.CompletedProcess:
    """train.py to the end, with SHARDWRAP_TEST_SIGNAL_AT set (faults.py), in a
    process group of its own (the group a Ctrl-C reaches); ``.stdout`` holds stdout
    and stderr in the order they were written."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARDWRAP_TEST_SIGNAL_AT": signal_at}
    return subprocess.run(
        command(run_dir, *overrides),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        timeout=600,
    )


def test_stopped_rank_is_named_within_the_timeout(tmp_path):
    """Case 6: a rank stopped with SIGSTOP is named (rank, PID, host), in one line,
    soon after trainer.timeout_s."""
    timeout_s = 8
    proc = start(tmp_path, "trainer.max_steps=100000", f"trainer.timeout_s={timeout_s}")
    read_until(proc, "step 2:")
    victim = worker_pids(proc.pid)[-1]
    stopped_at = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    # Timed to the line that names it, not to the exit of every process (a busy
    # machine's teardown is not what trainer.timeout_s bounds).
    named = read_until(proc, "stopped responding")
    elapsed = time.monotonic() - stopped_at
    rest, _ = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 1
    line = one_line_error("".join(named) + rest)
    assert f"rank 1 (PID {victim} on " in line and "stopped responding" in line
    assert elapsed < timeout_s + 20, f"took {elapsed:.0f}s to name the stopped rank"


def test_full_disk_says_no_space_left_and_where(tmp_path):
    """Case 7: a write that fails with ENOSPC (metrics.jsonl is /dev/full here) ends
    the run with one line saying so and naming the run dir. What an earlier full
    disk left mid-write (a checkpoint being saved, a summary.json being replaced) is
    removed when the run starts, in one line."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    (tmp_path / "checkpoints" / ".tmp.step_00000002").mkdir(parents=True)
    writer = subprocess.Popen(["true"])  # a writer that is gone
    writer.wait()
    (tmp_path / f"summary.json.tmp-shardwrap-{writer.pid}").write_text("{")
    run = run_train(tmp_path, "trainer.max_steps=2")
    assert run.returncode == 1
    line = one_line_error(run.stdout + run.stderr)
    assert f"no space left on device writing to {tmp_path}" in line
    assert (
        f"left in {tmp_path}: checkpoints/.tmp.step_00000002, "
        f"summary.json.tmp-shardwrap-{writer.pid}\n" in run.stderr
    )
    assert not list(tmp_path.glob("**/*.tmp*"))


def test_errors_before_any_rank_starts_are_one_line(monkeypatch, capsys, tmp_path):
    """Case 8: a data glob that matches nothing. (A run dir that cannot be created:
    tests/test_run_dir.py, train.py's command line in-process.)"""
    glob = f"data.paths={tmp_path}/none/*.txt"
    run = refused(monkeypatch, capsys, tmp_path / "run", "data=text", glob)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("config error: data.paths: no files match")


@pytest.mark.parametrize(
    ("point", "stopped_at"),
    [("prepare", None), ("rank_start", 1), ("validation", 2)],
)
def test_ctrl_c_to_the_group_at_any_moment_loses_nothing_and_says_one_line(
    tmp_path, point, stopped_at
):
    """A real Ctrl-C: SIGINT to the whole process group (launcher and ranks), sent by
    rank 1 itself at a named point (SHARDWRAP_TEST_SIGNAL_AT; the launcher for
    ``prepare``), not after a timer. Before the ranks start: one line, nothing to
    resume. While a rank starts (before its handler exists) or during validation
    (mid-step: the chain test above, whose first Ctrl-C comes mid-step): the step ends, a complete checkpoint of it is written, and the run ends
    with exit 130 and the one resume line; no traceback, no leaked-semaphore warning.
    (The launcher used to pass the signal on to ranks that had it already, a second
    signal that killed them before the checkpoint whenever it was handled apart from
    the first; and a rank signalled while importing died with a KeyboardInterrupt.)"""
    proc = run_with_signal(
        tmp_path, point, "trainer.max_steps=4", "trainer.val_every=2"
    )
    out = proc.stdout
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    for noise in ("Traceback", "KeyboardInterrupt", "leaked", "Warning"):
        assert noise not in out, out[-3000:]
    stops = [line for line in out.splitlines() if "stopped by SIGINT" in line]
    assert stops == [out.strip().splitlines()[-1]]
    if stopped_at is None:
        assert stops == ["stopped by SIGINT before the first step; nothing to resume"]
        assert not (tmp_path / "checkpoints").exists()
        return
    checkpoint = tmp_path / f"checkpoints/step_{stopped_at:08d}"
    assert stops == [
        f"stopped by SIGINT at step {stopped_at}: checkpoint {checkpoint}; resume with "
        f"python train.py hydra.run.dir={tmp_path} trainer.resume=auto"
    ]
    assert (checkpoint / "COMPLETE").is_file()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [checkpoint.name]


def test_ranks_under_torchrun_die_with_its_agent(tmp_path):
    """Issue 48 item 4 under torchrun: ``kill -9`` of the torchrun agent (the OOM
    killer, a user) ends its ranks within seconds (the kernel's parent-death
    signal, asked by each rank as train.py starts), instead of leaving them
    training as orphans."""
    ranks = [o for o in BASE if not o.startswith("trainer.devices")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + ["--nproc_per_node=2", str(ROOT / "train.py"), *ranks]
        + ["trainer.max_steps=100000", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        read_until(agent, "step 1:")
        workers = [p for p, cmd in children(agent.pid).items() if "train.py" in cmd]
        assert len(workers) == 2, children(agent.pid)
        agent.kill()
        agent.wait(timeout=HANG_S)  # not its output: orphans would hold it open
        deadline = time.monotonic() + 20  # SIGKILLs, by the kernel: milliseconds
        while living := [p for p in workers if start_time(p) is not None]:
            assert time.monotonic() < deadline, f"outlived their agent: {living}"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
