"""Text from a trained checkpoint: ``python sample.py run=<run dir> [key=value ...]``.

Like nanoGPT's sample.py, for sharded checkpoints: the run's own composed config
(``<run dir>/.hydra/config.yaml``) gives the model, tokenizer and sharding; the
checkpoint (written by any number of ranks) loads on ``devices`` ranks; GPT and Llama
decode with a KV cache, Hugging Face models through ``generate()``. The keys are in
conf/sample.yaml; a config error is one line naming the key (exit status 2).
"""

from src.entry import fork_rank_server, quiet_ctrl_c, start_rank_server, started

if __name__ == "__main__":
    quiet_ctrl_c()  # first: a Ctrl-C while the imports below run is one line
    start_rank_server("devices", given=True)  # devices=N>1: ranks fork from a server

import logging

import hydra
from omegaconf import DictConfig

from src.checkpoint.folders import reading
from src.config.cli import exit_on_config_error, run_cli
from src.config.run_plan import model_spec
from src.config.validate import validate_sample
from src.runs.compose import open_run
from src.runs.from_run import on_ranks, run_tokenizer, sample_rank
from src.trainer.sampling import sampling_changes

log = logging.getLogger("sample")


@hydra.main(config_path="conf", config_name="sample", version_base="1.3")
def main(cfg: DictConfig) -> list[str]:
    """The samples; the checkpoint they come from is held until then (a live run's
    keep_last leaves it)."""
    with reading():
        return _sample(cfg)


def _sample(cfg: DictConfig) -> list[str]:
    def changes(run_cfg: DictConfig) -> dict:
        changes, note = sampling_changes(
            model_spec(run_cfg), cfg.devices, run_cfg.sharding.backend
        )
        if note:
            log.warning(note)
        return changes

    with exit_on_config_error():
        validate_sample(cfg)
        _, checkpoint, run_cfg, resolved = open_run(
            cfg.run, changes, trust_remote_code=cfg.trust_remote_code, ckpt=cfg.ckpt
        )
        run_tokenizer(run_cfg)  # a run without one is refused before any rank starts
    opts = {
        key: cfg[key]
        for key in ("prompt", "num_samples", "max_new_tokens", "temperature")
    }
    opts.update(top_k=cfg.top_k, seed=cfg.seed, kv_cache=cfg.kv_cache)
    with exit_on_config_error():  # a rank's failure: one line
        out = on_ranks(sample_rank, run_cfg, resolved, checkpoint, opts)
    if out is None:  # a rank > 0 under torchrun: rank 0 reports
        return []
    log.info(
        "%d samples from %s (step %d, %d rank%s):",
        len(out["samples"]),
        checkpoint,
        out["step"],
        resolved.world_size,
        "" if resolved.world_size == 1 else "s",
    )
    for text in out["samples"]:
        log.info("%s\n---------------", text)
    return out["samples"]


if __name__ == "__main__":
    started()
    fork_rank_server()  # the imports done: the ranks fork from a copy
    run_cli(main)
