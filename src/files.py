"""Reading and writing files as data: atomic writes, strict JSON and YAML reads
(bounded, checked where read), CRC-32 sums, free space and writability checks,
keeping a damaged file aside."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import stat
import tempfile
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

#: The temporary name :func:`atomic_path` writes ``<name>`` under:
#: ``<name>.tmp-shardwrap-<PID>``, a marker only this project's writers use, so a
#: clean-up never takes a user's own ``notes.txt.tmp-20240101`` for one.
ATOMIC_MARK = ".tmp-shardwrap-"


_ATOMIC_TMP = re.compile(r".+" + re.escape(ATOMIC_MARK) + r"(\d+)")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; renamed onto ``path`` when
    the block succeeds (readers never see half a file), removed when it fails (a
    killed writer's stays: :func:`interrupted_writes` finds it)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{ATOMIC_MARK}{os.getpid()}")  # one per writer
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def interrupted_writes(directory: str | os.PathLike) -> list[Path]:
    """The temporary files :func:`atomic_path` left in ``directory`` (not below it):
    regular files named as it names them whose writer is no process on this host."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _ATOMIC_TMP.fullmatch(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                if not _alive(int(match.group(1))):
                    found.append(Path(entry.path))
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's (or not a PID: keep it)
    return True


def unwritable(directory: str | os.PathLike) -> str | None:
    """Why the directory ``directory`` cannot be written, or None; created first if
    missing, as its writer would. A file is written to find out: to root,
    ``os.access`` says yes to any directory, also on /proc or /sys, where nothing
    can be created."""
    directory = os.path.abspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        above = directory
        while not os.path.lexists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            return f"{above} is not a directory"
        return f"cannot create {err.filename or directory} ({err.strerror})"
    try:
        with tempfile.TemporaryFile(dir=directory) as probe:
            # Creating a file needs no free block: a full disk is found by writing.
            probe.write(b"\0" * _PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
            return None
    except OSError as err:
        if err.errno == errno.ENOSPC:
            return f"no space left on device ({free_space(directory)} free)"
        return f"cannot create a file in it ({err.strerror})"


_PROBE_BYTES = 64 << 10  # what unwritable() writes to find a full disk


def free_space(path: str | os.PathLike) -> str:
    """The free space of ``path``'s file system, for a message ("12.5 MiB")."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown space"
    return f"{free / 2**20:.1f} MiB"


def parse_json(data: bytes) -> Any:
    """``data`` as strict JSON: UTF-8, no NaN or Infinity, no number that overflows
    a float, no nesting deeper than the parser; ValueError in one line otherwise."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text} does not fit a float")
        return value

    try:
        return json.loads(data.decode(), parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise ValueError("nested deeper than the JSON parser goes") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


#: The largest JSON file :func:`read_json` reads (the project's own are KiBs to a
#: few MiB); a larger one is refused by its size, before it is read into memory.
MAX_JSON = 256 << 20


def read_json(path: str | os.PathLike) -> Any:
    """The strict JSON (:func:`parse_json`) in the regular file ``path`` of at most
    :data:`MAX_JSON` bytes; OSError or ValueError in one line otherwise."""
    if not os.path.isfile(path):
        raise OSError(f"{path} is missing or not a regular file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_JSON:  # a sparse file of 100 GB is free to plant
            raise ValueError(f"{size:,} bytes, over the {MAX_JSON:,} read")
        return parse_json(f.read())


def read_json_object(path: str | os.PathLike) -> dict:
    """:func:`read_json` of a file that must hold a JSON object (ValueError if not)."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def read_yaml(path: str | os.PathLike, kind: str = "mapping") -> Any:
    """The YAML in the regular file ``path`` (OmegaConf's loader, yaml's safe one:
    data, never code) if it is a ``kind``: ``mapping`` (a DictConfig) or ``list``
    (of strings: a plain list, ``${...}`` left as written); ValueError naming the
    file in one line otherwise."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing or not a regular file")
    try:
        data = OmegaConf.load(path)
    except Exception as exc:  # yaml's, OmegaConf's and decoding errors alike
        what = " ".join(str(exc).split())
        raise ValueError(f"{path} is damaged ({type(exc).__name__}: {what})") from None
    if kind == "list":
        # unresolved: Hydra records an override's ${...} as given (a ListConfig
        # would resolve it against the list itself and fail)
        if isinstance(data, ListConfig):
            data = OmegaConf.to_container(data, resolve=False)
        ok = isinstance(data, list) and all(isinstance(v, str) for v in data)
    else:
        ok = isinstance(data, DictConfig)
    if not ok:
        raise ValueError(
            f"{path} is damaged (not a YAML {kind}{' of strings' * (kind == 'list')})"
        )
    return data


def keep_aside(path: str | os.PathLike, copy: bool = False) -> Path:
    """Move (or ``copy``) the damaged file ``path`` to ``<name>.damaged-<n>`` next to
    it, a name not taken yet, so a record is never lost to its rewrite; returns it."""
    path = Path(path)
    n = 1
    while (aside := path.with_name(f"{path.name}.damaged-{n}")).exists():
        n += 1
    if copy:
        shutil.copy2(path, aside)
    else:
        path.rename(aside)
    return aside


#: The files a run opens at its run dir's top level (and ``<command>.log``, Hydra's
#: job log): each a regular file, never a directory.
_RUN_FILES = (
    "run.lock",
    "metrics.jsonl",
    "metrics.csv",
    "summary.json",
    "eval.json",
    "data.json",
    "job_status.json",
)


#: Devices a run's file may link to: what is written there is discarded, or
#: refused as on a full disk (tests/test_faults.py's full-disk run writes there).
_SINKS = ("/dev/null", "/dev/full")


def planted_file(run_dir: str | os.PathLike, subdirs: Sequence[str]) -> str | None:
    """Why a file the run would open in place in ``run_dir`` (``run.lock``,
    ``train.log``, ``metrics.jsonl`` appended to, an error report) could be another
    file, or None: a symbolic link (the run would truncate or append to what it
    points to, outside the run dir) or a FIFO, device or socket (the run would block
    on it), at its top level or under ``subdirs``. A directory that is a link
    (``checkpoints`` on another disk) is not one, nor a link to ``/dev/null`` or
    ``/dev/full``."""

    def problem(path: str) -> str | None:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return None
        rel = os.path.relpath(path, run_dir)
        if stat.S_ISLNK(mode):
            if os.path.isdir(path) or os.path.realpath(path) in _SINKS:
                return None
            return f"{rel} is a symbolic link (to {os.readlink(path)})"
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"{rel} is not a regular file"
        return None

    if not os.path.isdir(run_dir):
        return None
    with os.scandir(run_dir) as entries:
        top = sorted(e.path for e in entries)
    for path in top:
        if reason := problem(path):
            return reason
        name = os.path.basename(path)
        if (name in _RUN_FILES or name.endswith(".log")) and os.path.isdir(path):
            return f"{name} is a directory, not the file the run writes there"
    for sub in subdirs:
        root = os.path.join(run_dir, sub)
        if os.path.islink(root) or not os.path.isdir(root):
            continue
        for dirpath, dirs, files in os.walk(root):
            for name in sorted(dirs + files):
                if reason := problem(os.path.join(dirpath, name)):
                    return reason
    return None


def file_crc32(path: str | os.PathLike) -> tuple[int, int]:
    """Size and CRC-32 (zlib) of the file ``path``, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def json_default(value: Any) -> Any:
    """For ``json.dumps(default=...)``: dtypes, devices, paths as readable strings."""
    return str(value)


def finite_json(data: Any) -> Any:
    """``data`` with every float that is NaN or infinite as None (JSON's null): what
    :func:`parse_json` reads back (Python's ``json`` writes them as ``NaN`` and
    ``Infinity``, which are not JSON)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, Mapping):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite_json(v) for v in data]
    return data


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as indented, strict JSON (a NaN or infinite float as null:
    :func:`finite_json`), atomically (see :func:`atomic_path`), so that
    :func:`read_json` reads it back."""
    text = json.dumps(
        finite_json(data), indent=2, default=json_default, allow_nan=False
    )
    with atomic_path(path) as tmp:
        tmp.write_text(text)
