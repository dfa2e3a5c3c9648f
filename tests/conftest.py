"""Session-wide test settings, and the process state each test leaves as it found it
(issue 55: a suite that passes in any order; `python -m pytest -p randomly
--randomly-seed=N --randomly-dont-reset-seed` runs it shuffled, pyproject.toml)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist


def pytest_configure(config):
    """A suite started in the background (``nohup python -m pytest ... &``: a shell
    without job control starts it with SIGINT ignored, and every process it starts,
    the xdist workers, train.py and its ranks, inherits that) runs as from a terminal
    or CI: Python's own Ctrl-C handler. (That inherited SIGINT, not a test, was the
    worker "left with SIGINT ignored" of tests/test_cli.py's comment.)"""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _share_the_cores(config)


def _share_the_cores(config) -> None:
    """Each test process (an xdist worker, and every train.py it starts) gets its
    share of the cores as intra-op threads (``OMP_NUM_THREADS``, unless set):
    two workers of 2 threads on 2 cores made OpenMP's threads wait for each other
    (the in-process model tests took 16% longer). Multi-rank runs already get
    cores // ranks; the tests of that default clear the variable themselves."""
    if "OMP_NUM_THREADS" in os.environ or hasattr(config, "workerinput"):
        return  # the user's; or a worker, which inherits the controller's
    from src.planner.profiles import available_cores

    workers = getattr(config.option, "numprocesses", None) or 1
    workers = workers if isinstance(workers, int) else available_cores()
    threads = max(1, available_cores() // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _token_cache_in_tmp(tmp_path_factory):
    """The token cache (data.cache_dir's default, $SHARDWRAP_CACHE) of every test and
    of the train.py subprocesses they start lives in a session tmp dir, not ~/.cache.
    The device profiles (and op times) have their own dir there, which a test that
    points $SHARDWRAP_CACHE elsewhere keeps: it found none and ran the CPU probe
    (25-47 s a test)."""
    cache = tmp_path_factory.mktemp("token_cache")
    os.environ["SHARDWRAP_CACHE"] = str(cache)
    os.environ["SHARDWRAP_PROFILE_DIR"] = str(cache / "profiles")
    _fixed_cpu_profile()
    yield


def _fixed_cpu_profile() -> None:
    """This machine's device profile in $SHARDWRAP_CACHE/profiles, fixed figures: the
    step time every test's plan predicts is the same on any machine, and no
    train.py a test starts runs the probe (tests/test_step_time.py runs it)."""
    from src.planner.profiles import COLLECTIVES, DeviceProfile, Link, cpu_profile

    link = {c: Link(2e-4, 1e9) for c in COLLECTIVES}
    fixed = DeviceProfile(
        name="cpu: the tests' fixed profile (tests/conftest.py)",
        source="probe",
        cores=2,
        matmul={"fp32": {1: 5e10, 2: 9e10}, "bf16": {1: 1e10, 2: 1.8e10}},
        attention={"fp32": {1: 2e10, 2: 3.6e10}, "bf16": {1: 1e10, 2: 1.8e10}},
        memory_bw={1: 1e10, 2: 1.5e10},
        activation_bw={1: 3e9, 2: 5e9},
        op_s=2e-5,
        links=link,
        inter_links=link,
        ranks_per_node=2,
        overlap=False,
    )
    cpu_profile(lambda: fixed)


@pytest.fixture(autouse=True, scope="session")
def _project_console():
    """The project's log records reach the console as in a run (train.py's Hydra job
    logging), so a test reads what a user would see with capsys."""
    from src.observe.logs import PROJECT_LOGGER, ConsoleHandler

    project = logging.getLogger(PROJECT_LOGGER)
    handler = ConsoleHandler()
    project.addHandler(handler)
    project.setLevel(logging.INFO)
    yield
    project.removeHandler(handler)


# ------------------------------------------------------------ state a test leaves

# SIGALRM is pytest-timeout's (a handler of its own around each test); SIGKILL and
# SIGSTOP cannot be caught.
_SIGNALS = sorted(
    set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGALRM}
)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _pytest_handler(handler: logging.Handler) -> bool:
    """pytest's own capture handlers (caplog, the report's log section): pytest adds
    and removes them around each phase of a test."""
    return type(handler).__module__.startswith("_pytest")


