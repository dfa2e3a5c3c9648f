"""Trainer overhead: train.py's tokens/s against a minimal hand-written FSDP2 loop.

Both sides train the same GPT (``conf/model/<model>.yaml``), on the same synthetic
tokens (``src.data.sources`` ``GlobalBatches``), with the same global batch, 2 gloo
ranks of 1 thread each, FSDP2 ``fully_shard`` on every block and on the root, AdamW
(weight decay on matrices only), warmup + cosine LR and grad-norm clipping, with the
hyper-parameters of ``conf/trainer/default.yaml``. So the losses match step for step
(checked: ``max |dloss|``).

- ``trainer``: ``python train.py model=<model> data=synthetic sharding.policy=block
  trainer.devices=2 ... logger=none trainer.progress=false`` in a subprocess; its
  throughput over steps (W, N] comes from metrics.jsonl (each log record's
  ``step_time_s`` x steps in its window), so the log points at W and N bound the window.
- ``minimal``: the loop below, started with ``torch.multiprocessing`` (``spawn``) or
  torch's elastic launcher (``elastic``, as train.py does); rank 0 times steps (W, N].

Repeats alternate the order of the sides; the ratio trainer / minimal is reported per
repeat and as the median, also window by window (window i of each side, the same
steps: the median of the paired windows' ratios and their quartiles, per repeat and
over all repeats), with the CPU time of each side's process tree (read from /proc at
the log lines of steps W and N), which other load on a shared machine disturbs less
than wall time.

``--ab`` instead runs the arms of ``AB_ARMS`` (the minimal step, the trainer's own
``Trainer.build`` + ``Trainer.step`` and the fit loop's stop check, root resharding
on/off, log points; on request ``AB_FOREACH``: either with AdamW's foreach
implementation) inside the same 2 ranks, one step of each in turn, so machine load hits them alike: the step-level
comparison without process start-up, launcher or Hydra.

    python -m bench.overhead [--model small] [--steps 60] [--warmup 10] [--repeats 3]
        [--minimal spawn elastic] [--ab] [--append-docs]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from bench.common import publish
from src.harness import compose_config, run_distributed
from src.trainer.optimizer import final_lr

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2


# --shape: (model config, its overrides, global batch). ``default``: train.py's
# default model; ``gpt-4x512``: 4 MiB block activations (issue 55); ``llama-32k``: a
# 32k vocabulary at sequence 1024, small enough for 2 CPU cores.
SHAPES = {
    "default": ("small", (), 16),
    "gpt-4x512": (
        "small",
        ("n_layer=4", "n_embd=512", "n_head=8", "vocab_size=8192", "block_size=256"),
        8,
    ),
    "llama-32k": (
        "llama_tiny",
        ("dim=256", "n_layers=2", "n_heads=4", "n_kv_heads=2", "vocab_size=32000",
         "max_seq_len=1024", "multiple_of=64"),
        2,
    ),
}  # fmt: skip


def model_overrides(args: argparse.Namespace) -> list[str]:
    """``model=<config>`` and its ``model.<key>=<value>`` overrides (both sides)."""
    return [f"model={args.model}", *(f"model.{o}" for o in args.model_set)]


def load_settings(args: argparse.Namespace) -> dict:
    """The model shape and trainer hyper-parameters both sides use."""
    from dataclasses import asdict

    from src.config.run_plan import resolve

    r = resolve(compose_config(*model_overrides(args), "data=synthetic"))
    trainer = OmegaConf.load(ROOT / "conf" / "trainer" / "default.yaml")
    data = OmegaConf.load(ROOT / "conf" / "data" / "synthetic.yaml")
    return {
        "family": r.spec.name,
        "shape": asdict(r.model_config),
        "seq_len": int(r.spec.seq_len(r.model_config)),
        "vocab_size": int(r.model_config.vocab_size),
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "log_every": args.log_every,
        "seed": int(trainer.seed),
        "lr": float(trainer.lr),
        "min_lr": float(final_lr(trainer)),
        "warmup_steps": int(trainer.warmup_steps),
        "weight_decay": float(trainer.weight_decay),
        "betas": tuple(float(b) for b in trainer.betas),
        "grad_clip": float(trainer.grad_clip),
        "num_tokens": int(data.num_tokens),
        "val_fraction": float(data.val_fraction),
    }


def synthetic_data(s: dict) -> SimpleNamespace:
    """The trainer's ``data=synthetic`` config as both sides read it."""
    return SimpleNamespace(
        name="synthetic", num_tokens=s["num_tokens"], val_fraction=s["val_fraction"]
    )


