"""What ``trainer.profile=true`` costs: step time inside and after the window.

Two ``train.py`` runs of the same config (model=small, synthetic tokens, 2 gloo ranks),
``--repeats`` times in alternating order: ``off`` (``trainer.profile=false``) and
``on`` (the window covers steps (W, 2W], ``trainer.profile_start=W+1
trainer.profile_steps=W``). Step times per log window come from each run's
metrics.jsonl (``step_time_s``, log points every W steps): window (W, 2W] holds the
profiled steps plus writing the files, window (2W, 3W] shows what is left after it
(nothing should be). Also: the trace and memory-timeline sizes per rank.

    python -m bench.profile_cost [--window 10] [--repeats 2] [--append-docs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import append_to_benchmarks
from src.util import markdown_table

ROOT = Path(__file__).resolve().parent.parent


def run(out: Path, window: int, profile: bool) -> dict[int, float]:
    """step -> step_time_s of the window ending there."""
    cmd = [
        sys.executable,
        "train.py",
        "model=small",
        "data=synthetic",
        "logger=none",
        "trainer.progress=false",
        "trainer.val_every=0",
        f"trainer.max_steps={3 * window}",
        f"trainer.log_every={window}",
        f"trainer.profile={str(profile).lower()}",
        f"trainer.profile_start={window + 1}",
        f"trainer.profile_steps={window}",
        f"hydra.run.dir={out}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1200)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    w = args.window
    ratios: dict[str, list[float]] = {"in": [], "after": []}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            times = {}
            for profile in order:
                out = Path(tmp) / f"{repeat}-{profile}"
                times[profile] = run(out, w, profile)
                if profile:
                    for f in sorted((out / "profile").iterdir()):
                        sizes[f.name] = f.stat().st_size
            ratios["in"].append(times[True][2 * w] / times[False][2 * w])
            ratios["after"].append(times[True][3 * w] / times[False][3 * w])
    rows = [
        {
            "window": f"steps ({w}, {2 * w}]: profiled + files written",
            "step time on / off (median)": f"{statistics.median(ratios['in']):.2f}",
            "per repeat": ", ".join(f"{r:.2f}" for r in ratios["in"]),
        },
        {
            "window": f"steps ({2 * w}, {3 * w}]: after the window",
            "step time on / off (median)": f"{statistics.median(ratios['after']):.2f}",
            "per repeat": ", ".join(f"{r:.2f}" for r in ratios["after"]),
        },
    ]
    size_note = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
    table = markdown_table(rows)
    print(table)
    print(size_note)
    if args.append_docs:
        append_to_benchmarks(
            f"trainer.profile=true cost, model=small, 2 gloo ranks, {w}-step window",
            f"python -m bench.profile_cost --window {w} --repeats {args.repeats} "
            "--append-docs",
            table,
            "Step time of the log window holding the profiled steps (the profiler on "
            "CPU records ops and allocations; the files are written at its last step) "
            "and of the window after it, against the same run with "
            f"trainer.profile=false. Files of one run: {size_note}. Measured on the "
            "shared 2-core machine under load from other jobs: ratios, not times.",
        )
    return rows


if __name__ == "__main__":
    main()
