"""Where checkpoints live and which of them count.

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

A ``step_N`` dir being replaced by a save of the same step is ``.old.step_N`` while
the new one takes its place (:func:`drop_partial` puts it back if the save stopped).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from src.checkpoint.damage import CheckpointError

MARKER = "COMPLETE"
META = "meta.json"
INDEX = ".metadata"  # DCP's index of tensors, chunks and file offsets (a pickle)
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP_PREFIX = ".tmp."
_OLD_PREFIX = ".old."


def run_checkpoints(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def run_exports(run_dir: str | Path) -> Path:
    """Where a run keeps the exports of its steps (``trainer.export_every``, export.py):
    one ``step_N`` dir each, as :func:`step_dir` names them."""
    return Path(run_dir) / "exports"


def step_dir(directory: str | Path, step: int) -> Path:
    """The ``step_N`` dir of ``step`` under ``directory`` (checkpoints, exports)."""
    return Path(directory) / f"step_{step:08d}"


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


#: descriptors of the checkpoints this process reads (:func:`hold`)
_held: list[int] = []


def hold(path: str | Path) -> bool:
    """Hold the checkpoint at ``path`` for reading until this process ends, or the
    :func:`reading` it is in does (sample.py, eval.py): a shared ``flock`` on its
    directory, so ``trainer.keep_last`` pruning by a live run leaves it in place
    (:func:`deleting`). False when it is no longer a complete checkpoint (pruned
    before the hold was taken): pick again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    with contextlib.suppress(OSError):  # a file system without flock: unguarded
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a prune under way
    if not is_complete(path):
        os.close(fd)
        return False
    _held.append(fd)
    return True


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """The holds (:func:`hold`) taken inside it are released at its end: a command's
    reading of a run (sample.py, eval.py), also when it runs in a longer process."""
    start = len(_held)
    try:
        yield
    finally:
        while len(_held) > start:
            os.close(_held.pop())


@contextlib.contextmanager
def deleting(path: Path) -> Iterator[bool]:
    """Whether the checkpoint at ``path`` may be deleted now (no reader holds it:
    :func:`hold`); held exclusively while the caller deletes it, so a reader that
    comes meanwhile waits and then finds it gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    except OSError:  # a file system without flock: no reader is known
        pass
    try:
        yield True
    finally:
        os.close(fd)


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
    what = (
        f"not a complete checkpoint (a step_N directory with a {MARKER} marker) nor "
        "a directory holding one"
        if path.exists()
        else "no such file or directory"
    )
    raise FileNotFoundError(f"trainer.resume: {str(path)!r}: {what}")


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


# ------------------------------------------------ directories published whole
#: Where a directory published whole (the ``hf/`` export) is written before its
#: rename, and where the copy it replaces waits until the new one is in place: names
#: only this project gives (src/files.py's marker), found and undone at the next
#: start (:func:`drop_unpublished`).
_ASIDE = ".tmp-shardwrap-dir"
_REPLACED = ".old-shardwrap-dir"


def aside(final: str | Path) -> Path:
    """Where ``final`` is written before :func:`publish` renames it into place."""
    final = Path(final)
    return final.with_name(final.name + _ASIDE)


def publish(final: str | Path) -> None:
    """Rename :func:`aside` onto ``final`` (a copy there is replaced): a reader, or
    a kill at any moment, never finds half a directory under the final name."""
    final = Path(final)
    old = final.with_name(final.name + _REPLACED)
    if os.path.lexists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(aside(final), final)
    shutil.rmtree(old, ignore_errors=True)


def drop_unpublished(final: str | Path) -> list[Path]:
    """Undo what an interrupted :func:`publish` of ``final`` left (call it while
    nothing writes there): the copy being written goes; a replaced copy goes if the
    new one is in place, else it is put back. Returns the paths removed."""
    final, removed = Path(final), []
    old = final.with_name(final.name + _REPLACED)
    for path in (aside(final), old):
        if not os.path.lexists(path) or os.path.islink(path):
            continue
        if path == old and not os.path.lexists(final):
            os.rename(old, final)  # the new copy never took its place
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
