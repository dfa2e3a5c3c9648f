"""Downstream tasks through lm-eval on the run's model: :func:`run_tasks` (eval.py's
``tasks=`` and the trainer's ``trainer.eval_tasks``), on every rank.

Every rank runs the harness on the same tasks (the same requests in the same order,
so the same forwards of the sharded model: src/trainer/lm_adapter.py) and gets rank
0's scores. This is simpler than rank 0 driving the harness and sending each batch of
requests to the others (a second protocol, a worker loop per rank) and as exact: the
harness's work is deterministic and the scores it reads are rank 0's; its CPU work
(tokenizing a few hundred requests) is done on each rank.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from src.config.run_plan import RunPlan
from src.data.tokenizer import Tokenizer
from src.errors import RunError
from src.observe.keys import TASKS_SECONDS, task_metric_key
from src.sharding import Backend
from src.trainer.best import score_of
from src.trainer.eval_tasks import (
    env_var,
    offline,
    replaced,
    task_manager,
    task_specs,
)

log = logging.getLogger(__name__)


def metric_name(key: str) -> str:
    """lm-eval's ``"acc,none"`` -> ``acc``; a filtered metric keeps its filter's
    name (``"exact_match,strict-match"`` -> ``exact_match_strict-match``)."""
    metric, _, filtered = key.partition(",")
    return metric if filtered in ("", "none") else f"{metric}_{filtered}"


def task_metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of lm-eval's results (no stderr, no alias)."""
    out = {}
    for task, figures in results["results"].items():
        out[task] = {
            metric_name(k): float(v)
            for k, v in figures.items()
            if "," in k and "_stderr" not in k and isinstance(v, (int, float))
        }
    return out


@contextlib.contextmanager
def _rng_kept(device: torch.device) -> Iterator[None]:
    """Python's, numpy's and torch's random states restored after (lm-eval seeds
    them all; training's streams go on as if it had not run)."""
    state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)


def run_tasks(
    model: nn.Module,
    backend: Backend,
    resolved: RunPlan,
    tokenizer: Tokenizer,
    names: Sequence[str],
    specs: Sequence[Any],
    *,
    batch_size: int = 8,
    kv_cache: bool = True,
) -> tuple[dict[str, dict[str, float]], float]:
    """Scores of the tasks ``names`` (``specs``: as src/trainer/eval_tasks.py found
    them) on this rank's shards of ``model``, and the seconds they took; the same
    on every rank (a collective)."""
    from lm_eval import evaluator

    from src.trainer.lm_adapter import ShardedLM

    start = time.perf_counter()
    lm = ShardedLM(model, backend, resolved, tokenizer, batch_size, kv_cache)
    # every rank is lm-eval's rank 0 of 1; it returns results only where LOCAL_RANK
    # is 0 too (its torchrun tensor-parallel case): each rank reads its own
    local_rank0 = env_var("LOCAL_RANK", "0")
    # its report of the environment (torch's collect_env: ~2 s of subprocesses)
    no_env_report = replaced(evaluator, "add_env_info", lambda _: None)
    with _rng_kept(backend.device), offline(), local_rank0, no_env_report:
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=list(specs),
            task_manager=task_manager(specs),
            bootstrap_iters=0,  # no stderr resampling: seconds for nothing here
            log_samples=False,
        )
    return task_metrics(results), time.perf_counter() - start


def per_rank_rows(rows: int, ranks: int) -> int:
    """Rows per forward of the tasks' log-likelihoods: those a rank forwards of a
    training micro-batch of ``rows`` sequences, so the forward, without gradients,
    is no bigger than one the planner counts in the training step's peak."""
    return max(1, rows // ranks)


def flat_metrics(scores: dict[str, dict[str, float]]) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` of :func:`run_tasks`' scores."""
    return {
        task_metric_key(task, metric): value
        for task, figures in scores.items()
        for metric, value in figures.items()
    }


class LoopTasks:
    """``trainer.eval_tasks`` during training: every ``trainer.eval_tasks_every``
    steps and at the last, on the ranks' sharded model (the loop's one hook)."""

    def __init__(self, trainer_cfg: Any) -> None:
        self.names = list(trainer_cfg.eval_tasks)
        self.dirs = list(trainer_cfg.eval_tasks_dirs)
        self.every = trainer_cfg.eval_tasks_every
        self.metric = trainer_cfg.best_metric
        self.specs: list[Any] | None = None

    def due(self, step: int, last: bool) -> bool:
        return bool(self.names) and (
            last or bool(self.every and step % self.every == 0)
        )

    def score(self, val_loss: float | None, row: dict[str, float]) -> float | None:
        """This step's score for keep_best and early stopping (lower is best,
        :func:`best.score_of`): its ``val_loss`` or ``trainer.best_metric``'s value
        in the step's task ``row``; None where the step has none."""
        if self.metric == "val_loss":
            return val_loss
        if not row:
            return None
        if self.metric not in row:
            raise RunError(
                f"trainer.best_metric={self.metric} is not among the tasks' "
                f"metrics: {', '.join(k for k in row if k != TASKS_SECONDS)}"
            )
        return score_of(self.metric, row[self.metric])

    def run(self, trainer: Any, step: int) -> dict[str, float]:
        """Score the tasks on ``trainer``'s model and log them at ``step`` with
        ``tokens_seen`` (metrics.jsonl, wandb, the summary); their seconds are
        logged as ``eval_tasks_s``, not counted in the throughput."""
        if self.specs is None:  # found and checked before the ranks started
            keys = ("trainer.eval_tasks", "trainer.eval_tasks_dirs")
            self.specs = task_specs(self.names, self.dirs, *keys)
        t = trainer.cfg.trainer
        micro_batch = t.batch_size // t.grad_accum
        scores, seconds = run_tasks(
            trainer.whole_model(),
            trainer.backend,
            trainer.resolved,
            trainer.tokenizer,
            self.names,
            self.specs,
            batch_size=per_rank_rows(micro_batch, trainer.backend.dp_size),
            kv_cache=not trainer.cfg.sharding.compile,  # a compile per cache length
        )
        row = {**flat_metrics(scores), TASKS_SECONDS: seconds}
        trainer.logger.log({**row, "tokens_seen": trainer.tokens_seen}, step)
        trainer.summary.update(row)
        figures = ", ".join(
            f"{k} {v:.4f}" for k, v in row.items() if k != TASKS_SECONDS
        )
        log.info("step %d: %s (%.1f s)", step, figures, seconds)
        trainer.meter.restart(step)  # the tasks' time is not training throughput
        return row
