"""One prepared GPU check: the CUDA path run for real, with MFU and memory against the plan.

A GPU machine is lent only now and then, for minutes, so this is one command that does
everything in order and never stops at the first failure:

1. ``tests``: the test subset with CUDA variants (``pytest -m cuda``);
2. for each config (eager, per-unit compile, then ``tp2``: tensor + sequence
   parallelism over 2 devices with FSDP2 over the rest, skipped with a line on a
   machine with fewer devices, then ``float8``: compile with float8 linear layers): the planner's estimate (``trainer.plan_only=true``,
   allocates nothing), then the trainer itself for a short fixed number of steps,
   through ``train.py`` as a user runs it;
3. ``profile``: a ``trainer.profile=true`` window on the same shape (per-rank traces,
   the CUDA allocator's history snapshot), then ``oom`` (GPU only): a run that cannot
   fit must stop with one line naming its OOM snapshot (``profile_problems`` and
   ``oom_problems`` say what is missing);
4. one JSON (``gpu_check.json``) and one Markdown table (``gpu_check.md``) in the output
   dir: tokens/s, MFU against the datasheet peak of the detected GPU, the CUDA
   allocator peak (``torch.cuda.max_memory_allocated``) against the plan's estimate,
   compile's and tp2's tokens/s over eager, float8's (``precision=float8`` with
   compile) over compile's (bf16_mixed on a GPU, the same shape), and the first error
   line of anything that failed.

    python -m bench.gpu_check OUT_DIR                # on a GPU machine (a few minutes)
    python -m bench.gpu_check OUT_DIR --dry-run      # the same steps on CPU, tiny shapes

The GPU model is a Llama of about 1.2B parameters (Llama 3.2 1B's shape) in bf16 with
full activation checkpointing, which fits one 80 GB GPU. ``--dry-run`` (tested in CI)
runs every step with ``model=llama_tiny`` on 2 CPU ranks, so the script cannot rot;
its plan-only leg runs for the first config alone (the others differ from it only by
overrides the planner's own tests plan, and each leg's layout search took ~7 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine
from src.text import markdown_table

ROOT = Path(__file__).resolve().parent.parent

# What each mode trains: the model, its shape and the loop (train.py overrides).
GPU_RUN = [
    "model=llama3_1b",
    "model.init_device=meta",
    "precision=bf16_mixed",
    "sharding.policy=block",
    "sharding.activation_checkpointing=full",
    "trainer.devices=auto",
    "trainer.batch_size=8",
    "trainer.max_steps=30",
    "trainer.log_every=10",
]
DRY_RUN = [
    "model=llama_tiny",
    "precision=fp32",
    "sharding.activation_checkpointing=full",
    "trainer.devices=1",
    "trainer.batch_size=4",
    "trainer.max_steps=4",
    "trainer.log_every=2",
]
COMMON = [
    "data=synthetic",
    "logger=none",
    "trainer.val_every=0",
    "trainer.progress=false",
]
CONFIGS = {
    "eager": [],
    "compile": ["sharding.compile=true"],
    # Tensor (+ sequence) parallelism over 2 devices, FSDP2 over the rest: needs 2
    # devices (skipped, and said so, on a 1-GPU machine; the dry run starts 2 CPU
    # ranks). Its loss must equal eager's (same model, same global batch).
    "tp2": ["sharding.tensor_parallel=2"],
    # float8 linear layers in the blocks (torchao; FSDP2 float8 all-gather), with
    # compile as float8 is run: against "compile" (bf16_mixed on a GPU) at the same
    # shape. MFU counts against the bf16 peak (torchtitan's convention).
    "float8": ["precision=float8", "sharding.compile=true"],
}
#: Devices a leg needs (1 when not listed).
LEG_DEVICES = {"tp2": 2}


def device_count(dry_run: bool) -> int:
    """Devices a leg may use: the GPUs (2 CPU ranks in a dry run)."""
    if dry_run:
        return 2
    import torch

    return torch.cuda.device_count()


# The profiler leg: a short window on the same shape (traces, CUDA memory snapshot).
PROFILE = [
    "trainer.max_steps=4",
    "trainer.profile=true",
    "trainer.profile_start=2",
    "trainer.profile_steps=2",
]
# The OOM leg (GPU only): logits of 128 x 2048 x 262144 fp32 values (275 GB) cannot
# be allocated on any GPU; the run must stop with one line naming the snapshot.
OOM = [
    "model=llama_tiny",
    "model.vocab_size=262144",
    "model.max_seq_len=2048",
    "precision=fp32",
    "trainer.devices=1",
    "trainer.batch_size=128",
    "trainer.max_steps=2",
    *COMMON,
]


def profile_problems(run_dir: Path, cuda: bool) -> list[str]:
    """What is missing from a ``trainer.profile=true`` run's ``profile/`` folder: a
    Chrome trace with the units' ranges per rank, the memory timeline (CPU) or the
    allocator snapshot with its history (CUDA), rank 0's table."""
    import pickle

    prof = run_dir / "profile"
    world = read_summary(run_dir).get("world_size", 1)
    problems = [] if (prof / "summary.md").is_file() else ["no summary.md"]
    for rank in range(world):
        trace = prof / f"rank{rank}.pt.trace.json"
        try:
            events = json.loads(trace.read_text())["traceEvents"]
        except (OSError, ValueError, KeyError) as err:
            problems.append(f"{trace.name}: {err}")
            continue
        if not any(str(e.get("name", "")).startswith("unit:") for e in events):
            problems.append(f"{trace.name}: no unit:<path> ranges")
        if not cuda:
            if not (prof / f"rank{rank}.memory_timeline.json").is_file():
                problems.append(f"no rank{rank}.memory_timeline.json")
            continue
        snap = prof / f"rank{rank}.memory_snapshot.pickle"
        try:
            data = pickle.loads(snap.read_bytes())
        except (OSError, pickle.UnpicklingError) as err:
            problems.append(f"{snap.name}: {err}")
            continue
        if not data.get("segments") or not any(data.get("device_traces", [])):
            problems.append(f"{snap.name}: no segments or no allocation history")
    return problems


