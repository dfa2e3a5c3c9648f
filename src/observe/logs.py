"""The run's console and ``train.log``: one Python ``logging`` setup for every process.

The project logs through ``logging.getLogger(__name__)`` (loggers under ``src``);
nothing in ``src/`` prints. Where the records go:

- In the Hydra job (``train.py``), Hydra's job logging (``conf/hydra/job_logging/
  console_and_file.yaml``) sends them to the console (:class:`ConsoleHandler`: INFO to
  stdout, warnings and errors to stderr, written around the progress bar) and to
  ``<run dir>/train.log``. ``hydra.verbose=true`` (or ``=src``) or
  ``trainer.log_level=debug`` turns detail up; ``trainer.log_level=warning`` down.
- The ranks that the elastic launcher starts are fresh processes without that set-up:
  :func:`log_spec` describes the Hydra process's handlers and levels, and each rank
  re-creates them (:func:`rank_logging`), so rank 0's records reach the same console
  and the same ``train.log``.
- Rank-aware: only rank 0's records pass (:class:`RankFilter`); at debug every rank's
  do, each prefixed ``[rank N]``.
- The progress bar (tqdm) is console-only. A record logged with ``extra=FILE_ONLY``
  goes to ``train.log`` but not to the console (the per-interval line while the bar
  shows the same figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm

#: The project's root logger; ``trainer.log_level`` sets its level.
PROJECT_LOGGER = "src"
#: ``trainer.log_level`` values.
LOG_LEVELS = ("debug", "info", "warning", "error")
#: ``log.info(line, extra=FILE_ONLY)``: in train.log, not on the console.
FILE_ONLY = {"console": False}


class ConsoleHandler(logging.Handler):
    """The console sink: INFO and below to stdout, WARNING and above to stderr, each
    written with ``tqdm.write`` so a progress bar on the console is cleared and
    redrawn around it. The streams are looked up at each record (pytest's capture and
    a redirected ``sys.stdout`` see the output). Records marked ``FILE_ONLY`` skip it."""

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "console", True):
            return
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except Exception:
            self.handleError(record)


class RankFilter(logging.Filter):
    """Lets rank 0's records through; with ``all_ranks`` (debug) every rank's,
    prefixed ``[rank N]`` when there are several ranks."""

    def __init__(self, rank: int, world: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.world, self.all_ranks = rank, world, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank != 0 and not self.all_ranks:
            return False
        if self.all_ranks and self.world > 1 and not hasattr(record, "rank"):
            record.rank = self.rank  # once, though several handlers see the record
            record.msg = f"[rank {self.rank}] {record.msg}"
        return True


_SRC = Path(__file__).resolve().parents[1]  # the project's code: src/
_python_format = warnings.formatwarning


def rank_bars_lock() -> None:
    """In a rank: tqdm's output lock a thread lock. Its default adds a
    multiprocessing semaphore, created by each rank on its first line, which a rank
    that is killed (its peers too, when one fails) leaves to the resource tracker:
    ``There appear to be N leaked semaphore objects`` after the failure's line. A
    rank's bars and lines are its own: no other process shares that lock."""
    tqdm.set_lock(threading.RLock())


def format_warning(message, category, filename, lineno, line=None) -> str:
    """A warning the project's own code raises (a checkpoint resharded onto another
    number of ranks, ...) is a notice: its message alone, as the project's other
    lines; a library's keeps Python's form (file, line, category)."""
    try:
        ours = Path(filename).resolve().is_relative_to(_SRC)
    except (OSError, ValueError):
        ours = False
    if ours:
        return str(message)
    return _python_format(message, category, filename, lineno, line)


def capture_warnings() -> None:
    """Python warnings become log records (console and train.log), the project's
    own as one plain line (:func:`format_warning`)."""
    logging.captureWarnings(True)
    warnings.formatwarning = format_warning


def set_log_level(level: str) -> None:
    """``trainer.log_level``: the project loggers' level, or debug where
    ``hydra.verbose`` asks for it (``true``, or ``src``). Set for each job, so a
    multirun job does not inherit the previous one's. Python warnings become log
    records too, so ``train.log`` holds them as the console shows them."""
    capture_warnings()
    wanted = getattr(logging, level.upper())
    if _hydra_verbose():
        wanted = logging.DEBUG
    logging.getLogger(PROJECT_LOGGER).setLevel(wanted)


