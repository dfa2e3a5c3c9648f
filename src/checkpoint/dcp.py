"""Sharded checkpoints with atomic publish, verification, resume and resharding.

Layout of a checkpoint directory (``trainer.ckpt_every`` writes one per save)::

    checkpoints/
      step_00000200/          published: renamed into place only once complete
        .metadata, __0_0.distcp, __1_0.distcp, ...   torch.distributed.checkpoint (DCP)
        rng/rank_00000.safetensors                    per-rank RNG states (tensors + JSON)
        meta.json                                     step, world size, scheduler, extra,
                                                      size and CRC-32 of every file above
        COMPLETE                                      completion marker, written last
      .tmp.step_00000300/     a save in progress (or one that crashed): never loaded

Model and optimizer go through DCP, so a checkpoint written by N ranks loads on M ranks
under any of FSDP2, FSDP1 (``use_orig_params=True``), DDP or a plain module. Only tensors
are given to DCP; every non-tensor value (optimizer hyperparameters, scheduler state,
extra) is stored as JSON and the DCP index is read with an allow-list unpickler, so
loading a checkpoint never runs arbitrary pickled code.

Loading is strict and verified: a parameter, buffer or optimizer tensor that the
checkpoint and the model do not both have, or have with different shapes, is a
:class:`CheckpointError` naming the first one; every file is checked against the size
and checksum recorded at save (the work split over the ranks), and ``resume=auto``
skips a checkpoint that fails, saying why, for the newest one that passes. CRC-32
(zlib) rather than a cryptographic hash: it detects torn writes and flipped bytes at
memory speed, and a checkpoint is not a security boundary (the unpickler above is).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
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
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from src.errors import RunError
from src.util import collective_device

MARKER = "COMPLETE"
META = "meta.json"
RNG_DIR = "rng"
FORMAT_VERSION = 2  # 2: meta.json holds per-file checksums
CHECKSUMS = "checksums"
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


# ----------------------------------------------------------- safe DCP metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP's ``.metadata`` index that only builds DCP's own records.

    DCP stores its index (tensor shapes, chunk offsets, file offsets) with pickle;
    this refuses every global outside that vocabulary instead of importing it.
    """

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (
            module
            in (
                "torch.distributed.checkpoint.metadata",
                "torch.distributed.checkpoint.planner",
            )
            or (module, name) in self._ALLOWED
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint: refusing to load {module}.{name} from a DCP index"
        )


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
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


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def is_complete(path: str | Path) -> bool:
    """A published checkpoint: a ``step_N`` dir holding the completion marker."""
    path = Path(path)
    return (
        _step_of(path) is not None
        and (path / MARKER).is_file()
        and (path / META).is_file()
    )


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest step first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=_step_of)


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
        f"no usable checkpoint in {found[0].parent} ({'; '.join(reasons)}); "
        "set trainer.resume=null to start over"
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
    """

    def __init__(
        self, directory: str | Path, keep_last: int = 0, async_save: bool = False
    ):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.async_save = async_save
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
        _write_synced(tmp / MARKER, "")
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
        for path in self.directory.iterdir():
            if path.name.startswith((_TMP_PREFIX, _OLD_PREFIX)):
                shutil.rmtree(path, ignore_errors=True)
        if self.keep_last:
            for path in complete_checkpoints(self.directory)[: -self.keep_last]:
                # Unmark first so a crash mid-delete leaves an ignored dir.
                (path / MARKER).unlink()
                shutil.rmtree(path)

    def verify(self, path: str | Path) -> str | None:
        """Why the checkpoint at ``path`` is damaged (a file missing, truncated or
        failing its checksum), or None if it is intact. A collective: each rank checks
        a share of the files and every rank gets the same answer. A checkpoint written
        before checksums existed (format 1) passes."""
        path = Path(path)
        expected, reason = {}, None
        try:
            expected = json.loads((path / META).read_text()).get(CHECKSUMS) or {}
        except (OSError, ValueError) as exc:
            reason = f"{META} unreadable ({exc})"
        got, error = _digests(path, sorted(expected), reason)
        if error is not None:
            return str(error)
        for name, want in sorted(expected.items()):
            have = got[name]
            if have["bytes"] != want["bytes"]:
                return f"{name} has {have['bytes']} bytes, {want['bytes']} were written"
            if have["crc32"] != want["crc32"]:
                return f"{name} fails its checksum (corrupted)"
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
        already ran :meth:`verify`). Returns ``{"step": step, **extra}``.
        """
        path = Path(path)
        meta = self._meta(path, verify)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_DSD_OPTIONS)
        model_tensors, _ = _split(model_sd)
        optim_tensors, _ = _split(optim_sd)
        _read_tensors(path, {"model": model_tensors, "optim": optim_tensors})
        model_tensors.update(_from_json(meta["model_objects"]))
        optim_tensors.update(_from_json(meta["optim_objects"]))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_tensors,
            optim_state_dict=optim_tensors,
            options=_DSD_OPTIONS,
        )
        if scheduler is not None:
            if meta["scheduler"] is None:
                raise ValueError(f"{path} holds no scheduler state")
            scheduler.load_state_dict(_from_json(meta["scheduler"]))

        if meta["world_size"] == _world_size():
            rng_path = _rng_file(path, this_rank())
            with safe_open(rng_path, framework="pt") as f:
                scalars = json.loads(f.metadata()["scalars"])
            _set_rng_state(load_file(rng_path), scalars)
        else:
            warnings.warn(
                f"checkpoint {path.name} was written by {meta['world_size']} ranks and "
                f"is loaded on {_world_size()}: model and optimizer resharded, RNG "
                "states not restored (random streams will differ from the original run)",
                stacklevel=2,
            )
        return {"step": meta["step"], **_from_json(meta["extra"])}

    def load_model(
        self, path: str | Path, model: nn.Module, verify: bool = True
    ) -> dict:
        """Restore only the model of a checkpoint (sample.py, eval.py), resharded onto
        ``model`` as :meth:`load` does; optimizer, scheduler and RNG states stay
        unread. Returns ``{"step": step, **extra}``."""
        path = Path(path)
        meta = self._meta(path, verify)
        model_tensors, _ = _split(get_model_state_dict(model, options=_DSD_OPTIONS))
        _read_tensors(path, {"model": model_tensors})
        model_tensors.update(_from_json(meta["model_objects"]))
        set_model_state_dict(model, model_tensors, options=_DSD_OPTIONS)
        return {"step": meta["step"], **_from_json(meta["extra"])}

    def _meta(self, path: Path, verify: bool) -> dict:
        """``meta.json`` of a complete checkpoint, after :meth:`verify` if asked."""
        if not is_complete(path):
            raise FileNotFoundError(f"not a complete checkpoint: {path}")
        reason = self.verify(path) if verify else None
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {reason}")
        return json.loads((path / META).read_text())


