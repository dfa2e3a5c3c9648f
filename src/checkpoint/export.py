"""Whole-model export and Hugging Face weights: a consolidated safetensors file
(``trainer.export=true``), and safetensors under transformers' names, read into
(``model.pretrained``) and written from (``trainer.export=hf``) the sharded model.

Every function here is a collective: all ranks call it, each reads or writes only its
own shards, and rank 0 writes what is consolidated.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import (
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from src.checkpoint.dcp import dcp_errors, quiet_single_process
from src.checkpoint.folders import aside, publish
from src.checkpoint.hf_layout import HFLayout
from src.checkpoint.ranks import all_agree, this_rank
from src.checkpoint.values import canonical_keys, own_keys
from src.data.tokenizer import (
    Tokenizer,
    hf_tokenizer_mismatch,
    save_hf_tokenizer,
    special_ids,
)
from src.files import atomic_path, parse_json
from src.sharding import adapted_layers, canonical_name, is_adapter, merged_weights
from src.sharding.layout import collective_device, flat_mesh

log = logging.getLogger(__name__)

# -------------------------------------------------------------------- export

#: Where ``trainer.export`` writes in the run dir: ``hf`` (a directory, published
#: whole) and the consolidated safetensors file (``true``).
HF_EXPORT_DIR = "hf"
CONSOLIDATED_FILE = "model.safetensors"


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
    if this_rank() == 0:
        try:
            aliases = {a: k for a, k in _tied_aliases(model).items() if a in state}
            tensors = {
                name: plain_tensor(
                    t.float() if t.is_floating_point() else t
                ).contiguous()
                for name, t in state.items()
                if name not in aliases
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                metadata = {"format": "pt", "aliases": json.dumps(aliases)}
                save_file(tensors, tmp, metadata=metadata)
        except Exception as exc:
            error = exc
    all_agree(error, "export")


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


#: Bytes per element of the safetensors dtypes.
_ST_BYTES = {
    **dict.fromkeys(["F64", "I64", "U64"], 8),
    **dict.fromkeys(["F32", "I32", "U32"], 4),
    **dict.fromkeys(["F16", "BF16", "I16", "U16"], 2),
    **dict.fromkeys(["I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"], 1),
}


#: safetensors' own limit on a header (MAX_HEADER_SIZE in its Rust reader).
_ST_MAX_HEADER = 100_000_000


def safetensors_damage(path: str | Path) -> str | None:
    """What is wrong with the safetensors file ``path`` (from its header and size,
    without reading the tensors), or None: a header that is not JSON, a tensor of an
    unknown dtype, whose bytes do not match its shape or lie outside the file, or a
    file longer or shorter than its tensors."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read below for ever
        return "is not a regular file"
    size = info.st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"has {size} bytes, no safetensors header"
        n = int.from_bytes(head, "little")
        if n > _ST_MAX_HEADER:  # read whole below: a sparse file's 3 GiB took 6 GB
            return (
                f"declares a header of {n:,} bytes, over safetensors' limit of "
                f"{_ST_MAX_HEADER:,}"
            )
        if n > size - 8:
            return f"is cut short: its header needs {n} bytes, the file has {size}"
        try:
            header = parse_json(f.read(n))
        except ValueError as exc:
            return f"has a header that is not JSON ({exc})"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (begin, stop) = list(info["shape"]), info["data_offsets"]
            per = _ST_BYTES[info["dtype"]]
            ok = all(type(d) is int and d >= 0 for d in [*shape, begin, stop])
        except (KeyError, TypeError, ValueError):
            return f"has a malformed entry for {name!r}"
        if not ok or stop - begin != per * math.prod(shape):
            return f"has {name!r} whose bytes do not match its dtype and shape"
        end = max(end, stop)
    if 8 + n + end != size:
        return f"has {size} bytes, its tensors need {8 + n + end} (cut short or padded)"
    return None


