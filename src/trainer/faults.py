"""Faults a run survives, or reports in one line naming the culprit (docs/reliability.md).

- :func:`run_dir_lock`: one run per run dir. An exclusive ``flock`` on
  ``<run dir>/run.lock`` (the kernel drops it when the holder dies, so a stale lock
  is taken over); the file records the holder's host and PID for the message, and
  each rank's PID and start time (:func:`record_rank`): a lock whose launcher died
  is not taken over while one of its ranks lives.
- :class:`StopRequest`: SIGTERM, SIGINT, SIGHUP (and SIGUSR2, SLURM's advance warning)
  sent to any process of the run ask it to stop after the current step, with a
  checkpoint; a second signal stops at once (:class:`StopNow`).
  :func:`stop_signal` is the collective that makes every rank stop at the same step.
- :class:`Heartbeat`: every rank bumps a counter in the rendezvous store each second;
  after a collective times out, the ranks whose counter stopped moving are named.
- :func:`named_failures`: a collective timeout becomes :class:`PeerUnresponsive`, a
  peer's closed connection :class:`PeerExited` (both name the rank, its PID and
  host), a full disk :class:`DiskFull` ("no space left", and where).

Every :class:`RunError` is reported as its one-line message; the traceback stays in the
rank's error file (``<run dir>/ranks/...``), or inline with ``HYDRA_FULL_ERROR=1``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from src.checkpoint.export import HF_EXPORT_DIR
from src.checkpoint.folders import (
    complete_checkpoints,
    drop_partial,
    drop_unpublished,
    run_checkpoints,
    run_exports,
    saving_step,
)
from src.entry import STOP_SIGNALS
from src.errors import (
    FULL_ERROR_ENV,
    DiskFull,
    PeerExited,
    PeerUnresponsive,
    RunDirBusy,
    RunError,
    Stopped,
)
from src.files import atomic_path, free_space, interrupted_writes, parse_json
from src.observe.profiling import PROFILE_DIR

log = logging.getLogger(__name__)

# Set when the user asked for full tracebacks (HYDRA_FULL_ERROR=1, which the command
# line also sets for its own use): failures are then shown with their traceback, not
# one line.
LOCK_FILE = "run.lock"
RANK_REPORTS = "ranks"  # in the run dir: torchrun's logs and each rank's error report
#: Set by the launcher for ranks it restarts after a failure (elastic restart): the
#: failure's one-line report, which the restarted ranks say.
RESTART_CAUSE_ENV = "SHARDWRAP_RESTART_CAUSE"
HEARTBEAT_S = 1.0


def full_errors() -> bool:
    """Whether the user asked for tracebacks inline (``HYDRA_FULL_ERROR=1``; ``run_cli``
    sets that variable for itself too, so it records the user's choice separately)."""
    return os.environ.get(FULL_ERROR_ENV) == "1"


# ----------------------------------------------------------------- run-dir lock


def _holder() -> dict[str, Any]:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job}


def describe_holder(holder: dict[str, Any]) -> str:
    where = f"PID {holder.get('pid')} on {holder.get('host')}"
    return where + (f", job {holder['job']}" if holder.get("job") else "")


#: At most this much of ``run.lock`` is read: the holder's line and one line per
#: rank started under it (:func:`record_rank`).
_LOCK_READ = 1 << 20
#: How long a start waits for the ranks of a run whose launcher died to end (they
#: end with it: src/entry.py, ``die_with_launcher``) before it refuses the run dir.
ORPHAN_GRACE_S = 5.0
_held: set[str] = set()  # the run dirs this process holds (run_dir_lock)


