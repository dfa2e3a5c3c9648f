"""Observability: loggers and their sinks (console, metrics.jsonl, csv, wandb), metrics
(throughput, MFU, memory), profiling, and the logging set-up.

The logger options that live in their own files add themselves to ``LOGGERS`` on
import; importing any module of this package imports them first, so every process has
them.
"""

from src.observe import csv_logger  # noqa: F401
