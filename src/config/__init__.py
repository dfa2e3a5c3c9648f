"""Checking a config: :mod:`src.config.validate` (what a type cannot say) and
:mod:`src.config.cli` (a config error as one line). The types themselves, and the
allowed values a type cannot restrict, are :mod:`src.config.schema`, low in the import order
(registered in Hydra's ConfigStore when it is imported). A run dir's config
(a resume, sample.py, eval.py) is composed in src/runs/compose.py. Nothing is
re-exported here: import the module you need."""
