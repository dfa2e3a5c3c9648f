"""The trainer end to end: train.py on 2 ranks, 1 rank vs 2 ranks, failures, torchrun."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

from src.config.run_plan import resolve
from src.config.schema import LR_SCHEDULES
from src.harness import compose_config
from src.models import GPT, get_spec
from src.planner.profiles import cpu_threads
from src.planner.report import plan_only
from src.trainer.loop import train
from src.trainer.optimizer import apply_hyperparameters, build_optimizer, lr_lambda
from src.trainer.optimizers import MUON, MuonAdamW
from tests.distributed import HANG_S, run_distributed
from tests.test_models import TinyLM

ROOT = Path(__file__).resolve().parents[1]
# A short fp32 run on model=tiny: several wrap units, two micro-batches per step.
SMALL_RUN = [
    "model=tiny",
    "logger=none",
    "trainer.max_steps=6",
    "trainer.batch_size=8",
    "trainer.grad_accum=2",
    "trainer.log_every=1",
    "trainer.val_every=3",
    "trainer.val_batches=2",
    "trainer.warmup_steps=2",
    "trainer.progress=false",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
    "sharding.min_params=2e4",
]


def make_cfg(*overrides: str):
    return compose_config(*overrides)


def read_rows(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = make_cfg("trainer.lr=1e-3", "trainer.min_lr=1e-4", "trainer.warmup_steps=10")
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(cfg.trainer.max_steps) == pytest.approx(0.1)
    steps = range(10, cfg.trainer.max_steps + 1)
    assert all(f(a) >= f(b) for a, b in zip(steps, steps[1:], strict=False))


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
def test_each_schedule_decays_as_named_and_resumes_exactly(schedule):
    """The warmup is shared; then cosine and linear fall to min_lr, wsd holds lr until
    its last decay_fraction, constant holds lr. A resume (and one extending
    max_steps) continues with the formula's learning rate, bit for bit."""
    over = ("trainer.lr=1e-3", "trainer.min_lr=1e-4", "trainer.warmup_steps=10")
    cfg = make_cfg(*over, f"trainer.schedule={schedule}", "trainer.max_steps=50")
    f, end = lr_lambda(cfg), 0.1 if schedule != "constant" else 1.0
    assert [f(s) for s in range(10)] == [(s + 1) / 10 for s in range(10)]
    assert f(10) == 1.0 and f(50) == pytest.approx(end) and f(60) == f(50)
    steps = range(10, 51)
    assert all(f(a) >= f(b) for a, b in zip(steps, steps[1:], strict=False))
    if schedule == "wsd":  # decay_fraction 0.2 of 50 steps: the decay from step 40
        assert f(40) == 1.0 and f(41) < 1.0 and f(45) == pytest.approx(0.55)
    if schedule == "linear":
        assert f(30) == pytest.approx(0.1 + 0.9 * 0.5)

    def lrs(cfg, start, stop, state=None):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
        if state is not None:
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
            apply_hyperparameters(opt, sched, cfg)
        out = []
        for _ in range(start, stop):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out, (opt.state_dict(), sched.state_dict())

    whole, _ = lrs(cfg, 0, 50)
    _, state = lrs(cfg, 0, 30)
    assert lrs(cfg, 30, 50, state)[0] == whole[30:]
    longer = make_cfg(*over, f"trainer.schedule={schedule}", "trainer.max_steps=80")
    assert lrs(longer, 30, 80, state)[0] == lrs(longer, 0, 80)[0][30:]


def test_muon_leaves_the_output_head_to_adamw_on_every_pipeline_stage():
    """A pipeline stage without the embedding still knows its head by the model's
    vocabulary: the same matrices as the whole model's, stage by stage (Llama, untied:
    PP2 with Muon trained head-by-AdamW on stage 1 only once it was told)."""
    from src.build import rank_stages
    from src.models.spec import muon_matrices

    cfg = make_cfg(
        "model=llama_tiny", "sharding.pipeline_parallel=2", "trainer.devices=2"
    )
    plan = resolve(cfg)
    vocab = plan.spec.vocab_size(plan.model_config)
    with torch.device("meta"):
        whole = plan.spec.build(plan.model_config, 0)

    def muon_names(model):
        ids = muon_matrices(model, plan.spec.no_decay, vocab)
        return {n for n, p in model.named_parameters() if id(p) in ids}

    staged = set()
    for pp_rank in (0, 1):
        for part in rank_stages(plan, 2, pp_rank).parts():
            staged |= muon_names(part)
    assert staged == muon_names(whole)
    assert "output.weight" not in staged and "layers.3.attention.wq.weight" in staged


