"""Damaged and forged files for the fuzz tests: a checkpoint's files cut, flipped,
retyped, or rewritten by a forger (who recomputes every checksum), with pickles whose
payload would create a marker file if any of their code ran."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

INDEX, META, MARKER = ".metadata", "meta.json", "COMPLETE"


class Payload:
    """Pickles as ``os.system('touch <marker>')``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _text(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def global_call(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling ``module``.``name``(arg) (STACK_GLOBAL: a dotted
    name is looked up attribute by attribute)."""
    return b"\x80\x04" + _text(module) + _text(name) + b"\x93" + _text(arg) + b"\x85R."


def build_on_class(module: str, cls: str, attribute: str) -> bytes:
    """A protocol-4 pickle whose BUILD sets ``attribute`` on the class
    ``module``.``cls`` itself (a slot state: ``setattr(cls, attribute, 1)``), which
    would last for the rest of the process."""
    return (
        b"\x80\x04"
        + _text(module)
        + _text(cls)
        + b"\x93N}"  # the class; no dict state; the slot state:
        + _text(attribute)
        + b"K\x01s\x86b."  # {attribute: 1}, (None, {...}), BUILD
    )


# ------------------------------------------------------------------ mutations


def truncate(fraction: float) -> Callable[[Path], None]:
    def cut(file: Path) -> None:
        data = file.read_bytes()
        file.write_bytes(data[: int(len(data) * fraction)])

    return cut


def flip(where: float) -> Callable[[Path], None]:
    def flip_byte(file: Path) -> None:
        data = bytearray(file.read_bytes())
        if data:
            i = min(len(data) - 1, int(len(data) * where))
            data[i] ^= 0x5A
        file.write_bytes(bytes(data))

    return flip_byte


def append(file: Path) -> None:
    file.write_bytes(file.read_bytes() + b"\x00junk")


def delete(file: Path) -> None:
    file.unlink()


def fill(byte: int) -> Callable[[Path], None]:
    def same_size(file: Path) -> None:
        file.write_bytes(bytes([byte]) * file.stat().st_size)

    return same_size


RAW = {
    "empty": truncate(0),
    "half": truncate(0.5),
    "last byte cut": truncate(0.999),
    "flip early": flip(0.05),
    "flip middle": flip(0.5),
    "flip late": flip(0.97),
    "append": append,
    "delete": delete,
    "0xff": fill(0xFF),
}

#: Damage any file format meets: nesting past a parser, and a file that is not one.
NOT_DATA = {
    "nested too deep": lambda f: f.write_text("[" * 100000 + "]" * 100000),
    "a directory": lambda f: [f.unlink(), f.mkdir()],
    "-> /dev/zero": lambda f: [f.unlink(), f.symlink_to("/dev/zero")],
}


# -------------------------------------------------------------------- forging


def reseal(ckpt: Path) -> None:
    """What a forger does after an edit: every checksum and the marker recomputed."""
    meta = json.loads((ckpt / META).read_text())
    sums = {}
    for name in meta.get("checksums", {}):
        file = ckpt / name
        if file.is_file() and not name.startswith(("/", "..")) and ".." not in name:
            data = file.read_bytes()
            sums[name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        else:
            sums[name] = meta["checksums"][name]
    meta["checksums"] = sums
    write_meta(ckpt, meta)


def write_meta(ckpt: Path, meta: object) -> None:
    """meta.json as given, with a marker that matches it (a forger's)."""
    text = json.dumps(meta, allow_nan=True)
    (ckpt / META).write_text(text)
    crc = zlib.crc32(text.encode())
    (ckpt / MARKER).write_text(f"{META} crc32 {crc:08x}\n")


def edit_meta(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def forge(ckpt: Path) -> None:
        meta = json.loads((ckpt / META).read_text())
        out = change(meta)
        write_meta(ckpt, meta if out is None else out)

    return forge


def edit_index(change: Callable[[object, Path], object]) -> Callable[[Path], None]:
    """Unpickle the index (trusted here: the test wrote it), change it, re-pickle,
    reseal."""

    def forge(ckpt: Path) -> None:
        with open(ckpt / INDEX, "rb") as f:
            md = pickle.load(f)
        out = change(md, ckpt)
        (ckpt / INDEX).write_bytes(pickle.dumps(md if out is None else out, 4))
        reseal(ckpt)

    return forge


def index_bytes(data: Callable[[Path], bytes]) -> Callable[[Path], None]:
    def forge(ckpt: Path) -> None:
        (ckpt / INDEX).write_bytes(data(ckpt))
        reseal(ckpt)

    return forge


def _append_payload(ckpt: Path, marker: Path) -> _StorageInfo:
    """A pickle with the payload appended to the shard; where it lies."""
    shard = ckpt / "__0_0.distcp"
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    return _StorageInfo(shard.name, offset, len(buf.getvalue()))


def rng_scalar(name: str, value: object) -> Callable[[Path], None]:
    """Rank 0's RNG file with the JSON scalar ``name`` set to ``value``, resealed."""

    def forge(ckpt: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        file = ckpt / "rng" / "rank_00000.safetensors"
        with safe_open(file, "pt") as f:
            scalars = json.loads(f.metadata()["scalars"])
        tensors = load_file(file)
        save_file(
            tensors, file, metadata={"scalars": json.dumps({**scalars, name: value})}
        )
        reseal(ckpt)

    return forge


def bytes_entry(marker: Path) -> Callable[[Path], None]:
    """The 0-d optimizer ``step`` entry turned into a bytes entry whose bytes are a
    pickle (DCP would hand them to torch.load(weights_only=False))."""

    def change(md, ckpt: Path) -> None:
        key = next(k for k in md.state_dict_metadata if k.endswith(".step"))
        md.state_dict_metadata[key] = BytesStorageMetadata()
        md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
        md.storage_data[MetadataIndex(key)] = _append_payload(ckpt, marker)

    return edit_index(change)


def shard_payload(marker: Path) -> Callable[[Path], None]:
    """A tensor's bytes in the shard replaced by a pickle with the payload (DCP reads
    tensors with weights_only=True)."""

    def change(md, ckpt: Path) -> None:
        md.storage_data[next(iter(md.storage_data))] = _append_payload(ckpt, marker)

    return edit_index(change)


def storage(**fields) -> Callable[[Path], None]:
    """Every storage entry's fields (relative_path, offset, ...) replaced."""

    def change(md, ckpt: Path) -> None:
        for k, v in md.storage_data.items():
            md.storage_data[k] = _StorageInfo(
                **{**{f: getattr(v, f) for f in v.__dataclass_fields__}, **fields}
            )

    return edit_index(change)


def chunk_outside(md, ckpt: Path) -> None:
    entry = next(v for v in md.state_dict_metadata.values() if len(v.size))
    entry.chunks[0].sizes = torch.Size([d + 1 for d in entry.size])


def chunks_gap(md, ckpt: Path) -> None:
    """A tensor's chunks that leave part of it uncovered (DCP would keep the model's)."""
    entry = next(v for v in md.state_dict_metadata.values() if v.size[0] > 1)
    entry.chunks[0].sizes = torch.Size([entry.size[0] - 1, *entry.size[1:]])


def chunks_none(md, ckpt: Path) -> None:
    next(v for v in md.state_dict_metadata.values() if len(v.size)).chunks.clear()


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ------------------------------------------------- work bombs (bounded reading)


def self_sharing(levels: int = 60) -> list:
    """A list holding itself twice per level (memo references: a few bytes a level
    pickled, 2**levels items to ``repr``, compare or hash)."""
    value: list = []
    for _ in range(levels):
        value = [value, value]
    return value


def shared_tuple_key(levels: int = 60) -> bytes:
    """A protocol-4 pickle of a dict whose key is a tuple holding itself twice per
    level: hashing it (SETITEM) takes 2**levels steps."""
    body = b"".join(
        b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94" for i in range(levels)
    )  # BINGET i twice, TUPLE2, MEMOIZE
    return b"\x80\x04)\x94" + body + b"}h" + bytes([levels]) + b"Ns."


def build_on_self_sharing(levels: int = 60) -> bytes:
    """BUILD on a self-sharing list (the refusal once showed it with ``repr``)."""
    return pickle.dumps(self_sharing(levels), 4)[:-1] + b"}b."


def huge_length(opcode: bytes) -> bytes:
    """A protocol-5 pickle whose first value declares 32 TiB (BINBYTES8,
    BINUNICODE8, BYTEARRAY8)."""
    return b"\x80\x05" + opcode + (1 << 45).to_bytes(8, "little") + b"x."


def many_chunks(md, ckpt: Path) -> None:
    """A 2-D tensor split into one column chunk per column, each stored: more
    chunks than the save had ranks (a million made the overlap check quadratic)."""
    key, entry = next(
        (k, v) for k, v in md.state_dict_metadata.items() if len(v.size) == 2
    )
    rows, cols = entry.size
    first = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[first]
    entry.chunks = [
        type(entry.chunks[0])(torch.Size([0, c]), torch.Size([rows, 1]))
        for c in range(cols)
    ]
    for c in range(cols):
        md.storage_data[MetadataIndex(key, torch.Size([0, c]))] = info


def linked_dir(ckpt: Path) -> None:
    """The checkpoint dir moved aside and linked in its place."""
    aside = ckpt.parent / f"aside-{ckpt.name}"
    ckpt.rename(aside)
    ckpt.symlink_to(aside)
