"""The JSON values of a checkpoint: every non-tensor value of a state dict
(optimizer hyperparameters, scheduler state, extra) is stored in ``meta.json`` with
its tuples tagged, and read back only if it has the kinds of value this run's own
state has."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from src.checkpoint.damage import _as_error, _bad_value, _Damaged
from src.checkpoint.folders import META
from src.sharding import canonical_name


def _to_json(obj: Any) -> Any:
    """Tag tuples so that JSON gives back exactly what was saved (betas stay a tuple)."""
    if isinstance(obj, tuple):
        return {"__tuple__": [_to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [_to_json(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _to_json(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(
        f"checkpoint: cannot store {type(obj).__name__} value {obj!r} as JSON; "
        "only tensors, numbers, strings, lists, tuples and dicts are supported"
    )


def _from_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.keys() == {"__tuple__"}:
            return tuple(_from_json(v) for v in obj["__tuple__"])
        return {k: _from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    return obj


def canonical_keys(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``state`` (a flat model or optimizer state dict) under canonical names (a
    LoRA layer's ``base_layer`` left out: the base weights are saved, loaded and
    exported under the names a model without adapters has), and canonical -> the
    model's own key, to set it back (:func:`own_keys`)."""
    names = {canonical_name(k): k for k in state}
    return {canonical_name(k): v for k, v in state.items()}, names


def own_keys(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state`` (canonical keys) under the model's own keys (:func:`canonical_keys`)."""
    return {names.get(k, k): v for k, v in state.items()}


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (for DCP) and everything else (for JSON) of a flat state dict."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors, others


#: torchao's FSDP2 float8 all-gather weight (``precision=float8``): a wrapper around
#: the high-precision weight, named here so that saving needs no torchao import.
_WEIGHT_WRAPPERS = frozenset({"WeightWithDynamicFloat8CastTensor"})


def plain_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each torchao float8 weight wrapper (:data:`_WEIGHT_WRAPPERS`,
    the local tensor of a DTensor or the tensor itself) replaced by the plain
    tensor it holds (the same storage): a checkpoint holds plain tensors and
    DTensors whatever the training precision, which any run can read."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, t in tensors.items():
        local = t._local_tensor if isinstance(t, DTensor) else t
        if type(local).__name__ in _WEIGHT_WRAPPERS:
            inner = local._tensor.detach()
            if isinstance(t, DTensor):
                inner = DTensor.from_local(
                    inner, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
                )
            t = inner
        out[k] = t
    return out


def _kind(value: Any) -> str:
    if value is None or type(value) in (bool, str, dict, list):
        return {
            None: "null",
            bool: "a boolean",
            str: "a string",
            dict: "an object",
            list: "a list",
        }[None if value is None else type(value)]
    if type(value) in (int, float):
        return "a number"
    if type(value) is tuple:
        return f"a tuple of {len(value)}"
    return type(value).__name__


def json_like(saved: Any, live: Any, where: str, partial: bool = False) -> Any:
    """``saved`` (a JSON section of a checkpoint) as Python values, if it has the
    shape of ``live`` (what this run's own state holds there): the same keys (a
    subset with ``partial``, top level only), the same kinds of value, finite
    numbers (integers where ``live`` has one); a null where ``live`` has a boolean
    or a null is accepted (optional flags). _Damaged naming the first difference
    otherwise."""
    saved = _from_json(saved)

    def same(s: Any, v: Any, at: str) -> None:
        if v is None and (s is None or type(s) in (bool, int, float, str)):
            pass
        elif s is None and type(v) is bool:
            pass
        elif _kind(s) != _kind(v) or (type(v) is int and type(s) is float):
            raise _bad_value(f"{META}: {at}", s, _kind(v))
        elif type(s) is float and not math.isfinite(s):
            raise _bad_value(f"{META}: {at}", s, "a finite number")
        elif type(s) in (list, tuple):
            if len(s) != len(v):
                raise _bad_value(f"{META}: {at}", s, f"{len(v)} values")
            for i, (a, b) in enumerate(zip(s, v, strict=True)):
                same(a, b, f"{at}[{i}]")
        elif type(s) is dict:
            keys(s, v, at)

    def keys(s: dict, v: dict, at: str, subset: bool = False) -> None:
        extra = [k for k in s if k not in v]
        missing = [] if subset else [k for k in v if k not in s]
        if extra or missing:
            which = (
                f"has {extra[0]!r}, which this run's state does not"
                if extra
                else f"lacks {missing[0]!r}, which this run's state has"
            )
            raise _Damaged(f"{META}: {at} {which}")
        for k in s:
            same(s[k], v[k], f"{at}.{k}")

    if type(saved) is not dict:
        raise _bad_value(f"{META}: {where}", saved, "an object")
    keys(saved, live, where, partial)
    return saved


def checked_extra(path: str | Path, extra: dict, key: str, like: Any) -> Any:
    """``extra[key]`` of the checkpoint at ``path`` (what :meth:`Checkpointer.load`
    returned) if it has the kinds of value ``like`` has (see :func:`json_like`);
    a one-line :class:`CheckpointError` naming it otherwise."""
    with _as_error(Path(path)):
        return json_like({key: extra.get(key)}, {key: like}, "extra")[key]