def hf_checkpoint_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the safetensors files in ``directory`` (headers only);
    ValueError naming the first damaged file (:func:`safetensors_damage`)."""
    for file in sorted(Path(directory).glob("*.safetensors")):
        damage = safetensors_damage(file)
        if damage:
            raise ValueError(f"{file} {damage}")
    try:
        metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    except Exception as exc:  # safetensors' and DCP's own errors, of many types
        raise ValueError(f"{directory}: unreadable ({exc})") from None
    return {name: tuple(md.size) for name, md in metadata.state_dict_metadata.items()}


def check_hf_shapes(
    expected: dict[str, tuple[int, ...]], directory: str | Path, part: bool = False
) -> None:
    """``ValueError`` naming the first expected tensor that the checkpoint in
    ``directory`` lacks or holds with another shape (both shapes given), or the first
    tensor it holds that the model has not (older checkpoints' rotary ``inv_freq``
    buffers aside; none with ``part``: the model is a part of the whole, a pipeline
    stage)."""
    found = hf_checkpoint_shapes(directory)
    extra = [
        n
        for n in found
        if not part and n not in expected and not n.endswith("inv_freq")
    ]
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


def stored_layout(layout: HFLayout, directory: str | Path, part: bool = False):
    """``layout`` as the checkpoint in ``directory`` stores it (save_pretrained's
    per-expert tensors or the in-memory fused ones, :meth:`HFLayout.as_stored`),
    checked against it (:func:`check_hf_shapes`)."""
    layout = layout.as_stored(hf_checkpoint_shapes(directory))
    check_hf_shapes(layout.disk_shapes, directory, part)
    return layout


def _hf_named_state(
    model: nn.Module,
    to_hf_name: Callable[[str], str],
    transposed: Callable[[str], bool] | None = None,
    merged: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's (sharded, never gathered) parameters by canonical name, each tied
    tensor once, as transformers holds them (``transposed`` names: the transpose, a
    sharded tensor of its own; each rank keeps only its slice), and canonical name ->
    transformers name. LoRA adapters are not transformers weights: left out, or
    with ``merged`` (an export) merged into their base weights."""
    params = {canonical_name(n, model) for n, _ in model.named_parameters()}
    state = {
        k: plain_tensor(v)
        for k, v in canonical_keys(get_model_state_dict(model))[0].items()
        if k in params and not is_adapter(k)
    }
    if merged:
        state.update(merged_weights(model))
    if transposed is not None:
        state = {k: _transposed(v) if transposed(k) else v for k, v in state.items()}
    return state, {k: to_hf_name(k) for k in state}


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values in a plain tensor where a wrapper subclass holds them
    (torchao's float8 all-gather weights): safetensors needs the storage (a DTensor
    stays one, over a plain local tensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if not is_traceable_wrapper_subclass(local):
        return t
    data = torch.empty(local.shape, dtype=local.dtype, device=local.device)
    data.copy_(local)
    if not isinstance(t, DTensor):
        return data
    return DTensor.from_local(
        data, t.device_mesh, t.placements, run_check=False, shape=t.shape,
        stride=t.stride(),
    )  # fmt: skip


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The transpose of a 2-D (sharded) tensor as a new contiguous tensor of the same
    kind, each rank holding the transpose of its own slice: a DTensor's shard dim
    swaps, an FSDP1 ShardedTensor's shard offsets and sizes swap; nothing is gathered.
    """
    from torch.distributed._shard.sharded_tensor import (
        Shard as LocalShard,
    )
    from torch.distributed._shard.sharded_tensor import (
        ShardedTensor,
        ShardMetadata,
    )

    if isinstance(t, ShardedTensor):
        shards = [
            LocalShard(
                s.tensor.t().contiguous(),
                ShardMetadata(
                    shard_offsets=list(s.metadata.shard_offsets)[::-1],
                    shard_sizes=list(s.metadata.shard_sizes)[::-1],
                    placement=s.metadata.placement,
                ),
            )
            for s in t.local_shards()
        ]
        return ShardedTensor._init_from_local_shards(shards, *reversed(t.size()))
    return t.detach().t().contiguous()  # a DTensor stays one (Shard(0) -> Shard(1))


def _world_spread() -> Callable[[torch.Tensor], torch.Tensor]:
    """``spread(t)``: ``t`` (whole on every rank) as each rank's slice of it (a DTensor
    sharded on dim 0 over all ranks, on the process group's device), so DCP reads or
    writes only that slice; one process: ``t`` itself."""
    if not dist.is_available() or not dist.is_initialized():
        return lambda t: t
    device = collective_device()
    mesh = flat_mesh(device.type, dist.get_world_size())

    def spread(t: torch.Tensor) -> torch.Tensor:
        placements = [Shard(0) if t.dim() else Replicate()]
        return distribute_tensor(t.to(device), mesh, placements, src_data_rank=None)

    return spread


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every rank (a plain one as it is)."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if isinstance(t, ShardedTensor):  # FSDP1: each element on exactly one rank
        shards = t.local_shards()
        device = shards[0].tensor.device if shards else collective_device()
        whole = torch.zeros(t.size(), dtype=t.dtype, device=device)
        for shard in shards:
            whole[_region(shard.metadata)] = shard.tensor.view(
                shard.metadata.shard_sizes
            )
        dist.all_reduce(whole)
        return whole
    return t


def _region(metadata: Any) -> tuple[slice, ...]:
    return tuple(
        slice(o, o + n)
        for o, n in zip(metadata.shard_offsets, metadata.shard_sizes, strict=True)
    )


def _as_local(ref: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``whole`` placed as ``ref`` is (its own slice of a sharded tensor)."""
    whole = whole.to(ref.dtype)
    if isinstance(ref, DTensor):
        return distribute_tensor(
            whole.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None
        )
    if isinstance(ref, ShardedTensor):
        for shard in ref.local_shards():
            part = whole[_region(shard.metadata)]
            shard.tensor.copy_(part.reshape(shard.tensor.shape))
        return ref
    return whole.to(ref.device)


def _layout(
    state: dict[str, torch.Tensor], hf_names: dict[str, str], skeleton: Any
) -> tuple[HFLayout, dict[str, str]]:
    """The on-disk layout of the model's tensors, and transformers name -> ours."""
    shapes = {hf_names[k]: tuple(v.shape) for k, v in state.items()}
    return HFLayout(skeleton, shapes), {m: k for k, m in hf_names.items()}


def load_hf_weights(
    model: nn.Module,
    directory: str | Path,
    to_hf_name: Callable[[str], str],
    skeleton: nn.Module | None = None,
    transposed: Callable[[str], bool] | None = None,
    part: bool = False,
) -> None:
    """Load a Hugging Face safetensors checkpoint (as ``save_pretrained`` writes it)
    into the (sharded) model in place; each rank reads only its own slices. Tensors
    that transformers converts on load (``skeleton``'s conversion: fused MoE experts)
    are read as slices over all ranks, then converted one group at a time; the
    ``transposed`` ones (GPT-2's Conv1D) are read into their transpose's slices.
    ``part``: the model is a pipeline stage, which reads only its own tensors. A
    collective: every rank calls it."""
    state, hf_names = _hf_named_state(model, to_hf_name, transposed)
    layout, ours = _layout(state, hf_names, skeleton)
    layout = stored_layout(layout, directory, part)
    on_disk = {d: state[ours[m]] for m, d in layout.renames.items()}
    spread = _world_spread()
    for group in layout.groups:
        dtype = state[ours[group.names[0]]].dtype
        for name, shape in group.disk.items():
            on_disk[name] = spread(torch.empty(shape, dtype=dtype))
    with quiet_single_process(), dcp_errors(f"load from {directory}"):
        dcp.load(on_disk, storage_reader=HuggingFaceStorageReader(str(directory)))
    loaded = {ours[m]: on_disk[d] for m, d in layout.renames.items()}
    if transposed is not None:  # back to our layout
        loaded = {k: _transposed(v) if transposed(k) else v for k, v in loaded.items()}
    for group in layout.groups:
        disk = {d: _whole(on_disk.pop(d)) for d in group.disk}
        for name, whole in layout.to_memory(group, disk).items():
            loaded[ours[name]] = _as_local(state[ours[name]], whole)
    keys = canonical_keys(get_model_state_dict(model))[1]
    set_model_state_dict(
        model, own_keys(loaded, keys), options=StateDictOptions(strict=False)
    )


def export_hf(
    model: nn.Module,
    directory: str | Path,
    to_hf_name: Callable[[str], str],
    hf_config: Any,
    skeleton: nn.Module | None = None,
    transposed: Callable[[str], bool] | None = None,
    tokenizer: Tokenizer | None = None,
    written: Callable[[], None] | None = None,
) -> None:
    """Write ``directory`` with ``config.json`` and safetensors in the layout
    ``save_pretrained`` writes (``skeleton``'s conversion reverted: one tensor per MoE
    expert; ``transposed`` names as their transpose), which
    ``AutoModelForCausalLM.from_pretrained`` opens. A collective: every rank writes
    its shards (a converted group is gathered, converted, and each rank writes its
    slice of the result), rank 0 consolidates them (tensor by tensor) and removes the
    per-rank files. It is all written beside ``directory`` (:func:`aside`) and
    renamed into place at the end (:func:`publish`): a kill midway leaves no half
    export under its final name. ``written``: called on every rank once the weights
    are written, before anything is published (a test's kill: tests/test_faults.py).

    With the run's ``tokenizer`` (rank 0's is enough), rank 0 also writes its
    ``tokenizer.json`` / ``tokenizer_config.json`` (``AutoTokenizer`` opens them) and
    checks that ``AutoTokenizer`` encodes as the run does (a warning if not), and
    sets the config's ``use_cache`` (on: training's off is not exported), ``eos_token_id`` (what the tokenizer ends documents with),
    ``bos_token_id`` and ``pad_token_id`` (the tokenizer's own, else None)."""
    directory = Path(directory)
    final, directory = directory, aside(directory)  # renamed into place at the end
    state, hf_names = _hf_named_state(model, to_hf_name, transposed, merged=True)
    layout, ours = _layout(state, hf_names, skeleton)
    out = {d: state[ours[m]] for m, d in layout.renames.items()}
    spread = _world_spread()
    for group in layout.groups:
        whole = {m: _whole(state[ours[m]]) for m in group.names}
        out.update({d: spread(t) for d, t in layout.to_disk(group, whole).items()})
    writer = HuggingFaceStorageWriter(
        str(directory), save_distributed=True, enable_consolidation=True
    )
    with quiet_single_process(), dcp_errors(f"export to {directory}"):
        dcp.save(out, storage_writer=writer)
    adapter = adapter_state(model, to_hf_name)  # a collective: every rank
    if written is not None:
        written()
    all_agree(None, "export")  # every rank is past the hook before rank 0 publishes
    error = None
    if this_rank() == 0:
        try:
            # A copy (the model's own stays as it is) with the KV cache on, which
            # training turns off and generate uses.
            hf_config = copy.deepcopy(hf_config)
            hf_config.use_cache = True
            if tokenizer is not None:
                for key, value in special_ids(tokenizer).items():
                    setattr(hf_config, key, value)
                save_hf_tokenizer(tokenizer, directory)
            hf_config.save_pretrained(directory)
            if adapter is not None:
                save_peft_adapter(*adapter, directory / PEFT_ADAPTER_DIR)
            shutil.rmtree(directory / "sharded", ignore_errors=True)
            publish(final)
            mismatch = tokenizer and hf_tokenizer_mismatch(tokenizer, final)
            if mismatch:
                log.warning("trainer.export=hf: %s", mismatch)
        except Exception as exc:
            error = exc
    all_agree(error, "export")


#: In a Hugging Face export of a LoRA run: the adapters alone, as peft saves them
#: (``PeftModel.from_pretrained(base, <export>/adapter)``); the export itself holds
#: the merged weights.
PEFT_ADAPTER_DIR = "adapter"


@torch.no_grad()
def adapter_state(
    model: nn.Module, to_hf_name: Callable[[str], str]
) -> tuple[Any, dict[str, torch.Tensor]] | None:
    """A LoRA run's adapters as peft names them on the transformers model
    (``base_model.model.<module>.lora_A.weight``), whole, with their LoraConfig;
    None without adapters. A collective (each adapter is gathered)."""
    from torch.distributed.tensor import DTensor

    layers = adapted_layers(model)
    if not layers:
        return None
    from peft import LoraConfig

    from src.sharding.lora import ADAPTER

    tensors, targets = {}, set()
    first = layers[0][1]
    for path, layer in layers:
        module = to_hf_name(f"{path}.weight").removesuffix(".weight")
        targets.add(module.rsplit(".", 1)[-1])
        for part in ("lora_A", "lora_B"):
            w = getattr(layer, part)[ADAPTER].weight
            w = w.full_tensor() if isinstance(w, DTensor) else w
            tensors[f"base_model.model.{module}.{part}.weight"] = w.detach().float()
    config = LoraConfig(
        r=first.r[ADAPTER],
        lora_alpha=first.lora_alpha[ADAPTER],
        lora_dropout=float(getattr(first.lora_dropout[ADAPTER], "p", 0.0)),
        target_modules=sorted(targets),
        task_type="CAUSAL_LM",
    )
    return config, tensors


def save_peft_adapter(config: Any, tensors: dict, directory: Path) -> None:
    """Write an adapter dir as peft's ``save_pretrained`` does: its
    ``adapter_config.json`` (peft writes it) and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    save_file(
        {k: v.contiguous().cpu() for k, v in tensors.items()},
        directory / "adapter_model.safetensors",
    )


def export_model(
    model: nn.Module,
    path: str | Path,
    hf: Any = None,
    model_config: Any = None,
    tokenizer: Tokenizer | None = None,
    written: Callable[[], None] | None = None,
) -> str:
    """Write ``model`` (whole on these ranks) to ``path``: with ``hf`` (its family's
    adapter) a Hugging Face dir (:func:`export_model_hf`, with ``tokenizer``: rank
    0's), else one consolidated safetensors file (:func:`export_consolidated`). What
    ``trainer.export`` and export.py write. A collective; returns what, in words."""
    if hf is None:
        export_consolidated(model, path)
        return "consolidated weights"
    export_model_hf(model, path, hf, model_config, tokenizer, written=written)
    return "weights, config.json" + (
        f" and the {tokenizer.name} tokenizer" if tokenizer else ""
    )


def export_name(hf: bool) -> str:
    """The name of an export in a run dir or a step's export dir."""
    return HF_EXPORT_DIR if hf else CONSOLIDATED_FILE


def export_model_hf(
    model: nn.Module,
    directory: str | Path,
    adapter: Any,
    config: Any,
    tokenizer: Tokenizer | None = None,
    written: Callable[[], None] | None = None,
) -> None:
    """:func:`export_hf` of a model family's ``model`` (of config ``config``) through
    its Hugging Face ``adapter`` (``spec.hf``): its names, config, conversion and
    transposed weights, and the run's ``tokenizer``."""
    export_hf(
        model,
        directory,
        adapter.to_hf_name,
        adapter.hf_config(config),
        adapter.converting_model(config),
        adapter.transposed,
        tokenizer,
        written,
    )
