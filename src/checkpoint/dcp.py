"""Sharded checkpoints with atomic publish, verification, resume and resharding.

Layout of a checkpoint directory (``trainer.ckpt_every`` writes one per save)::

    checkpoints/
      step_00000200/          published: renamed into place only once complete
        .metadata, __0_0.distcp, __1_0.distcp, ...   torch.distributed.checkpoint (DCP)
        rng/rank_00000.safetensors                    per-rank RNG states (tensors + JSON)
        meta.json                                     step, world size, scheduler, extra,
                                                      size and CRC-32 of every file above
        COMPLETE                                      completion marker, written last;
                                                      holds the CRC-32 of meta.json
      .tmp.step_00000300/     a save in progress (or one that crashed): never loaded

Model and optimizer go through DCP, so a checkpoint written by N ranks loads on M ranks
under any of FSDP2, FSDP1 (``use_orig_params=True``), DDP or a plain module. Only tensors
are given to DCP; every non-tensor value (optimizer hyperparameters, scheduler state,
extra) is stored as JSON.

Everything read is data, checked before it is used. DCP's index (``.metadata``, a
pickle) is read by an unpickler that builds only an allow-list of exact (module, name)
pairs of DCP's own records, then checked as a whole: tensors only (DCP would hand a
bytes entry to ``torch.load(weights_only=False)``), every chunk inside its tensor and
inside a ``.distcp`` file of the checkpoint, no stream transforms; DCP reads the tensors
themselves with ``torch.load(weights_only=True)``. ``meta.json``'s fields are checked
for type and range (:func:`read_checkpoint_meta`), its checksum entries may name only
files inside the checkpoint, and the JSON sections must have the kinds of value this
run's own state has before any is set. RNG files are safetensors (no pickle).

Loading is strict and verified: a parameter, buffer or optimizer tensor that the
checkpoint and the model do not both have, or have with different shapes, is a
:class:`CheckpointError` naming the first one; every file is checked against the size
and checksum recorded at save (the work split over the ranks; a file no checksum
covers, a link or a device is damage), and ``resume=auto`` skips a checkpoint that
fails, saying why, for the newest one that passes. CRC-32 (zlib) rather than a
cryptographic hash: it detects torn writes and flipped bytes at memory speed; a forger
can recompute it, which is why the reading above is safe without it.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import importlib
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import stat
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from src.errors import RunError
from src.util import MAX_JSON, collective_device, file_crc32, parse_json

MARKER = "COMPLETE"
META = "meta.json"
RNG_DIR = "rng"
# 2: meta.json holds per-file checksums; 3: the marker holds meta.json's CRC-32
FORMAT_VERSION = 3
_MARKER_TEXT = re.compile(rf"{re.escape(META)} crc32 ([0-9a-f]{{8}})\n")
CHECKSUMS = "checksums"
INDEX = ".metadata"  # DCP's index of tensors, chunks and file offsets (a pickle)
_CRC32 = re.compile(r"[0-9a-f]{8}")
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP_PREFIX = ".tmp."
_OLD_PREFIX = ".old."
# Flat optimizer keys ("state.<fqn>.exp_avg") reshard by name, like the model's.
_DSD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


# --------------------------------------------------------------------------- ranks


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


class CheckpointError(RunError):
    """A checkpoint that cannot be loaded into this run: damaged, or another model."""


# ------------------------------------------------------------------- JSON values


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


def _split(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (for DCP) and everything else (for JSON) of a flat state dict."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return tensors, others


# ------------------------------------------------------------------------- RNG


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


# ------------------------------------------------------------- reading safely


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


def _member_name(name: Any) -> bool:
    """A checksum entry that can only name a file inside the checkpoint."""
    if type(name) is not str or not name or "\\" in name or "\0" in name:
        return False
    parts = name.split("/")
    return not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _check_meta(meta: Any, step: int | None) -> dict:
    """``meta`` (meta.json, parsed) if every field has its type and range, else
    _Damaged naming the first field that does not; ``step`` is the one the
    checkpoint's directory name says."""
    if not isinstance(meta, dict):
        raise _Damaged(f"{META} holds a {type(meta).__name__}, not a JSON object")
    version = meta.get("format_version")
    if version not in (2, FORMAT_VERSION) or type(version) is not int:
        raise _bad_value(
            f"{META}: format_version",
            version,
            f"2 or {FORMAT_VERSION} (this version's)",
        )
    if not _is_int(meta.get("step")):
        raise _bad_value(f"{META}: step", meta.get("step"), "an integer >= 0")
    if step is not None and meta["step"] != step:
        raise _bad_value(f"{META}: step", meta["step"], f"{step} (the directory's)")
    if not _is_int(meta.get("world_size"), 1):
        raise _bad_value(
            f"{META}: world_size", meta.get("world_size"), "an integer >= 1"
        )
    for key, types, want in (
        ("torch_version", (str,), "a string"),
        ("model_objects", (dict,), "an object"),
        ("optim_objects", (dict,), "an object"),
        ("scheduler", (dict, type(None)), "an object or null"),
        ("extra", (dict,), "an object"),
        (CHECKSUMS, (dict,), "an object"),
    ):
        if type(meta.get(key)) not in types:
            raise _bad_value(f"{META}: {key}", meta.get(key), want)
    for key in ("model_objects", "optim_objects", "scheduler", "extra"):
        _check_section(meta[key], f"{META}: {key}")
    if "step" in meta["extra"]:  # load returns {"step": step, **extra}
        raise _bad_value(f"{META}: extra.step", meta["extra"]["step"], "absent")
    for name, entry in meta[CHECKSUMS].items():
        if not _member_name(name):
            raise _bad_value(
                f"{META}: a checksum entry", name, "a file inside the checkpoint"
            )
        if (
            not isinstance(entry, dict)
            or not _is_int(entry.get("bytes"))
            or not isinstance(entry.get("crc32"), str)
            or not _CRC32.fullmatch(entry["crc32"])
        ):
            raise _bad_value(
                f"{META}: checksums[{name!r}]",
                entry,
                '{"bytes": integer >= 0, "crc32": 8 hex digits}',
            )
    needed = [INDEX] + [str(_rng_file(Path(), r)) for r in range(meta["world_size"])]
    missing = [n for n in needed if n not in meta[CHECKSUMS]]
    if missing:
        raise _Damaged(f"{META} has no checksum of {missing[0]}")
    return meta


