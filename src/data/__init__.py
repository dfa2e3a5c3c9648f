"""Data: corpora, tokenizers, the token cache, global batches and the data sources.

The data sources that live in their own files add themselves to ``DATA_SOURCES`` on
import; importing any module of this package imports them first (after the module that
holds the registry), so every process (the launcher and each rank) has them.
"""

# In this order (data.name's --help line and its errors list the sources as
# registered): text and files (src/data/sources.py), tokens, then synthetic.
from src.data import tokens_data  # noqa: F401

# isort: split
from src.data import synthetic_data  # noqa: F401
