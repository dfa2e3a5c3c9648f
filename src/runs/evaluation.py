"""Loss and perplexity of a run's checkpoint on any data source: ``eval.py``.

The run's model and tokenizer (src/runs/from_run.py), the data of the run or of
``data=...`` read with the run's tokenizer, on every rank: each rank evaluates its
rows of the same fixed batches the trainer validates on (``GlobalBatches.val_batches``,
windows evenly spaced over the split) and ``step.evaluate`` averages over ranks, so on
the run's own validation split with its ``trainer.val_batches`` the loss is the
run's ``val_loss`` at that step. Rank 0's result goes to ``<run dir>/eval.json`` (a
list, one record per evaluation) and to the run's wandb run.
"""

from __future__ import annotations

import datetime
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from src.config.run_plan import RunPlan, world_size
from src.data.corpus import Corpus
from src.data.mixture import ValBatches, make_batches, whole_stream
from src.data.packing import Documents
from src.data.pinning import read_pin
from src.data.sources import (
    DATA_SOURCES,
    corpus_changes,
    load_splits,
    tokenizer_of,
)
from src.data.tokenizer import Tokenizer
from src.errors import ConfigError
from src.files import keep_aside, read_json, write_json_atomic
from src.observe.keys import task_metrics_in
from src.runs.from_run import load_model, run_tokenizer
from src.sharding import Backend
from src.trainer.downstream import flat_metrics, per_rank_rows, run_tasks
from src.trainer.sampling import SHARDED_ONLY, spread_over
from src.trainer.step import evaluate, evaluate_sources

log = logging.getLogger(__name__)

EVAL_FILE = "eval.json"


def eval_split(eval_cfg: DictConfig) -> str:
    """The split eval.py scores: ``split``, or when null the run's validation split
    (its ``val_loss``) or, for ``data=`` given, every token of that data."""
    if eval_cfg.split is not None:
        return eval_cfg.split
    return "val" if eval_cfg.data is None else "all"


def eval_changes(eval_cfg: DictConfig, run_cfg: DictConfig) -> dict[str, Any]:
    """The changes to the run's config for ``eval.py``: its ranks and, with ``data``
    given, that data read with the run's tokenizer (the model knows no other)."""
    changes: dict[str, Any] = {
        "trainer.devices": eval_cfg.devices,
        "trainer.resume": None,
        "trainer.plan_only": False,
        **SHARDED_ONLY,  # any number of ranks, whatever the run's layout
    }
    # each batch (batch_size=, else the run's micro-batch) splits over the ranks: a
    # batch_size= given is the run's for the check (it checked the run's own
    # trainer.batch_size, naming that key: devices=3 batch_size=6 was refused)
    ranks, t = world_size(eval_cfg.devices), run_cfg.trainer
    changes.update(spread_over(run_cfg.sharding.backend, ranks))
    batch = eval_cfg.batch_size
    if batch is not None:
        changes.update({"trainer.batch_size": batch, "trainer.grad_accum": 1})
    elif isinstance(t.grad_accum, int) and t.batch_size % t.grad_accum == 0:
        batch = t.batch_size // t.grad_accum
    if batch is not None and batch % ranks:
        given = eval_cfg.batch_size is not None
        what = "batch_size" if given else "the run's micro-batch"
        raise ConfigError(
            "batch_size" if given else "devices",
            f"batches of {batch} sequences ({what}) do not split over "
            f"devices={eval_cfg.devices} ({ranks} ranks); give batch_size= a "
            f"multiple of {ranks}",
        )
    if eval_cfg.data is not None:
        data = OmegaConf.to_container(eval_cfg.data)
        tokenizer = run_tokenizer(run_cfg)
        if "tokenizer" in data:  # a tokenized source: the run's tokenizer reads it
            data["tokenizer"] = tokenizer.path or "byte"  # a BPE: its cached file
            data["eos_token"] = (
                tokenizer.hf.id_to_token(tokenizer.eos_id) if tokenizer.hf else None
            )
        changes["data"] = data
    return changes