#: How deep a JSON section of meta.json may nest (a run's own is at most 6 deep).
_MAX_DEPTH = 32


def _check_section(section: Any, where: str) -> None:
    """_Damaged unless ``section`` nests at most :data:`_MAX_DEPTH` deep (deeper ones
    would reach Python's recursion limit where they are read) and every tuple tag
    (``{"__tuple__": ...}``, :func:`_to_json`) holds a list."""
    todo = [(section, 0)]
    while todo:
        value, depth = todo.pop()
        if depth > _MAX_DEPTH:
            raise _Damaged(f"{where} nests deeper than {_MAX_DEPTH} levels")
        if isinstance(value, dict):
            if value.keys() == {"__tuple__"} and type(value["__tuple__"]) is not list:
                raise _bad_value(f"{where}: a tuple", value["__tuple__"], "a list")
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)


def read_checkpoint_meta(path: str | Path) -> dict:
    """``meta.json`` of the checkpoint at ``path``, checked before anything acts on
    it: step (that of the ``step_N`` directory), world size, the JSON sections, and
    checksum entries that name only files inside the checkpoint. A
    :class:`CheckpointError` in one line naming the field otherwise."""
    path = Path(path)
    try:
        return _read_meta(path)
    except _Damaged as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}") from None


def _read_meta(path: Path) -> dict:
    file = path / META
    if file.is_symlink() or not file.is_file():
        raise _Damaged(f"{META} is missing or not a regular file")
    size = file.stat().st_size  # a run's own: tens of KiB, MiBs for huge models
    if size > MAX_JSON:  # refused before it is read into memory
        raise _Damaged(
            f"{META} has {size:,} bytes, over {MAX_JSON:,} (not one this project "
            "writes)"
        )
    marker = path / MARKER
    if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 64:
        raise _Damaged(f"{MARKER} is missing or not a marker")
    try:
        data, sealed = file.read_bytes(), marker.read_text()
    except (OSError, ValueError) as exc:
        raise _Damaged(f"{META} is unreadable ({_one_line(exc)})") from None
    seal = _MARKER_TEXT.fullmatch(sealed)
    if sealed and not seal:
        raise _Damaged(f"{MARKER} is damaged")
    if seal and seal.group(1) != f"{zlib.crc32(data):08x}":
        raise _Damaged(f"{META} fails its checksum (corrupted)")
    try:
        meta = parse_json(data)
    except ValueError as exc:
        raise _Damaged(f"{META} is unreadable ({_one_line(exc)})") from None
    meta = _check_meta(meta, step_of(path))
    if not seal and meta["format_version"] != 2:
        raise _Damaged(
            f"{MARKER} is empty (format {meta['format_version']} seals {META})"
        )
    return meta


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _stray_files(root: Path, names: list[str]) -> str | None:
    """Why the files under ``root`` are not exactly meta.json, the marker and
    ``names`` as regular files (a link, a device, a file no checksum covers), or
    None."""
    expected = set(names) | {META, MARKER}
    present = set()
    for dirpath, dirs, files in os.walk(root):
        for entry in dirs + files:
            full = Path(dirpath, entry)
            rel = str(full.relative_to(root))
            mode = full.lstat().st_mode
            if stat.S_ISLNK(mode):
                return f"{rel} is a symbolic link"
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                return f"{rel} is not a regular file"
            if rel not in expected:
                return f"{rel} has no checksum in {META}"
            present.add(rel)
    missing = sorted(expected - present)
    return f"{missing[0]} is missing" if missing else None


