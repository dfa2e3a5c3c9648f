"""DCP's index (``.metadata``, a pickle) read as data: an unpickler that builds
only an allow-list of exact (module, name) pairs of DCP's own records, in bounded
work and memory whatever the file holds, then a check of the whole: tensors only
(DCP would hand a bytes entry to ``torch.load(weights_only=False)``), every chunk
inside its tensor, the chunks covering it exactly once, each stored inside a
``.distcp`` file of the checkpoint, no stream transforms. DCP reads the tensors
themselves with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import collections
import contextlib
import importlib
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from src.checkpoint.damage import _bad_value, _Damaged, _is_int, _one_line, _shown
from src.checkpoint.folders import INDEX
from src.checkpoint.meta import CHECKSUMS


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
    if type(md) is not Metadata:
        raise _bad_value(INDEX, type(md).__name__, "a DCP Metadata")
    entries, storage = md.state_dict_metadata, md.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        raise _Damaged(f"{INDEX} has no tensor table or no storage table")
    for key, entry in entries.items():
        _check_entry(key, entry, storage, world_size)
    _check_storage(storage, entries, sizes)
    planner = md.planner_data
    if planner is not None and (
        type(planner) is not dict
        or not all(
            type(k) is str and type(v) is tuple and all(type(p) is str for p in v)
            for k, v in planner.items()
        )
    ):
        raise _bad_value(f"{INDEX}: planner_data", planner, "key paths")
    if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
        raise _bad_value(f"{INDEX}: storage_meta", md.storage_meta, "a StorageMeta")
    return md


def _check_entry(key: Any, entry: Any, storage: dict, world_size: int) -> None:
    """_Damaged unless ``key`` is a name and ``entry`` a tensor's: a dtype, a shape,
    at most one chunk per rank of the save, each checked by :func:`_check_chunk`,
    together covering the tensor exactly once."""
    if type(key) is not str or len(key) > 4096:
        raise _bad_value(f"{INDEX}: a key", key, "a name of at most 4096 characters")
    if type(entry) is not TensorStorageMetadata:
        raise _bad_value(f"{INDEX}: {key}", type(entry).__name__, "a tensor entry")
    props = entry.properties
    if type(props) is not TensorProperties or type(props.dtype) is not torch.dtype:
        raise _bad_value(f"{INDEX}: {key}'s properties", props, "a dtype")
    shape = _size(entry.size, f"{INDEX}: {key}'s size")
    if type(entry.chunks) is not list:
        raise _bad_value(f"{INDEX}: {key}'s chunks", entry.chunks, "a list")
    if len(entry.chunks) > world_size:
        # each rank saves at most one chunk of a tensor: more would only make
        # the overlap check below quadratic
        raise _bad_value(
            f"{INDEX}: {key}'s chunks",
            f"{len(entry.chunks):,} chunks",
            f"at most one per rank of the save ({world_size})",
        )
    for chunk in entry.chunks:
        _check_chunk(key, chunk, shape, storage)
    if not _tiles(shape, entry.chunks):
        # DCP leaves what no chunk covers as the model has it: silently unloaded
        raise _Damaged(f"{INDEX}: the chunks of {key} do not cover it exactly")


def _check_chunk(key: str, chunk: Any, shape: tuple[int, ...], storage: dict) -> None:
    """_Damaged unless ``chunk`` of tensor ``key`` (of ``shape``) lies inside it and
    has an entry in ``storage``."""
    if type(chunk) is not ChunkStorageMetadata:
        raise _bad_value(f"{INDEX}: {key}'s chunk", chunk, "a chunk")
    offsets = _size(chunk.offsets, f"{INDEX}: {key}'s chunk offsets")
    lengths = _size(chunk.sizes, f"{INDEX}: {key}'s chunk sizes")
    if (
        len(offsets) != len(shape)
        or len(lengths) != len(shape)
        or any(o + n > d for o, n, d in zip(offsets, lengths, shape, strict=True))
    ):
        raise _Damaged(f"{INDEX}: a chunk of {key} lies outside its tensor")
    if MetadataIndex(key, offsets) not in storage:
        raise _Damaged(f"{INDEX}: a chunk of {key} is stored nowhere")


def _check_storage(storage: dict, entries: dict, sizes: dict[str, int]) -> None:
    """_Damaged unless every entry of ``storage`` is a chunk of a tensor of
    ``entries`` stored within the recorded size (``sizes``) of a ``.distcp`` file
    of the checkpoint, with no stream transform."""
    data_files = {
        n: b for n, b in sizes.items() if "/" not in n and n.endswith(".distcp")
    }
    for index, info in storage.items():
        if type(index) is not MetadataIndex or index.fqn not in entries:
            raise _bad_value(f"{INDEX}: a storage key", index, "a tensor's chunk")
        if (
            type(info) is not _StorageInfo
            or type(info.relative_path) is not str
            or info.relative_path not in data_files
        ):
            raise _bad_value(
                f"{INDEX}: {index.fqn}'s file",
                getattr(info, "relative_path", info),
                "a .distcp file of the checkpoint",
            )
        if not (_is_int(info.offset) and _is_int(info.length)) or (
            info.offset + info.length > data_files[info.relative_path]
        ):
            raise _Damaged(f"{INDEX}: {index.fqn} lies outside {info.relative_path}")
        if info.transform_descriptors:
            raise _bad_value(
                f"{INDEX}: {index.fqn}'s transforms",
                info.transform_descriptors,
                "none",
            )


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
