"""Loss and perplexity of a trained checkpoint: ``python eval.py run=<run dir>``;
with ``tasks=[NAME,...]``, its scores on lm-eval tasks (docs/evaluation.md).

The run's own composed config (``<run dir>/.hydra/config.yaml``) gives the model,
tokenizer, sharding and data; ``data=files data.paths=...`` (any data option)
evaluates other text, read with the run's tokenizer. Every rank evaluates its rows
(src/runs/evaluation.py); the result is logged, appended to ``<run dir>/eval.json``
and to a wandb run of its own, linked to the run's. Keys in conf/eval.yaml; a config error is one line naming
the key (exit status 2).
"""

from src.entry import fork_rank_server, quiet_ctrl_c, start_rank_server, started

if __name__ == "__main__":
    quiet_ctrl_c()  # first: a Ctrl-C while the imports below run is one line
    start_rank_server("devices", given=True)  # devices=N>1: ranks fork from a server

import logging

import hydra
from omegaconf import DictConfig

from src.checkpoint.folders import reading
from src.config.cli import exit_on_config_error, run_cli
from src.config.validate import validate_eval
from src.runs.compose import open_run
from src.runs.evaluation import (
    EVAL_FILE,
    changed_run_data,
    eval_changes,
    eval_rank,
    eval_split,
    figures,
    log_to_wandb,
    record,
    task_record,
    write_record,
)
from src.runs.from_run import on_ranks, run_tokenizer
from src.trainer.eval_tasks import check_tasks

log = logging.getLogger("eval")


def evaluate_run(cfg: DictConfig) -> dict:
    """Everything ``eval.py`` does for ``cfg`` (conf/eval.yaml); returns the record.
    The checkpoint it reads is held until then: a live run's keep_last leaves it."""
    with reading():
        return _evaluate_run(cfg)


def _evaluate_run(cfg: DictConfig) -> dict:
    if cfg.tasks is not None:
        return _evaluate_tasks(cfg)
    with exit_on_config_error():
        validate_eval(cfg)
        split = eval_split(cfg)
        run_dir, checkpoint, run_cfg, resolved = open_run(
            cfg.run,
            lambda run_cfg: eval_changes(cfg, run_cfg),
            EVAL_FILE,
            cfg.trust_remote_code,
            (split,),
            cfg.ckpt,
        )
        changed = None if cfg.data is not None else changed_run_data(run_dir, run_cfg)
    opts = {"split": split, "batches": cfg.batches, "batch_size": cfg.batch_size}
    with exit_on_config_error():  # a rank's failure: one line
        result = on_ranks(eval_rank, run_cfg, resolved, checkpoint, opts)
    if result is None:  # a rank > 0 under torchrun: rank 0 reports
        return {}
    run_data = cfg.data is None and changed is None
    entry = record(result, checkpoint, run_cfg, split, run_data)
    path = write_record(run_dir, entry)
    log.info(
        "eval of %s (step %d) on data=%s split=%s (%s of its %s tokens), %d batches "
        "x %d x %d tokens, %d rank%s: loss %.4f, perplexity %.2f (appended to %s)",
        checkpoint,
        entry["step"],
        entry["data"],
        entry["split"],
        f"{entry['split_tokens']:,}",
        f"{entry['data_tokens']:,}",
        entry["batches"],
        entry["batch_size"],
        resolved.spec.seq_len(resolved.model_config),
        entry["world_size"],
        "" if entry["world_size"] == 1 else "s",
        entry["loss"],
        entry["perplexity"],
        path,
    )
    log_to_wandb(run_cfg, run_dir, entry)
    return entry


def _evaluate_tasks(cfg: DictConfig) -> dict:
    """``tasks=[...]``: the checkpoint scored on lm-eval tasks, every task found
    and its data loaded before a rank starts."""
    with exit_on_config_error():
        validate_eval(cfg)
        run_dir, checkpoint, run_cfg, resolved = open_run(
            cfg.run,
            lambda run_cfg: eval_changes(cfg, run_cfg),
            EVAL_FILE,
            cfg.trust_remote_code,
            (),  # reads no data: the tasks bring theirs
            cfg.ckpt,
        )
        run_tokenizer(run_cfg)  # a run on token ids has no text to score
        names = list(cfg.tasks)
        specs = check_tasks(names, list(cfg.tasks_dirs), "tasks", "tasks_dirs")
    opts = {"tasks": names, "specs": specs, "batch_size": cfg.batch_size}
    with exit_on_config_error():  # a rank's failure: one line
        result = on_ranks(eval_rank, run_cfg, resolved, checkpoint, opts)
    if result is None:  # a rank > 0 under torchrun: rank 0 reports
        return {}
    entry = task_record(result, checkpoint)
    path = write_record(run_dir, entry)
    log.info(
        "eval of %s (step %d) on %d task%s in %.1f s, %d rank%s: %s (appended to %s)",
        checkpoint,
        entry["step"],
        len(names),
        "" if len(names) == 1 else "s",
        entry["eval_tasks_s"],
        entry["world_size"],
        "" if entry["world_size"] == 1 else "s",
        ", ".join(f"{k} {v:.4f}" for k, v in figures(entry).items()),
        path,
    )
    log_to_wandb(run_cfg, run_dir, entry)
    return entry


@hydra.main(config_path="conf", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    return evaluate_run(cfg).get("loss")


if __name__ == "__main__":
    started()
    fork_rank_server()  # the imports done: the ranks fork from a copy
    run_cli(main)