class _IndexUnpickler(pickle._Unpickler):  # the Python one: its BUILD is ours
    """Unpickler for DCP's ``.metadata`` index that builds DCP's own records and
    nothing else: exact (module, name) pairs, so no dotted name (protocol 4 resolves
    ``a.b`` attribute by attribute) and no other member of an allowed module passes.
    A bytes entry (``BytesStorageMetadata``, loaded by DCP with full pickle) is not
    among them: this project's checkpoints hold tensors only. BUILD (set an object's
    state) applies only to an instance of an allowed class, with a dict of attribute
    names or the class's own ``__setstate__``: on a class itself it would set the
    class's attributes (``PosixPath.__truediv__``) for the rest of the process."""

    _ALLOWED = frozenset(
        [
            *(
                ("torch.distributed.checkpoint.metadata", n)
                for n in (
                    "Metadata",
                    "MetadataIndex",
                    "StorageMeta",
                    "TensorProperties",
                    "TensorStorageMetadata",
                    "ChunkStorageMetadata",
                    "_MEM_FORMAT_ENCODING",
                )
            ),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"),
            *(
                (m, n)
                for m in ("pathlib", "pathlib._local")
                for n in (
                    "PosixPath",
                    "PurePosixPath",
                    "WindowsPath",
                    "PureWindowsPath",
                )
            ),
            *(
                ("torch", n)
                for n, v in vars(torch).items()
                if isinstance(v, torch.dtype)
            ),
        ]
    )

    _BUILDABLE: frozenset[type] = frozenset()  # the classes of _ALLOWED, below

    def _load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) not in self._BUILDABLE:
            raise pickle.UnpicklingError(f"it sets the state of {_shown(inst):.40}")
        if getattr(type(inst), "__setstate__", None) is None:
            if type(state) is not dict or not all(type(k) is str for k in state):
                raise pickle.UnpicklingError(
                    f"it sets {type(inst).__name__}'s state to {_shown(state):.40}"
                )
        pickle._Unpickler.load_build(self)

    def _keyed(handler: Callable[[Any], None], keys: Callable[[Any], Any]) -> Any:
        """``handler`` (an opcode that hashes ``keys(self)``: a dict's keys, a set's
        items) once each key is plain (:func:`_plain_key`): hashing a tuple that
        shares itself 60 levels down takes 2**60 steps."""

        def load(self: Any) -> None:
            for key in keys(self):
                if not _plain_key(key):
                    raise pickle.UnpicklingError(f"it uses {_shown(key):.40} as a key")
            handler(self)

        return load

    def _load_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if func is collections.OrderedDict and args != ():
            # hashes its argument's keys; pickle itself gives them by SETITEMS
            raise pickle.UnpicklingError("it builds an OrderedDict from arguments")
        pickle._Unpickler.load_reduce(self)

    def _refused(what: str) -> Any:
        def load(self: Any) -> None:
            raise pickle.UnpicklingError(f"it holds {what}")

        return load

    dispatch = {
        **pickle._Unpickler.dispatch,
        pickle.BUILD[0]: _load_build,
        pickle.REDUCE[0]: _load_reduce,
        pickle.SETITEM[0]: _keyed(
            pickle._Unpickler.load_setitem, lambda u: [u.stack[-2]]
        ),
        pickle.SETITEMS[0]: _keyed(
            pickle._Unpickler.load_setitems, lambda u: u.stack[::2]
        ),
        pickle.DICT[0]: _keyed(pickle._Unpickler.load_dict, lambda u: u.stack[::2]),
        pickle.ADDITEMS[0]: _keyed(pickle._Unpickler.load_additems, lambda u: u.stack),
        pickle.FROZENSET[0]: _keyed(
            pickle._Unpickler.load_frozenset, lambda u: u.stack
        ),
        # protocol 5: a bytearray is allocated at its declared size before it is
        # read; out-of-band buffers are never given. DCP's index holds neither.
        pickle.BYTEARRAY8[0]: _refused("a bytearray"),
        pickle.NEXT_BUFFER[0]: _refused("an out-of-band buffer"),
        pickle.READONLY_BUFFER[0]: _refused("an out-of-band buffer"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id")


#: How many values a dict key or set item of the index may hold, all nested ones
#: counted (DCP's keys: a name, or a MetadataIndex of a name, an offset and an int).
_KEY_VALUES = 256


def _plain_key(key: Any) -> bool:
    """``key`` is a name, a number, a dtype, a shape, or a tuple, frozenset or
    MetadataIndex of such, holding at most :data:`_KEY_VALUES` values in all: its
    hash takes bounded work (checked in bounded work)."""
    todo, seen = [key], 0
    while todo:
        value = todo.pop()
        seen += 1
        if seen > _KEY_VALUES:
            return False
        kind = type(value)
        if value is None or kind in (str, int, bool, float, bytes, torch.dtype):
            continue
        if kind in (tuple, frozenset, torch.Size):
            if len(value) > _KEY_VALUES:
                return False
            todo.extend(value)
        elif kind is MetadataIndex:
            todo.extend(vars(value).values())
        else:
            return False
    return True


class _BoundedReads:
    """The index file for :class:`_IndexUnpickler`: no read (a string's, a frame's,
    a line's) of more than :data:`_MAX_READ` bytes, so a forged length or a huge
    file without a newline cannot fill memory before the pickle is refused."""

    def __init__(self, file: Any):
        self._file = file

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > _MAX_READ:
            raise pickle.UnpicklingError(f"it declares a value of {size:,} bytes")
        return self._file.read(size)

    def readline(self) -> bytes:
        line = self._file.readline(_MAX_READ + 1)
        if len(line) > _MAX_READ:
            raise pickle.UnpicklingError(f"it holds a line over {_MAX_READ:,} bytes")
        return line


#: The longest single read of the index (DCP's strings are names and paths).
_MAX_READ = 16 << 20


def _allowed_classes() -> frozenset[type]:
    found = set()
    for module, name in _IndexUnpickler._ALLOWED:
        with contextlib.suppress(ImportError):
            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type):
                found.add(value)
    return frozenset(found)


_IndexUnpickler._BUILDABLE = _allowed_classes()


def _size(value: Any, where: str) -> tuple[int, ...]:
    """A shape of at most 64 dims, each below 2**62 (a forged 100M-bit size made
    every product of sizes take minutes)."""
    if (
        type(value) is not torch.Size
        or len(value) > 64
        or not all(_is_int(d) and d < 1 << 62 for d in value)
    ):
        raise _bad_value(where, value, "a shape")
    return tuple(value)


def _tiles(shape: tuple[int, ...], chunks: list[ChunkStorageMetadata]) -> bool:
    """The chunks (each inside the tensor) cover ``shape`` once: their volumes add up
    to the tensor's and no two overlap (sorted by their offset along the dim where
    they start at the most places, a chunk is compared only with those that start
    before it ends there: linear for row or column shards)."""
    boxes = [
        (tuple(c.offsets), tuple(c.sizes)) for c in chunks if math.prod(c.sizes) > 0
    ]
    if sum(math.prod(n) for _, n in boxes) != math.prod(shape):
        return False
    if shape:  # sweep along the dim where the chunks start at the most places
        dim = max(range(len(shape)), key=lambda d: len({o[d] for o, _ in boxes}))
        boxes.sort(key=lambda box: box[0][dim])
    for i, (o1, n1) in enumerate(boxes):
        for o2, n2 in boxes[i + 1 :]:
            if shape and o2[dim] >= o1[dim] + n1[dim]:
                break
            spans = zip(o1, n1, o2, n2, strict=True)
            if all(b < a + m and a < b + k for a, m, b, k in spans):
                return False
    return True


def _check_index(md: Any, sizes: dict[str, int], world_size: int) -> Metadata:
    """``md`` if it is a DCP index of tensors only, every chunk inside its tensor
    and stored in a listed ``.distcp`` file of the checkpoint within its size
    (``sizes``: recorded bytes), with no stream transform; _Damaged otherwise."""
    where = INDEX
    if type(md) is not Metadata:
        raise _bad_value(where, type(md).__name__, "a DCP Metadata")
    entries, storage = md.state_dict_metadata, md.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        raise _Damaged(f"{where} has no tensor table or no storage table")
    for key, entry in entries.items():
        if type(key) is not str or len(key) > 4096:
            raise _bad_value(
                f"{where}: a key", key, "a name of at most 4096 characters"
            )
        if type(entry) is not TensorStorageMetadata:
            raise _bad_value(f"{where}: {key}", type(entry).__name__, "a tensor entry")
        props = entry.properties
        if type(props) is not TensorProperties or type(props.dtype) is not torch.dtype:
            raise _bad_value(f"{where}: {key}'s properties", props, "a dtype")
        shape = _size(entry.size, f"{where}: {key}'s size")
        if type(entry.chunks) is not list:
            raise _bad_value(f"{where}: {key}'s chunks", entry.chunks, "a list")
        if len(entry.chunks) > world_size:
            # each rank saves at most one chunk of a tensor: more would only make
            # the overlap check below quadratic
            raise _bad_value(
                f"{where}: {key}'s chunks",
                f"{len(entry.chunks):,} chunks",
                f"at most one per rank of the save ({world_size})",
            )
        for chunk in entry.chunks:
            if type(chunk) is not ChunkStorageMetadata:
                raise _bad_value(f"{where}: {key}'s chunk", chunk, "a chunk")
            offsets = _size(chunk.offsets, f"{where}: {key}'s chunk offsets")
            lengths = _size(chunk.sizes, f"{where}: {key}'s chunk sizes")
            if (
                len(offsets) != len(shape)
                or len(lengths) != len(shape)
                or any(
                    o + n > d for o, n, d in zip(offsets, lengths, shape, strict=True)
                )
            ):
                raise _Damaged(f"{where}: a chunk of {key} lies outside its tensor")
            if MetadataIndex(key, offsets) not in storage:
                raise _Damaged(f"{where}: a chunk of {key} is stored nowhere")
        if not _tiles(shape, entry.chunks):
            # DCP leaves what no chunk covers as the model has it: silently unloaded
            raise _Damaged(f"{where}: the chunks of {key} do not cover it exactly")
    data_files = {
        n: b for n, b in sizes.items() if "/" not in n and n.endswith(".distcp")
    }
    for index, info in storage.items():
        if type(index) is not MetadataIndex or index.fqn not in entries:
            raise _bad_value(f"{where}: a storage key", index, "a tensor's chunk")
        if (
            type(info) is not _StorageInfo
            or type(info.relative_path) is not str
            or info.relative_path not in data_files
        ):
            raise _bad_value(
                f"{where}: {index.fqn}'s file",
                getattr(info, "relative_path", info),
                "a .distcp file of the checkpoint",
            )
        if not (_is_int(info.offset) and _is_int(info.length)) or (
            info.offset + info.length > data_files[info.relative_path]
        ):
            raise _Damaged(f"{where}: {index.fqn} lies outside {info.relative_path}")
        if info.transform_descriptors:
            raise _bad_value(
                f"{where}: {index.fqn}'s transforms",
                info.transform_descriptors,
                "none",
            )
    planner = md.planner_data
    if planner is not None and (
        type(planner) is not dict
        or not all(
            type(k) is str and type(v) is tuple and all(type(p) is str for p in v)
            for k, v in planner.items()
        )
    ):
        raise _bad_value(f"{where}: planner_data", planner, "key paths")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        raise _bad_value(f"{where}: storage_meta", md.storage_meta, "a StorageMeta")
    return md


def _read_index(path: Path, meta: dict) -> Metadata:
    """The checkpoint's DCP index, unpickled with :class:`_IndexUnpickler` and
    checked by :func:`_check_index`; _Damaged saying what is wrong otherwise."""
    try:
        with open(path / INDEX, "rb") as f:
            md = _IndexUnpickler(_BoundedReads(f)).load()
    except Exception as exc:  # pickle's own errors are of many types
        raise _Damaged(
            f"{INDEX} is not a DCP index of tensors ({_one_line(exc)})"
        ) from None
    sizes = {n: e["bytes"] for n, e in meta[CHECKSUMS].items()}
    try:
        return _check_index(md, sizes, meta["world_size"])
    except _Damaged:
        raise
    except Exception as exc:  # an attribute of a forged type the checks missed
        raise _Damaged(
            f"{INDEX} is not a DCP index of tensors ({type(exc).__name__}: "
            f"{_one_line(exc)})"
        ) from None


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader given an index already read and checked (never unpickled
    again from the file)."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = copy.copy(self._metadata)
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """DCP raises CheckpointException, a BaseException that ``except Exception`` misses.

    It already carries every rank's failure (DCP gathers them), so all ranks raise.
    """
    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"checkpoint {what} failed: {exc}") from exc


