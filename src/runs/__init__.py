"""Opening a finished run: its config, model and tokenizer (from_run.py), scoring data
(evaluation.py), and comparing runs (compare.py)."""
