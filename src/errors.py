"""The error types every layer raises; what each one means to the command line.

A :class:`ConfigError` is a config value that cannot work (printed as one line naming
the key, exit 2); a :class:`RunError` a failure the user can act on (printed as its
message alone); :class:`Stopped` is not a failure: the run stopped on a signal after
writing a checkpoint.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

#: Set to "1" when the user asked for tracebacks inline (``HYDRA_FULL_ERROR=1``):
#: ``run_cli`` sets Hydra's own variable for itself, so the choice is kept here.
FULL_ERROR_ENV = "SHARDWRAP_FULL_ERROR"


class ConfigError(ValueError):
    """A config value that cannot work; ``str()`` is one line naming the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


def not_writable(key: str, path: str, what: str, problem: str) -> ConfigError:
    """The one-line error for a directory ``what`` writes to that cannot be written
    (``problem``: :func:`src.files.unwritable`'s reason), naming the ``key`` (or
    environment variable) that moves it."""
    return ConfigError(
        key, f"{what} writes to {path}: {problem}; set {key} to a writable directory"
    )


def keyed(key: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, its ``ValueError`` (the lower layers name no config key) as a
    :class:`ConfigError` on ``key``."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(key, str(err)) from None


class RunError(RuntimeError):
    """A failure the user can act on, reported as its message alone."""


class RunDirBusy(RunError):
    """Another live run holds the run dir."""


class PeerUnresponsive(RunError):
    """A collective timed out because a peer rank stopped responding."""


class PeerExited(RunError):
    """A collective failed because a peer rank's connection closed (it exited or was
    killed)."""


class DiskFull(RunError):
    """A write failed with ENOSPC."""


class Stopped(Exception):
    """The run stopped on a signal after writing a checkpoint (not a failure)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