# ----------------------------------------------------------------- discovery


def run_checkpoints(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int | None:
    """The step of a ``step_N`` checkpoint dir (None for any other name)."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: str | Path) -> bool:
    """A published checkpoint: a ``step_N`` dir holding the completion marker (its
    other files, meta.json included, are checked by :meth:`Checkpointer.verify`)."""
    path = Path(path)
    marker = path / MARKER
    return step_of(path) is not None and (marker.exists() or marker.is_symlink())


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def drop_partial(directory: str | Path) -> list[Path]:
    """Remove what interrupted saves left in ``directory`` (call it while no rank
    writes there): ``.tmp.step_N`` dirs go, and a ``step_N`` being replaced when the
    save stopped gets its old copy back (an old copy already replaced goes). Returns
    the dirs removed (:func:`saving_step` gives a save's step)."""
    directory, removed = Path(directory), []
    if not directory.is_dir():
        return removed
    for path in sorted(directory.iterdir()):
        if path.name.startswith(_OLD_PREFIX):
            final = directory / path.name.removeprefix(_OLD_PREFIX)
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            else:  # the new copy never took its place: the old one is the checkpoint
                os.rename(path, final)
        elif path.name.startswith(_TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def saving_step(path: Path) -> int | None:
    """The step whose save ``path`` (a ``.tmp.step_N`` dir) was writing, else None."""
    if not path.name.startswith(_TMP_PREFIX):
        return None
    return step_of(Path(path.name.removeprefix(_TMP_PREFIX)))


def incomplete_checkpoints(directory: str | Path) -> list[tuple[Path, str]]:
    """The ``step_N`` dirs under ``directory`` without the completion marker, each
    with why (never loaded; a resume names them)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [
        (path, f"no {MARKER} marker (a save that did not finish)")
        for path in sorted(directory.iterdir())
        if step_of(path) is not None and path.is_dir() and not is_complete(path)
    ]


def resolve_resume(
    resume: str | Path | None,
    directory: str | Path,
    verify: Callable[[Path], str | None] | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> Path | None:
    """The checkpoint a run continues from, given ``trainer.resume``.

    ``None`` (or ``"none"``) starts fresh; ``"auto"`` takes the newest complete checkpoint
    in ``directory`` if there is one, else starts fresh; anything else is a path to a
    checkpoint, or to a directory of checkpoints (or a run dir with ``checkpoints/``)
    whose newest is taken. A path that holds no complete checkpoint is an error: a typo
    must not silently restart training from step 0.

    With ``verify`` (``Checkpointer.verify``: the reason a checkpoint is damaged, or
    None), a damaged checkpoint among several is skipped (``on_skip(path, reason)``) for
    the next newest; a named checkpoint, or all of them, damaged is a CheckpointError.
    """
    if resume is None or str(resume).strip().lower() in ("", "none", "null"):
        return None
    if str(resume).strip().lower() == "auto":
        return _newest_good(complete_checkpoints(directory), verify, on_skip)
    path = Path(resume).expanduser()
    if is_complete(path):
        return _newest_good([path], verify, on_skip)
    for candidates in (path, run_checkpoints(path)):
        found = complete_checkpoints(candidates)
        if found:
            return _newest_good(found, verify, on_skip)
    raise FileNotFoundError(
        f"trainer.resume={resume!r}: not a complete checkpoint (a step_N directory "
        f"with a {MARKER} marker) nor a directory holding one"
    )


def _newest_good(
    found: list[Path],
    verify: Callable[[Path], str | None] | None,
    on_skip: Callable[[Path, str], None] | None,
) -> Path | None:
    """The newest of ``found`` (oldest first) that passes ``verify``."""
    if not found or verify is None:
        return found[-1] if found else None
    reasons = []
    for path in reversed(found):
        reason = verify(path)
        if reason is None:
            return path
        reasons.append(f"{path.name}: {reason}")
        if on_skip is not None and len(found) > 1:
            on_skip(path, reason)
    raise CheckpointError(
        f"no usable checkpoint in {found[0].parent} ({'; '.join(reasons)})"
    )


# ---------------------------------------------------------------- checkpointer


class Checkpointer:
    """Save, find and restore sharded training checkpoints in one directory.

    ``save`` and ``load`` are collectives: every rank calls them. Without a process group
    they work in a single process (``sharding=none``). ``keep_last``: the newest
    complete checkpoints kept after a save (0, the default: all; the trainer passes
    ``trainer.keep_last``), so a Checkpointer that only reads never deletes one.

    With ``async_save=True``, ``save`` returns once the state is copied (staged) to
    host memory; DCP's ``async_save`` writes it from a background thread while
    training goes on, and the checkpoint is checksummed and published (``COMPLETE``,
    rename) there, only after every rank's write finished. One save is in flight at a
    time: the next ``save`` (and :meth:`wait`) first waits for it. The background
    collectives run on a process group of their own, so they never interleave with
    the training loop's. (DCP's other mode, a checkpoint daemon process per rank, also
    works with gloo on CPU but costs a process start, about 18 s here, at the first
    save.)

    ``writing``: called on each rank with the step once its ``.tmp.step_N`` dir exists
    (the trainer's test hook for a signal mid-save, src/trainer/faults.py).
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 0,
        async_save: bool = False,
        writing: Callable[[int], None] | None = None,
    ):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.async_save = async_save
        self._writing = writing
        self._pending: Future | None = None
        self._group = None
        self._executor = None
        if async_save:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            if _distributed():  # a collective: every rank builds its Checkpointer
                self._group = dist.new_group(backend="gloo")

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def latest(self) -> Path | None:
        """The newest complete checkpoint; temporary and unmarked dirs are ignored."""
        found = complete_checkpoints(self.directory)
        return found[-1] if found else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        extra: dict | None = None,
    ) -> Path:
        """Write a checkpoint of ``step`` and publish it once every rank has written.

        Ranks write into ``.tmp.step_N``; rank 0 then adds ``meta.json`` and the
        ``COMPLETE`` marker and renames the dir to ``step_N`` (atomic on one
        filesystem). A crash at any point before the rename leaves only a tmp dir,
        which ``latest`` ignores and the next save removes. Asynchronous: returns the
        path it will be published at while the write goes on (see the class).
        """
        if extra and "step" in extra:
            raise ValueError(
                "checkpoint extra must not hold 'step': save(step=...) sets it"
            )
        self.wait()
        rank, world_size = this_rank(), _world_size()
        final = self.path_for(step)
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}"

        rng_tensors, rng_scalars = _rng_state()  # before anything below draws from it
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_DSD_OPTIONS)
        model_tensors, model_objects = _split(model_sd)
        optim_tensors, optim_objects = _split(optim_sd)
        # every rank's (pipeline stages each hold their own parameters' entries)
        model_objects, optim_objects = _union(model_objects), _union(optim_objects)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "world_size": world_size,
            "torch_version": torch.__version__,
            "model_objects": _to_json(model_objects),
            "optim_objects": _to_json(optim_objects),
            "scheduler": None
            if scheduler is None
            else _to_json(scheduler.state_dict()),
            "extra": _to_json(dict(extra or {})),
        }
        json.dumps(meta)  # fails here, on every rank, if not JSON

        error = None
        if rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / RNG_DIR).mkdir(parents=True)
            except OSError as exc:
                error = exc
        all_agree(error, "setup")

        error = None
        try:
            save_file(
                rng_tensors,
                _rng_file(tmp, rank),
                metadata={"scalars": json.dumps(rng_scalars)},
            )
        except Exception as exc:
            error = exc
        all_agree(error, "RNG write")
        if self._writing is not None:
            self._writing(step)

        state = {"model": model_tensors, "optim": optim_tensors}
        writer = dcp.FileSystemWriter(tmp)
        with quiet_single_process(), dcp_errors(f"save to {tmp}"):
            if not self.async_save:
                dcp.save(state, storage_writer=writer)
                self._finish(tmp, final, meta)
                return final
            # Returns once the state is staged (copied); the write goes on behind.
            written = dcp.async_save(
                state, storage_writer=writer, process_group=self._group
            )
        self._pending = self._executor.submit(
            self._finish_after, written, tmp, final, meta
        )
        return final

    def wait(self) -> None:
        """Block until the background save in flight (if any) is published; raises
        its error, on every rank, if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with dcp_errors("background save"):
                pending.result()

    def _finish_after(
        self, written: Future, tmp: Path, final: Path, meta: dict
    ) -> None:
        written.result()  # every rank's shards and DCP's index are on disk
        self._finish(tmp, final, meta, self._group)

    def _finish(self, tmp: Path, final: Path, meta: dict, group: Any = None) -> None:
        """Checksum every file (ranks share the work), then rank 0 publishes and
        prunes. A collective over ``group``; raises on every rank if any failed."""
        sums, error = _digests(tmp, _files_of(tmp), group=group)
        all_agree(error, "checksum", group)

        error = None
        if this_rank() == 0:
            try:
                meta_text = json.dumps({**meta, CHECKSUMS: sums}, indent=1)
                self._publish(tmp, final, meta_text)
                self._prune()
            except Exception as exc:
                error = exc
        all_agree(error, "publish", group)

    def _publish(self, tmp: Path, final: Path, meta_text: str) -> None:
        """Marker last, then one rename: readers see all of a checkpoint or none of it."""
        _write_synced(tmp / META, meta_text)
        crc = zlib.crc32(meta_text.encode())
        _write_synced(tmp / MARKER, f"{META} crc32 {crc:08x}\n")
        _fsync_dir(tmp)
        if final.exists():  # saving a step again (e.g. after a resume): replace it
            old = final.with_name(f"{_OLD_PREFIX}{final.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.directory)

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop crashed tmp dirs."""
        drop_partial(self.directory)
        if self.keep_last:
            for path in complete_checkpoints(self.directory)[: -self.keep_last]:
                if path.is_symlink():  # the link goes, never what it points to
                    path.unlink()
                    continue
                # Unmark first so a crash mid-delete leaves an ignored dir.
                (path / MARKER).unlink()
                shutil.rmtree(path)

    def verify(self, path: str | Path) -> str | None:
        """Why the checkpoint at ``path`` is damaged, or None if it is intact: its
        ``meta.json`` checked (:func:`read_checkpoint_meta`), its files exactly those
        meta.json lists (regular files, none missing, none extra), each of the size
        and CRC-32 recorded, and its DCP index one of tensors stored in those files.
        A collective: each rank checks a share of the files and every rank gets the
        same answer."""
        path = Path(path)
        names, reason, meta = [], None, None
        try:
            meta = _read_meta(path)
            names = sorted(meta[CHECKSUMS])
            reason = _stray_files(path, names)
        except (_Damaged, OSError) as exc:
            reason = str(exc)
        got, error = _digests(path, names if reason is None else [], reason)
        if error is not None:
            return str(error)
        for name, want in sorted(meta[CHECKSUMS].items()):
            have = got[name]
            if have["bytes"] != want["bytes"]:
                return f"{name} has {have['bytes']} bytes, {want['bytes']} were written"
            if have["crc32"] != want["crc32"]:
                return f"{name} fails its checksum (corrupted)"
        try:
            _read_index(path, meta)
        except _Damaged as exc:
            return str(exc)
        return None

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        verify: bool = True,
    ) -> dict:
        """Restore a checkpoint into ``model``/``optimizer``/``scheduler`` in place.

        The model and optimizer may be sharded differently than when saved (any world
        size, any backend), but must have the same tensors with the same shapes.
        Per-rank RNG states are restored only when the world size is unchanged (they
        have no meaning otherwise). ``verify=False`` skips the checksums (the caller
        already ran :meth:`verify`); every value is still checked against the kind
        this run's own state holds before any is set. Returns
        ``{"step": step, **extra}``.
        """
        path = Path(path)
        meta = self._meta(path, verify)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_DSD_OPTIONS)
        model_tensors, model_objects = _split(model_sd)
        optim_tensors, optim_objects = _split(optim_sd)
        wanted = {"model": model_tensors, "optim": optim_tensors}
        with _as_error(path):
            index = _read_index(path, meta)
        _check_same_tensors(path, index, wanted)
        held = {
            "model_objects": set(_all_ranks(list(model_objects))),
            "optim_objects": set(_all_ranks(list(optim_objects))),
        }
        with _as_error(path):
            model_objects = json_like(
                _ours(meta, "model_objects", model_objects, held),
                model_objects,
                "model_objects",
            )
            optim_objects = json_like(
                _ours(meta, "optim_objects", optim_objects, held),
                optim_objects,
                "optim_objects",
            )
            if scheduler is not None:
                if meta["scheduler"] is None:
                    raise _Damaged("it holds no scheduler state")
                live = scheduler.state_dict()
                saved = {k: v for k, v in meta["scheduler"].items() if k in live}
                scheduler_state = json_like(saved, live, "scheduler", partial=True)
            rng = None
            if meta["world_size"] == _world_size():
                rng = _read_rng(_rng_file(path, this_rank()), path)
        _read_tensors(path, index, wanted)
        model_tensors.update(model_objects)
        optim_tensors.update(optim_objects)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_tensors,
            optim_state_dict=optim_tensors,
            options=_DSD_OPTIONS,
        )
        if scheduler is not None:
            scheduler.load_state_dict(scheduler_state)
        if rng is not None:
            _set_rng_state(*rng)
        else:
            warnings.warn(
                f"checkpoint {path.name} was written by {meta['world_size']} ranks and "
                f"is loaded on {_world_size()}: model and optimizer resharded, RNG "
                "states not restored (random streams will differ from the original run)",
                stacklevel=2,
            )
        return {**_from_json(meta["extra"]), "step": meta["step"]}

    def load_model(
        self, path: str | Path, model: nn.Module, verify: bool = True
    ) -> dict:
        """Restore only the model of a checkpoint (sample.py, eval.py), resharded onto
        ``model`` as :meth:`load` does; optimizer, scheduler and RNG states stay
        unread. Returns ``{"step": step, **extra}``."""
        path = Path(path)
        meta = self._meta(path, verify)
        model_tensors, objects = _split(
            get_model_state_dict(model, options=_DSD_OPTIONS)
        )
        wanted = {"model": model_tensors}
        with _as_error(path):
            index = _read_index(path, meta)
        _check_same_tensors(path, index, wanted)
        with _as_error(path):
            objects = json_like(meta["model_objects"], objects, "model_objects")
        _read_tensors(path, index, wanted)
        model_tensors.update(objects)
        set_model_state_dict(model, model_tensors, options=_DSD_OPTIONS)
        return {**_from_json(meta["extra"]), "step": meta["step"]}

    def _meta(self, path: Path, verify: bool) -> dict:
        """``meta.json`` of a complete checkpoint, checked; after :meth:`verify` if
        asked."""
        if not is_complete(path):
            raise FileNotFoundError(f"not a complete checkpoint: {path}")
        reason = self.verify(path) if verify else None
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {reason}")
        return read_checkpoint_meta(path)