def _lock_lines(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a lock file's lines (a damaged line is left out)."""
    out = []
    for line in data.splitlines():
        try:
            item = parse_json(line) if line.strip() else None
        except (ValueError, RecursionError):  # damaged: nothing to name
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


def _read_lock(fd: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The holder a lock file names (its first line) and the ranks it records."""
    try:
        data = os.pread(fd, _LOCK_READ, 0)
    except OSError:
        return None, []
    first, _, rest = data.partition(b"\n")
    holder = _lock_lines(first)
    return (holder[0] if holder else None), [
        r for r in _lock_lines(rest) if "rank" in r
    ]


def _read_holder(fd: int) -> dict[str, Any] | None:
    return _read_lock(fd)[0]


def _stat_fields(pid: Any) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first);
    None when there is no such process or no ``/proc``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` of this host started (clock ticks since boot, from
    ``/proc``), so a PID reused by another process is told apart; None if it is no
    live process (ended, or a zombie) or this system has no ``/proc``."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _lives(entry: dict[str, Any]) -> bool:
    """Whether the process a lock line records is still that process, on this host
    (another host's cannot be told: not counted)."""
    pid, started = entry.get("pid"), entry.get("start")
    if entry.get("host") != socket.gethostname() or type(pid) is not int or pid < 1:
        return False
    return started is not None and start_time(pid) == started


def live_ranks(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The ranks ``run.lock`` records that still run on this host: a run whose
    launcher is gone still lives while they do (its lock is free: the launcher held
    it)."""
    try:  # not through a link; a FIFO would block an open for reading
        fd = os.open(
            Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        )
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        return [r for r in _read_lock(fd)[1] if _lives(r)]
    finally:
        os.close(fd)


def holds(run_dir: str | os.PathLike) -> bool:
    """Whether this process holds ``run_dir`` (:func:`run_dir_lock`)."""
    return os.path.realpath(run_dir) in _held


def record_rank(run_dir: str | os.PathLike) -> None:
    """Add this rank (its PID and start time) to ``run.lock``, which its launcher
    holds: should the launcher die first, the lock is free, and these lines keep a
    later start from taking the run dir over while the rank lives. Appended, one
    line per rank (each a single write); nothing is created."""
    me = os.getpid()
    line = {**_holder(), "rank": int(os.environ.get("RANK", 0)), "pid": me}
    line["start"] = start_time(me)
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
    with contextlib.suppress(OSError):  # no lock file to write: nothing to record
        fd = os.open(Path(run_dir) / LOCK_FILE, flags)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)


def _orphans(fd: int, run_dir: str | os.PathLike) -> None:
    """RunDirBusy if ranks of the run that held the lock still live after
    :data:`ORPHAN_GRACE_S` (they die with their launcher; this waits for that)."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while alive := [r for r in _read_lock(fd)[1] if _lives(r)]:
        if time.monotonic() > deadline:
            pids = ", ".join(str(r["pid"]) for r in alive)
            raise RunDirBusy(
                f"run dir {run_dir} is in use: its launcher is gone but rank(s) of "
                f"its run still run (PID {pids} on {socket.gethostname()}); wait "
                f"for them to end or end them (kill {pids.replace(',', '')}), then "
                "start again"
            )
        time.sleep(0.1)


@contextlib.contextmanager
def run_dir_lock(run_dir: str | os.PathLike) -> Iterator[dict[str, Any] | None]:
    """Hold ``run_dir`` for this run; yields the previous holder if it died holding it
    (its lock is taken over), else None. Raises :class:`RunDirBusy` naming a live
    holder, or the live ranks of a run whose launcher died (:func:`record_rank`:
    a lock is never taken over while a process of its run lives). An elastic restart or SLURM requeue of the same job runs after its
    predecessor died, so it takes the lock over like any stale one."""
    path = Path(run_dir) / LOCK_FILE
    try:  # never through a link: it would truncate the file it points to
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644
        )
    except OSError as err:
        raise RunError(f"{path} cannot be the run's lock: {err.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunError(f"{path} cannot be the run's lock: not a regular file")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd) or {"pid": "?", "host": "?"}
            raise RunDirBusy(
                f"run dir {run_dir} is in use by another run ({describe_holder(holder)}); "
                "wait for it or stop it, or pick another hydra.run.dir"
            ) from None
        _orphans(fd, run_dir)
        stale = _read_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder()) + "\n").encode(), 0)
        _held.add(os.path.realpath(run_dir))
        try:
            yield stale
        finally:
            _held.discard(os.path.realpath(run_dir))
            os.ftruncate(fd, 0)  # empty: released by a run that ended (even failed)
    finally:
        os.close(fd)  # releases the flock


#: Where in a run dir the run's own writers use :func:`atomic_path` (the top level:
#: metrics, summary, data.json, eval.json; wandb's run id; the profiler's files).
#: Nothing else is looked into: the rest may be the user's.
_ATOMIC_DIRS = ("", "wandb", PROFILE_DIR)


def remove_interrupted_writes(run_dir: str | os.PathLike) -> list[Path]:
    """Remove what writes that did not finish (a full disk, a killed run) left in
    ``run_dir``: interrupted checkpoint saves (:func:`drop_partial`), an export
    being written (:func:`drop_unpublished`) and the temporary
    files of :func:`atomic_path` (their marker, a dead writer's PID) in the dirs the
    run writes them to (:data:`_ATOMIC_DIRS`, never a link); one line names them.
    Call it holding the run dir (:func:`run_dir_lock`): no other run writes there."""
    run_dir = Path(run_dir)
    removed = drop_partial(run_checkpoints(run_dir))
    removed += drop_unpublished(run_dir / HF_EXPORT_DIR)
    exports = run_exports(run_dir)
    for step in sorted(exports.iterdir()) if exports.is_dir() else ():
        removed += drop_unpublished(step / HF_EXPORT_DIR)
    for sub in _ATOMIC_DIRS:
        if sub and (run_dir / sub).is_symlink():
            continue
        for path in interrupted_writes(run_dir / sub):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning(
            "removed what writes that did not finish (a full disk, a killed run) "
            "left in %s: %s",
            run_dir,
            ", ".join(str(p.relative_to(run_dir)) for p in removed),
        )
    return removed


# ---------------------------------------------------------------- graceful stop

_requested = 0  # the first stop signal this process received
#: Set by the launcher for its ranks: the file it writes a stop signal to. Ranks learn
#: of a signal sent to the launcher alone from it, never from a second signal (a real
#: Ctrl-C reaches every process of the group already, and a second signal means "stop
#: at once").
STOP_FILE_ENV = "SHARDWRAP_STOP_FILE"
#: Test hook: comma-separated ``<point>[:<target>[:<SIGNAL>]]``. At that named point
#: rank 1 (the launcher for ``prepare``) sends a signal once: to its process group
#: (``group``, the default: SIGINT, as a Ctrl-C does), to the launcher alone
#: (``launcher``: SIGTERM, as a scheduler does) or to itself (``self``: SIGTERM). A
#: point is a name (its first occurrence) or ``<name><N>`` (of step N). See
#: tests/test_faults.py.
SIGNAL_AT_ENV = "SHARDWRAP_TEST_SIGNAL_AT"
_signalled: set[str] = set()


class StopNow(BaseException):
    """A second stop signal: stop at once, without the stop's checkpoint. Raised in
    the process that reports the stop (the launcher, or a rank with no peers), which
    then removes what the interrupted save left (:func:`stopped_at_once`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """While active, the first stop signal is remembered (``requested()``) and passed
    to ``forward``; a second one raises :class:`StopNow` (``at_once="raise"``: the
    process that reports the stop) or ends the process as the default action would
    (a rank among peers: they see its connection close).

    Entering it also unblocks the stop signals: a rank starts with them blocked (see
    :func:`ranks_start_blocked`), so a signal sent while it was starting waits for
    this handler instead of killing it half-imported."""

    def __init__(
        self, forward: Callable[[int], None] | None = None, at_once: str = "die"
    ) -> None:
        self._forward = forward
        self._raise = at_once == "raise"
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        global _requested
        _requested = 0
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        global _requested
        if _requested and self._raise:
            for sig in STOP_SIGNALS:  # the report of this one is not interrupted
                signal.signal(sig, signal.SIG_IGN)
            raise StopNow(signum)
        if _requested:
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
            signal.pthread_kill(threading.main_thread().ident, signum)
            return
        _requested = signum
        if self._forward is not None:
            self._forward(signum)


def stop_at_once(signum: int, frame: Any) -> None:
    """The stop signals' handler until the ranks start (:func:`stop_before_start`):
    one line, then ``SystemExit(128 + signal)`` (files and locks are closed)."""
    log.warning(resume_hint(None, "", signum))
    raise SystemExit(128 + signum)


_late = 0  # a stop signal that came once the run had completed


def finished_anyway(signum: int) -> None:
    """``signum`` came once the run's last step had passed: the run is complete and
    kept as one (exit 0, a requeue handler is not called); said in one line, and
    remembered (:func:`late_stop`): a multirun starts no further job."""
    global _late
    log.info(
        "%s arrived as the run finished; nothing was stopped",
        signal.Signals(signum).name,
    )
    _late = _late or signum


def after_the_run() -> None:
    """Once the run has completed, a stop signal until the command ends (or its next
    job starts) is :func:`finished_anyway`: it was the before-start handler's
    ``stopped ... before the first step`` and a traceback from wherever it landed."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: finished_anyway(signum))


def late_stop() -> int:
    """The stop signal that came after a run completed in this process (0: none)."""
    return _late


def stop_before_start() -> None:
    """Until the ranks start (or a :class:`StopRequest` takes over), a stop signal
    ends the command at once with one line: nothing has trained, nothing is lost."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_at_once)


@contextlib.contextmanager
def ranks_start_blocked(run_dir: str) -> Iterator[None]:
    """Around starting the ranks (inside a :class:`StopRequest`): they start with the
    stop signals blocked, so a Ctrl-C while they import stays pending until their own
    :class:`StopRequest` is in place (a spawned process inherits the signal mask).

    This thread blocks them while the ranks are spawned; a waiter thread takes each
    one and hands it to this thread's handler (``interrupt_main``), so the launcher
    still acts on it at once. multiprocessing's resource tracker unblocks SIGINT and
    SIGTERM when it starts, so it is started first. The stop file
    (:data:`STOP_FILE_ENV`) is where the handler tells the ranks."""
    import _thread
    from multiprocessing import resource_tracker

    stop_file = Path(run_dir) / ".stop_request"
    stop_file.unlink(missing_ok=True)
    os.environ[STOP_FILE_ENV] = str(stop_file)
    resource_tracker.ensure_running()
    done = threading.Event()

    def wait() -> None:
        while not done.is_set():
            info = signal.sigtimedwait(STOP_SIGNALS, 0.2)
            # After a SIGSTOP/SIGCONT of the launcher sigtimedwait can return a
            # record with a garbage si_signo; taking it killed this thread, and every
            # later stop signal stayed blocked until the ranks had finished.
            if info is not None and info.si_signo in STOP_SIGNALS:
                # Tell the ranks from here, at once: the main thread may be inside
                # the elastic agent's monitor sleep, where interrupt_main waits for
                # its next bytecode while the ranks run on past the step.
                tell_ranks(info.si_signo)
                _thread.interrupt_main(info.si_signo)

    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    waiter = threading.Thread(target=wait, name="stop-signals", daemon=True)
    waiter.start()
    try:
        yield
    finally:
        done.set()
        waiter.join()
        del os.environ[STOP_FILE_ENV]
        stop_file.unlink(missing_ok=True)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # pending: handled


def tell_ranks(signum: int) -> None:
    """The launcher's forward of a stop signal: written to the stop file, which every
    rank reads at the end of each step (:func:`stop_signal`)."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        with atomic_path(path) as tmp:
            tmp.write_text(str(signum))


def _told() -> int:
    path = os.environ.get(STOP_FILE_ENV)
    try:
        return int(Path(path).read_text()) if path else 0
    except (OSError, ValueError):
        return 0


_LAUNCHER = ("prepare", "finished")  # the points the launcher passes, not rank 1


def signal_point(name: str, step: int | None = None) -> None:
    """Test hook (:data:`SIGNAL_AT_ENV`): at the named point (of ``step``, if given),
    rank 1 (the launcher for ``prepare`` and ``finished``) sends the signal the variable names, once:
    to its whole process group, as a Ctrl-C in the terminal does; to itself; or to
    the launcher, then waits until the launcher has told the ranks, so the stop lands
    in this step. Nothing happens unless the variable names this point, nor in ranks
    an elastic restart started (once per run: they pass the point again)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return
    for item in os.environ.get(SIGNAL_AT_ENV, "").split(","):
        point, target, signame = (item.split(":") + ["", ""])[:3]
        if point not in (name, f"{name}{step}") or item in _signalled:
            continue
        if int(os.environ.get("RANK", -1)) != (-1 if name in _LAUNCHER else 1):
            return
        _signalled.add(item)
        target = target or "group"
        signum = getattr(
            signal, signame or ("SIGINT" if target == "group" else "SIGTERM")
        )
        if target == "group":
            os.killpg(os.getpgrp(), signum)
        elif target == "self":
            os.kill(os.getpid(), signum)
        else:
            _signal_launcher(signum)
        return


def _signal_launcher(signum: int) -> None:
    # A local rank's parent is the rank server; the launcher created its process
    # object. Under torchrun the rank is its agent's child.
    launcher = multiprocessing.parent_process()
    os.kill(launcher.pid if launcher else os.getppid(), signum)
    deadline = time.monotonic() + 600  # the launcher may be stopped (SIGSTOP) a while
    while not _told():
        if time.monotonic() > deadline:
            raise RuntimeError("test hook: the launcher never told the ranks to stop")
        time.sleep(0.01)


def stopped_by_signal(err: BaseException) -> bool:
    """Whether ``err`` is the exit of a run stopped by a stop signal (128 + signal)."""
    code = err.code if isinstance(err, SystemExit) else None
    return isinstance(code, int) and code - 128 in STOP_SIGNALS


def requested() -> int:
    """The stop signal this process received (0: none)."""
    return _requested


def stop_signal(device: torch.device) -> int:
    """The stop signal any rank received (0: none); a collective, so that every rank
    stops after the same step."""
    flag = torch.tensor([_requested or _told()], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def mean_and_stop(value: torch.Tensor) -> tuple[float, int]:
    """The mean over ranks of a per-rank scalar (as ``step.global_mean``) and the stop
    signal any rank received (as :func:`stop_signal`), in one all-reduce: a step's
    loss and its stop check share one collective (issue 55). The vector is ``[value,
    one slot per signal number]``, summed: element-wise, so the value's sum is
    global_mean's to the bit; a slot counts the ranks that received its signal, and
    the highest signal counted is stop_signal's MAX."""
    signum = _requested or _told()
    flags = torch.zeros(signal.NSIG, dtype=value.dtype, device=value.device)
    if 0 < signum < signal.NSIG:
        flags[signum] = 1
    both = torch.cat([value.detach().reshape(1), flags])
    world = 1
    if dist.is_initialized():
        world = dist.get_world_size()
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
    total, *counts = both.tolist()
    return total / world, max((i for i, n in enumerate(counts) if n), default=0)


def resume_hint(stop: Stopped | None, run_dir: str, signum: int = 0) -> str:
    """The one line a stopped run ends with (``stop``: what the ranks did; None: no
    rank had started training when ``signum`` came)."""
    if stop is None or stop.checkpoint is None:
        name = signal.Signals(stop.signum if stop else signum).name
        return f"stopped by {name} before the first step; nothing to resume"
    return f"{stop}: checkpoint {stop.checkpoint}; {_resume_with(run_dir)}"


def _resume_with(run_dir: str) -> str:
    return f"resume with python train.py hydra.run.dir={run_dir} trainer.resume=auto"


def stopped_at_once(signum: int, run_dir: str) -> str:
    """The one line of a run stopped by a second signal, once no rank is left
    writing: what the interrupted checkpoint left is removed (the line says which),
    and where the run resumes from."""
    directory = run_checkpoints(run_dir)
    dropped = [s for p in drop_partial(directory) if (s := saving_step(p)) is not None]
    name = signal.Signals(signum).name
    skipped = (
        f"the checkpoint of step {dropped[-1]} it was writing is skipped (removed)"
        if dropped
        else "no checkpoint written"
    )
    found = complete_checkpoints(directory)
    if not found:
        return f"stopped at once by a second {name}: {skipped}; nothing to resume"
    return (
        f"stopped at once by a second {name}: {skipped}; the newest checkpoint is "
        f"{found[-1]}; {_resume_with(run_dir)}"
    )


# ------------------------------------------------------------------- heartbeats


class Heartbeat:
    """A daemon thread that bumps ``heartbeat/<rank>`` in ``store`` every second
    (clock-free: readers compare counters, never timestamps across hosts)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._stop = threading.Event()
        store.set(f"heartbeat_who/{rank}", json.dumps(_holder()))
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the store is gone at shutdown
                self.store.add(f"heartbeat/{self.rank}", 1)
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self._stop.set()

    def silent_peers(self, window_s: float = 3 * HEARTBEAT_S) -> list[str]:
        """The other ranks whose counter did not move within ``window_s``, described
        as ``rank R (PID P on HOST)``."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        before = {r: self._count(r) for r in peers}
        time.sleep(window_s)
        out = []
        for r in peers:
            if self._count(r) == before[r]:
                who = json.loads(self.store.get(f"heartbeat_who/{r}"))
                where = f"PID {who['pid']} on {who['host']}{_local_state(who)}"
                out.append(f"rank {r} ({where})")
        return out

    def _count(self, rank: int) -> int:
        return self.store.add(f"heartbeat/{rank}", 0)


def _local_state(who: dict[str, Any]) -> str:
    """', stopped' / ', exited' when the process is on this host and we can tell."""
    if who.get("host") != socket.gethostname():
        return ""
    fields = _stat_fields(who["pid"])
    if fields is None:
        return ", exited"
    return ", process stopped" if fields[0] in "Tt" else ""


@contextlib.contextmanager
def named_failures(
    heartbeat: Heartbeat | None, run_dir: str, timeout_s: float
) -> Iterator[None]:
    """Turn a failed collective into the peer's failure, naming the rank(s) whose
    heartbeat stopped: :class:`PeerExited` when the peer's connection closed (it
    exited or was killed), :class:`PeerUnresponsive` when it timed out; and a full
    disk into :class:`DiskFull` saying where."""
    try:
        yield
    except RunError:
        raise
    except Exception as err:
        if _no_space(err):
            raise DiskFull(
                f"no space left on device writing to {run_dir} "
                f"({free_space(run_dir)} free): {_first_line(err)}"
            ) from err
        if heartbeat is not None and isinstance(err, RuntimeError):
            closed = _peer_closed(err)
            try:
                silent = heartbeat.silent_peers()
            except Exception:  # the rendezvous store went with the peer
                silent = []
            if closed:
                who = ", ".join(silent) or "a peer rank"
                raise PeerExited(
                    f"{who} is gone: its connection closed during a collective "
                    f"({closed})"
                ) from err
            if silent:
                raise PeerUnresponsive(
                    f"{', '.join(silent)} stopped responding: a collective timed out "
                    f"after trainer.timeout_s={timeout_s:g}"
                ) from err
        raise


#: How gloo and the store say a peer's socket closed (the peer exited or was killed).
_CLOSED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_closed(err: BaseException | None) -> str | None:
    """Which of :data:`_CLOSED` ``err`` (or its cause) says, if any."""
    while err is not None:
        closed = [c for c in _CLOSED if c in str(err)]
        if closed:
            return closed[0]
        err = err.__cause__ or err.__context__
    return None


def _no_space(err: BaseException) -> bool:
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def disk_full(run_dir: str) -> str | None:
    """A one-line 'no space left' report if the run dir's filesystem is (nearly) full."""
    try:
        full = shutil.disk_usage(run_dir).free < 2**20
    except OSError:
        return None
    return (
        f"no space left on device in {run_dir} ({free_space(run_dir)} free)"
        if full
        else None
    )


def run_error_names() -> set[str]:
    """Class names of every RunError (how a rank's error file names its exception)."""
    out, todo = set(), [RunError]
    while todo:
        cls = todo.pop()
        out.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return out


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
