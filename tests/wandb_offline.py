"""Read an offline wandb run back from its own files (for tests: no network, no sync).

Decoded by wandb's own reader (``wandb leet inspect --json``, a wandb-core command).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path


def _offline_run_file(run_dir: str | os.PathLike) -> Path:
    files = sorted(
        glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")),
        key=os.path.getmtime,
    )
    if not files:
        raise FileNotFoundError(f"no offline wandb run under {run_dir}/wandb")
    return Path(files[-1])


def read_wandb_offline_records(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of the latest offline run's .wandb transaction log, decoded by
    wandb's own reader (``wandb leet inspect --json``, a wandb-core command)."""
    from wandb.util import get_core_path

    run_file = _offline_run_file(run_dir)
    out = subprocess.run(
        [
            get_core_path(),
            "leet",
            "inspect",
            "--json",
            "--no-observability",
            "--run-file",
            str(run_file),
            str(run_file.parent.parent),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def read_wandb_offline_history(run_dir: str | os.PathLike) -> list[dict]:
    """The logged history rows (each with ``_step``) of the offline run in ``run_dir``,
    read from its own files: for tests, and for users who do not sync."""
    return [
        r["history"]["item"]
        for r in read_wandb_offline_records(run_dir)
        if r.get("type") == "history"
    ]


def read_wandb_offline_run(run_dir: str | os.PathLike) -> dict:
    """The offline run's identity and config (its ``run`` record) plus its summary."""
    run: dict = {}
    summary: dict = {}
    for r in read_wandb_offline_records(run_dir):
        if r.get("type") == "run":
            run = r["run"]
        elif r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    return {**run, "summary": summary}
