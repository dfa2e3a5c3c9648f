"""For tests and benchmarks: the composed config of some overrides, and a function run
on N real torch.distributed ranks.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, gives each
a process group (gloo; NCCL with ``pg_backend="nccl"``) through a FileStore (no ports
to race for), calls ``fn(rank, world_size, *args)`` and returns the list of per-rank
results. A rank that raises fails the call with that rank's traceback; a rank that
hangs fails it after ``timeout`` seconds instead of hanging the caller. The ranks
are forked from one server process per caller (multiprocessing's forkserver) that
imported torch and the trainer once (:data:`RANK_MODULES`): a test session pays
those seconds once, not once per rank of every call; each rank gets the caller's
environment as it is at the call.
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
#: What the rank server imports before it forks a rank: what train.py's ranks import.
RANK_MODULES = ["src.runs.compose", "src.trainer.launch"]


def compose_config(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """conf/config.yaml composed with ``overrides``, typed by src/config/schema.py.
    Each call gets its own copy of what the same overrides composed to before in
    this process: Hydra reads and merges every YAML file again at each compose
    (~0.25 s, against ~8 ms for the copy), and tests compose the same configs many
    times. With ``return_hydra_config`` (the run's cwd and time in it) it composes."""
    if return_hydra_config:
        return _compose(overrides, True)
    return copy.deepcopy(_composed(overrides))


@functools.lru_cache(maxsize=256)
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    return _compose(overrides, False)


def _compose(overrides: tuple[str, ...], return_hydra_config: bool) -> DictConfig:
    from hydra import compose, initialize_config_dir

    import src.config.schema  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            "config",
            overrides=list(overrides),
            return_hydra_config=return_hydra_config,
        )


def _worker(
    rank: int,
    env: dict[str, str],
    world_size: int,
    tmpdir: str,
    fn: Callable,
    args: tuple,
    timeout: float,
    pg_backend: str,
    setup: Callable[[int], None] | None,
) -> None:
    torch.set_num_threads(1)
    os.environ.clear()  # the server's is the caller's as the server started
    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if setup is not None:
        setup(rank)
    store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
    dist.init_process_group(
        pg_backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(tmpdir, f"result_{rank}.pt"))
        # No rank tears its process group down while a peer still talks to it: gloo
        # aborts the process ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        torch.save(
            {"error": traceback.format_exc()}, os.path.join(tmpdir, f"result_{rank}.pt")
        )
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(
    fn: Callable,
    world_size: int = 2,
    *args: Any,
    timeout: float = 300,
    pg_backend: str = "gloo",
    setup: Callable[[int], None] | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh ranks; ``setup(rank)``
    (a module-level function) runs in each first, before its process group exists."""
    mp.set_forkserver_preload(RANK_MODULES)
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmpdir:
        ctx = mp.start_processes(
            _worker,
            args=(env, world_size, tmpdir, fn, args, timeout, pg_backend, setup),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        try:
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise AssertionError(f"ranks still running after {timeout}s")
        except mp.ProcessRaisedException as exc:
            raise AssertionError(f"a rank failed:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            # Every rank saved its result before the barrier that precedes teardown:
            # a death after that (gloo's destructor aborting at exit, seen now and
            # then on 2 cores) happened after the function finished on every rank.
            if not all(
                os.path.exists(os.path.join(tmpdir, f"result_{r}.pt"))
                for r in range(world_size)
            ):
                raise AssertionError(f"a rank died: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            out = torch.load(
                os.path.join(tmpdir, f"result_{rank}.pt"), weights_only=False
            )
            if "error" in out:
                raise AssertionError(f"rank {rank} failed:\n{out['error']}")
            results.append(out["ok"])
        return results
