"""Compare runs side by side: ``python compare.py RUN_DIR_OR_SWEEP_DIR... [--out DIR]``.

A table (the overrides that differ, what a resume changed, each run's final figures,
the best run marked) and a plot over steps or tokens seen: src/runs/compare.py.
"""

from src.runs.compare import main

if __name__ == "__main__":
    main()
