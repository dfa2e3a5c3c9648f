"""The per-rank memory plan: the estimate part by part (planner.py), the activation
tracer on fake tensors (trace.py), the fit search and the ``auto`` values."""
