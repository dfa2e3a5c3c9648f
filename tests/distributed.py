"""The tests' rank runner: :func:`src.harness.run_distributed` (one copy, shared with
the benchmarks), and a free port for a test's own rendezvous (torchrun agents)."""

import socket

from src.harness import run_distributed

__all__ = ["free_port", "run_distributed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]
