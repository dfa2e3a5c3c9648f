"""The ranks of a checkpoint's collectives: who this process is, and one rank's
failure turned into the same failure on every rank. Without a process group every
function works in a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from src.sharding.layout import collective_device


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def this_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def all_agree(error: BaseException | None, what: str, group: Any = None) -> None:
    """Raise on every rank if ``what`` failed on any rank.

    A rank that raised alone would leave the others waiting forever in the next
    collective; this turns one rank's failure into the same failure everywhere.
    """
    if _distributed():
        device = collective_device(group)
        failed = torch.tensor([int(error is not None)], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if error is None and failed.item():
            raise RuntimeError(f"checkpoint {what} failed on another rank")
    if error is not None:
        raise error


def _union(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` of every rank merged (this rank's alone without ranks)."""
    if not _distributed() or _world_size() == 1:
        return objects
    everyone: list[dict] = [{} for _ in range(_world_size())]
    dist.all_gather_object(everyone, objects)
    return {k: v for objs in everyone for k, v in objs.items()}


def _all_ranks(names: list[str]) -> list[str]:
    """``names`` of every rank together (this rank's alone without ranks)."""
    if not _distributed() or _world_size() == 1:
        return names
    everyone: list[list[str]] = [[] for _ in range(_world_size())]
    dist.all_gather_object(everyone, names)
    return [n for names in everyone for n in names]
