"""A trained run opened again, by ``sample.py`` and ``eval.py``.

- :func:`find_run`: ``run=PATH`` is a run dir of train.py (its newest intact
  checkpoint is taken, or with ``ckpt=best`` the intact one of the lowest recorded
  ``val_loss``), its ``checkpoints/`` dir, or one ``step_N`` checkpoint; the run
  dir is the first of PATH and its parents holding ``.hydra/config.yaml``.
- :func:`run_config`: that file is the run's own composed config (what Hydra saved
  when train.py started), with the keys the user set on its command line
  (``.hydra/overrides.yaml``), so the entry point can prepare it exactly as train.py
  did (``launch.prepare``: the token cache, the vocabulary following the tokenizer,
  ``auto`` values) after changing only what it must (ranks, data, ...).
- :func:`load_model`: on each rank, the model built as training builds it (the
  run's family, sharded as it is built under the wrap context by the backend of
  ``sharding``), with the checkpoint's weights (DCP: written by any number of ranks,
  read by any other); :func:`sample_rank`: a rank of sample.py.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from src.build import build_model, make_backend
from src.checkpoint.damage import CheckpointError
from src.checkpoint.dcp import Checkpointer, best_checkpoints
from src.checkpoint.export import export_model
from src.checkpoint.folders import (
    complete_checkpoints,
    hold,
    resolve_resume,
    run_checkpoints,
    step_of,
)
from src.config.run_plan import RunPlan
from src.data.sources import DATA_SOURCES, tokenizer_of
from src.data.tokenizer import Tokenizer
from src.errors import ConfigError, keyed
from src.runs.branches import BRANCHES
from src.runs.resume import RECORD, recorded_config
from src.sharding import Backend
from src.trainer.launch import run_ranks
from src.trainer.sampling import sample_texts

log = logging.getLogger(__name__)

RUN_CONFIG = Path(RECORD) / "config.yaml"
RUN_OVERRIDES = Path(RECORD) / "overrides.yaml"


def find_run(path: str, key: str = "run", ckpt: str = "latest") -> tuple[Path, Path]:
    """``(run dir, checkpoint)`` of ``path`` (see the module's doc); a checkpoint that
    fails its checksums is skipped for the newest intact one, as a resume does.
    ``ckpt``: ``latest`` or ``best`` (:func:`best_of`). ConfigError naming ``key``
    if there is no run or no complete checkpoint."""
    where = Path(path).expanduser().resolve()
    run_dir = next(
        (d for d in (where, *where.parents) if (d / RUN_CONFIG).is_file()), None
    )
    if run_dir is None:
        raise ConfigError(
            key,
            f"{path}: no {RUN_CONFIG} in it or above it; give a run dir of "
            "train.py (hydra.run.dir), or a checkpoint in one",
        )
    directory = run_checkpoints(run_dir)
    inside = (directory, run_dir / BRANCHES)  # the run's checkpoints, and set aside
    nested = where != run_dir and not any(where.is_relative_to(d) for d in inside)
    if nested and where.exists():
        raise ConfigError(
            key,
            f"{path} is inside the run {run_dir} (the nearest dir above it with a "
            f"{RUN_CONFIG}) but not one of its checkpoints: it would be read with "
            f"that run's config and its records would go there; give the run dir of "
            "train.py that saved it",
        )
    if ckpt == "best":
        return run_dir, best_of(where, directory)
    verify, checkpoint = _held_and(Checkpointer(directory).verify), None
    for _ in range(_PICKS):  # a live run's keep_last may prune the one picked
        try:
            checkpoint = resolve_resume(str(where), directory, verify, _skipped)
        except FileNotFoundError:
            checkpoint = None
        except CheckpointError as err:  # every checkpoint there damaged or forged
            raise ConfigError(key, f"{path}: {err}") from None
        except _Pruned as gone:
            log.warning(
                "checkpoint %s was deleted by its live run (trainer.keep_last) as it "
                "was opened; taking the newest one again",
                gone,
            )
            continue
        break
    if checkpoint is None:
        raise ConfigError(
            key,
            f"{path}: no complete checkpoint in {directory} (a run keeps its last "
            "step's unless trainer.ckpt_final=false; trainer.ckpt_every=N saves more)",
        )
    return run_dir, checkpoint


#: how many times a pick pruned under the reader is made again
_PICKS = 5


class _Pruned(Exception):
    """The checkpoint picked was deleted before this process held it."""


def _held_and(verify: Any) -> Any:
    """``verify``, after the checkpoint is held for this process's reading (a live
    run's pruning leaves it in place: ``folders.hold``); raises :class:`_Pruned` if
    it went before it was held."""

    def held_and_verified(path: Path) -> str | None:
        if not hold(path):
            raise _Pruned(path)
        return verify(path)

    return held_and_verified


def best_of(where: Path, directory: Path) -> Path:
    """``ckpt=best``: the intact checkpoint of ``directory`` with the lowest recorded
    ``val_loss`` (kept by ``trainer.keep_best``); ConfigError naming ``ckpt`` if
    ``where`` names one checkpoint or none has a score."""
    if step_of(where) is not None:
        raise ConfigError(
            "ckpt", f"best picks among a run's checkpoints; run={where} names one"
        )
    verify = Checkpointer(directory).verify
    for _, path in best_checkpoints(directory, len(complete_checkpoints(directory))):
        if hold(path) and verify(path) is None:
            return path
    raise ConfigError(
        "ckpt",
        f"best: no checkpoint in {directory} records a val_loss (train with "
        "trainer.keep_best=K to keep the K best by val_loss)",
    )


def _skipped(path: Path, reason: str) -> None:
    """Said when a damaged checkpoint is passed over for an older one."""
    log.warning(
        "skipping checkpoint %s: %s; reading the newest intact one", path, reason
    )


def run_config(run_dir: Path) -> tuple[DictConfig, list[str]]:
    """The run's composed config and its command line's overrides (whose keys
    ``launch.override_keys`` gives)."""
    return keyed("run", recorded_config, run_dir)


def with_changes(cfg: DictConfig, changes: Mapping[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with ``changes`` (``{"trainer.devices": 2}``) applied."""
    cfg = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def run_tokenizer(cfg: DictConfig) -> Tokenizer:
    """The tokenizer the run trained with (``data.tokenizer``: byte, the BPE trained
    on its corpus and cached, or a path). A run on token ids (``data=tokens`` or
    ``synthetic``) has none: ConfigError."""
    tokenizer = tokenizer_of(cfg.data)
    if tokenizer is None:
        text = [n for n in DATA_SOURCES if DATA_SOURCES[n].tokenized]
        raise ConfigError(
            "data",
            f"the run trained on data={cfg.data.name} (token ids, no tokenizer); "
            f"text in and out needs a run on data={' or data='.join(text)}",
        )
    return tokenizer


def load_model(
    resolved: RunPlan, checkpoint: Path, device: torch.device
) -> tuple[nn.Module, Backend, int]:
    """This rank's part of the run's model with ``checkpoint``'s weights, its backend
    and the checkpoint's step. ``resolved``: as ``launch.prepare`` returned it."""
    resolved = replace(resolved, pretrained=None)  # the checkpoint has them
    backend = make_backend(resolved, device)
    model = build_model(resolved, backend)
    state = Checkpointer(checkpoint.parent).load_model(checkpoint, model, verify=False)
    model.eval()
    return model, backend, state["step"]


def on_ranks(
    fn: Any, cfg: DictConfig, resolved: RunPlan, checkpoint: Path, opts: dict
) -> Any:
    """``fn(device, cfg, resolved, checkpoint, opts)`` on the run's ranks (sample.py's
    and eval.py's ``devices``); rank 0's result, None on a rank > 0 under torchrun."""
    return run_ranks(
        fn, resolved.world_size, cfg.trainer.timeout_s, cfg, resolved, checkpoint, opts
    )


def export_rank(
    device: torch.device,
    cfg: DictConfig,
    resolved: RunPlan,
    checkpoint: Path,
    opts: dict[str, Any],
) -> dict[str, Any]:
    """One rank of export.py: the run's model from ``checkpoint`` written to
    ``opts["path"]`` (``opts["hf"]``: a Hugging Face dir with the run's tokenizer,
    else one consolidated file); returns the step and what was written."""
    model, _, step = load_model(resolved, checkpoint, device)
    hf = resolved.spec.hf if opts["hf"] else None
    rank0 = torch.distributed.get_rank() == 0
    tokenizer = tokenizer_of(cfg.data) if hf and rank0 else None  # None: token ids
    what = export_model(model, opts["path"], hf, resolved.model_config, tokenizer)
    return {"step": step, "what": what}


def sample_rank(
    device: torch.device,
    cfg: DictConfig,
    resolved: RunPlan,
    checkpoint: Path,
    opts: dict[str, Any],
) -> dict[str, Any]:
    """One rank of sample.py: the run's model from ``checkpoint``, then ``opts``'
    samples (``sample_texts``' keywords and ``prompt``); returns them with the step."""
    model, _, step = load_model(resolved, checkpoint, device)
    opts = dict(opts)
    texts = sample_texts(
        model, resolved, run_tokenizer(cfg), [opts.pop("prompt")], device=device, **opts
    )
    return {"step": step, "samples": texts[0]}
