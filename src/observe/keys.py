"""What a metric is called where: a training row's wandb section (``train/``,
``val/``), and a mixture's per-source validation losses (``val/<source>/loss``) in
metrics.jsonl, summary.json, the console and the tables that read them."""

from __future__ import annotations

#: The wandb sections of a training run's rows (:func:`wandb_key`); eval.py's
#: ``eval/`` records in the same run are not the trainer's.
TRAINING_SECTIONS = ("train/", "val/")


def wandb_key(name: str) -> str:
    """A metric's name in wandb: in the ``val/`` section if it is a validation figure
    (``val_loss`` -> ``val/val_loss``), else in ``train/`` (``loss`` ->
    ``train/loss``); a name that already has a section keeps it. metrics.jsonl and
    summary.json keep the plain names."""
    if "/" in name:
        return name
    train, val = TRAINING_SECTIONS
    return f"{val}{name}" if name.startswith("val_") else f"{train}{name}"


#: A mixture's validation loss of one source (data.weights), beside ``val_loss``.
SOURCE_VAL = "val/{}/loss"


def source_val_key(source: str) -> str:
    """The metrics.jsonl / summary.json / wandb key of ``source``'s validation loss."""
    return SOURCE_VAL.format(source)


def source_of(key: str) -> str | None:
    """The source of a per-source validation key (:func:`source_val_key`), or None."""
    head, tail = SOURCE_VAL.split("{}")
    if key.startswith(head) and key.endswith(tail) and len(key) > len(head + tail):
        return key[len(head) : -len(tail)]
    return None


def source_val_losses(row: dict) -> dict[str, float]:
    """``{source: loss}`` of the per-source validation losses in ``row`` (a metrics
    row or a summary), in their order there."""
    return {
        source_of(k): v
        for k, v in row.items()
        if source_of(k) and isinstance(v, int | float)
    }


def val_line(row: dict) -> str:
    """``val_loss 2.2160`` and, for a mixture, each source's: ``(web 2.1012, code
    2.4410)``."""
    sources = source_val_losses(row)
    each = ", ".join(f"{n} {v:.4f}" for n, v in sources.items())
    return f"val_loss {row['val_loss']:.4f}" + (f" ({each})" if each else "")


#: A downstream task's metric (lm-eval, src/trainer/downstream.py), in the loop's
#: rows and summary, eval.py's wandb run, compare's and the sweep summary's columns.
TASK_METRIC = "eval/{}/{}"
#: The seconds a round of downstream tasks took (not training throughput).
TASKS_SECONDS = "eval_tasks_s"


def task_metric_key(task: str, metric: str) -> str:
    """``eval/<task>/<metric>``: ``eval/pycode_mc/acc``."""
    return TASK_METRIC.format(task, metric)


def is_task_metric(key: str) -> bool:
    """Whether ``key`` names a downstream task's metric (:func:`task_metric_key`)."""
    head = TASK_METRIC.split("{}")[0]
    return key.startswith(head) and key.count("/") == 2 and not key.endswith("/")


def task_metrics_in(row: dict) -> dict[str, float]:
    """The downstream task metrics (:func:`task_metric_key`) in ``row``."""
    return {
        k: v for k, v in row.items() if is_task_metric(k) and isinstance(v, int | float)
    }
