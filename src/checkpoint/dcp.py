"""Sharded checkpoints with atomic publish, verification, resume and resharding:
the :class:`Checkpointer` (the directory's layout: src/checkpoint/folders.py).

Model and optimizer go through DCP, so a checkpoint written by N ranks loads on M ranks
under any of FSDP2, FSDP1 (``use_orig_params=True``), DDP or a plain module. Only tensors
are given to DCP; every non-tensor value (optimizer hyperparameters, scheduler state,
extra) is stored as JSON.

Loading is strict and verified: a parameter, buffer or optimizer tensor that the
checkpoint and the model do not both have, or have with different shapes, is a
:class:`CheckpointError` naming the first one; every file is checked against the size
and checksum recorded at save (the work split over the ranks; a file no checksum
covers, a link or a device is damage), and ``resume=auto`` skips a checkpoint that
fails, saying why, for the newest one that passes (CRC-32, and why it is enough:
src/checkpoint/meta.py; what is read checked as data: meta.py, index.py, values.py,
rng.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from src.checkpoint.damage import CheckpointError, _as_error, _Damaged, _one_line
from src.checkpoint.folders import (
    _OLD_PREFIX,
    _TMP_PREFIX,
    MARKER,
    META,
    complete_checkpoints,
    deleting,
    drop_partial,
    is_complete,
    step_dir,
    step_of,
)
from src.checkpoint.index import _read_index
from src.checkpoint.meta import (
    CHECKSUMS,
    _digests,
    _files_of,
    _fsync_dir,
    _new_meta,
    _read_meta,
    _seal,
    _stray_files,
    read_checkpoint_meta,
)
from src.checkpoint.ranks import (
    _all_ranks,
    _distributed,
    _union,
    _world_size,
    all_agree,
    this_rank,
)
from src.checkpoint.rng import RNG_DIR, _read_rng, _rng_file, _rng_state, _set_rng_state
from src.checkpoint.values import (
    _from_json,
    _split,
    canonical_keys,
    json_like,
    own_keys,
    plain_tensors,
)

log = logging.getLogger(__name__)

#: What a checkpoint that does not match the model advises by default.
RESUME_HINT = "resume with the model config it was saved with"


# Flat optimizer keys ("state.<fqn>.exp_avg") reshard by name, like the model's.
_DSD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


#: What torch says on every FSDP1 (ShardedTensor) state dict, save and load, about
#: its own internals (~70 lines per save on a small model): nothing the user can act
#: on. Ignored process-wide (DCP's async save warns from its writer thread, where a
#: ``catch_warnings`` block would not reach).
_FSDP1_NOISE = (
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered with this ProcessGroup",
)
for _text in _FSDP1_NOISE:
    warnings.filterwarnings("ignore", message=re.escape(_text))


@contextlib.contextmanager
def dcp_errors(what: str) -> Iterator[None]:
    """DCP raises CheckpointException, a BaseException that ``except Exception`` misses.

    It already carries every rank's failure (DCP gathers them), so all ranks raise.
    """
    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"checkpoint {what} failed: {exc}") from exc


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


#: The figure in a checkpoint's ``extra`` that ranks it (``trainer.keep_best``,
#: ``ckpt=best``): the validation loss at its step, lower is better.
SCORE = "val_loss"


def checkpoint_score(path: Path) -> float | None:
    """The :data:`SCORE` recorded in the checkpoint at ``path`` (None: none, or its
    meta.json is damaged: such a checkpoint is never a best one)."""
    try:
        extra = read_checkpoint_meta(path)["extra"]
    except CheckpointError:
        return None
    value = extra.get(SCORE)
    if type(value) not in (int, float) or value != value or abs(value) == math.inf:
        return None
    return float(value)


def best_checkpoints(directory: str | Path, k: int) -> list[tuple[float, Path]]:
    """The ``k`` complete checkpoints in ``directory`` with the lowest score (the
    newer first among equal ones), best first, each with its score."""
    if k <= 0:
        return []
    scored = [(checkpoint_score(p), p) for p in complete_checkpoints(directory)]
    ranked = sorted(
        ((v, p) for v, p in scored if v is not None),
        key=lambda vp: (vp[0], -(step_of(vp[1]) or 0)),
    )
    return ranked[:k]


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

    ``keep_best``: the checkpoints with the ``keep_best`` lowest :data:`SCORE` (the
    ``val_loss`` the trainer records in ``extra``) are kept beside the newest
    ``keep_last``: pruning never deletes one of them (:func:`best_checkpoints`).
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 0,
        async_save: bool = False,
        writing: Callable[[int], None] | None = None,
        keep_best: int = 0,
    ):
        if keep_last < 0 or keep_best < 0:
            raise ValueError(
                f"keep_last and keep_best must be >= 0, got {keep_last}, {keep_best}"
            )
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
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
        return step_dir(self.directory, step)

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
        final = self.path_for(step)
        tmp = self.directory / f"{_TMP_PREFIX}{final.name}"

        rng_tensors, rng_scalars = _rng_state()  # before anything below draws from it
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_DSD_OPTIONS)
        (model_sd, _), (optim_sd, _) = (
            canonical_keys(model_sd),
            canonical_keys(optim_sd),
        )
        model_tensors, model_objects = _split(model_sd)
        optim_tensors, optim_objects = _split(optim_sd)
        model_tensors, optim_tensors = map(
            plain_tensors, (model_tensors, optim_tensors)
        )
        # every rank's (pipeline stages each hold their own parameters' entries)
        model_objects, optim_objects = _union(model_objects), _union(optim_objects)
        meta = _new_meta(step, model_objects, optim_objects, scheduler, extra)
        self._start(step, tmp, rng_tensors, rng_scalars)
        state = {"model": model_tensors, "optim": optim_tensors}
        return self._write(state, tmp, final, meta)

    def _start(
        self,
        step: int,
        tmp: Path,
        rng_tensors: dict[str, torch.Tensor],
        rng_scalars: dict[str, Any],
    ) -> None:
        """Rank 0 makes ``tmp`` afresh, then every rank writes its RNG states there
        and calls ``writing``. Collectives; each raises on every rank if any failed."""
        rank = this_rank()
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

    def _write(
        self, state: dict[str, dict], tmp: Path, final: Path, meta: dict
    ) -> Path:
        """DCP writes ``state`` into ``tmp``, published as ``final`` (with ``meta``)
        before this returns, or from the background with ``async_save``."""
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
        _seal(tmp, meta_text)
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
        """Keep the newest ``keep_last`` complete checkpoints and the ``keep_best``
        best; drop crashed tmp dirs."""
        drop_partial(self.directory)
        if self.keep_last:
            best = {p for _, p in best_checkpoints(self.directory, self.keep_best)}
            for path in complete_checkpoints(self.directory)[: -self.keep_last]:
                if path in best:
                    continue
                if path.is_symlink():  # the link goes, never what it points to
                    path.unlink()
                    continue
                with deleting(path) as free:
                    if not free:  # pruned at a later save, once the reader ends
                        log.info("keep_last: %s kept for now: it is being read", path)
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
        (model_sd, model_keys), (optim_sd, optim_keys) = (
            canonical_keys(model_sd),
            canonical_keys(optim_sd),
        )
        model_tensors, model_objects = _split(model_sd)
        optim_tensors, optim_objects = _split(optim_sd)
        wanted = {"model": model_tensors, "optim": optim_tensors}
        with _as_error(path):
            index = _read_index(path, meta)
        _check_same_tensors(path, index, wanted)
        optim_objects, added = _added_since(optim_objects, meta.get("optim_objects"))
        held = {
            "model_objects": set(_all_ranks(list(model_objects))),
            "optim_objects": set(_all_ranks(list(optim_objects))),
        }
        with _as_error(path):
            model_objects = _saved_objects(meta, "model_objects", model_objects, held)
            optim_objects = _saved_objects(meta, "optim_objects", optim_objects, held)
            if scheduler is not None:
                scheduler_state = _saved_scheduler(meta, scheduler)
            rng = None
            if meta["world_size"] == _world_size():
                rng = _read_rng(_rng_file(path, this_rank()), path)
        _read_tensors(path, index, wanted)
        model_tensors.update(model_objects)
        optim_tensors.update({**optim_objects, **added})
        set_state_dict(
            model,
            optimizer,
            model_state_dict=own_keys(model_tensors, model_keys),
            optim_state_dict=own_keys(optim_tensors, optim_keys),
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
        self,
        path: str | Path,
        model: nn.Module,
        verify: bool = True,
        hint: str = RESUME_HINT,
        fresh: Callable[[str], bool] | None = None,
    ) -> dict:
        """Restore only the model of a checkpoint (sample.py, eval.py,
        ``trainer.init_from``), resharded onto ``model`` as :meth:`load` does;
        optimizer, scheduler and RNG states stay unread. ``hint``: what a mismatch's
        error advises; ``fresh``: the tensors (by name) that stay as initialised
        where the checkpoint has none (new LoRA adapters on a trained model).
        Returns ``{"step": step, **extra}``."""
        path = Path(path)
        meta = self._meta(path, verify)
        state, keys = canonical_keys(get_model_state_dict(model, options=_DSD_OPTIONS))
        model_tensors, objects = _split(state)
        with _as_error(path):
            index = _read_index(path, meta)
        if fresh is not None:
            saved = index.state_dict_metadata
            model_tensors = {
                k: v
                for k, v in model_tensors.items()
                if not fresh(k) or f"model.{k}" in saved
            }
        wanted = {"model": model_tensors}
        _check_same_tensors(path, index, wanted, hint)
        with _as_error(path):
            objects = json_like(meta["model_objects"], objects, "model_objects")
        _read_tensors(path, index, wanted)
        model_tensors.update(objects)
        options = _DSD_OPTIONS
        if len(model_tensors) + len(objects) < len(state):  # some stay fresh
            options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        set_model_state_dict(model, own_keys(model_tensors, keys), options=options)
        return {**_from_json(meta["extra"]), "step": meta["step"]}

    def check_model(
        self, path: str | Path, model: nn.Module, hint: str = RESUME_HINT
    ) -> None:
        """CheckpointError naming the first tensor that ``model`` (a plain module,
        a meta-device build will do) and the checkpoint at ``path`` do not both have
        with the same shape; reads only the checked meta.json and DCP index."""
        path = Path(path)
        meta = self._meta(path, verify=False)
        with _as_error(path):
            index = _read_index(path, meta)
        tensors, _ = _split(canonical_keys(model.state_dict())[0])
        _check_same_tensors(path, index, {"model": tensors}, hint)

    def _meta(self, path: Path, verify: bool) -> dict:
        """``meta.json`` of a complete checkpoint, checked; after :meth:`verify` if
        asked."""
        if not is_complete(path):
            raise FileNotFoundError(f"not a complete checkpoint: {path}")
        reason = self.verify(path) if verify else None
        if reason is not None:
            raise CheckpointError(f"checkpoint {path} is damaged: {reason}")
        return read_checkpoint_meta(path)


def _read_tensors(
    path: Path, index: Metadata, wanted: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Fill ``wanted`` (``{"model": ..., "optim": ...}``: this rank's possibly sharded
    tensors, which :func:`_check_same_tensors` found in ``index``) in place from the
    checkpoint whose checked DCP ``index`` is given."""
    for attempt in range(2):
        try:
            with quiet_single_process():
                dcp.load(wanted, storage_reader=_SafeReader(path, index))
            return
        except CheckpointException as exc:  # every rank's failures, gathered by DCP
            rank, (error, _) = min(exc.failures.items())
        wrapped = isinstance(error, pickle.UnpicklingError) and _TORCHAO in str(error)
        if wrapped and attempt == 0 and _allow_float8_wrappers():
            continue  # every rank (each saw every rank's failures)
        break
    what = _one_line(error)
    if wrapped:  # never "damaged": it loads where torchao's float8 is imported
        named = re.search(r"GLOBAL ([\w.]+)", str(error))
        raise CheckpointError(
            f"checkpoint {path} holds torchao float8 weights (a precision=float8 "
            "run's, saved before checkpoints held plain tensors), which this run "
            f"cannot unpickle: on rank {rank} torch.load(weights_only=True) refused "
            f"{named.group(1) if named else _TORCHAO} (is torchao installed?)"
        ) from None
    if isinstance(error, pickle.UnpicklingError):  # torch.load's long advice
        what = "bytes that torch.load(weights_only=True) refuses to unpickle"
    raise CheckpointError(
        f"checkpoint {path} is damaged: rank {rank} read {type(error).__name__}: {what}"
    ) from None