# --------------------------------------------------------------------- minimal loop


def _minimal_setup(s: dict, mesh, root_reshard: bool | None = None):
    """The hand-written side: fully_shard per block and on the root, AdamW with decay on
    matrices only, the same LR schedule as the trainer."""
    from torch.distributed.fsdp import fully_shard

    from src.models import get_spec

    spec = get_spec(s["family"])
    config = spec.config_cls(**s["shape"])
    model = spec.build(config, s["seed"])
    blocks = spec.block_classes(config)
    for block in [m for m in model.modules() if isinstance(m, blocks)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {
                "params": [p for p in params if p.dim() >= 2],
                "weight_decay": s["weight_decay"],
            },
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=s["lr"],
        betas=s["betas"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(s, step)
    )
    return model, optimizer, scheduler


def _lr_factor(s: dict, step: int) -> float:
    """Linear warmup, then cosine to min_lr (the trainer's schedule)."""
    if step < s["warmup_steps"]:
        return (step + 1) / s["warmup_steps"]
    floor = s["min_lr"] / s["lr"]
    progress = (step - s["warmup_steps"]) / max(1, s["steps"] - s["warmup_steps"])
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def minimal_train(s: dict, out_dir: str) -> None:
    """One rank of the hand-written loop (process group already initialised)."""
    from torch.distributed.device_mesh import init_device_mesh

    from src.data.sources import GlobalBatches, load_splits

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(s["seed"])
    mesh = init_device_mesh("cpu", (world,))
    model, optimizer, scheduler = _minimal_setup(s, mesh)
    train_split, _ = load_splits(synthetic_data(s), s["vocab_size"], s["seed"])
    batches = GlobalBatches(train_split, s["batch_size"], s["seq_len"], s["seed"])

    losses, stamps = [], {}
    progress = open(  # rank 0's log points, read by run_side
        os.path.join(out_dir, "progress.jsonl") if rank == 0 else os.devnull, "a"
    )
    for step in range(1, s["steps"] + 1):
        x, y = batches.get(step - 1, 0, rank, world)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"] or math.inf)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        stamps[step] = time.perf_counter()
        if rank == 0 and (step == 1 or step % s["log_every"] == 0):
            progress.write(json.dumps({"step": step, "loss": losses[-1]}) + "\n")
            progress.flush()
    progress.close()
    with open(os.path.join(out_dir, f"minimal_{rank}.json"), "w") as f:
        json.dump({"losses": losses, "stamps": stamps}, f)


def _spawn_rank(rank: int, world: int, s: dict, out_dir: str) -> None:
    minimal_train(s, out_dir)


def _elastic_worker(s: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        minimal_train(s, out_dir)
    finally:
        dist.destroy_process_group()


def minimal_process(launcher: str, out_dir: str) -> None:
    """``--worker``: start the minimal loop's ranks (a subprocess of the benchmark, as
    train.py is, so both sides are measured the same way)."""
    with open(os.path.join(out_dir, "settings.json")) as f:
        s = json.load(f)
    s["betas"] = tuple(s["betas"])
    if launcher == "spawn":
        # no harness timeout: a large shape on a loaded machine runs past 300 s
        run_distributed(_spawn_rank, WORLD, s, out_dir, timeout=24 * 3600)
        return
    from torch.distributed.launcher.api import elastic_launch

    from src.trainer.launch import local_launch_config  # as train.py launches

    elastic_launch(local_launch_config(WORLD), _elastic_worker)(s, out_dir)


# ------------------------------------------- interleaved A/B inside the same ranks

# Arms of --ab: each a model + optimizer + schedule in the same 2 ranks, stepped in
# turn (one step of each arm, rotating the order), so load on the machine hits all
# arms alike. ``minimal*``: hand-written FSDP2 and step; ``trainer*``: the trainer's
# own parts, ``Trainer.build``, ``Trainer.step`` and ``Trainer.stop_if_asked``
# (src.trainer.loop).
AB_ARMS = (
    "minimal",  # fully_shard(block), fully_shard(root) with torch's defaults
    "minimal+root_reshard",  # the same, root with reshard_after_forward=True
    "trainer_step",  # Trainer.build + Trainer.step, config as given
    "trainer_step+root_keep",  # the same, root with reshard_after_forward=False
    "trainer_step+log",  # the same with a log point at every step
)
# Not run by default: AdamW's foreach implementation (one op per group, not per
# parameter; torch's default on CPU is the per-parameter loop), for either side.
AB_FOREACH = ("minimal+foreach", "trainer_step+foreach")


def compose_trainer_cfg(args: argparse.Namespace, s: dict):
    """The composed (resolved) train.py config of the trainer side."""
    cfg = compose_config(*trainer_command(s, args, "/unused")[2:-1])
    OmegaConf.resolve(cfg)
    return cfg


def _ab_arm(name: str, s: dict, cfg, resolved, mesh, out_dir: str):
    """(step function, model) of one arm."""

    from src.observe.loggers import Logger
    from src.trainer.loop import Trainer

    foreach = name.endswith("+foreach")
    if name.startswith("minimal"):
        root_reshard = True if name.endswith("root_reshard") else None
        model, optimizer, scheduler = _minimal_setup(s, mesh, root_reshard)
        _use_foreach(optimizer, foreach)

        def step_fn(batches, step: int) -> float:
            x, y = batches.get(step, 0, dist.get_rank(), dist.get_world_size())
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s["grad_clip"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        return step_fn

    # The trainer's own parts (src.trainer.loop.Trainer): build, then step. Its log
    # points are the first and last steps, or every step for ``+log``.
    log_every_step = name.endswith("+log")
    arm_cfg = copy.deepcopy(cfg)
    arm_cfg.trainer.log_every = 1 if log_every_step else s["steps"] + 1
    run_dir = os.path.join(out_dir, name)
    logger = Logger.files(run_dir if log_every_step and dist.get_rank() == 0 else None)
    trainer = Trainer(arm_cfg, run_dir, torch.device("cpu"), resolved, logger).build()
    if name.endswith("root_keep"):
        trainer.model.set_reshard_after_forward(False, recurse=False)
    _use_foreach(trainer.optimizer, foreach)

    def step_fn(batches, step: int) -> float:
        trainer.step(step + 1)  # its own batches: the same synthetic tokens
        trainer.stop_if_asked(step + 1, None)  # Trainer.fit's per-step stop check
        return trainer.loss  # the global mean, on every rank

    return step_fn


def _use_foreach(optimizer: torch.optim.Optimizer, foreach: bool) -> None:
    """AdamW's foreach implementation in every group, where ``foreach``."""
    if foreach:
        for group in optimizer.param_groups:
            group["foreach"] = True


def _ab_rank(
    rank: int, world: int, s: dict, cfg, resolved, arms: list[str], out_dir: str
):
    from torch.distributed.device_mesh import init_device_mesh

    from src.data.sources import GlobalBatches, load_splits

    mesh = init_device_mesh("cpu", (WORLD,))
    steps = {a: _ab_arm(a, s, cfg, resolved, mesh, out_dir) for a in arms}
    train_split, _ = load_splits(
        synthetic_data(s),
        s["vocab_size"],
        s["seed"],
    )
    batches = GlobalBatches(train_split, s["batch_size"], s["seq_len"], s["seed"])
    out = {a: {"wall": [], "cpu": [], "loss": []} for a in arms}
    for step in range(s["steps"]):
        k = step % len(arms)
        for arm in arms[k:] + arms[:k]:
            dist.barrier()  # each arm's step starts with both ranks ready
            t0, c0 = time.perf_counter(), time.process_time()
            loss = steps[arm](batches, step)
            out[arm]["wall"].append(time.perf_counter() - t0)
            out[arm]["cpu"].append(time.process_time() - c0)
            out[arm]["loss"].append(loss)
    return out


def run_ab(args: argparse.Namespace, s: dict) -> list[dict]:
    """Per-step wall (rank 0) and CPU (both ranks) of each arm after the warm-up."""
    from src.config.run_plan import resolve

    cfg = compose_trainer_cfg(args, s)
    arms = list(args.ab_arms)
    with tempfile.TemporaryDirectory() as out_dir:
        ranks = run_distributed(_ab_rank, WORLD, s, cfg, resolve(cfg), arms, out_dir)
    w = s["warmup"]
    rows, base = [], None
    for arm in arms:
        wall = statistics.median(ranks[0][arm]["wall"][w:])
        cpu = statistics.median(
            sum(v) for v in zip(*(r[arm]["cpu"][w:] for r in ranks), strict=True)
        )
        losses = [
            statistics.fmean(v)
            for v in zip(*(r[arm]["loss"] for r in ranks), strict=True)
        ]
        base = base or (wall, cpu, losses)
        rows.append(
            {
                "arm": arm,
                "step ms (median)": f"{wall * 1e3:.1f}",
                "tokens/s": _fmt_tps(s["batch_size"] * s["seq_len"] / wall),
                "arm / first (tokens/s)": f"{base[0] / wall:.3f}",
                "CPU ms/step, both ranks (median)": f"{cpu * 1e3:.1f}",
                "CPU: arm / first": f"{cpu / base[1]:.3f}",
                "max dloss vs first": f"{max(abs(a - b) for a, b in zip(losses, base[2], strict=True)):.1e}",
            }
        )
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------- CPU time from /proc

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, tuple[float, float, int]] | None:
    """(parent pid, (user + system CPU seconds, system CPU seconds, minor page
    faults)) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    user, system = int(fields[11]) / _TICK, int(fields[12]) / _TICK
    return int(fields[1]), (user + system, system, int(fields[7]))


def tree_cpu(root: int) -> dict[int, tuple[float, float, int]]:
    """(CPU seconds, system CPU seconds, minor page faults) of ``root`` and each of
    its live descendants, by pid."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None:
                stats[int(entry)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            out[pid] = stats[pid][1]
            todo.extend(children.get(pid, []))
    return out


def run_side(cmd: list[str], progress: str, s: dict) -> dict:
    """Run one side; while it runs, watch its progress file (one JSON line per log
    step) and read the CPU time of its process tree when steps W and N appear."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    marks: dict[int, tuple[float, dict[int, tuple[float, float, int]]]] = {}
    offset, pending = 0, ""
    while proc.poll() is None:
        time.sleep(0.01)
        if len(marks) == 2 or not os.path.exists(progress):
            continue
        with open(progress) as f:
            f.seek(offset)
            chunk = f.read()
            offset = f.tell()
        *lines, pending = (pending + chunk).split("\n")
        for line in lines:
            step = json.loads(line).get("step")
            if step in (s["warmup"], s["steps"]):
                marks[step] = (time.perf_counter(), tree_cpu(proc.pid))
    stderr = proc.stderr.read()
    if proc.returncode or len(marks) != 2:
        raise RuntimeError(f"{cmd[1:3]} failed ({proc.returncode}):\n{stderr[-3000:]}")
    (t0, cpu0), (t1, cpu1) = marks[s["warmup"]], marks[s["steps"]]
    steps = s["steps"] - s["warmup"]
    zero = (0.0, 0.0, 0)
    used = {pid: cpu1[pid][0] - cpu0.get(pid, zero)[0] for pid in cpu1}
    # The allocator's page faults and kernel time: what machine load hardly moves.
    faults = sum(cpu1[pid][2] - cpu0.get(pid, zero)[2] for pid in cpu1)
    system = sum(cpu1[pid][1] - cpu0.get(pid, zero)[1] for pid in cpu1)
    return {
        "cpu_per_step": sum(used.values()) / steps,
        "sys_per_step": system / steps,
        "faults_per_step": faults / steps,
        "launcher_cpu_share": used.get(proc.pid, 0.0) / (t1 - t0),
        "ranks_cpu_share": (sum(used.values()) - used.get(proc.pid, 0.0))
        / (t1 - t0)
        / WORLD,
    }


def run_minimal(s: dict, launcher: str) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        with open(os.path.join(out_dir, "settings.json"), "w") as f:
            json.dump(s, f)
        cmd = [sys.executable, "-m", "bench.overhead", "--worker", launcher, out_dir]
        result = run_side(cmd, os.path.join(out_dir, "progress.jsonl"), s)
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(out_dir, f"minimal_{r}.json")) as f:
                ranks.append(json.load(f))
    stamps = {int(k): v for k, v in ranks[0]["stamps"].items()}
    points = range(s["warmup"], s["steps"] + 1, s["log_every"])
    result["windows"] = [
        (stamps[b] - stamps[a]) / (b - a) for a, b in itertools.pairwise(points)
    ]
    losses = [
        statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks), strict=True)
    ]
    result["losses"] = {i + 1: v for i, v in enumerate(losses)}
    return result


# ---------------------------------------------------------------------- the trainer


def trainer_command(s: dict, args: argparse.Namespace, run_dir: str) -> list[str]:
    return [
        sys.executable,
        "train.py",
        *model_overrides(args),
        "data=synthetic",
        "sharding.policy=block",
        f"trainer.devices={WORLD}",
        f"trainer.max_steps={s['steps']}",
        f"trainer.batch_size={s['batch_size']}",
        f"trainer.log_every={s['log_every']}",
        "trainer.val_every=0",
        "logger=none",
        "trainer.progress=false",
        # the minimal loop saves none; the final save would start within the window's
        # last poll of the process tree's CPU time
        "trainer.ckpt_final=false",
        *args.trainer_overrides,
        f"hydra.run.dir={run_dir}",  # last: compose_trainer_cfg drops it
    ]


def run_trainer(s: dict, args: argparse.Namespace, extra: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        cmd = trainer_command(s, args, run_dir)
        result = run_side([*cmd[:-1], *extra, cmd[-1]], metrics, s)
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
    logged = [r for r in records if "loss" in r]
    result["windows"] = [
        r["step_time_s"]
        for r in logged
        if "step_time_s" in r and r["step"] > s["warmup"]
    ]
    result["losses"] = {r["step"]: r["loss"] for r in logged}
    return result


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="default", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="a conf/model config (over --shape's)")
    p.add_argument(
        "--model-set", nargs="*", default=None, help="model KEY=VALUE overrides"
    )
    p.add_argument("--batch-size", type=int, default=None, help="global, in sequences")
    p.add_argument(
        "--mmap",
        nargs="*",
        default=[],
        help="trainer.malloc_mmap_threshold_kib values: one trainer side each "
        "(alternated with the others in each repeat); none: the trainer's default",
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--warmup", type=int, default=10, help="steps left out of the timing"
    )
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--minimal",
        nargs="+",
        default=["spawn", "elastic"],
        choices=["spawn", "elastic"],
        help="launchers of the minimal loop (each one is a column)",
    )
    p.add_argument(
        "--trainer-overrides",
        nargs="*",
        default=[],
        help="extra train.py overrides (trainer side only: a changed hyper-parameter shows as max dloss)",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="interleaved in-process A/B of the minimal step and the trainer's own "
        "Trainer.build/Trainer.step (and variants) instead of the end-to-end runs",
    )
    p.add_argument(
        "--ab-arms", nargs="+", default=list(AB_ARMS), choices=AB_ARMS + AB_FOREACH
    )
    p.add_argument("--append-docs", action="store_true")
    p.add_argument(
        "--worker", nargs=2, metavar=("LAUNCHER", "DIR"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    model, model_set, batch = SHAPES[args.shape]
    args.model = args.model or model
    args.model_set = list(model_set) if args.model_set is None else args.model_set
    args.batch_size = args.batch_size or batch
    if args.warmup % args.log_every or args.steps % args.log_every or args.warmup <= 0:
        p.error("--warmup and --steps must be positive multiples of --log-every")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def _fmt_tps(x: float) -> str:
    return f"{x:,.0f}"


def _paired_row(ratios: list[float]) -> dict[str, str]:
    """The median and the quartiles of the paired windows' ratios (window i of a
    minimal side's run over window i of the trainer's in the same repeat): one slow
    window moves them little, unlike a repeat's mean."""
    if len(ratios) < 2:
        return {"paired windows": f"{ratios[0]:.3f}", "paired IQR": "-"}
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "paired windows": f"{statistics.median(ratios):.3f}",
        "paired IQR": f"{q1:.3f}-{q3:.3f}",
    }


def _side_line(r: dict, tokens_per_step: int) -> str:
    return (
        f"{tokens_per_step / r['step_s']:,.0f} tokens/s, CPU {r['cpu_per_step']:.3f} "
        f"s/step (sys {r['sys_per_step']:.3f}, {r['faults_per_step']:,.0f} page "
        f"faults; launcher {r['launcher_cpu_share']:.1%} of a core, ranks "
        f"{r['ranks_cpu_share']:.0%} each); s/step per window: "
        + " ".join(f"{w:.3f}" for w in r["windows"])
    )


def _paired(r: dict, t: dict) -> list[float]:
    """Window i of a minimal side over window i of trainer side ``t`` (same steps)."""
    return [m / w for m, w in zip(r["windows"], t["windows"], strict=True)]


def _row(repeat, side: str, t: str, res: dict, ratios, tokens_per_step: int) -> dict:
    """One side's row of one repeat, against trainer side ``t``."""
    r, tr = res[side], res[t]
    common = set(tr["losses"]) & set(r["losses"])
    dloss = max(abs(tr["losses"][k] - r["losses"][k]) for k in common)
    return {
        "repeat": repeat,
        "side": side,
        "against": t,
        "tokens/s": _fmt_tps(tokens_per_step / r["step_s"]),
        "tokens/s (median window)": _fmt_tps(tokens_per_step / r["median_step_s"]),
        "trainer / this": f"{r['step_s'] / tr['step_s']:.3f}",
        "(median window)": f"{r['median_step_s'] / tr['median_step_s']:.3f}",
        "CPU s/step": f"{r['cpu_per_step']:.3f}",
        "CPU: this / trainer": f"{r['cpu_per_step'] / tr['cpu_per_step']:.3f}",
        "sys CPU s/step": f"{r['sys_per_step']:.3f}",
        "page faults/step": f"{r['faults_per_step']:,.0f}",
        "launcher CPU": f"{r['launcher_cpu_share']:.1%}",
        "rank CPU/wall": f"{r['ranks_cpu_share']:.2f}",
        "max dloss": "-" if side == t else f"{dloss:.1e}",
        **(
            {"paired windows": "-", "paired IQR": "-"}
            if side == t
            else _paired_row(ratios)
        ),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.worker:
        minimal_process(*args.worker)
        return []
    s = load_settings(args)
    if args.ab:
        rows = run_ab(args, s)
        publish(
            rows,
            f"Trainer step against a minimal FSDP2 step, interleaved, "
            f"model={args.model}, {WORLD} gloo ranks",
            "All arms live in the same 2 ranks (1 thread each) and take one "
            "step each in turn (rotating order, a barrier before each step), "
            f"{s['steps']} steps, the first {s['warmup']} left out; medians of "
            "per-step wall time (rank 0) and CPU time (sum of both ranks). "
            "`minimal`: fully_shard per block and root with torch's defaults "
            "(the root keeps its parameters unsharded after forward); "
            "`trainer_step`: src.trainer.loop's Trainer.build, then per step "
            "Trainer.step and Trainer.fit's stop check (a collective), with the "
            "composed train.py config (log points: first and last "
            "step; `+log`: every step; `+foreach`: AdamW's foreach "
            "implementation, torch's default on CPU being the per-parameter loop).",
            bench="overhead",
            argv=argv,
            append=args.append_docs,
        )
        return rows
    tokens_per_step = s["batch_size"] * s["seq_len"]
    trainers = [f"trainer@{m}" for m in args.mmap] if args.mmap else ["trainer"]
    minimals = [f"minimal-{m}" for m in args.minimal]
    sides = trainers + minimals
    rows = []
    paired: dict[tuple[str, str], list[float]] = {
        (t, m): [] for t in trainers for m in minimals
    }
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        res = {}
        for side in order:
            if side.startswith("trainer"):
                mmap = side.partition("@")[2]
                extra = [f"trainer.malloc_mmap_threshold_kib={mmap}"] if mmap else []
                r = run_trainer(s, args, extra)
            else:
                r = run_minimal(s, side.split("-", 1)[1])
            r["step_s"] = statistics.fmean(r["windows"])
            r["median_step_s"] = statistics.median(r["windows"])
            res[side] = r
            print(
                f"repeat {repeat}: {side}: " + _side_line(r, tokens_per_step),
                flush=True,
            )
        for t in trainers:
            for side in [t, *minimals]:
                ratios = _paired(res[side], res[t]) if side != t else []
                rows.append(_row(repeat, side, t, res, ratios, tokens_per_step))
                if side != t:
                    paired[(t, side)] += ratios
    for (t, side), ratios in paired.items():
        mine = [r for r in rows if r["side"] == side and r["against"] == t]
        rows.append(
            {
                "repeat": "median",
                "side": side,
                "against": t,
                **{
                    k: f"{statistics.median(float(r[k]) for r in mine):.3f}"
                    for k in (
                        "trainer / this",
                        "(median window)",
                        "CPU: this / trainer",
                    )
                },
                **_paired_row(ratios),
            }
        )
    publish(
        rows,
        f"Trainer overhead against a minimal FSDP2 loop, shape {args.shape} "
        f"({' '.join(model_overrides(args))}), "
        f"{WORLD} gloo ranks",
        f"Same model, synthetic tokens, global batch {s['batch_size']} x "
        f"{s['seq_len']}, FSDP2 per block + root, fp32, AdamW, clip "
        f"{s['grad_clip']}, 1 thread per rank, {s['steps']} steps. Throughput "
        f"over steps ({s['warmup']}, {s['steps']}] in windows of "
        f"{s['log_every']} steps: trainer from metrics.jsonl, minimal timed on "
        "rank 0; the sides alternate order per repeat. `trainer / this`: "
        "trainer tokens/s over this side's (> 1: the trainer is faster), from "
        "the mean and the median window. `paired windows`: the median of the "
        "window-by-window ratios (window i of this side over the trainer's window "
        "i, the same steps), in the median row over every repeat's windows, and "
        "`paired IQR` their quartiles, the run's own spread. `CPU "
        "s/step`: CPU time (user + sys) of "
        "the side's whole process tree (launcher + ranks) over the same steps, "
        "read from /proc when the log lines of steps W and N appear; it is far "
        "less sensitive to other load on the machine than wall time. `sys CPU "
        "s/step`, `page faults/step`: the kernel's share of it and the minor page "
        "faults over the same steps (the allocator's cost; load barely moves "
        "them). "
        "`launcher CPU`: the launching process's share of a core (train.py: "
        "Hydra + torch's elastic agent). `rank CPU/wall` < 1: ranks waiting or "
        "preempted. `max dloss`: largest difference of the logged losses "
        "against the trainer's (same work).",
        bench="overhead",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
