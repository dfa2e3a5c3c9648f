"""The first thing each command (train.py, sample.py, eval.py) does, before its
imports: importing torch, transformers and Hydra takes seconds, and a Ctrl-C then
raised KeyboardInterrupt inside the import machinery, a traceback of importlib frames
for a command that had done nothing. This module imports nothing heavy."""

from __future__ import annotations

import signal
import sys
from typing import Any


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
