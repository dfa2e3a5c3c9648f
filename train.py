"""Train a model with sharded data parallelism: ``python train.py [key=value ...]``.

Hydra composes and validates the config (conf/ + the schema in src/schema.py)
in this process, then the ranks start (see src/trainer/launch.py). A config error is
one line on stderr naming the key, and exits with status 2 before any rank starts. In a
multirun (``-m``) a failed job is recorded instead and the other jobs still run
(docs/sweeps.md).
"""

from src.entry import fork_rank_server, quiet_ctrl_c, start_rank_server

if __name__ == "__main__":
    quiet_ctrl_c()  # first: a Ctrl-C while the imports below run is one line
    start_rank_server()  # ranks will fork from a rank server (forked below)

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from src.config.cli import exit_on_config_error, run_cli
from src.config.validate import validate
from src.data.pinning import read_pin
from src.errors import keyed
from src.planner.auto import default_policy
from src.planner.run import budget_check
from src.planner.settings import run_budget_bytes
from src.runs.branches import Completed
from src.runs.compose import continue_run, take_branch
from src.runs.sweep import check_objective, run_job
from src.trainer.faults import stop_before_start
from src.trainer.launch import (
    admitted,
    job_user_keys,
    launch,
    own_run_dir,
    preflight,
    prepare,
)
from src.trainer.resume import check_init_from


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Returns the job's objective for sweepers (tokens/s; see src/trainer/sweep.py).
    In a multirun a failed job is recorded as failed and the sweep goes on."""
    run_dir = HydraConfig.get().runtime.output_dir
    return run_job(
        cfg, run_dir, lambda: _run(cfg, run_dir), precheck=lambda: _fits(cfg)
    )


def _fits(cfg: DictConfig) -> tuple[float, float] | None:
    """In a multirun: (needed, budget) GiB when the planner says the point cannot fit
    (planned with the wrap policy the run would get, as ``prepare`` chooses it); a
    point that cannot have the sweep's objective is refused (``check_objective``)."""
    with exit_on_config_error():
        resolved = validate(cfg)
        check_objective(cfg)
    if run_budget_bytes(resolved) is None:
        return None  # nothing to judge against: no model is built for it
    resolved, _, _ = default_policy(resolved, job_user_keys())
    return budget_check(resolved)


def _run(cfg: DictConfig, run_dir: str) -> dict | None:
    """The run's summary (None for plan-only). A run holds its run dir from before
    it reads the run's config or writes anything there (data.json, a resume's
    record) until its ranks end: a second command there is refused untouched."""
    if cfg.trainer.plan_only:  # no rank starts: its errors are the config's
        with exit_on_config_error():
            validate(cfg)
            cfg, resolved = prepare(cfg, None, run_dir=run_dir)
            return launch(cfg, run_dir, resolved)
    with own_run_dir(run_dir):
        with exit_on_config_error():  # one line, before any rank starts
            try:
                cfg, user_keys = continue_run(cfg, run_dir)  # a resume: its config
            except Completed:  # said; its records stay as they are
                return None
            # a resume reads the run's own tokenizer, and its data must be the run's
            pin = (
                keyed("hydra.run.dir", read_pin, run_dir)
                if user_keys is not None
                else None
            )
            validate(cfg)
            cfg, resolved = prepare(cfg, user_keys, run_dir, pin=pin)
            preflight(run_dir)  # the run dir is writable
            check_init_from(
                cfg, resolved.spec, resolved.model_config, run_dir
            )  # its checkpoint fits the model
            take_branch(cfg, run_dir)  # from an older point: the rest set aside
            resolved = admitted(run_dir, resolved)  # data.json: now, not before
        return launch(cfg, run_dir, resolved)


if __name__ == "__main__":
    stop_before_start()  # Ctrl-C before the ranks start: one line, exit 130
    fork_rank_server()  # the imports done: the ranks fork from a copy of them
    run_cli(main)
