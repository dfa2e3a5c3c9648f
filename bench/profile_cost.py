"""What ``trainer.profile=true`` costs: step time before, inside and after the window.

One ``train.py`` run per repeat (model=small, synthetic tokens, 2 gloo ranks), log
points every W/2 steps, the profiler window over steps (W, 2W]
(``trainer.profile_start=W+1 trainer.profile_steps=W``). Compared within the same run,
so load on a shared machine drifts little between the windows: the baseline is the
step time of (W/2, W] (the first log window is warm-up and never reported); the
window's step time leaves out writing the files, which rank 0 reports on its own
(``files written in X s``); (2W, 3W] shows what is left after the window (nothing
should be). Also: the size of each file.

    python -m bench.profile_cost [--window 10] [--repeats 2] [--append-docs]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import publish

ROOT = Path(__file__).resolve().parent.parent


def run(out: Path, window: int) -> dict:
    """Seconds per step before, inside (without writing files) and after the
    window, the seconds writing them took, and the files' sizes."""
    half = window // 2
    cmd = [
        sys.executable,
        "train.py",
        "model=small",
        "data=synthetic",
        "logger=none",
        "trainer.progress=false",
        "trainer.val_every=0",
        f"trainer.max_steps={3 * window}",
        f"trainer.log_every={half}",
        "trainer.profile=true",
        f"trainer.profile_start={window + 1}",
        f"trainer.profile_steps={window}",
        f"hydra.run.dir={out}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1200)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}
    written = re.search(r"files written in ([\d.]+) s", (out / "train.log").read_text())
    write_s = float(written.group(1))

    def total(first: int, last: int) -> float:  # seconds of steps (first, last]
        return sum(half * t for s, t in step_s.items() if first < s <= last)

    return {
        "before": total(half, window) / (window - half),
        "inside": (total(window, 2 * window) - write_s) / window,
        "after": total(2 * window, 3 * window) / window,
        "write_s": write_s,
        "sizes": {f.name: f.stat().st_size for f in (out / "profile").iterdir()},
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    w = args.window
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run(Path(tmp) / str(i), w) for i in range(args.repeats)]
    rows = []
    for i, r in enumerate(runs):
        rows.append(
            {
                "repeat": i,
                f"ms/step before (steps {w // 2}-{w})": f"{r['before'] * 1e3:.0f}",
                "profiled / before": f"{r['inside'] / r['before']:.2f}",
                "after / before": f"{r['after'] / r['before']:.2f}",
                "files written (s)": f"{r['write_s']:.1f}",
            }
        )
    rows.append(
        {
            "repeat": "median",
            "profiled / before": f"{statistics.median(r['inside'] / r['before'] for r in runs):.2f}",
            "after / before": f"{statistics.median(r['after'] / r['before'] for r in runs):.2f}",
        }
    )  # fmt: skip
    sizes = ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(runs[0]["sizes"].items())
    )
    print(sizes)
    publish(
        rows,
        f"trainer.profile=true cost, model=small, 2 gloo ranks, {w}-step window",
        f"Within one run per repeat: step time of the {w} profiled steps (CPU "
        "activities and allocation events, unit ranges; writing the files left "
        f"out, shown on its own) and of the {w} steps after the window, against "
        f"steps {w // 2}-{w} before it. Files of one run: {sizes}. Measured on "
        "the shared 2-core machine under load from other jobs: ratios within a "
        "run, not absolute times.",
        bench="profile_cost",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
