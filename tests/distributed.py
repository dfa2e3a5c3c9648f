"""The tests' rank runner: :func:`src.harness.run_distributed` (one copy, shared with
the benchmarks), and a free port for a test's own rendezvous (torchrun agents)."""

import socket

from src.harness import run_distributed

__all__ = ["HANG_S", "free_port", "run_distributed"]

#: The wall-clock limit of a subprocess a test runs (train.py, sample.py, torchrun):
#: a guard against a hang, not a bound on a loaded machine, so pytest's own
#: ``--timeout`` (600 s). A tighter one failed on a busy CI machine: a train.py that
#: only reports a config error took 98 s there (imports, at load 14 on 2 cores).
HANG_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
