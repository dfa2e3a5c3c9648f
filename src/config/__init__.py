"""The config, by concern: :mod:`src.config.schema` (the types, registered in
Hydra's ConfigStore when it is imported), :mod:`src.config.validate` (what a type
cannot say) and :mod:`src.config.cli` (a config error as one line). A run dir's config
(a resume, sample.py, eval.py) is composed in src/runs/compose.py. Nothing is
re-exported here: import the module you need."""