def test_muon_takes_the_block_matrices_as_torch_muon_and_lion_steps_by_sign():
    """optimizer=muon: Muon for the blocks' matrices (one momentum buffer each), AdamW
    for the embeddings (the tied head), norms and biases; its update is
    torch.optim.Muon's (Moonlight's AdamW-RMS lr), up to torch's bf16 Newton-Schulz.
    optimizer=lion: p -= lr * sign(interpolated momentum), one buffer."""
    cfg = make_cfg("model=tiny", "trainer.optimizer=muon")
    model = GPT(get_spec("gpt").make_config(cfg.model))
    opt = build_optimizer(model, cfg, resolve(cfg).spec)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in opt.param_groups if g[MUON] for p in g["params"]]
    assert muon and all(n.startswith("h.") and n.endswith(".weight") for n in muon)
    assert "wte.weight" not in muon and len(muon) == 4 * model.config.n_layer

    w = torch.nn.Parameter(torch.randn(8, 16))
    ref = torch.nn.Parameter(w.detach().clone())
    ours = MuonAdamW([{"params": [w], MUON: True, "momentum": 0.95}], lr=0.02)
    ours.param_groups[0]["weight_decay"] = 0.1
    theirs = torch.optim.Muon(
        [ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    for step in range(3):
        w.grad = ref.grad = torch.randn(
            8, 16, generator=torch.Generator().manual_seed(step)
        )
        ours.step()
        theirs.step()
    assert set(ours.state[w]) == {"momentum_buffer", "step"}
    torch.testing.assert_close(w, ref, atol=1e-3, rtol=0)  # bf16 against fp32
    assert (w - ref).abs().max() > 0  # ours orthogonalises in fp32

    p = torch.nn.Parameter(torch.ones(4))
    lion = build_optimizer(
        torch.nn.Linear(4, 1, bias=False),
        make_cfg("trainer.optimizer=lion"),
        get_spec("gpt"),
    )
    assert type(lion).__name__ == "Lion"
    lion = type(lion)([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    p.grad = torch.tensor([1.0, -2.0, 0.0, 3.0])
    lion.step()
    assert p.tolist() == pytest.approx([0.85, 1.05, 0.95, 0.85])
    assert lion.state[p]["exp_avg"].tolist() == pytest.approx([0.01, -0.02, 0, 0.03])


def test_weight_decay_only_on_matrices():
    cfg = make_cfg("model=tiny")
    model = GPT(get_spec("gpt").make_config(cfg.model))
    decay, no_decay = build_optimizer(model, cfg, resolve(cfg).spec).param_groups
    assert decay["weight_decay"] == cfg.trainer.weight_decay
    assert no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(
        list(model.parameters())
    )


def test_plan_only_allocates_nothing_and_writes_the_plan(tmp_path, capsys):
    cfg = make_cfg("model=gpt2_xl", "trainer.plan_only=true", "sharding.policy=block")
    plan = plan_only(resolve(cfg), str(tmp_path))
    assert len(plan.units) == cfg.model.n_layer + 1  # every block + the root
    assert plan.total_numel > 1.5e9
    assert "wrap plan:" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["total_gib"] > 0
    assert len(json.loads((tmp_path / "wrap_plan.json").read_text())) == len(plan.units)


def test_cpu_ranks_split_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert cpu_threads(1) == cores and cpu_threads(2) == max(1, cores // 2)
    assert cpu_threads(4 * cores) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert cpu_threads(1) == cpu_threads(2) == 3
    for unusable in ("0", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert cpu_threads(1) == cores


def _train_rank(rank: int, world_size: int, cfg, run_dir: str) -> list[dict] | None:
    train(cfg, run_dir, torch.device("cpu"), resolve(cfg))
    return read_rows(Path(run_dir)) if rank == 0 else None


@pytest.mark.slow
def test_losses_same_on_one_and_two_ranks(tmp_path):
    cfg = make_cfg(*SMALL_RUN)
    one = run_distributed(_train_rank, 1, cfg, str(tmp_path / "one"))[0]
    two = run_distributed(_train_rank, 2, cfg, str(tmp_path / "two"))[0]

    def series(rows, key):
        return [(r["step"], r[key]) for r in rows if key in r]

    for key in ("loss", "grad_norm", "val_loss"):
        a, b = series(one, key), series(two, key)
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 2
        for (step, x), (_, y) in zip(a, b, strict=True):
            assert abs(x - y) < 1e-5, (key, step, x, y)
    losses = [v for _, v in series(one, "loss")]
    assert losses[-1] < losses[0]


def run_cmd(args: list[str], cwd: Path = ROOT, timeout: float = HANG_S):
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


@pytest.mark.slow
def test_train_py_on_two_ranks_writes_metrics(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cmd(
        [sys.executable, "train.py", *SMALL_RUN, "sharding.min_params=1e8"]
        + ["trainer.devices=2", f"hydra.run.dir={run_dir}"]
    )
    assert out.returncode == 0, out.stderr
    rows = read_rows(run_dir)
    loss_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in loss_rows] == [1, 2, 3, 4, 5, 6]
    for r in loss_rows:
        assert math.isfinite(r["loss"]) and r["lr"] > 0 and r["peak_mem_gib"] > 0
    assert "tokens_per_s" in loss_rows[-1] and "mfu" in loss_rows[-1]
    assert rows[0]["step"] == 0 and rows[0]["init_peak_mem_gib"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["wrap_units"] == 1  # min_params=1e8: only the root
    assert out.stdout.count("wrap plan:") == 1  # rank 0 only
    # The console ends with the closing summary, once, with the final figures.
    closing = out.stdout.strip().splitlines()[-2:]
    assert closing[0].startswith("finished 6 steps in ")
    assert f"loss {summary['loss']:.4f}" in closing[0] and "tokens/s" in closing[0]
    assert closing[1] == f"outputs: {run_dir}"


class FailingLM(TinyLM):
    """Raises on a real batch (the planner's fake tensors pass): every rank fails in
    its first step, with an error no check before the ranks can see."""

    def forward(self, idx, targets=None):
        if not is_fake(idx):
            raise ValueError(FAILURE)
        return super().forward(idx, targets)


FAILURE = "FailingLM: this rank's own error"
FAILING = ["model=custom", "model._target_=tests.test_train.FailingLM", *SMALL_RUN[1:]]


@pytest.mark.slow
def test_failing_rank_fails_the_command_and_shows_its_error_once(tmp_path):
    out = run_cmd(
        [sys.executable, "train.py", *FAILING, f"hydra.run.dir={tmp_path}/run"]
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert text.count(FAILURE) == 1, text
    assert "failed (exit code 1)" in out.stderr
    # One rank runs in the launching process: the same one line, not a traceback.
    out = run_cmd(
        [sys.executable, "train.py", *FAILING]
        + ["trainer.devices=1", f"hydra.run.dir={tmp_path}/one"]
    )
    assert out.returncode == 1
    error_file = tmp_path / "one" / "ranks" / "rank0_error.txt"
    assert out.stderr.strip().splitlines()[-1] == (
        f"rank 0 on {socket.gethostname()} failed: ValueError: {FAILURE} "
        f"(traceback: {error_file})"
    )
    assert "Traceback" not in out.stdout + out.stderr
    assert FAILURE in error_file.read_text()


@pytest.mark.slow
def test_under_torchrun_ranks_share_rank0_run_dir(tmp_path):
    out = run_cmd(
        [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        + ["--nproc_per_node=2", str(ROOT / "train.py"), *SMALL_RUN]
        + ["trainer.max_steps=2"],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    metrics = list(tmp_path.glob("outputs/*/*/metrics.jsonl"))
    assert len(metrics) == 1
    assert [r["step"] for r in read_rows(metrics[0].parent) if "loss" in r] == [1, 2]
