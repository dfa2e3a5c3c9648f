"""Whole-model export and Hugging Face weights: a consolidated safetensors file
(``trainer.export=true``), and safetensors under transformers' names, read into
(``model.pretrained``) and written from (``trainer.export=hf``) the sharded model.

Every function here is a collective: all ranks call it, each reads or writes only its
own shards, and rank 0 writes what is consolidated.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from src.sharding import canonical_name
from src.trainer.checkpoint import _agree, _plain_errors, _quiet_single_process, _rank
from src.trainer.loggers import atomic_path

# -------------------------------------------------------------------- export


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: kept name}`` for every parameter/buffer registered under several names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        name = canonical_name(name, model)
        kept = first.setdefault(id(tensor), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def export_consolidated(model: nn.Module, path: str | Path) -> None:
    """Write the full, unsharded model as one safetensors file (rank 0 writes).

    A collective: every rank calls it (shards are gathered to rank 0 on CPU, one
    tensor at a time). Floating tensors are written as fp32 under canonical names; a
    tied tensor is written once and its other names are recorded in the file's
    metadata, so ``load_consolidated`` hands them back.
    """
    path = Path(path)
    # Offload gathers to rank 0's host memory one tensor at a time; with CPU-resident
    # params there is nothing to offload, and FSDP1 crashes (SIGSEGV) when asked to.
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu)
    state = get_model_state_dict(model, options=options)
    error = None
    if _rank() == 0:
        try:
            aliases = {a: k for a, k in _tied_aliases(model).items() if a in state}
            tensors = {
                name: (t.float() if t.is_floating_point() else t).contiguous()
                for name, t in state.items()
                if name not in aliases
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                metadata = {"format": "pt", "aliases": json.dumps(aliases)}
                save_file(tensors, tmp, metadata=metadata)
        except Exception as exc:
            error = exc
    _agree(error, "export")


def load_consolidated(path: str | Path) -> dict[str, torch.Tensor]:
    """Read an exported model (no pickle); tied names share one tensor, as in the model."""
    state = load_file(path)
    with safe_open(path, framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for alias, kept in aliases.items():
        state[alias] = state[kept]
    return state


# ------------------------------------------------------------ Hugging Face weights
# Read and written through torch.distributed.checkpoint's Hugging Face storage
# (safetensors): each rank reads only the slices of the tensors it owns, and writes only
# its shards, which rank 0 consolidates into files that `from_pretrained` opens.


def hf_checkpoint_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors files in ``directory`` (headers only)."""
    reader = HuggingFaceStorageReader(str(directory))
    metadata = reader.read_metadata().state_dict_metadata
    return {name: tuple(md.size) for name, md in metadata.items()}


def check_hf_shapes(
    expected: dict[str, tuple[int, ...]], directory: str | Path
) -> None:
    """``ValueError`` naming the first expected tensor that the checkpoint in
    ``directory`` lacks or holds with another shape (both shapes given), or the first
    tensor it holds that the model has not (older checkpoints' rotary ``inv_freq``
    buffers aside)."""
    found = hf_checkpoint_shapes(directory)
    extra = [n for n in found if n not in expected and not n.endswith("inv_freq")]
    if extra:
        raise ValueError(
            f"{str(directory)!r} holds {extra[0]!r}, which the "
            f"configured model has not ({len(extra)} such tensors)"
        )
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"{str(directory)!r} has no tensor {name!r}")
        if tuple(found[name]) != tuple(shape):
            raise ValueError(
                f"shape mismatch at {name}: checkpoint "
                f"{tuple(found[name])} vs model {tuple(shape)}"
            )


def _hf_named_state(
    model: nn.Module, to_hf_name: Callable[[str], str]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's (sharded, never gathered) parameters by canonical name, each tied
    tensor once, and canonical name -> transformers name."""
    params = {canonical_name(n, model) for n, _ in model.named_parameters()}
    state = {k: v for k, v in get_model_state_dict(model).items() if k in params}
    return state, {k: to_hf_name(k) for k in state}


def load_hf_weights(
    model: nn.Module, directory: str | Path, to_hf_name: Callable[[str], str]
) -> None:
    """Load a Hugging Face safetensors checkpoint into the (sharded) model in place;
    each rank reads only its own slices. A collective: every rank calls it."""
    state, hf_names = _hf_named_state(model, to_hf_name)
    check_hf_shapes({hf_names[k]: tuple(v.shape) for k, v in state.items()}, directory)
    hf_state = {hf_names[k]: v for k, v in state.items()}
    with _quiet_single_process(), _plain_errors(f"load from {directory}"):
        dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(directory)))
    set_model_state_dict(
        model,
        {k: hf_state[hf_names[k]] for k in state},
        options=StateDictOptions(strict=False),
    )


def export_hf(
    model: nn.Module,
    directory: str | Path,
    to_hf_name: Callable[[str], str],
    hf_config: Any,
) -> None:
    """Write ``directory`` with ``config.json`` and safetensors under transformers'
    names, which ``AutoModelForCausalLM.from_pretrained`` opens. A collective: every
    rank writes its shards, rank 0 consolidates them (tensor by tensor) and removes
    the per-rank files."""
    directory = Path(directory)
    state, hf_names = _hf_named_state(model, to_hf_name)
    writer = HuggingFaceStorageWriter(
        str(directory), save_distributed=True, enable_consolidation=True
    )
    with _quiet_single_process(), _plain_errors(f"export to {directory}"):
        dcp.save({hf_names[k]: v for k, v in state.items()}, storage_writer=writer)
    error = None
    if _rank() == 0:
        try:
            hf_config.save_pretrained(directory)
            shutil.rmtree(directory / "sharded", ignore_errors=True)
        except Exception as exc:
            error = exc
    _agree(error, "export")
