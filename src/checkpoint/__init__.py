"""Checkpoints: DCP save / load / verify (dcp.py), Hugging Face import and export
(export.py) and the mapping between the two layouts (hf_layout.py)."""
