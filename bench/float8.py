"""precision=float8 (torchao) on CPU: how it trains against bf16_mixed, 2 ranks
against 1, and the bytes FSDP2 all-gathers per step with and without float8
all-gather.

Three tables, each run with the trainer's own pieces (``Trainer.build`` /
``Trainer.step``), the same seed and the same batches (``trainer.batch_size`` is the
global batch, whatever the number of ranks):

1. Numerics: the default GPT (``model=small``) and ``model=llama_tiny``, one process,
   ``--steps`` steps in fp32, bf16_mixed and float8. Reported: the final loss (the
   mean of the last 10 steps' losses: one step's loss moves with its batch) and its
   gap to bf16_mixed's, beside bf16_mixed's own gap to fp32: a precision's rounding
   sends the run down another path, and that gap measures how far two equally good
   paths drift apart after so many steps. float8 passes when its gap stays within
   :data:`TRACK_REL` of bf16_mixed's final loss.
2. FSDP2 on 2 gloo ranks with float8 all-gather (the float8 bytes moved as uint8)
   against float8 on one process, ``--parity-steps`` steps: the largest per-step
   relative loss gap, within :data:`RANKS_REL`, beside bf16_mixed's own 2-rank gap.
   12 steps by default: past them (batch 8, no warmup) these runs reach loss
   spikes, where two roundings of one step land on either side of a spike and
   the per-step gap measures the spike, not the precision (bf16_mixed itself was
   1.7% apart at step 19, float8 13% at step 20).
3. The bytes each rank all-gathers per step (a counting all-gather on every FSDP2
   unit, ``set_custom_all_gather``), FSDP2 on 2 ranks: bf16_mixed, float8 without
   and with float8 all-gather. The float8 weights travel at 1 byte instead of bf16's
   2: the gain a GPU also gets, visible without one.

    python -m bench.float8 [--steps 200] [--parity-steps 12] [--append-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from bench.common import publish
from src.harness import compose_config, run_distributed
from src.sharding.float8 import ByteAllGather

MODELS = {"GPT (model=small)": "small", "Llama (model=llama_tiny)": "llama_tiny"}
PRECISIONS = ("fp32", "bf16_mixed", "float8")
#: float8's final loss within this fraction of bf16_mixed's (table 1; the docs say why)
TRACK_REL = 0.03
#: float8 FSDP2 2 ranks against 1 process: each step's loss within this fraction
RANKS_REL = 0.01
#: table 3's runs: name -> precision overrides
GATHERS = {
    "bf16_mixed": ["precision=bf16_mixed"],
    "float8, bf16 all-gather": [
        "precision=float8",
        "precision.float8_all_gather=false",
    ],
    "float8, float8 all-gather": [
        "precision=float8",
        "precision.float8_all_gather=true",
    ],
}
LAST = 10  # the final loss: the mean of the last LAST steps'


class CountingAllGather(ByteAllGather):
    """FSDP2's all-gather (float8 as bytes, as on gloo), counting the bytes each
    call's output receives."""

    def __init__(self, counter: list[int]) -> None:
        super().__init__()
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter[0] += output_tensor.numel() * output_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


def compose_cfg(model: str, world: int, steps: int, *overrides: str):
    return compose_config(
        f"model={model}",
        "logger=none",
        f"trainer.devices={world}",
        "sharding=fsdp2" if world > 1 else "sharding=none",
        "trainer.batch_size=8",
        f"trainer.max_steps={steps}",
        "trainer.val_every=0",
        "trainer.ckpt_every=0",
        "trainer.progress=false",
        "trainer.peak_tflops=1",  # no peak probe
        *overrides,
    )


def _rank(rank: int, world: int, cfg, resolved, out: str) -> dict:
    """The losses of ``cfg.trainer.max_steps`` steps and the bytes all-gathered per
    step after the first (FSDP2 only)."""
    from torch.distributed.fsdp import FSDPModule

    from src.trainer.loop import Trainer

    trainer = Trainer(cfg, os.path.join(out, "run"), torch.device("cpu"), resolved)
    trainer = trainer.build()
    counter = [0]
    for m in trainer.model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(CountingAllGather(counter))
    losses = []
    for step in range(1, cfg.trainer.max_steps + 1):
        if step == 2:
            counter[0] = 0  # the first step may gather for lazy init
        trainer.step(step)
        losses.append(trainer.loss)
    per_step = counter[0] / max(cfg.trainer.max_steps - 1, 1)
    return {"losses": losses, "gathered_bytes": per_step}


def run(model: str, world: int, steps: int, *overrides: str) -> dict:
    """Rank 0's result of ``steps`` steps of ``model`` on ``world`` ranks."""
    from src.config.run_plan import resolve

    cfg = compose_cfg(model, world, steps, *overrides)
    resolved = resolve(cfg)
    with tempfile.TemporaryDirectory() as out:
        return run_distributed(_rank, world, cfg, resolved, out, timeout=3600)[0]


