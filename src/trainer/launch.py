"""Start the ranks of a run: N local processes, or the ones torchrun already started.

- ``trainer.devices=N`` (N > 1): torch's elastic launcher (``elastic_launch``, what
  ``torchrun --standalone`` runs) starts N local ranks on a private c10d rendezvous and
  restarts the group up to ``trainer.max_restarts`` times after a failure.
- ``trainer.devices=1``: the single rank runs in this process (a debugger works).
- Under ``torchrun`` (its environment is set): this process is one rank of a possibly
  multi-node job; the world comes from torchrun's rendezvous, and rank 0's run dir is
  broadcast so every rank writes its checkpoint shards to the same place.

The Hydra output dir is decided once, in the Hydra job, and handed to every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys
import uuid
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from src.trainer.data import follow_tokenizer_vocab, prepare_data
from src.trainer.loop import train
from src.trainer.planner import plan_only, resolve_auto
from src.trainer.resolved import Resolved, model_config, under_torchrun


def prepare(cfg: DictConfig, resolved: Resolved) -> tuple[DictConfig, Resolved]:
    """What the ranks start from, decided once before any starts: ``cfg`` with its
    interpolations resolved (ranks have no Hydra context for ``${hydra:...}``), the
    data ready in the token cache, the model's vocabulary following the tokenizer and
    every ``auto`` value chosen. Bad input is a ``ConfigError``."""
    cfg = copy.deepcopy(cfg)
    OmegaConf.resolve(cfg)
    if not cfg.trainer.plan_only:  # plan-only reads no data
        meta = prepare_data(cfg.data, _is_rank0(), cfg.trainer.progress)
        if meta is not None:
            follow_tokenizer_vocab(cfg, meta, _user_keys())
            resolved = dataclasses.replace(resolved, model_config=model_config(cfg))
    cfg, reasons = resolve_auto(cfg, _world_from_env())
    if _is_rank0():
        for line in reasons:
            print(line, flush=True)
    return cfg, resolved


def _world_from_env() -> int | None:
    return int(os.environ.get("WORLD_SIZE", 0)) or None  # set under torchrun


def launch(cfg: DictConfig, run_dir: str, resolved: Resolved) -> dict[str, Any] | None:
    """Run training for ``cfg`` (from :func:`prepare`) on its ranks and return the
    run's summary (rank 0's); exit non-zero, showing the first failed rank's error
    once, if any rank fails. With ``trainer.plan_only`` no rank starts: the wrap plan
    for that many ranks is printed instead (and None returned)."""
    world = _world_from_env()
    if cfg.trainer.plan_only:
        if _is_rank0():
            plan_only(cfg, run_dir, world_size=world or resolved.world_size)
        return None
    if under_torchrun():
        # record(): torchrun's failure summary then shows this rank's traceback.
        return record(run_rank)(cfg, run_dir, resolved)
    nprocs = resolved.world_size
    if nprocs == 1:
        return run_rank(cfg, run_dir, resolved)
    # Ranks > 0 write to <run_dir>/ranks/...; only rank 0 talks to the console.
    log_dir = os.path.join(run_dir, "ranks")
    config = local_launch_config(nprocs, cfg.trainer.max_restarts, log_dir)
    _quiet_launcher_logs()
    try:
        summaries = elastic_launch(config, _rank_entry)(cfg, run_dir, resolved)
    except ChildFailedError as err:
        sys.exit(_failure_report(err))
    return summaries.get(0)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", 0)) == 0


def _user_keys() -> set[str]:
    """The keys set on the command line of this Hydra job (empty outside Hydra)."""
    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def local_launch_config(
    nprocs: int, max_restarts: int = 0, log_dir: str | None = None
) -> LaunchConfig:
    """torch's elastic launcher set up as ``torchrun --standalone``: ``nprocs`` ranks
    on this machine, a private c10d rendezvous on a free port; with ``log_dir`` the
    output of ranks > 0 goes there instead of the console."""
    logs = {}
    if log_dir is not None:
        redirects = {r: Std.ALL for r in range(1, nprocs)}
        logs["logs_specs"] = DefaultLogsSpecs(log_dir=log_dir, redirects=redirects)
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port
        max_restarts=max_restarts,
        **logs,
    )


def _rank_entry(cfg: DictConfig, run_dir: str, resolved: Resolved) -> dict[str, Any]:
    # Module level so the spawned ranks can unpickle it.
    return run_rank(cfg, run_dir, resolved)


def _quiet_launcher_logs() -> None:
    """The launcher logs a failed rank's traceback at ERROR level and we report it
    ourselves (once); its INFO chatter would flood Hydra's INFO-level console."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
        logging.CRITICAL
    )
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


def _failure_report(err: ChildFailedError) -> str:
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # the rank's error file, written by record()
        message = message.get("extraInfo", {}).get("py_callstack") or message["message"]
    return f"rank {rank} failed (exit code {failure.exitcode}):\n{message}".rstrip()


def init_distributed(timeout_s: float) -> torch.device:
    """Join the process group (NCCL on GPU, gloo on CPU) and pick this rank's device.

    On CPU each rank gets ``cores // local ranks`` threads so the ranks on a machine
    do not oversubscribe it.
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        torch.set_num_threads(max(1, (cores or os.cpu_count() or 1) // local_world))
    backend = "nccl" if cuda else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # set by the launcher: env:// rendezvous
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # After an elastic restart the store can still hold the dead attempt's gloo
        # addresses; a per-attempt prefix keeps the new ranks from dialling them.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"attempt_{attempt}", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
    else:  # a single in-process rank
        store = dist.HashStore()
        dist.init_process_group(
            backend, store=store, rank=0, world_size=1, timeout=timeout
        )
    return device


def _shared_run_dir(run_dir: str) -> str:
    """Rank 0's run dir on every rank (under torchrun each rank's Hydra chose its own)."""
    if not under_torchrun() or dist.get_world_size() == 1:
        return run_dir
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_rank(cfg: DictConfig, run_dir: str, resolved: Resolved) -> dict[str, Any]:
    """One rank: join the group, train, leave the group; returns the summary."""
    device = init_distributed(cfg.trainer.timeout_s)
    try:
        if dist.get_rank() != 0:
            warnings.simplefilter("ignore")  # only rank 0 talks
        # FSDP2 warns whenever a unit returns a view (any Linear on 3-D input) because an
        # in-place op on it would skip a hook; the GPT never modifies outputs in place.
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module .* view tensor"
        )
        return train(cfg, _shared_run_dir(run_dir), device, resolved)
    finally:
        dist.destroy_process_group()
