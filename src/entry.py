"""The first things each command (train.py, sample.py, eval.py) does, before its
imports: importing torch, transformers and Hydra takes seconds, and a Ctrl-C then
raised KeyboardInterrupt inside the import machinery, a traceback of importlib frames
for a command that had done nothing; and the rank server starts, so that those
seconds are spent once, alongside this process's own imports, instead of once per
rank after them. This module imports nothing heavy."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver, resource_tracker
from typing import Any

#: The signals that stop a run after a checkpoint (src/trainer/faults.py); a rank
#: starts with them blocked until its own handler is in place.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
_rank_server = False  # start_rank_server() ran in this process


def _stop_while_starting(signum: int, frame: Any) -> None:
    sys.stderr.write(
        f"stopped by {signal.Signals(signum).name} while starting; nothing to resume\n"
    )
    raise SystemExit(128 + signum)


def quiet_ctrl_c() -> None:
    """Until :func:`started` (or the command's own handler), Ctrl-C ends the command
    with one line and exit status 130, wherever the imports are. Called only when the
    file runs as a script: importing it (a test, a spawned rank) changes nothing."""
    signal.signal(signal.SIGINT, _stop_while_starting)


def started() -> None:
    """The imports are done: Ctrl-C is Python's own again (KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def start_rank_server() -> None:
    """Start the process the local ranks are forked from, importing this command
    (``__main__`` and so everything it imports) while this process does the same.
    A spawned rank imported torch, Hydra and the project itself after the launcher
    had (about 4 s of CPU per rank, all ranks at once); forked from this server a
    rank starts with them imported, and a sweep's jobs share the one server. It has
    run nothing but imports, so nothing is forked mid-way (no threads, no OpenMP
    pool). It starts with :data:`STOP_SIGNALS` blocked, which every rank inherits as
    a spawned rank inherited the launcher's mask (src/trainer/faults.py unblocks
    them once a rank's handler is in place). Not under torchrun, whose ranks are
    this command itself. :func:`stop_rank_server` ends it when no rank will start
    here (one rank, plan-only, a config error)."""
    global _rank_server
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return
    _rank_server = True
    multiprocessing.set_forkserver_preload(["__main__"])
    # Started first: starting it unblocks SIGINT and SIGTERM in this thread.
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    atexit.register(stop_rank_server)


def rank_start_method() -> str:
    """How local ranks start: forked from the rank server when the command started
    one (:func:`start_rank_server`), else spawned (a library caller, a test: a new
    interpreter that imports what the rank needs)."""
    return "forkserver" if _rank_server else "spawn"


def stop_rank_server() -> None:
    """End the rank server at once if it runs (its ranks, if any, are not its to
    end: they are the launcher's children in all but name)."""
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # it may still be importing: no waiting for it
    except ProcessLookupError:
        pass
    server._stop()
