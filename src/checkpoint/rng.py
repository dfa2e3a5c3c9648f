"""Per-rank RNG states (torch, CUDA, Python, numpy) as a safetensors file of
tensors plus JSON scalars: no pickle, checked against this process's own states
before any is set."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from src.checkpoint.damage import _bad_value, _Damaged, _one_line

RNG_DIR = "rng"


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This process's RNG states as tensors plus JSON scalars (no pickle needed)."""
    version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {
        "torch_cpu": torch.get_rng_state(),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
    }
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    scalars = {
        "python_version": version,
        "python_gauss": py_gauss,
        "numpy_name": np_name,
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
    }
    return tensors, scalars


def _set_rng_state(tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    random.setstate(
        (
            scalars["python_version"],
            tuple(tensors["python_state"].tolist()),
            scalars["python_gauss"],
        )
    )
    np.random.set_state(
        (
            scalars["numpy_name"],
            tensors["numpy_keys"].numpy().astype(np.uint32),
            scalars["numpy_pos"],
            scalars["numpy_has_gauss"],
            scalars["numpy_gauss"],
        )
    )
    cuda = sorted(k for k in tensors if k.startswith("cuda_"))
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint: saved {len(cuda)} CUDA RNG states, "
                f"{torch.cuda.device_count()} devices now; CUDA RNG not restored",
                stacklevel=3,
            )
        else:
            torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def _rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank_{rank:05d}.safetensors"


#: The RNG states a checkpoint holds per rank: tensor name -> dtype, and the JSON
#: scalars' kinds (``python_gauss`` is null until random.gauss has run).
_RNG_TENSORS = {
    "torch_cpu": torch.uint8,
    "python_state": torch.int64,
    "numpy_keys": torch.int64,
}
_RNG_SCALARS = {
    "python_version": (int,),
    "python_gauss": (float, type(None)),
    "numpy_name": (str,),
    "numpy_pos": (int,),
    "numpy_has_gauss": (int,),
    "numpy_gauss": (float,),
}


def _read_rng(file: Path, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A rank's RNG file (safetensors: no pickle), checked against the states this
    process has (names, dtypes, shapes, the scalars' types); _Damaged otherwise."""
    rel = file.relative_to(path)
    live_tensors, _ = _rng_state()
    try:
        with safe_open(file, framework="pt") as f:
            scalars = json.loads((f.metadata() or {}).get("scalars", "null"))
        tensors = load_file(file)
    except (OSError, ValueError, SafetensorError) as exc:
        raise _Damaged(f"{rel} is unreadable ({_one_line(exc)})") from None
    for name, dtype in _RNG_TENSORS.items():
        got = tensors.get(name)
        want = live_tensors[name]
        if got is None or got.dtype != dtype or got.shape != want.shape:
            raise _bad_value(
                f"{rel}: {name}", got, f"{dtype} of shape {list(want.shape)}"
            )
    if not isinstance(scalars, dict):
        raise _bad_value(f"{rel}: scalars", scalars, "an object")
    for name, types in _RNG_SCALARS.items():
        if type(scalars.get(name)) not in types:
            raise _bad_value(f"{rel}: {name}", scalars.get(name), types[0].__name__)
    if not 0 <= scalars["numpy_pos"] <= 624:
        raise _bad_value(f"{rel}: numpy_pos", scalars["numpy_pos"], "0..624")
    # what random.setstate and np.random.set_state take (they raise otherwise, after
    # the model and optimizer are set)
    if scalars["python_version"] != 3 or scalars["numpy_name"] != "MT19937":
        raise _Damaged(f"{rel}: not the Mersenne Twister states of Python and numpy")
    state = tensors["python_state"]
    if state.min() < 0 or state[:-1].max() >= 1 << 32 or state[-1] > 624:
        raise _Damaged(f"{rel}: python_state is not a Mersenne Twister state")
    return tensors, scalars
