"""A run's attempts in ``summary.json``: the first start and each resume, with its
steps, seconds and measured speed, so the summary describes the whole run.

A run's ``tokens_per_s`` and ``mfu`` are over every attempt that measured them
(a resume of a few steps measures none: its warm-up window is never reported):
tokens over seconds of all measured windows, and MFU weighted by each attempt's
measured seconds, leaving out the attempts whose peak-FLOP/s probe was disturbed
(other processes held the cores; its peak reads low and MFU high) when another
attempt's was not. Each attempt keeps its own figures beside them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from src.files import keep_aside, read_json
from src.observe.loggers import SUMMARY_FILE

log = logging.getLogger(__name__)

ATTEMPTS = "attempts"
#: An attempt's record: what it must hold, with the types it must have.
_FIELDS = {"start_step": int, "end_step": int, "wall_time_s": (int, float)}
#: ... and an attempt that measured its speed (``measured_s``) also these.
_MEASURED = {
    "measured_s": (int, float),
    "measured_steps": int,
    "tokens_per_s": (int, float),
    "world_size": int,
}


def set_aside_damaged_summary(run_dir: str | Path) -> None:
    """At a run's start (once admitted): a ``summary.json`` there that is not one
    (not a JSON object, or its attempts not records) is kept aside as
    ``summary.json.damaged-N``, said in one line, before any step; it was found at
    the run's end, and replaced."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return
    try:
        _recorded_attempts(path)
    except (OSError, ValueError) as exc:
        aside = keep_aside(path)
        log.warning(
            "%s is damaged (%s): kept as %s; this run's summary leaves out the "
            "attempts it recorded",
            path,
            exc,
            aside,
        )


def earlier_attempts(run_dir: str | Path, start_step: int) -> list[dict[str, Any]]:
    """The attempts the run dir's summary.json records that started before
    ``start_step`` (the step this attempt resumes from); [] for a fresh start, or a
    summary without them (a line says so when it is damaged)."""
    path = Path(run_dir) / SUMMARY_FILE
    if start_step == 0 or not path.is_file():
        return []
    try:
        records = _recorded_attempts(path)
    except (OSError, ValueError) as exc:
        log.warning("%s: earlier attempts left out of the summary (%s)", path, exc)
        return []
    return [r for r in records if r["start_step"] < start_step]


def _recorded_attempts(path: Path) -> list[dict[str, Any]]:
    """The attempts the summary at ``path`` records; ValueError if it is damaged."""
    summary = read_json(path)
    records = summary.get(ATTEMPTS, []) if isinstance(summary, dict) else None
    if not isinstance(records, list) or not all(_valid(r) for r in records):
        raise ValueError(f"{ATTEMPTS!r} is not a list of attempt records")
    return records


def _valid(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    fields = {**_FIELDS, **(_MEASURED if "measured_s" in record else {})}
    if "mfu" in record:
        fields["mfu"] = (int, float)
    return all(
        isinstance(record.get(k), t) and not isinstance(record.get(k), bool)
        for k, t in fields.items()
    )


def run_figures(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole run's figures from its ``attempts``: ``wall_time_s`` (all of them),
    ``steps_trained``, and where any attempt measured them ``tokens_per_s``,
    ``tokens_per_s_per_rank``, ``step_time_s`` and ``mfu`` (module docstring)."""
    out: dict[str, Any] = {
        "wall_time_s": sum(a["wall_time_s"] for a in attempts),
        "steps_trained": sum(a["end_step"] - a["start_step"] for a in attempts),
    }
    measured = [a for a in attempts if a.get("measured_s")]
    if not measured:
        return out
    seconds = sum(a["measured_s"] for a in measured)
    out["tokens_per_s"] = (
        sum(a["tokens_per_s"] * a["measured_s"] for a in measured) / seconds
    )
    out["tokens_per_s_per_rank"] = (
        sum(a["tokens_per_s"] / a["world_size"] * a["measured_s"] for a in measured)
        / seconds
    )
    out["step_time_s"] = seconds / sum(a["measured_steps"] for a in measured)
    with_mfu = [a for a in measured if "mfu" in a]
    sound = [a for a in with_mfu if not a.get("probe_contended")] or with_mfu
    if len(sound) == 1:  # its own figure, not m * s / s (a rounding away from it)
        out["mfu"] = sound[0]["mfu"]
    elif sound:
        weight = sum(a["measured_s"] for a in sound)
        out["mfu"] = sum(a["mfu"] * a["measured_s"] for a in sound) / weight
    return out
