"""The trainer: launch, build, loop, checkpoints, data, metrics and sinks.

The logger options and data sources that live in their own files add themselves to
``LOGGERS`` / ``DATA_SOURCES`` on import; importing any module of this package
imports them first (after the module that holds the registry), so every process
(the launcher and each rank) has them.
"""

from src.trainer import csv_logger  # noqa: F401  (registers logger=csv)
