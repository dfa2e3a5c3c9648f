"""Start-up time with and without the token cache: ``python train.py
data.tokenizer=bpe`` (the default corpus, 2 gloo ranks, one step) run twice on a fresh
cache directory, then the byte-level default for reference.

- ``to_step1_s``: wall time from starting the command to rank 0 printing step 1
  (Python and torch imports, data preparation, ranks, model build, one step);
- ``data_s``: the data preparation the launcher reports (BPE training + tokenizing on
  the first run, reading the cache's metadata on the others);
- ``vs_byte``: ``to_step1_s`` over the byte-level run's, measured in the same session.

    python -m bench.token_cache [--bpe-vocab-size 4096] [--ranks 2] [--append-docs]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import append_to_benchmarks
from src.text import markdown_table

ROOT = Path(__file__).resolve().parent.parent
DATA_TIME = re.compile(r"data ready in ([0-9.]+)s")


def run(overrides: list[str], cache: str, run_dir: str) -> dict:
    """One train.py run; the seconds to its first step and to data ready."""
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        "logger=none",
        "trainer.max_steps=1",
        "trainer.val_every=0",
        "trainer.progress=false",
        "trainer.peak_tflops=1",  # no MFU probe
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "SHARDWRAP_CACHE": cache, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    to_step1, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if to_step1 is None and line.startswith("step 1:"):
            to_step1 = time.perf_counter() - start
    if proc.wait() != 0 or to_step1 is None:
        raise RuntimeError(f"run failed:\n{''.join(lines[-20:])}")
    data = [float(m.group(1)) for m in map(DATA_TIME.search, lines) if m]
    cached = any("token cache: reusing" in line for line in lines)
    return {"to_step1_s": to_step1, "data_s": data[0], "cache": cached}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bpe-vocab-size", type=int, default=4096)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--paths", default=None, help="data.paths (default: the stdlib)")
    p.add_argument("--append-docs", action="store_true")
    args = p.parse_args(argv)
    common = [f"trainer.devices={args.ranks}"]
    if args.paths:
        common.append(f"data.paths={args.paths}")
    bpe = [*common, "data.tokenizer=bpe", f"data.bpe_vocab_size={args.bpe_vocab_size}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache")
        points = [
            ("bpe, first run (builds)", bpe),
            ("bpe, second run (cache)", bpe),
            ("byte (cache)", common),
        ]
        run(common, cache, os.path.join(tmp, "warm"))  # byte cache + OS file cache
        for i, (name, overrides) in enumerate(points):
            r = run(overrides, cache, os.path.join(tmp, f"run{i}"))
            rows.append({"run": name, **r})
    byte = rows[-1]["to_step1_s"]
    table = [
        {
            "run": r["run"],
            "to_step1_s": f"{r['to_step1_s']:.1f}",
            "data_s": f"{r['data_s']:.2f}",
            "cache": "reused" if r["cache"] else "built",
            "vs_byte": f"{r['to_step1_s'] / byte:.2f}",
        }
        for r in rows
    ]
    print(markdown_table(table))
    if args.append_docs:
        append_to_benchmarks(
            "Start-up with the token cache (data.tokenizer=bpe)",
            "python -m bench.token_cache " + " ".join(argv or sys.argv[1:]),
            markdown_table(table),
            note="Shared, loaded machine: compare the rows of one table only.",
        )
    return rows


if __name__ == "__main__":
    main()
