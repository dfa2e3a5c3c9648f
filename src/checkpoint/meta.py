"""``meta.json`` and the seal of a checkpoint: step, world size, the JSON sections
and the size and CRC-32 of every other file, written by rank 0 once every rank has
written; then ``COMPLETE``, holding meta.json's CRC-32. Read back, every field is
checked for type and range (:func:`read_checkpoint_meta`), a checksum entry may name
only a file inside the checkpoint, and the files present must be exactly those
listed. CRC-32 (zlib) rather than a cryptographic hash: it detects torn writes and
flipped bytes at memory speed; a forger can recompute it, which is why what is read
is checked as data without it (src/checkpoint/index.py for DCP's index).
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from src.checkpoint.damage import (
    CheckpointError,
    _bad_value,
    _Damaged,
    _is_int,
    _one_line,
)
from src.checkpoint.folders import INDEX, MARKER, META, step_of
from src.checkpoint.ranks import _distributed, _world_size, this_rank
from src.checkpoint.rng import _rng_file
from src.checkpoint.values import _to_json
from src.files import MAX_JSON, file_crc32, parse_json

# 2: meta.json holds per-file checksums; 3: the marker holds meta.json's CRC-32
FORMAT_VERSION = 3
_MARKER_TEXT = re.compile(rf"{re.escape(META)} crc32 ([0-9a-f]{{8}})\n")
CHECKSUMS = "checksums"
_CRC32 = re.compile(r"[0-9a-f]{8}")


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


def _new_meta(
    step: int,
    model_objects: dict[str, Any],
    optim_objects: dict[str, Any],
    scheduler: Any,
    extra: dict | None,
) -> dict:
    """meta.json of a save of ``step`` but its checksums (added once every file is
    written): the non-tensor state of every rank, as JSON. Fails on every rank if a
    value is not JSON."""
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": _world_size(),
        "torch_version": torch.__version__,
        "model_objects": _to_json(model_objects),
        "optim_objects": _to_json(optim_objects),
        "scheduler": None if scheduler is None else _to_json(scheduler.state_dict()),
        "extra": _to_json(dict(extra or {})),
    }
    json.dumps(meta)  # fails here, on every rank, if not JSON
    return meta


def _seal(directory: Path, meta_text: str) -> None:
    """Write meta.json, then the marker holding its CRC-32 (:data:`_MARKER_TEXT`),
    each synced to disk."""
    _write_synced(directory / META, meta_text)
    crc = zlib.crc32(meta_text.encode())
    _write_synced(directory / MARKER, f"{META} crc32 {crc:08x}\n")


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
