"""The tests' rank runner: :func:`src.harness.run_distributed` (one copy, shared with
the benchmarks)."""

from src.harness import run_distributed

__all__ = ["run_distributed"]
