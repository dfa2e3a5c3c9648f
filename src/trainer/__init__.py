"""The trainer: launch, build, loop, checkpoints, data, metrics and sinks.

The logger options and data sources that live in their own files add themselves to
``LOGGERS`` / ``DATA_SOURCES`` on import; importing any module of this package
imports them first (after the module that holds the registry), so every process
(the launcher and each rank) has them.
"""

# In this order (data.name's --help line and its errors list the sources as
# registered): text and files (src/trainer/data.py), tokens, then synthetic.
from src.trainer import csv_logger, tokens_data  # noqa: F401

# isort: split
from src.trainer import synthetic_data  # noqa: F401