def oom_problems(run_dir: Path, output: str, code: int) -> list[str]:
    """What is wrong with a run that must run out of CUDA memory: it failed, with one
    line naming ``profile/rank0.oom_snapshot.pickle``, which holds the allocator's
    segments."""
    import pickle

    snap = run_dir / "profile" / "rank0.oom_snapshot.pickle"
    lines = [x for x in output.splitlines() if "ran out of CUDA memory" in x]
    problems = [] if code != 0 else ["the run did not fail"]
    if len(lines) != 1 or str(snap) not in lines[0]:
        problems.append(f"expected one line naming {snap}, got {lines}")
    try:
        if not pickle.loads(snap.read_bytes()).get("segments"):
            problems.append(f"{snap.name}: no segments")
    except (OSError, pickle.UnpicklingError) as err:
        problems.append(f"{snap.name}: {err}")
    return problems


def checked(status: dict, problems: list[str]) -> dict:
    """``status`` of :func:`run_step` judged by ``problems`` instead of exit code."""
    status.update(ok=not problems, error="; ".join(problems) or None)
    print(f"[gpu_check] {status['step']}: "
          f"{'ok' if status['ok'] else 'FAILED: ' + status['error']}", flush=True)  # fmt: skip
    return status


def first_error(text: str) -> str:
    """The line a user reads first in a failed command's output."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in ("config error:", "Error", "error", "failed"):
        hits = [line for line in lines if marker in line]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


def run_step(name: str, cmd: list[str], log_dir: Path, timeout: float) -> dict:
    """Run one command; record its status, time and first error (never raises)."""
    log_path = log_dir / f"{name}.log"
    start = time.perf_counter()
    try:
        out = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "WANDB_MODE": "offline"},
        )
        text, code = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as exc:
        text, code = (
            f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {timeout:.0f}s",
            -1,
        )
    log_path.write_text(
        text if isinstance(text, str) else text.decode(errors="replace")
    )
    status = {
        "step": name,
        "ok": code == 0,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if code != 0:
        status["error"] = first_error(str(text))
    print(f"[gpu_check] {name}: {'ok' if code == 0 else 'FAILED'} "
          f"({status['seconds']} s){'' if code == 0 else ': ' + status['error']}",
          flush=True)  # fmt: skip
    return status


def read_summary(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--timeout", type=float, default=600, help="s per step")
    parser.add_argument(
        "--skip-tests", action="store_true", help="skip step 1 (pytest -m cuda)"
    )
    parser.add_argument(
        "--override",
        nargs="*",
        default=[],
        help="more train.py overrides, e.g. "
        "trainer.batch_size=4 (after the script's own)",
    )
    args = parser.parse_args(argv)
    out_dir = args.out_dir.resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    shape = [*(DRY_RUN if args.dry_run else GPU_RUN), *args.override]
    steps: list[dict] = []

    if not args.skip_tests:
        steps.append(
            run_step(
                "tests",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-m",
                    "cuda",
                    "-p",
                    "no:cacheprovider",
                    "-n",  # one process: the CUDA tests share the one GPU
                    "0",
                ],
                out_dir / "logs",
                args.timeout,
            )  # fmt: skip
        )
        if (
            not steps[-1]["ok"]
            and "no tests ran" in (out_dir / "logs/tests.log").read_text()
        ):
            steps[-1].update(ok=True, error=None)  # pytest exit 5: nothing selected

    rows = []
    for name, extra in CONFIGS.items():
        overrides = [*shape, *COMMON, *extra]
        needs = LEG_DEVICES.get(name, 1)
        if needs > device_count(args.dry_run):
            skipped = f"needs {needs} devices"
            steps.append({"step": name, "ok": True, "seconds": 0.0, "skipped": skipped})
            print(f"[gpu_check] {name}: skipped ({skipped})", flush=True)
            continue
        if needs > 1 and args.dry_run:
            overrides.append(f"trainer.devices={needs}")
        plan_dir = out_dir / "runs" / f"{name}-plan"
        run_dir = out_dir / "runs" / name
        train = [sys.executable, "train.py", *overrides]
        if args.dry_run and rows:
            skipped = "dry run: the first config's plan-only leg stands for it"
            steps.append({"step": f"{name}-plan", "ok": True, "seconds": 0.0,
                          "skipped": skipped})  # fmt: skip
        else:
            steps.append(
                run_step(
                    f"{name}-plan",
                    [*train, "trainer.plan_only=true", f"hydra.run.dir={plan_dir}"],
                    out_dir / "logs",
                    args.timeout,
                )
            )
        steps.append(
            run_step(
                name,
                [*train, f"hydra.run.dir={run_dir}"],
                out_dir / "logs",
                args.timeout,
            )  # fmt: skip
        )
        plan, run = read_summary(plan_dir), read_summary(run_dir)
        # The run's own plan (planned_peak_gib: the same quantity as peak_mem_gib),
        # else plan-only's total (the CUDA allocator's peak has no process baseline).
        estimate = run.get("planned_peak_gib")
        if estimate is None and plan.get("total_gib") is not None:
            estimate = plan["total_gib"]
            if not args.dry_run:
                estimate -= plan.get("process_gib", 0.0)
        peak = run.get("peak_mem_gib")
        rows.append(
            {
                "config": name,
                "ok": steps[-1]["ok"],
                "tokens_per_s": run.get("tokens_per_s"),
                "mfu": run.get("mfu"),
                "peak_mem_gib": peak,
                "plan_estimate_gib": estimate,
                "plan_error": (estimate / peak - 1) if estimate and peak else None,
                "measured_over_planned": (peak / estimate)
                if estimate and peak
                else None,
                "loss": run.get("loss"),
                "num_params": run.get("num_params"),
            }
        )
    # The profiler: traces and the memory snapshot; on a GPU also the OOM snapshot.
    prof_dir = out_dir / "runs" / "profile"
    status = run_step(
        "profile",
        [sys.executable, "train.py", *shape, *COMMON, *PROFILE, f"hydra.run.dir={prof_dir}"],
        out_dir / "logs",
        args.timeout,
    )  # fmt: skip
    steps.append(
        checked(status, profile_problems(prof_dir, not args.dry_run))
        if status["ok"]
        else status
    )
    if not args.dry_run:
        oom_dir = out_dir / "runs" / "oom"
        status = run_step(
            "oom",
            [sys.executable, "train.py", *OOM, f"hydra.run.dir={oom_dir}"],
            out_dir / "logs",
            args.timeout,
        )
        output = (out_dir / "logs" / "oom.log").read_text()
        code = 0 if status["ok"] else 1
        steps.append(checked(status, oom_problems(oom_dir, output, code)))

    speed = {r["config"]: r.get("tokens_per_s") for r in rows}
    eager, compiled, tp = speed.get("eager"), speed.get("compile"), speed.get("tp2")
    speedup = compiled / eager if eager and compiled else None
    tp_ratio = tp / eager if eager and tp else None
    f8 = speed.get("float8")
    f8_ratio = f8 / compiled if compiled and f8 else None

    report = {
        "machine": machine(),
        "dry_run": args.dry_run,
        "overrides": [*shape, *COMMON],
        "steps": steps,
        "runs": rows,
        "compile_speedup": speedup,
        "tp2_vs_eager": tp_ratio,
        "float8_vs_compile": f8_ratio,
    }
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    table = markdown_table([_fmt(r) for r in rows])
    failed = [s for s in steps if not s["ok"]]
    lines = [
        f"Machine: {report['machine']}{' (dry run)' if args.dry_run else ''}.",
        f"Command: `python -m bench.gpu_check OUT{' --dry-run' if args.dry_run else ''}`",
        f"Overrides: `{' '.join(report['overrides'])}`",
        "",
        table,
        "",
        f"compile speed-up over eager: {speedup:.2f}x" if speedup else "compile speed-up: n/a",
        f"tp2 tokens/s over eager: {tp_ratio:.2f}x" if tp_ratio else "tp2: n/a (needs 2 devices)",
        f"float8 tokens/s over compile: {f8_ratio:.2f}x" if f8_ratio else "float8: n/a",
        *(f"- FAILED {s['step']}: {s['error']}" for s in failed),
    ]  # fmt: skip
    (out_dir / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return report


def _fmt(row: dict) -> dict:
    def num(value, fmt: str) -> str:
        return fmt.format(value) if isinstance(value, int | float) else "-"

    return {
        "config": row["config"],
        "status": "ok" if row["ok"] else "failed",
        "params (M)": num(row["num_params"] and row["num_params"] / 1e6, "{:.0f}"),
        "tokens/s": num(row["tokens_per_s"], "{:,.0f}"),
        "MFU": num(row["mfu"], "{:.1%}"),
        "peak allocated (GiB)": num(row["peak_mem_gib"], "{:.2f}"),
        "plan estimate (GiB)": num(row["plan_estimate_gib"], "{:.2f}"),
        "estimate / peak - 1": num(row["plan_error"], "{:+.1%}"),
        "measured / planned": num(row["measured_over_planned"], "{:.3f}"),
        "loss": num(row["loss"], "{:.3f}"),
    }


if __name__ == "__main__":
    main()