#: The module of torchao's float8 weight wrapper in the pickles of checkpoints a
#: float8 run saved before they held plain tensors (:func:`plain_tensors`).
_TORCHAO = "torchao.float8"


def _allow_float8_wrappers() -> bool:
    """Let ``torch.load(weights_only=True)`` read torchao's float8 tensor classes
    (importing ``torchao.float8`` allowlists them, as a float8 run does); False
    without torchao. Copying such a tensor into a plain one copies its data."""
    try:
        from src.sharding.float8 import _torchao_float8

        _torchao_float8()
    except ImportError:
        return False
    return True


def _check_same_tensors(
    path: Path,
    metadata: Metadata,
    wanted: dict[str, dict[str, torch.Tensor]],
    hint: str = RESUME_HINT,
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
                f"checkpoint {path} does not match this run: {problem} ({hint})"
            )


#: A param group's flag: its parameters take no weight decay (src/trainer/optimizer.py).
#: A checkpoint saved before the flag existed holds it nowhere, and loads with this
#: run's.
NO_DECAY = "no_decay"


def _added_since(live: dict, saved: Any) -> tuple[dict, dict]:
    """``live`` optimizer objects split into those a checkpoint must hold, and the
    group flag a checkpoint saved before it existed holds nowhere (:data:`NO_DECAY`),
    which keeps this run's value; any other difference is still checked
    (:func:`_saved_objects`: one flag missing among others is damage)."""
    if not isinstance(saved, dict) or any(k.endswith(f".{NO_DECAY}") for k in saved):
        return live, {}
    added = {
        k: v
        for k, v in live.items()
        if k.startswith("param_groups.") and k.endswith(f".{NO_DECAY}")
    }
    return {k: v for k, v in live.items() if k not in added}, added