def final(losses: list[float]) -> float:
    return statistics.fmean(losses[-LAST:])


def numerics(args: argparse.Namespace) -> list[dict]:
    """Table 1 (see the module docstring)."""
    rows = []
    for label, model in chosen(args):
        end = {}
        for p in PRECISIONS:
            end[p] = final(run(model, 1, args.steps, f"precision={p}")["losses"])
        ref = end["bf16_mixed"]
        gap = abs(end["float8"] - ref) / ref
        rows.append(
            {
                "model": label,
                "steps": args.steps,
                **{f"final loss {p}": f"{end[p]:.4f}" for p in PRECISIONS},
                "bf16 vs fp32": f"{abs(ref - end['fp32']) / ref:.2%}",
                "float8 vs bf16": f"{gap:.2%}",
                f"within {TRACK_REL:.0%}": "yes" if gap <= TRACK_REL else "NO",
            }
        )
    return rows


def ranks_and_bytes(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Tables 2 and 3 (see the module docstring)."""
    parity, gathered = [], []
    for label, model in chosen(args):
        n = args.parity_steps
        two = {name: run(model, 2, n, *o) for name, o in GATHERS.items()}
        pairs = {
            "float8": (
                run(model, 1, n, "precision=float8")["losses"],
                two["float8, float8 all-gather"]["losses"],
            ),
            "bf16_mixed": (
                run(model, 1, n, "precision=bf16_mixed")["losses"],
                two["bf16_mixed"]["losses"],
            ),
        }
        worst = {
            p: max(abs(a - b) / a for a, b in zip(*pair, strict=True))
            for p, pair in pairs.items()
        }
        one, sharded = pairs["float8"]
        parity.append(
            {
                "model": label,
                "steps": n,
                "float8 loss, 1 process": f"{one[-1]:.4f}",
                "float8 loss, FSDP2 2 ranks": f"{sharded[-1]:.4f}",
                "largest step gap float8": f"{worst['float8']:.3%}",
                "(bf16_mixed's)": f"{worst['bf16_mixed']:.3%}",
                f"within {RANKS_REL:.0%}": "yes"
                if worst["float8"] <= RANKS_REL
                else "NO",
            }
        )
        base = two["bf16_mixed"]["gathered_bytes"]
        for name, r in two.items():
            gathered.append(
                {
                    "model": label,
                    "run": name,
                    "all-gathered/rank/step (MiB)": f"{r['gathered_bytes'] / 2**20:.3f}",
                    "vs bf16_mixed": f"{r['gathered_bytes'] / base:.3f}",
                }
            )
    return parity, gathered


def chosen(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [(label, m) for label, m in MODELS.items() if m in args.models]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="table 1's steps")
    p.add_argument(
        "--parity-steps", type=int, default=12, help="tables 2-3's steps (see 2.)"
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS.values()),
        default=list(MODELS.values()),
    )
    p.add_argument("--append-docs", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    load = (
        open("/proc/loadavg").read().split()[0]
        if os.path.exists("/proc/loadavg")
        else "?"
    )
    tables = {"numerics": numerics(args)}
    tables["parity"], tables["gathered"] = ranks_and_bytes(args)
    notes = {
        "numerics": (
            f"One process, batch 8, byte-level text (data=text), seed 0; final loss = "
            f"mean of the last {LAST} steps. Load average {load} at the start. "
            f"The {TRACK_REL:.0%} band: e4m3 keeps 3 mantissa bits (a relative "
            "rounding of up to 2^-4 per element against bf16's 2^-8), averaged over "
            "dot products of 128-512 terms and rescaled every step, so float8 runs "
            "a path of its own; bf16_mixed's gap to fp32 shows how far two paths "
            "drift apart in these steps, and a wrong scale or a layer computing "
            "garbage moves the final loss by far more than 3%."
        ),
        "parity": "FSDP2 (float8 all-gather over gloo as uint8) vs sharding=none; "
        f"each step within {RANKS_REL:.0%} (tests/test_float8.py's band): the ranks "
        "scale their own half of the batch (tensorwise scales are per tensor), a "
        "float8 rounding (2^-4) averaged over each dot product.",
        "gathered": "Bytes each rank's FSDP2 all-gathers receive per step (after "
        "the first), counted by a CountingAllGather on every unit.",
    }
    titles = {
        "numerics": "float8 vs bf16_mixed, 1 CPU process",
        "parity": "float8 FSDP2 on 2 CPU ranks vs 1 process",
        "gathered": "Bytes all-gathered per step, FSDP2 on 2 CPU ranks",
    }
    for name, rows in tables.items():
        publish(
            rows, titles[name], notes[name], bench="float8", argv=argv,
            append=args.append_docs,
        )  # fmt: skip
    return tables


if __name__ == "__main__":
    main()
