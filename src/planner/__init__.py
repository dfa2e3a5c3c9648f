"""The per-rank memory plan: a run's plan in one call (run.py), the estimate part by
part (estimate.py), the activations (activations.py, traced on fake tensors by
trace.py), a pipeline's stages (pipeline.py), the fit search (search.py, costs.py), the
``auto`` values (auto.py) and plan-only's report (report.py)."""