@contextlib.contextmanager
def _as_error(path: Path) -> Iterator[None]:
    try:
        yield
    except _Damaged as exc:
        raise CheckpointError(f"checkpoint {path} is damaged: {exc}") from None


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


def _read_tensors(
    path: Path, index: Metadata, wanted: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Fill ``wanted`` (``{"model": ..., "optim": ...}``: this rank's possibly sharded
    tensors, which :func:`_check_same_tensors` found in ``index``) in place from the
    checkpoint whose checked DCP ``index`` is given."""
    try:
        with quiet_single_process():
            dcp.load(wanted, storage_reader=_SafeReader(path, index))
    except CheckpointException as exc:  # every rank's failures, gathered by DCP
        rank, (error, _) = min(exc.failures.items())
        what = _one_line(error)
        if isinstance(error, pickle.UnpicklingError):  # torch.load's long advice
            what = "bytes that torch.load(weights_only=True) refuses to unpickle"
        raise CheckpointError(
            f"checkpoint {path} is damaged: rank {rank} read "
            f"{type(error).__name__}: {what}"
        ) from None


def _check_same_tensors(
    path: Path, metadata: Metadata, wanted: dict[str, dict[str, torch.Tensor]]
) -> None:
    """CheckpointError naming the first tensor that the checkpoint and the model do
    not both have with the same (global) shape; model tensors first, in model order.
    DCP alone would ignore extra checkpoint entries and fail deep inside on the rest."""
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()}
    what = {"model": "the model", "optim": "the optimizer state"}
    # Each pipeline stage holds only its own tensors: what the checkpoint has beyond
    # them must be held by another rank.
    anywhere = set(_all_ranks([f"{s}.{k}" for s, ts in wanted.items() for k in ts]))
    for space, tensors in wanted.items():
        here = {f"{space}.{k}": tuple(t.size()) for k, t in tensors.items()}
        extra = [k for k in saved if k.startswith(f"{space}.") and k not in anywhere]
        problem = None
        for key, shape in here.items():
            name = key[len(space) + 1 :]
            if key not in saved:
                problem = (
                    f"{name} {list(shape)} is in {what[space]}, not the checkpoint"
                )
            elif saved[key] != shape:
                problem = (
                    f"{name} is {list(saved[key])} in the checkpoint "
                    f"and {list(shape)} in {what[space]}"
                )
            if problem:
                break
        if problem is None and extra:
            name = extra[0][len(space) + 1 :]
            problem = (
                f"{name} {list(saved[extra[0]])} is in the checkpoint, "
                f"not in {what[space]}"
            )
        if problem:
            raise CheckpointError(
                f"checkpoint {path} does not match this run: {problem} "
                "(resume with the model config it was saved with)"
            )


def _union(objects: dict[str, Any]) -> dict[str, Any]:
    """``objects`` of every rank merged (this rank's alone without ranks)."""
    if not _distributed() or _world_size() == 1:
        return objects
    everyone: list[dict] = [{} for _ in range(_world_size())]
    dist.all_gather_object(everyone, objects)
    return {k: v for objs in everyone for k, v in objs.items()}


def _ours(meta: dict, section: str, live: dict, held: dict[str, set]) -> Any:
    """A saved section of ``meta`` without the entries another rank holds (a
    pipeline stage's): what this rank's ``live`` state must match."""
    saved = meta[section]
    if type(saved) is not dict:
        return saved  # json_like names it
    return {k: v for k, v in saved.items() if k in live or k not in held[section]}


def _all_ranks(names: list[str]) -> list[str]:
    """``names`` of every rank together (this rank's alone without ranks)."""
    if not _distributed() or _world_size() == 1:
        return names
    everyone: list[list[str]] = [[] for _ in range(_world_size())]
    dist.all_gather_object(everyone, names)
    return [n for names in everyone for n in names]


def _files_of(root: Path) -> list[str]:
    """Every file of a checkpoint dir but the two written last (meta, marker)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name not in (META, MARKER)
    )


def _digest(path: Path) -> dict[str, Any]:
    size, crc = file_crc32(path)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def _digests(
    root: Path, names: list[str], error: str | None = None, group: Any = None
) -> tuple[dict[str, dict], BaseException | None]:
    """Size and CRC-32 of each named file under ``root``, every rank reading a share;
    every rank gets all of them, or the first failure (``error`` is this rank's own
    failure so far, passed on to all). A collective."""
    rank, world = this_rank(), _world_size()
    mine: dict[str, dict] = {}
    for name in names[rank::world] if error is None else ():
        try:
            mine[name] = _digest(root / name)
        except OSError as exc:
            error = f"{name}: {exc.strerror or exc}"
            break
    parts = [(mine, error)]
    if _distributed():
        parts = [None] * world
        dist.all_gather_object(parts, (mine, error), group=group)
    errors = [e for _, e in parts if e is not None]
    if errors:
        return {}, CheckpointError(errors[0])
    return {k: v for m, _ in parts for k, v in m.items()}, None


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
