"""The step-time model against measured steps: ordinary ``train.py`` runs.

Each configuration runs as a user runs it (``data=synthetic logger=none``, a few steps,
1-2 ranks); its summary.json holds the planner's ``predicted_step_time_s`` (from this
machine's probed profile, src/planner/profiles.py) and the measured ``step_time_s``
(the window after the first: one log point half-way, one at the end, so one
measured step in ``steps / 2`` is a logged one, whose memory is sampled at every
block's moments (src/observe/live_memory.py: 12 ms on the transformers model's
31 ms step), as one in ``trainer.log_every`` is in a run; with a log point every
second step half of them were, and the small models read 10-20% slower). The table gives both, the error, and the load: the
share of its window a rank's threads waited for a core other processes held
(``cpu_wait_others``), with the step that share leaves (``alone``: measured x (1 -
cpu_wait_others)), since on a shared machine the measured step stretches with other
processes' load. One thread per rank (``OMP_NUM_THREADS=1``: threads of one rank
wait for each other on a shared machine). Nothing is fitted to these runs: the
profile is the probe's.

    python -m bench.step_time_vs_measured [--configs NAME ...] [--steps 12] [--rounds 2]
        [--max-drift 0.1 [--tries 3]] [--append-docs]

This VM's speed moves by a third, at times twice, within minutes; ``--max-drift``
times the model's ops again after each run and runs a config again while the
prediction from them moved past that share: the machine changed speed during the
run, which no model of the run can predict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import publish, rounds_order

ROOT = Path(__file__).resolve().parent.parent
_MID = ["model.n_layer=6", "model.n_head=8", "model.n_embd=512"]
_MID += ["model.vocab_size=8192", "model.block_size=256", "trainer.batch_size=8"]
#: ~92M parameters: GPT-2 small's blocks over a vocabulary of 8192.
_BIG = ["model.n_layer=12", "model.n_head=12", "model.n_embd=768"]
_BIG += ["model.vocab_size=8192", "model.block_size=128"]
_HF = ["model=hf", "model.config=tiny_qwen2", "model.block_size=128"]

#: name -> overrides (2 ranks unless said): backends, layouts, checkpointing,
#: accumulation, precision, GPT / Llama / MoE / a transformers model, the default
#: model up to ~92M parameters.
CONFIGS: dict[str, list[str]] = {
    "gpt_fsdp2": [],
    "gpt_fsdp1": ["sharding=fsdp1"],
    "gpt_ddp": ["sharding=ddp"],
    "gpt_none_1rank": ["sharding=none", "trainer.devices=1"],
    "gpt_tp2": ["sharding.tensor_parallel=2"],
    "gpt_pp2_1f1b": ["sharding.pipeline_parallel=2", "sharding.pp_microbatches=4"],
    "gpt_pp2_gpipe": [
        "sharding.pipeline_parallel=2",
        "sharding.pp_microbatches=4",
        "sharding.pp_schedule=gpipe",
    ],  # fmt: skip
    "gpt_cp2": ["sharding.context_parallel=2"],
    "gpt_ac_full": ["sharding.activation_checkpointing=full"],
    "gpt_ac_selective": ["sharding.activation_checkpointing=selective"],
    "gpt_accum4": ["trainer.grad_accum=4"],
    "gpt_bf16": ["precision=bf16_mixed"],
    "llama_fsdp2": ["model=llama_tiny"],
    "llama_cp2": ["model=llama_tiny", "sharding.context_parallel=2"],
    "moe_fsdp2": ["model=moe_tiny"],
    "moe_ep2": ["model=moe_tiny", "sharding.expert_parallel=2"],
    "gpt_28m_fsdp2": _MID,
    "gpt_28m_ddp_accum4": [*_MID, "sharding=ddp", "trainer.grad_accum=4"],
    "gpt_92m_fsdp2": [*_BIG, "trainer.batch_size=4"],
    "llama_tp2": ["model=llama_tiny", "sharding.tensor_parallel=2"],
    "llama_ac_selective": [
        "model=llama_tiny",
        "sharding.activation_checkpointing=selective",
    ],
    "hf_fsdp2": _HF,
}
#: The same on one rank (no collective waits for a peer other processes hold off a
#: core): the compute terms alone.
_ONE = ["sharding=none", "trainer.devices=1", "trainer.batch_size=8"]
CONFIGS |= {
    "gpt_1rank": _ONE,
    "gpt_1rank_ac_full": [*_ONE, "sharding.activation_checkpointing=full"],
    "gpt_1rank_ac_selective": [*_ONE, "sharding.activation_checkpointing=selective"],
    "gpt_1rank_accum4": [*_ONE, "trainer.grad_accum=4"],
    "gpt_1rank_bf16": [*_ONE, "precision=bf16_mixed"],
    "llama_1rank": [*_ONE, "model=llama_tiny"],
    "moe_1rank": [*_ONE, "model=moe_tiny"],
    "gpt_28m_1rank": [*_MID, *_ONE[:2], "trainer.batch_size=4"],
    "gpt_92m_1rank": [*_BIG, *_ONE[:2], "trainer.batch_size=2"],
    "hf_1rank": [*_ONE, *_HF],
}


def run(overrides: list[str], steps: int) -> dict:
    """summary.json of ``python train.py <overrides>`` run for ``steps`` steps."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [
            "data=synthetic", "logger=none", f"trainer.max_steps={steps}",
            f"trainer.log_every={max(1, steps // 2)}", "trainer.val_every=0", "trainer.progress=false",
            "trainer.ckpt_final=false", *overrides, f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        subprocess.run(
            [sys.executable, "train.py", *args], cwd=ROOT, check=True,
            stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        return json.loads((Path(run_dir) / "summary.json").read_text())


def drift(overrides: list[str], before: dict) -> float:
    """How far this machine's speed moved during a run: the prediction from the
    model's ops timed again now (a plan-only run, its op times forgotten first)
    against the run's own, timed as it started (``before``: its summary)."""
    _forget(ops_only=True)
    after = run([*overrides, "trainer.plan_only=true"], 1)
    return after["predicted_step_time_s"] / before["predicted_step_time_s"] - 1


def _forget(ops_only: bool) -> None:
    """This machine's op times (src/planner/work.py), or its whole profile,
    forgotten: the next run measures them again. This VM's speed drifts within
    minutes at idle (fp32 matmuls at one thread 90 then 65 GFLOP/s, an op's dispatch
    40 then 78 us, 15 minutes apart): a prediction from figures of another minute
    would measure the drift."""
    from src.planner.profiles import cpu_identity, work_cache

    ops = work_cache(cpu_identity())
    for path in ops.parent.glob("*-ops-*.json"):
        path.unlink(missing_ok=True)
    if not ops_only:
        ops.with_name(ops.name.split("-ops-")[0] + ".json").unlink(missing_ok=True)


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def _cpu_ticks() -> tuple[int, int]:
    """(all, stolen) CPU ticks since boot (/proc/stat): the hypervisor's steal is
    time this VM's cores were taken away, which no in-guest clock subtracts."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields[:8]]
        return sum(ticks), ticks[7]
    except (OSError, ValueError, IndexError):
        return 0, 0


def _stolen(before: tuple[int, int]) -> str:
    after = _cpu_ticks()
    total = after[0] - before[0]
    return f"{(after[1] - before[1]) / total:.0%}" if total > 0 else "?"


def row(name: str, summary: dict, load_before: str, stolen: str = "?") -> dict:
    """One configuration's figures."""
    predicted, measured = summary["predicted_step_time_s"], summary["step_time_s"]
    others = float(summary.get("cpu_wait_others") or 0.0)
    alone = measured * (1 - others)
    return {
        "config": name,
        "ranks": summary["world_size"],
        "params": f"{summary['num_params'] / 1e6:.2f}M",
        "predicted ms": round(predicted * 1e3, 1),
        "measured ms": round(measured * 1e3, 1),
        "error": f"{measured / predicted - 1:+.0%}",
        "waited for others": f"{others:.0%}",
        "alone ms": round(alone * 1e3, 1),
        "error alone": f"{alone / predicted - 1:+.0%}",
        "loadavg": load_before,
        "stolen": stolen,
    }


def _error(summary: dict) -> float:
    return abs(summary["step_time_s"] / summary["predicted_step_time_s"] - 1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each config, every other round in reverse order; each config's "
        "run with the least measured step is kept (this VM's speed drifts by a third "
        "within minutes)",
    )
    p.add_argument(
        "--max-drift",
        type=float,
        default=None,
        help="after each run, time the model's ops again (a plan-only run) and run "
        "the config again while that prediction moved more than this share from "
        "the run's own (the machine's speed changed during it; e.g. 0.1)",
    )
    p.add_argument(
        "--tries",
        type=int,
        default=3,
        help="runs of a config at most, with --max-drift",
    )
    p.add_argument("--append-docs", action="store_true")
    p.add_argument(
        "--fresh-profile",
        action="store_true",
        help="probe the machine again before each run (about 13 s each): the "
        "comparison at the speed the machine has in that minute",
    )
    p.add_argument(
        "--keep-op-times",
        action="store_true",
        help="predict from the op times cached earlier (default: each run times "
        "the model's ops as it starts, beside the steps it is compared with)",
    )
    return p


def steady(
    attempt: Callable[[], tuple[dict, dict]],
    overrides: list[str],
    max_drift: float | None,
    tries: int = 3,
) -> tuple[dict, dict, float | None]:
    """``attempt()`` (a run of ``overrides``: its summary and its row), again while
    the machine's speed moved more than ``max_drift`` during it (:func:`drift`;
    None: once), ``tries`` times at most; the try that moved least, its row with
    its ``drift`` and the config's ``tries``, and how far it moved (None: not
    checked)."""
    done: list[tuple[float, dict, dict]] = []
    while len(done) < max(1, tries):
        summary, got = attempt()
        if max_drift is None:
            return summary, got, None
        moved = drift(overrides, summary)
        done.append((moved, summary, {**got, "drift": f"{moved:+.0%}"}))
        print({"try": len(done), **done[-1][2]}, flush=True)  # each, kept or not
        if abs(moved) <= max_drift:
            break
    moved, summary, got = min(done, key=lambda t: abs(t[0]))
    return summary, {**got, "tries": len(done)}, moved


def measure(name: str, args: argparse.Namespace) -> tuple[dict, dict, float | None]:
    """One config's run and row, made steady with ``--max-drift`` (:func:`steady`)."""

    def attempt() -> tuple[dict, dict]:
        load = _loadavg()
        if args.fresh_profile or not args.keep_op_times:
            _forget(ops_only=not args.fresh_profile)
        ticks = _cpu_ticks()
        summary = run(CONFIGS[name], args.steps)
        return summary, row(name, summary, load, _stolen(ticks))

    return steady(attempt, CONFIGS[name], args.max_drift, args.tries)


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    names = args.configs or list(CONFIGS)
    # the run with the least step: its row, |error| and drift
    best: dict[int, tuple[dict, float, float | None]] = {}
    first: dict[int, float] = {}  # the first round's |error|
    steps_ms: dict[int, list[str]] = {}
    for r, i in rounds_order(len(names), args.rounds):
        summary, got, moved = measure(names[i], args)
        print({"round": r + 1, **got}, flush=True)
        steps_ms.setdefault(i, []).append(f"{got['measured ms']:,.1f}")
        if r == 0:
            first[i] = _error(summary)
        if i not in best or got["measured ms"] < best[i][0]["measured ms"]:
            best[i] = got, _error(summary), moved
    rows = [best[i][0] for i in range(len(names))]
    if args.rounds > 1:
        rows = [
            {**got, "rounds ms": " / ".join(steps_ms[i])} for i, got in enumerate(rows)
        ]
    errors = [best[i][1] for i in range(len(names))]
    alone = [abs(r["alone ms"] / r["predicted ms"] - 1) for r in rows]
    note = (
        f"median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%}; "
        f"against the step alone (measured less the share its threads waited for "
        f"cores other processes held): median {statistics.median(alone):.0%}, worst "
        f"{max(alone):.0%}. loadavg: the 1-minute load average as each run started; "
        f"stolen: the share of the machine's CPU time the hypervisor took during the "
        f"run (/proc/stat's steal)."
    )
    if args.rounds > 1:
        firsts = list(first.values())
        note += (
            f" {args.rounds} rounds (every other in reverse order), each config's "
            f"run with the least measured step kept, with that run's own prediction "
            f"(rounds ms: each round's measured step); the first round alone: median "
            f"|error| {statistics.median(firsts):.0%}, worst {max(firsts):.0%}."
        )
    if args.max_drift is not None:
        over = [
            names[i]
            for i in range(len(names))
            if abs(best[i][2] or 0.0) > args.max_drift
        ]
        note += (
            f" Drift: the prediction from the model's ops timed again just after the "
            f"run, against the run's own; a config moved past {args.max_drift:.0%} "
            f"ran again (at most {args.tries} tries, the try that moved least kept), "
            f"{sum(r['tries'] for r in rows)} runs for {len(rows)} configs; "
            f"still past it: {', '.join(over) or 'none'}."
        )
    print(note)
    publish(
        rows,
        "Step-time model: predicted against measured step time",
        note,
        bench="step_time_vs_measured",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