@dataclass
class _State:
    """What a test could change for every later test of the same worker process:
    os.environ, the cwd, logging (each logger's level, handlers, filters, propagate
    and disabled flags, each handler's level, filters and formatter, logging.disable,
    captured warnings), signal handlers and the signal mask, and torch's process-wide
    settings (default dtype, threads, deterministic algorithms, grad mode, a default
    process group)."""

    environ: dict[str, str]
    cwd: str
    argv: list[str]
    path: list[str]
    loggers: dict[str, tuple]
    handlers: dict[int, tuple]
    logging_disable: int
    warnings_captured: bool
    formatwarning: Any
    signals: dict[int, Any]
    mask: set[int]
    dtype: torch.dtype
    threads: int
    deterministic: tuple[bool, bool]
    grad: bool
    process_group: bool

    @staticmethod
    def _loggers() -> dict[str, logging.Logger]:
        loggers = {
            name: logger
            for name, logger in list(logging.Logger.manager.loggerDict.items())
            if isinstance(logger, logging.Logger)
        }
        loggers[""] = logging.getLogger()
        return loggers

    @classmethod
    def take(cls) -> _State:
        main = threading.current_thread() is threading.main_thread()
        loggers = cls._loggers()
        handlers = {}
        for logger in loggers.values():
            for h in logger.handlers:
                if not _pytest_handler(h):
                    handlers[id(h)] = (h, h.level, list(h.filters), h.formatter)
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            argv=list(sys.argv),
            path=list(sys.path),
            loggers={
                name: (
                    logger.level,
                    [h for h in logger.handlers if not _pytest_handler(h)],
                    list(logger.filters),
                    logger.propagate,
                    logger.disabled,
                )
                for name, logger in loggers.items()
            },
            handlers=handlers,
            logging_disable=logging.root.manager.disable,
            warnings_captured=getattr(logging, "_warnings_showwarning", None)
            is not None,
            formatwarning=warnings.formatwarning,
            signals={s: signal.getsignal(s) for s in _SIGNALS} if main else {},
            mask=set(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            dtype=torch.get_default_dtype(),
            threads=torch.get_num_threads(),
            deterministic=(
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            grad=torch.is_grad_enabled(),
            process_group=dist.is_available() and dist.is_initialized(),
        )

    def restore(self) -> list[str]:
        """Put everything back; returns what was changed that a test must not leave
        changed (signal handlers and mask, a process group), one line each."""
        left: list[str] = []
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        sys.argv[:] = self.argv  # run_cli quotes it in place
        if sys.path != self.path:
            sys.path[:] = self.path
        self._restore_logging()

        for sig, before in self.signals.items():
            now = signal.getsignal(sig)
            if now is not before and now != before and before is not None:
                signal.signal(sig, before)
                left.append(f"{_signal_name(sig)} handler {before!r} -> {now!r}")
        mask = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        if mask != self.mask:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
            names = sorted(_signal_name(s) for s in mask ^ self.mask)
            left.append(f"signal mask changed for {', '.join(names)}")

        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        deterministic, warn_only = self.deterministic
        if (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ) != self.deterministic:
            torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_grad_enabled(self.grad)
        if dist.is_available() and dist.is_initialized() and not self.process_group:
            dist.destroy_process_group()
            left.append("a default process group left initialized")
        return left

    def _restore_logging(self) -> None:
        changed = False
        for name, logger in self._loggers().items():
            saved = self.loggers.get(name)
            if saved is None:
                continue  # created by this test (an import): as its module made it
            level, handlers, filters, propagate, disabled = saved
            if logger.level != level:
                logger.level = level
                changed = True
            ours = [h for h in logger.handlers if not _pytest_handler(h)]
            if ours != handlers:
                # pytest's own stay as they are (it removes them itself)
                pytests = [h for h in logger.handlers if _pytest_handler(h)]
                logger.handlers[:] = handlers + pytests
            if logger.filters != filters:
                logger.filters[:] = filters
            logger.propagate = propagate
            if logger.disabled != disabled:
                logger.disabled = disabled
                changed = True
        for handler, level, filters, formatter in self.handlers.values():
            handler.level = level
            if handler.filters != filters:
                handler.filters[:] = filters
            handler.formatter = formatter
        if logging.root.manager.disable != self.logging_disable:
            logging.disable(self.logging_disable)
        if changed:
            logging.root.manager._clear_cache()
        captured = getattr(logging, "_warnings_showwarning", None) is not None
        if captured != self.warnings_captured:
            logging.captureWarnings(self.warnings_captured)
        warnings.formatwarning = self.formatwarning


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo group (unless one is up) and its 1-D CPU mesh: DTensor code
    run in the test's own process."""
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group(
            "gloo", store=dist.FileStore(path, 1), rank=0, world_size=1
        )
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


@pytest.fixture
def stop_handlers_restored():
    """For a test whose code installs the stop signals' handlers the way a command's
    process keeps them (a multirun job's ``stop_before_start``, an in-process
    launch's ``after_the_run``): they are put back after it. Asking for this says
    the change is the code's own; any other test that changes a handler fails
    (``_state_restored``)."""
    saved = {s: signal.getsignal(s) for s in _SIGNALS}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


def _restored(request) -> Any:
    state = _State.take()
    yield
    left = state.restore()
    if left:
        pytest.fail(
            f"{request.node.nodeid} left process state changed (restored now, but "
            "a later test of this worker would have seen it):\n  " + "\n  ".join(left),
            pytrace=False,
        )


@pytest.fixture(autouse=True, scope="module")
def _module_state_restored(request):
    """A module's fixtures (a process group, a run) leave the state as they found
    it, checked once the module's last test is done."""
    yield from _restored(request)


@pytest.fixture(autouse=True)
def _state_restored(request):
    """Each test leaves the process as it found it: environment variables (a command
    run in-process sets some for its ranks: HYDRA_FULL_ERROR, the stop file), cwd,
    logging (an in-process run's handlers and levels; torch DCP's own DEBUG logger),
    torch's global settings, all put back quietly; a changed signal handler or signal
    mask, or a process group left open, is put back too and fails the test by name,
    as a worker left with SIGINT ignored once failed a test much later."""
    yield from _restored(request)
