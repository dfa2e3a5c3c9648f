"""Checkpoints: DCP save / load / verify (dcp.py, the Checkpointer; the dir's layout
and resume in folders.py, meta.json and its seal in meta.py, DCP's index read safely in
index.py, JSON values in values.py, RNG states in rng.py), Hugging Face import and
export (export.py) and the mapping between the two layouts (hf_layout.py)."""
