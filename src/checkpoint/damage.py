"""What is wrong with a checkpoint, said in one line: the error a run sees
(:class:`CheckpointError`), the reason a check finds (:class:`_Damaged`), and values
shown in messages in bounded work whatever a forged file holds."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from src.errors import RunError


class CheckpointError(RunError):
    """A checkpoint that cannot be loaded into this run: damaged, or another model."""


class _Damaged(ValueError):
    """What is wrong with one file of a checkpoint (a reason, without the path)."""


def _shown(value: Any, depth: int = 2) -> str:
    """``value`` for a one-line message, in bounded work whatever it is: a forged
    index can hold a list nested 100,000 deep or one that shares itself 60 levels
    down (2**60 items to ``repr``), a 16 MiB string or an integer of 100M bits."""
    kind = type(value)
    if value is None or kind in (bool, float, torch.dtype):
        return repr(value)
    if kind is int:
        bits = value.bit_length()
        return repr(value) if bits <= 64 else f"an integer of {bits} bits"
    if kind is str:
        return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
    if kind in (list, tuple, torch.Size, dict) and depth > 0:
        if kind is dict:
            items = [
                f"{_shown(k, 0)}: {_shown(v, depth - 1)}"
                for k, v in itertools.islice(value.items(), 4)
            ]
        else:
            items = [_shown(v, depth - 1) for v in value[:4]]
        items += ["..."] * (len(value) > 4)
        inner = ", ".join(items)
        if kind is torch.Size:
            return f"torch.Size([{inner}])"
        if kind is tuple:
            return f"({inner}{',' * (len(value) == 1)})"
        return f"{{{inner}}}" if kind is dict else f"[{inner}]"
    return f"a {kind.__name__}"


def _bad_value(where: str, value: Any, want: str) -> _Damaged:
    shown = _shown(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return _Damaged(f"{where} is {shown}, not {want}")


def _is_int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


@contextlib.contextmanager
def _as_error(path: Path) -> Iterator[None]:
    try:
        yield
    except _Damaged as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}") from None