def _read_tensors(path: Path, wanted: dict[str, dict[str, torch.Tensor]]) -> None:
    """Fill ``wanted`` (``{"model": ..., "optim": ...}``: this rank's possibly sharded
    tensors) in place from the checkpoint, after checking that it holds exactly these
    tensors with these shapes."""
    try:
        metadata = _SafeReader(path).read_metadata()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    _check_same_tensors(path, metadata, wanted)
    with quiet_single_process(), dcp_errors(f"load from {path}"):
        dcp.load(wanted, storage_reader=_SafeReader(path))


def _check_same_tensors(
    path: Path, metadata: Metadata, wanted: dict[str, dict[str, torch.Tensor]]
) -> None:
    """CheckpointError naming the first tensor that the checkpoint and the model do
    not both have with the same (global) shape; model tensors first, in model order.
    DCP alone would ignore extra checkpoint entries and fail deep inside on the rest."""
    saved = {
        k: tuple(getattr(v, "size", ()) or ())
        for k, v in metadata.state_dict_metadata.items()
    }
    what = {"model": "the model", "optim": "the optimizer state"}
    for space, tensors in wanted.items():
        here = {f"{space}.{k}": tuple(t.size()) for k, t in tensors.items()}
        extra = [k for k in saved if k.startswith(f"{space}.") and k not in here]
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


def _files_of(root: Path) -> list[str]:
    """Every file of a checkpoint dir but the two written last (meta, marker)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and p.name not in (META, MARKER)
    )


def _digest(path: Path) -> dict[str, Any]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
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