def _hydra_verbose() -> bool:
    """Whether this Hydra job's ``hydra.verbose`` covers the project's loggers."""
    try:
        from hydra.core.hydra_config import HydraConfig

        verbose = HydraConfig.get().verbose if HydraConfig.initialized() else False
    except (ImportError, ValueError):
        return False
    if isinstance(verbose, bool):
        return verbose
    names = [verbose] if isinstance(verbose, str) else list(verbose)
    return any(n in ("root", PROJECT_LOGGER) for n in names)


def debug_on() -> bool:
    return logging.getLogger(PROJECT_LOGGER).isEnabledFor(logging.DEBUG)


@dataclasses.dataclass(frozen=True)
class LogSpec:
    """The Hydra process's log set-up, for ranks started as new processes: each
    handler as (kind, formatter format, date format, level, file name) and the levels
    of the root and the project logger."""

    handlers: tuple[tuple[str, str | None, str | None, int, str | None], ...]
    root_level: int
    project_level: int


def log_spec() -> LogSpec:
    """This process's console and file handlers (Hydra's job logging) and levels."""
    handlers = []
    for h in logging.getLogger().handlers:
        fmt = h.formatter
        style = (fmt._fmt, fmt.datefmt) if fmt is not None else (None, None)
        if isinstance(h, logging.FileHandler):
            handlers.append(("file", *style, h.level, h.baseFilename))
        elif isinstance(h, ConsoleHandler | logging.StreamHandler):
            handlers.append(("console", *style, h.level, None))
    project = logging.getLogger(PROJECT_LOGGER).getEffectiveLevel()
    return LogSpec(tuple(handlers), logging.getLogger().level, project)


def _handler(kind: str, fmt, datefmt, level: int, filename) -> logging.Handler:
    handler = (
        logging.FileHandler(filename, mode="a", delay=True)
        if kind == "file"
        else ConsoleHandler()
    )
    handler.setFormatter(logging.Formatter(fmt, datefmt))
    handler.setLevel(level)
    return handler


@contextlib.contextmanager
def rank_logging(spec: LogSpec | None, rank: int, world: int) -> Iterator[None]:
    """This rank's logging for the block. A process that has handlers already (the
    Hydra process: one in-process rank, or a rank under torchrun) keeps them; a rank
    that the launcher started re-creates ``spec``'s (the Hydra process's console and
    ``train.log``). Either way only rank 0's records pass, or at debug every rank's."""
    root, project = logging.getLogger(), logging.getLogger(PROJECT_LOGGER)
    added: list[logging.Handler] = []
    if not root.handlers and spec is not None:
        added = [_handler(*h) for h in spec.handlers]
        for h in added:
            root.addHandler(h)
        # Libraries (torch, wandb) stay at WARNING unless Hydra was verbose.
        root.setLevel(max(spec.root_level, logging.WARNING))
        if spec.root_level <= logging.DEBUG:
            root.setLevel(logging.DEBUG)
        project.setLevel(spec.project_level)
    capture_warnings()
    gate = RankFilter(rank, world, debug_on())
    for h in root.handlers:
        h.addFilter(gate)
    try:
        yield
    finally:
        for h in root.handlers:
            h.removeFilter(gate)
        for h in added:
            root.removeHandler(h)
            h.close()


def exit_with_error(logger: logging.Logger, line: str) -> NoReturn:
    """Exit with status 1 and ``line`` on stderr (Python prints a ``SystemExit``'s
    message; a sweep records it as the job's error), the same line in train.log."""
    logger.error(line, extra=FILE_ONLY)
    sys.exit(line)


def error_line(logger: logging.Logger, line: str) -> None:
    """``line`` as one line on stderr, and in ``train.log`` once Hydra's job logging
    is set up. Before that (an override Hydra cannot parse, a run dir it cannot
    create) the root logger has no console handler of ours, or only Hydra's own on
    stdout: the console sink writes the line itself."""
    if any(isinstance(h, ConsoleHandler) for h in logging.getLogger().handlers):
        logger.error(line)
    else:
        ConsoleHandler().handle(
            logger.makeRecord(logger.name, logging.ERROR, "", 0, line, (), None)
        )