def eval_rank(
    device: torch.device,
    cfg: DictConfig,
    resolved: RunPlan,
    checkpoint: Path,
    opts: dict[str, Any],
) -> dict[str, Any]:
    """One rank of eval.py: the mean loss of the run's model from ``checkpoint`` on
    ``opts``' split, batches and batch size (None: the run's); with ``opts["tasks"]``
    its scores on those lm-eval tasks instead."""
    model, backend, step = load_model(resolved, checkpoint, device)
    t = cfg.trainer
    if opts.get("tasks"):
        tokenizer = run_tokenizer(cfg)
        rows = opts["batch_size"] or t.batch_size // t.grad_accum  # as the loss's
        args = (resolved, tokenizer, rows, opts)
        return _scored_tasks(model, backend, step, *args)
    spec, config = resolved.spec, resolved.model_config
    train, val = load_splits(cfg.data, spec.vocab_size(config), t.seed)
    stream = {"train": train, "val": val}.get(opts["split"])
    if stream is None:  # all: the stream the splits were cut from, in order
        stream = whole_stream(train, val, spec.vocab_size(config))
    batch = opts["batch_size"] or t.batch_size // t.grad_accum
    windows = make_batches(stream, batch, spec.seq_len(config), t.seed)
    n = opts["batches"] or t.val_batches
    n = windows.covering_batches() if n == "all" else int(n)
    world, rank = dist.get_world_size(), dist.get_rank()
    # data.packing=documents: scored within documents, as the run trained
    documents = None
    if resolved.batch.documents:
        documents = Documents(tokenizer_of(cfg.data).eos_id)
    batches = windows.val_batches(n, rank, world)
    sources = {}
    if isinstance(batches, ValBatches):  # a mixture: as the run validates, by source
        loss, sources = evaluate_sources(model, batches, backend, documents)
    else:
        loss = evaluate(model, batches, backend, documents)
    return {
        "step": step,
        "loss": loss,
        **({"sources": sources} if sources else {}),
        "batches": n,
        "batch_size": batch,
        "tokens": n * batch * spec.seq_len(config),
        "split_tokens": len(stream),
        "data_tokens": len(train) + len(val),
        "world_size": world,
    }


def _scored_tasks(
    model: torch.nn.Module,
    backend: Backend,
    step: int,
    resolved: RunPlan,
    tokenizer: Tokenizer,
    rows: int,
    opts: dict[str, Any],
) -> dict[str, Any]:
    """``eval.py tasks=[...]`` on this rank: the model scored on ``opts``' lm-eval
    tasks (src/trainer/downstream.py), the same on every rank."""
    scores, seconds = run_tasks(
        model,
        backend,
        resolved,
        tokenizer,
        opts["tasks"],
        opts["specs"],
        batch_size=per_rank_rows(rows, dist.get_world_size()),
    )
    return {
        "step": step,
        "tasks": scores,
        "eval_tasks_s": seconds,
        "world_size": dist.get_world_size(),
    }


def figures(entry: dict[str, Any]) -> dict[str, float]:
    """What a record of eval.json logs to wandb: ``eval/loss`` and
    ``eval/perplexity``, or each task's ``eval/<task>/<metric>``."""
    if "tasks" in entry:
        return flat_metrics(entry["tasks"])
    return {"eval/loss": entry["loss"], "eval/perplexity": entry["perplexity"]}


def changed_run_data(run_dir: Path, cfg: DictConfig) -> str | None:
    """How the files of the run's own data config (``cfg``: as eval.py prepared it)
    differ from those the run trained on (src/data/pinning.py), in a few words
    naming them; None when they do not, or the run pinned none. Said in one line:
    the score is then on other data, not the run's."""
    pin = read_pin(run_dir)
    if pin is None or not DATA_SOURCES[cfg.data.name].tokenized:
        return None
    changed = corpus_changes(cfg.data, Corpus.from_config(cfg.data), pin)
    if changed:
        log.warning(
            "eval: the run's data changed since it trained on it: %s; this scores "
            "the files as they are now, recorded with run_data=false (not the run's "
            "result)",
            changed,
        )
    return changed