def _saved_objects(meta: dict, section: str, live: dict, held: dict[str, set]) -> dict:
    """This rank's part of a saved section of ``meta`` (:func:`_ours`), as Python
    values of the kinds ``live`` has (:func:`json_like`); _Damaged otherwise."""
    return json_like(_ours(meta, section, live, held), live, section)


def _saved_scheduler(meta: dict, scheduler: Any) -> dict:
    """The saved scheduler state: the entries ``scheduler``'s own state has, as
    Python values of the same kinds; _Damaged otherwise."""
    if meta["scheduler"] is None:
        raise _Damaged("it holds no scheduler state")
    live = scheduler.state_dict()
    saved = {k: v for k, v in meta["scheduler"].items() if k in live}
    # The public entries are what load_state_dict reads (torch's private ones vary
    # with its version): one missing was a KeyError in the ranks, naming no file.
    missing = [k for k in live if not k.startswith("_") and k not in saved]
    if missing:
        raise _Damaged(f"{META}: scheduler has no {missing[0]!r}")
    return json_like(saved, live, "scheduler", partial=True)


def _ours(meta: dict, section: str, live: dict, held: dict[str, set]) -> Any:
    """A saved section of ``meta`` without the entries another rank holds (a
    pipeline stage's): what this rank's ``live`` state must match."""
    saved = meta[section]
    if type(saved) is not dict:
        return saved  # json_like names it
    return {k: v for k, v in saved.items() if k in live or k not in held[section]}
