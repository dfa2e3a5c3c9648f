"""The first things each command (train.py, sample.py, eval.py, export.py) does,
before its imports: importing torch, transformers and Hydra takes seconds, and a
Ctrl-C then raised KeyboardInterrupt inside the import machinery, a traceback of
importlib frames for a command that had done nothing; and, once they are done, the
last: the rank server is forked, so that those seconds are spent once, by this
process, instead of once per rank. This module imports nothing heavy."""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import sys
from multiprocessing import forkserver, resource_tracker
from typing import Any

#: The signals that stop a run after a checkpoint (src/trainer/faults.py); a rank
#: starts with them blocked until its own handler is in place.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)
_rank_server = False  # start_rank_server() ran in this process (its ranks fork)
_server_wanted = False  # and ranks may start: fork_rank_server() forks the server
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class _TorchaoImportNoise(logging.Filter):
    """Drops what importing torchao logs on a build whose compiled extensions do not
    load here (``Failed to load .../torchao/_C*.so``: a CPU, or another CUDA), its
    note that a CPU has no triton, and torch's deprecation note on torchao's own
    enums; every other record of those
    loggers (a real error) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if record.name == "torchao":
            return not (msg.startswith("Failed to load ") and "torchao/_C" in msg)
        if record.name == "torchao.kernel.intmm":  # peft's import of it, on a CPU
            return "Detected no triton" not in msg
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            msg.startswith("%s is an Enum subclass")
            and args
            and getattr(args[0], "__module__", "").startswith("torchao")
        )


def quiet_torchao() -> None:
    """Filter torchao's import noise (:class:`_TorchaoImportNoise`); called where
    torchao is imported (float8, and transformers' imports of it in src/models/hf.py
    and the commands), before it is. Idempotent."""
    for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoImportNoise) for f in logger.filters):
            logger.addFilter(_TorchaoImportNoise())


quiet_torchao()  # every command imports this module first, its ranks too


def _die_with_parent(parent: int) -> None:
    """This process is SIGKILLed by the kernel when ``parent``, its parent, ends
    (Linux's ``PR_SET_PDEATHSIG``, through ctypes; elsewhere nothing is asked); if
    it has ended already, this process ends now."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # it ended before the kernel was asked
        os._exit(1)


def die_with_launcher() -> None:
    """In a local rank (a process multiprocessing started: forked from the rank
    server, or spawned): end with the launcher, whatever ends it (``kill -9``, the
    OOM killer), instead of training on as an orphan. Two ways, either enough: the
    kernel kills this rank when its parent ends (the rank server, which the kernel
    kills when the launcher ends; or the launcher itself for a spawned rank); and a
    thread watches the pipe the launcher holds open to this rank
    (``multiprocessing.parent_process()``'s sentinel, at end of file once the
    launcher is gone, also if it was gone before this line ran) and kills this rank
    then. Nothing in a process multiprocessing did not start (the launcher's own
    rank, a torchrun rank)."""
    import threading

    launcher = multiprocessing.parent_process()
    if launcher is None:
        return
    _die_with_parent(os.getppid())

    def watch() -> None:
        launcher.join()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-launcher", daemon=True).start()


def _stop_while_starting(signum: int, frame: Any) -> None:
    sys.stderr.write(
        f"stopped by {signal.Signals(signum).name} while starting; nothing to resume\n"
    )
    raise SystemExit(128 + signum)


def quiet_ctrl_c() -> None:
    """Until :func:`started` (or the command's own handler), Ctrl-C ends the command
    with one line and exit status 130, wherever the imports are; and its exit skips
    the interpreter's last garbage collections (:func:`_leave_to_the_os`). Called only
    when the file runs as a script: importing it (a test, a spawned rank) changes
    nothing."""
    signal.signal(signal.SIGINT, _stop_while_starting)
    atexit.register(_leave_to_the_os)  # before the command's own: runs after them


def _leave_to_the_os() -> None:
    """At exit, after the command's own exit handlers (the rank server's end, weakref
    finalizers; logging's flush still follows): what is alive now is freed by the
    OS, not walked by the interpreter's final collections (~1 s of CPU in each
    command that imported torch and the project; a forked rank ends with
    ``os._exit`` and never paid it)."""
    gc.freeze()


def started() -> None:
    """The imports are done: Ctrl-C is Python's own again (KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _rank_preload() -> list[str]:
    """What the rank server imports: the command's module by name as well as
    ``__main__`` (CPython 3.11's forkserver skips a ``__main__`` preload: it looks
    for a ``main_path`` its preparation data never holds, so each forked rank
    imported torch and the project itself again, ~7 s of CPU a rank) and
    ``torch._dynamo``, which every rank imports at its first optimizer step
    (torch's ``_disable_dynamo``), ~3 s more."""
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    by_name = []
    if main_file and os.path.dirname(os.path.abspath(main_file)) in map(
        os.path.abspath, sys.path
    ):
        by_name.append(os.path.splitext(os.path.basename(main_file))[0])
    return ["__main__", *by_name, "torch._dynamo"]


def start_rank_server(ranks_key: str = "trainer.devices", given: bool = False) -> None:
    """Say that this command forks its local ranks from a rank server (started by
    :func:`fork_rank_server` once its imports are done), unless the command line
    says no rank starts here (:func:`_no_rank_starts`: ``ranks_key``, the command's
    key of its rank count; ``given``: one rank unless that key is given, as
    sample.py's, eval.py's and export.py's ``devices``). Not under torchrun, whose
    ranks are this command itself: there this process dies with torchrun's agent,
    its parent. Called first, before the imports."""
    global _rank_server, _server_wanted
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun rank: its parent is torchrun's agent, which a kill -9 ends
        # without ending its ranks; the kernel ends this one with it.
        _die_with_parent(os.getppid())
        return
    if "LOCAL_RANK" in os.environ:
        return
    _rank_server = True
    if _no_rank_starts(sys.argv[1:], ranks_key, given):  # planned as if they fork
        return
    _server_wanted = True
    multiprocessing.set_forkserver_preload(_rank_preload())  # if it must restart
    # The resource tracker (a process of its own) unlinks what a killed launcher
    # left registered (torch elastic's queues and event), as it should, but warns
    # `There appear to be N leaked semaphore objects` after the kill: it starts with
    # that warning ignored (-W from sys.warnoptions), and nothing else.
    sys.warnoptions.append(f"ignore:{_TRACKER_WARNING}:UserWarning")
    # Started first: starting it unblocks SIGINT and SIGTERM in this thread.
    resource_tracker.ensure_running()
    atexit.register(stop_rank_server)


def fork_rank_server() -> None:
    """Fork the process the local ranks are forked from, now that this command has
    imported torch, Hydra and the project and has run nothing yet (no thread, no
    OpenMP pool, no collective: what a fork copies is imports alone). A rank
    forked from it starts with them imported, as does every job of a sweep; the
    server imports ``torch._dynamo`` (every rank's first optimizer step would,
    ~1.7 s of CPU a rank) while this process validates and plans.

    It serves multiprocessing's forkserver protocol, so torch elastic starts ranks
    from it with ``start_method="forkserver"``; were it gone, multiprocessing
    would start a server of its own (a new interpreter importing
    :func:`_rank_preload`). Before, that new interpreter was the only server: it
    imported everything a second time beside this process's own imports (~4 s of
    CPU a launch). The kernel kills it when this process ends
    (:func:`_die_with_parent`), and its ranks die with it
    (:func:`die_with_launcher`). It runs with :data:`STOP_SIGNALS` blocked, which
    every rank inherits as a spawned rank inherited the launcher's mask
    (src/trainer/faults.py unblocks them once a rank's handler is in place) and
    Python's default handlers, as a new interpreter has them. A no-op unless
    :func:`start_rank_server` said ranks fork here, and where an import started a
    thread (a fork copies none, and a lock one held stays locked in the copy):
    multiprocessing then starts its own server at the first rank."""
    import threading

    server = forkserver._forkserver
    if not _server_wanted or server._forkserver_pid is not None:
        return
    if threading.active_count() > 1:  # an import started one: no fork of it
        return  # multiprocessing starts a server of its own at the first rank
    import socket
    from multiprocessing import connection

    sys.stdout.flush()
    sys.stderr.flush()
    launcher = os.getpid()
    address = connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # at EOF for the server once this process ends
        pid = os.fork()
        if pid == 0:  # the server
            code = 0
            try:
                os.close(alive_w)
                _die_with_parent(launcher)
                signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                for sig in STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                forkserver.main(listener.fileno(), alive_r, ["torch._dynamo"])
            except SystemExit:  # its end: every client (this process) gone
                pass
            except BaseException as err:  # no rank can start: say why, once
                code = 1
                sys.stderr.write(f"rank server failed: {err!r}\n")
            finally:
                os._exit(code)  # never this process's exit handlers
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def _no_rank_starts(argv: list[str], ranks_key: str, given: bool) -> bool:
    """The command line says no rank will fork (the plan alone, or one rank, which
    runs in this process): no server is forked.
    ``ranks_key``: the key of the rank count; ``given``: more than one rank only
    when that key is given."""
    said = dict(a.lstrip("+").lower().partition("=")[::2] for a in argv)
    ranks = said.get(ranks_key)
    return (
        said.get("trainer.plan_only") in ("true", "1")
        or ranks == "1"
        or (given and ranks is None)
    )


_TRACKER_WARNING = "resource_tracker"  # how its leak warning starts (no colon: -W)


def rank_start_method() -> str:
    """How local ranks start: forked from the rank server when the command starts
    one (:func:`start_rank_server`; a plan-only command plans its ranks so), else
    spawned (a library caller, a test: a new
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