def record(
    result: dict[str, Any],
    checkpoint: Path,
    cfg: DictConfig,
    split: str,
    run_data: bool = True,
) -> dict[str, Any]:
    """What eval.json keeps of one evaluation; ``run_data``: whether it scored the
    data the run trained on (its own data config, its files unchanged)."""
    data = OmegaConf.to_container(cfg.data)
    return {
        "run_data": run_data,
        "checkpoint": str(checkpoint),
        **result,
        "perplexity": math.exp(min(result["loss"], 700.0)),
        "data": data.get("name"),
        "paths": data.get("paths"),
        "split": split,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def task_record(result: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
    """What eval.json keeps of one ``tasks=[...]`` evaluation: ``tasks``, an entry
    per task with its metrics (as lm-eval names them: ``acc``, ``exact_match``)."""
    return {
        "checkpoint": str(checkpoint),
        **result,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def task_columns(run_dir: Path, summary: dict[str, Any]) -> dict[str, float]:
    """A run's downstream task metrics for compare and the sweep summary: the
    loop's last (summary.json), each replaced by eval.py's latest (eval.json) of
    that task; a damaged eval.json adds none."""
    out = task_metrics_in(summary)
    try:
        records = read_json(run_dir / EVAL_FILE)
        for r in records if isinstance(records, list) else []:
            if isinstance(r, dict) and isinstance(r.get("tasks"), dict):
                out.update(task_metrics_in(flat_metrics(r["tasks"])))
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return out


def write_record(run_dir: Path, entry: dict[str, Any]) -> Path:
    """Append ``entry`` to ``<run dir>/eval.json``. A history that is not a JSON
    list of records (cut short by a torn write, edited) is kept aside, never
    overwritten, with a line saying so; a new history starts."""
    path = run_dir / EVAL_FILE
    entries: list = []
    if path.exists() or path.is_symlink():
        try:
            entries = read_json(path)
            if not isinstance(entries, list) or not all(
                isinstance(e, dict) for e in entries
            ):
                raise ValueError("not a JSON list of records")
        except (OSError, ValueError) as exc:
            aside = keep_aside(path)
            log.warning(
                "%s is damaged (%s): kept as %s; a new history starts",
                path,
                exc,
                aside.name,
            )
            entries = []
    write_json_atomic(path, [*entries, entry])
    return path


def log_to_wandb(run_cfg: DictConfig, run_dir: Path, entry: dict[str, Any]) -> None:
    """The record's :func:`figures` in a wandb run of their own
    (``job_type="eval"``, files in ``<run dir>/wandb/eval``), in the training run's
    project and group (as its run_id.json records it), its name ``eval:<training run's name>``, and the training
    run's id and this evaluation's record in its config: the training run itself is
    never renamed, regrouped or reconfigured. Nothing if the run logged with another
    logger."""
    from src.observe.loggers import init_wandb, logs_to_wandb, recorded_wandb_run

    if not logs_to_wandb(run_cfg):
        return
    training = recorded_wandb_run(run_dir) or {}
    name = training.get("name") or run_dir.name
    config = {
        "training_run": {"id": training.get("id"), "name": name, "dir": str(run_dir)},
        "eval": {
            k: v for k, v in entry.items() if k not in ("loss", "perplexity", "tasks")
        },
    }
    wandb_dir = run_dir / "wandb" / EVAL_WANDB_DIR
    wandb_dir.mkdir(parents=True, exist_ok=True)
    group = training.get("group") or run_cfg.logger.group  # the training run's
    run = init_wandb(
        run_cfg,
        wandb_dir,
        job_type="eval",
        name=f"eval:{name}",
        group=group,
        config=config,
    )
    logged = figures(entry)
    run.log(logged)
    run.summary.update({**logged, "eval/step": entry["step"]})
    run.finish()
    if run_cfg.logger.mode == "offline":
        log.info("upload to wandb: wandb sync %s/wandb/offline-run-*", wandb_dir)


#: Where in ``<run dir>/wandb`` eval.py's wandb runs keep their files.
EVAL_WANDB_DIR = "eval"
