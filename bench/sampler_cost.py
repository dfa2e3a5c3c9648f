"""What the CPU peak sampler (src/observe/live_memory.py) costs a training step: one
process, model=small (overrides: another shape), the same step with and without the
sampler attached, alternated 12 times, median CPU time (process_time) of each.

    python -m bench.sampler_cost [--reps N] [OVERRIDES ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from src.config.run_plan import resolve
from src.harness import compose_config
from src.observe.live_memory import LiveMemory


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--reps", type=int, default=12, help="alternations")
    args = parser.parse_args(argv)
    argv, reps = args.overrides, args.reps
    torch.set_num_threads(1)
    r = resolve(compose_config("data=synthetic", *argv))
    model = r.spec.build(r.model_config, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq = r.spec.seq_len(r.model_config)
    x, y = torch.randint(0, 200, (8, seq)), torch.randint(0, 200, (8, seq))

    def step() -> None:
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    lm, cpu = LiveMemory(), {"off": [], "on": []}
    for rep in range(reps):
        for arm in ("on", "off") if rep % 2 else ("off", "on"):
            if arm == "on":
                lm.attach(model)
            start = time.process_time()
            step()
            cpu[arm].append(time.process_time() - start)
            if arm == "on":
                lm.detach()
    on, off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    row = {"overrides": " ".join(argv) or "(model=small)", "samples/step":
           round(lm.samples / reps), "off ms": round(off * 1e3, 1),
           "on ms": round(on * 1e3, 1), "on / off": round(on / off, 3)}  # fmt: skip
    print(row)
    return row


if __name__ == "__main__":
    main()
