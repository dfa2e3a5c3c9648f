"""Best checkpoints and early stopping, by ``val_loss``.

``trainer.keep_best=K``: a validation whose ``val_loss`` is among the ``K`` lowest so
far is saved as a checkpoint (if its step saves none anyway), its ``val_loss`` in the
checkpoint's ``extra`` (:data:`src.checkpoint.dcp.SCORE`); the Checkpointer's pruning
keeps those ``K`` beside the newest ``trainer.keep_last`` (src/checkpoint/dcp.py), and
``ckpt=best`` of sample.py and eval.py opens the best. The ranking is read from the
checkpoints on disk at the start, so it follows a resume and a branch (a branch's
newer checkpoints are set aside before it starts).

``trainer.early_stop_patience=N``: training stops after ``N`` validations in a row
without a ``val_loss`` lower than the best so far by more than
``trainer.early_stop_min_delta``; validations inside the learning-rate warmup
(``trainer.warmup_steps``) are not counted (a better one there is still the best). Its
state (the best, its step, the
validations since) is saved in every checkpoint, so a resumed run counts on, and a
run that stopped early resumes to "nothing to train".
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from pathlib import Path

from src.checkpoint.dcp import best_checkpoints

#: In a checkpoint's ``extra``: the early-stopping state (:meth:`Best.state`).
EARLY_STOP = "early_stop"


def score_of(metric: str, value: float) -> float:
    """What ranks checkpoints, the lowest best (``trainer.best_metric``): val_loss
    itself, a task's metric negated (the highest is best); its own inverse."""
    return value if metric == "val_loss" else -value


@dataclass
class Best:
    """What the trainer knows of its validations: the ``keep_best`` lowest scores of
    the checkpoints kept for them (ascending), and the early-stopping count."""

    keep_best: int
    patience: int
    best: float | None = None  # the lowest val_loss so far
    best_step: int = 0
    since: int = 0  # validations since it was reached
    kept: list[float] = field(default_factory=list)
    min_delta: float = 0.0  # an improvement is a val_loss below best - min_delta
    warmup: int = 0  # validations at steps <= warmup are not counted
    metric: str = "val_loss"  # trainer.best_metric: the scores are score_of's

    @classmethod
    def start(
        cls,
        keep_best: int,
        patience: int,
        directory: Path,
        state: dict | None,
        min_delta: float = 0.0,
        warmup: int = 0,
        metric: str = "val_loss",
    ) -> Best:
        """At the start of a run: the scores of the best checkpoints in
        ``directory``, and the early-stopping ``state`` of the checkpoint resumed
        (None: a fresh start)."""
        kept = [score for score, _ in best_checkpoints(directory, keep_best)]
        best = cls(keep_best, patience, kept=kept, min_delta=min_delta, warmup=warmup)
        best.metric = metric
        if state:
            best.best, best.best_step, best.since = (
                state["best"],
                state["best_step"],
                state["since"],
            )
        return best

    def seen(self, step: int, val_loss: float) -> bool:
        """Count the validation of ``step``; returns whether its checkpoint is to be
        kept as one of the best (it then is counted as kept)."""
        if self.best is None or val_loss < self.best - self.min_delta:
            self.best, self.best_step, self.since = val_loss, step, 0
        elif step > self.warmup:  # a validation inside the warmup is not counted
            self.since += 1
        if not self.keep_best:
            return False
        if len(self.kept) == self.keep_best and val_loss >= self.kept[-1]:
            return False
        bisect.insort(self.kept, val_loss)
        del self.kept[self.keep_best :]
        return True

    @property
    def exhausted(self) -> bool:
        """Early stopping is due: no better val_loss for ``patience`` validations."""
        return bool(self.patience) and self.since >= self.patience

    def state(self) -> dict | None:
        """What a checkpoint records (None before the first validation)."""
        if self.best is None:
            return None
        state = asdict(self)
        return {k: state[k] for k in ("best", "best_step", "since")}

    def line(self, step: int) -> str:
        """The console's line when training stops early at ``step``."""
        return (
            f"step {step}: stopping early: {self.metric} has not improved on "
            f"{score_of(self.metric, self.best):.4f} (step {self.best_step}) for "
            f"{self.since} validations (trainer.early_stop_patience={self.patience})"
        )

    def summary(self, step: int) -> dict:
        """``summary.json``'s ``early_stop`` (``metric``: a task's, not val_loss)."""
        return {
            "step": step,
            f"best_{self.metric}": score_of(self.metric, self.best),
            "best_step": self.best_step,
            "patience": self.patience,
            **({"metric": self.metric} if self.metric != "val_loss" else {}),
        }
