"""Read an offline wandb run back from its own files (for tests: no network, no sync).

Decoded by wandb's own reader (``wandb leet inspect --json``, a wandb-core command).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path


def offline_run_files(run_dir: str | os.PathLike) -> list[Path]:
    """The .wandb files of every offline run dir under ``<run_dir>/wandb``, oldest
    first (by the start time in the dir's name, then by mtime)."""
    files = sorted(
        glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")),
        key=lambda f: (Path(f).parent.name.split("-")[2], os.path.getmtime(f)),
    )
    return [Path(f) for f in files]


def _offline_run_file(run_dir: str | os.PathLike) -> Path:
    files = offline_run_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no offline wandb run under {run_dir}/wandb")
    return files[-1]


def read_wandb_offline_records(
    run_dir: str | os.PathLike, run_file: str | os.PathLike | None = None
) -> list[dict]:
    """Every record of the latest offline run's .wandb transaction log (or of
    ``run_file``), decoded by wandb's own reader (``wandb leet inspect --json``, a
    wandb-core command)."""
    from wandb.util import get_core_path

    if "wandb" in sys.modules:
        # run.finish() returns once the service has handled the run's exit record;
        # the service closes the run's files when it ends the run's stream, which
        # nothing here waits for. teardown() waits for the service process (started
        # by this process) to exit, so the file is read only once it is closed.
        import wandb

        wandb.teardown()
    run_file = Path(run_file) if run_file else _offline_run_file(run_dir)
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
        timeout=600,  # a guard against a hang, not a bound on a loaded machine
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def read_wandb_offline_history(
    run_dir: str | os.PathLike, run_file: str | os.PathLike | None = None
) -> list[dict]:
    """The logged history rows (each with ``_step``) of the offline run in ``run_dir``
    (its latest, or ``run_file``), read from its own files: for tests, and for users
    who do not sync."""
    return [
        r["history"]["item"]
        for r in read_wandb_offline_records(run_dir, run_file)
        if r.get("type") == "history"
    ]


def read_wandb_offline_run(
    run_dir: str | os.PathLike, run_file: str | os.PathLike | None = None
) -> dict:
    """The offline run's identity and config (its ``run`` record) plus its summary."""
    run: dict = {}
    summary: dict = {}
    for r in read_wandb_offline_records(run_dir, run_file):
        if r.get("type") == "run":
            run = r["run"]
        elif r.get("type") == "summary":
            summary.update(r["summary"].get("update", {}))
    return {**run, "summary": summary}
