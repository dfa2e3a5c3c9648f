"""A run's checkpoint written as weights, after training:
``python export.py run=<run dir or checkpoint> [ckpt=best] [format=hf|safetensors]``.

The run's own composed config gives the model and its sharding (src/runs/from_run.py);
the checkpoint (the newest, ``ckpt=best``, or the ``step_N`` dir given as ``run=``) is
read on ``devices`` ranks and written as ``trainer.export`` writes at the end of a run:
a Hugging Face dir (``format=hf``: config.json, safetensors, the run's tokenizer) or
one consolidated ``model.safetensors``, into ``out`` or ``<run dir>/exports/step_N/``.
Keys in conf/export.yaml; a config error is one line naming the key (exit status 2).
"""

from src.entry import fork_rank_server, quiet_ctrl_c, start_rank_server, started

if __name__ == "__main__":
    quiet_ctrl_c()  # first: a Ctrl-C while the imports below run is one line
    start_rank_server("devices", given=True)  # devices=N>1: ranks fork from a server

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from src.checkpoint.export import export_name
from src.checkpoint.folders import reading, run_exports, step_dir, step_of
from src.config.cli import exit_on_config_error, run_cli
from src.config.run_plan import model_spec
from src.config.validate import check_hf_export, validate_export
from src.runs.compose import open_run
from src.runs.from_run import export_rank, on_ranks
from src.trainer.sampling import sampling_changes

log = logging.getLogger("export")


@hydra.main(config_path="conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> str | None:
    """The export's path; the checkpoint it reads is held until then (a live run's
    keep_last leaves it)."""
    with reading():
        return _export(cfg)


def _export(cfg: DictConfig) -> str | None:
    hf = cfg.format == "hf"
    with exit_on_config_error():
        validate_export(cfg)
        run_dir, checkpoint, run_cfg, resolved = open_run(
            cfg.run,
            lambda run_cfg: sampling_changes(
                model_spec(run_cfg), cfg.devices, run_cfg.sharding.backend
            )[0],
            trust_remote_code=cfg.trust_remote_code,
            ckpt=cfg.ckpt,
        )
        if hf:
            check_hf_export(
                resolved.spec,
                resolved.model_config,
                "format",
                "; format=safetensors writes one consolidated file",
            )
        where = (
            Path(cfg.out)
            if cfg.out
            else step_dir(run_exports(run_dir), step_of(checkpoint))
        )
        path = where / export_name(hf)
    opts = {"path": str(path), "hf": hf}
    with exit_on_config_error():  # a rank's failure: one line
        out = on_ranks(export_rank, run_cfg, resolved, checkpoint, opts)
    if out is None:  # a rank > 0 under torchrun: rank 0 reports
        return None
    log.info(
        "exported %s of %s (step %d) to %s", out["what"], checkpoint, out["step"], path
    )
    return str(path)


if __name__ == "__main__":
    started()
    fork_rank_server()  # the imports done: the ranks fork from a copy
    run_cli(main)
