"""``python train.py --help``: the groups a user picks from and every key with one line
saying what it does.

Hydra's ``--help`` prints its config groups (the internal schema groups included:
``data=base_files``, ``model=schema/llama``) and the config without a word per key.
conf/config.yaml sets ``hydra.help.template`` to ``${shardwrap_help:}``, the resolver
below, which renders the composed config (with the command line's overrides) with
:data:`KEY_HELP` as comments and lists only the options of conf/. :data:`KEY_HELP` is
where a key's one-line description lives; tests/test_cli.py checks every key of every
option has one.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# Groups of conf/ that are Hydra's own or hold config files, not options to pick.
NOT_GROUPS = ("hydra", "hf_configs")
# ConfigStore entries that type a group's options (src/config.py); picking one gives
# an empty, untyped-by-a-preset node, so they are not options.
SCHEMA_PREFIXES = ("schema/", "base_")

KEY_HELP = {
    # model: every family
    "model.name": "the preset (conf/model/<name>.yaml)",
    "model.family": "the model family (src/models): gpt, llama, hf or custom",
    "model.init_device": "where parameters are first created: cpu, cuda or meta",
    "model.pretrained": "a local Hugging Face dir whose safetensors are loaded, sharded",
    "model.vocab_size": "vocabulary size; follows data.tokenizer unless set",
    "model.block_size": "the run's sequence length in tokens",
    # GPT
    "model.n_layer": "GPT: transformer blocks",
    "model.n_head": "GPT: attention heads",
    "model.n_embd": "GPT: hidden size (a multiple of n_head)",
    "model.dropout": "GPT: dropout probability (0 = off)",
    "model.bias": "GPT: biases in Linear and LayerNorm layers, as in GPT-2",
    # Llama
    "model.dim": "Llama: hidden size",
    "model.n_layers": "Llama: transformer blocks",
    "model.n_heads": "Llama: attention heads",
    "model.n_kv_heads": "Llama: key/value heads (grouped-query attention; null = n_heads)",
    "model.multiple_of": "Llama: the SwiGLU hidden size is rounded up to a multiple of it",
    "model.ffn_dim_multiplier": "Llama: scales the SwiGLU hidden size (null = 1)",
    "model.norm_eps": "Llama: RMSNorm epsilon",
    "model.rope_theta": "Llama: RoPE base frequency",
    "model.max_seq_len": "Llama: the run's sequence length (and RoPE's table)",
    "model.tie_embeddings": "Llama: share the input embedding and the output head",
    # hf and custom
    "model.config": "hf: a transformers config dir, or a name in conf/hf_configs",
    "model.trust_remote_code": "hf: run the config dir's own model code (auto_map)",
    "model._target_": "custom: dotted path of your nn.Module class",
    "model.args": "custom: more constructor arguments (+model.args.dim=64)",
    # sharding
    "sharding.backend": "fsdp2, fsdp1, ddp or none (pick with sharding=...)",
    "sharding.policy": "which modules become units: size, block, manual or a list",
    "sharding.min_params": "size policy: parameters that make a unit (1e8), or auto",
    "sharding.exclude_wrap_modules": "classes never made units (dotted paths)",
    "sharding.force_leaf_modules": "classes never split nor made units by themselves",
    "sharding.reshard_after_forward": "free gathered parameters after forward "
    "(fsdp2: or a group size)",
    "sharding.forward_prefetch": "fsdp2: units gathered ahead in forward (null: default)",
    "sharding.backward_prefetch": "fsdp2: units gathered ahead in backward",
    "sharding.activation_checkpointing": "none, full, selective or auto, per block",
    "sharding.activation_checkpointing_every": "full: checkpoint every k-th block",
    "sharding.compile": "torch.compile each block",
    "sharding.replicate": "HSDP: replica groups, each sharding over devices / R",
    "sharding.tensor_parallel": "fsdp2: T ranks split each block (tp mesh dim); 1 = off",
    "sharding.sequence_parallel": "with tensor_parallel: norms sharded over the sequence (null: family default)",
    # precision
    "precision.name": "fp32, bf16_mixed or fp16_mixed (pick with precision=...)",
    # trainer
    "trainer.devices": "ranks on this machine: an int, or auto (GPUs, else 1)",
    "trainer.max_steps": "optimizer steps to train",
    "trainer.batch_size": "global batch in sequences, whatever the number of ranks",
    "trainer.grad_accum": "micro-batches per step, or auto (the planner picks)",
    "trainer.grad_sync": "gradient reduction with grad_accum > 1: auto, last or every",
    "trainer.mem_budget_gib": "GiB per rank or an accelerator name, for the planner",
    "trainer.mem_margin": "the planner's safety margin: a fit needs estimate x (1 + m)",
    "trainer.seed": "seed of the model init and the batches",
    "trainer.log_every": "steps between logged rows (metrics.jsonl, wandb)",
    "trainer.val_every": "steps between validations (0 = none)",
    "trainer.val_batches": "batches per validation",
    "trainer.sample_every": "steps between greedy samples of sample_prompts (0 = off)",
    "trainer.sample_prompts": "texts continued by trainer.sample_every (a list)",
    "trainer.sample_tokens": "new tokens per trainer.sample_every sample",
    "trainer.lr": "peak learning rate (AdamW)",
    "trainer.min_lr": "learning rate at the end of the cosine decay",
    "trainer.warmup_steps": "steps of linear warmup",
    "trainer.weight_decay": "AdamW weight decay (2-D weights only)",
    "trainer.betas": "AdamW betas",
    "trainer.grad_clip": "max global gradient norm (0 = off)",
    "trainer.ckpt_every": "steps between sharded checkpoints (0 = only on a stop)",
    "trainer.keep_last": "newest checkpoints kept (0 = all)",
    "trainer.ckpt_async": "write checkpoints in the background",
    "trainer.resume": "null, auto (newest in the run dir) or a checkpoint path",
    "trainer.resume_schedule": "resuming with another max_steps: keep (refuse) or extend",
    "trainer.export": "at the end: false, true (model.safetensors) or hf",
    "trainer.max_restarts": "restarts of the whole group after a rank fails",
    "trainer.timeout_s": "collective timeout; a silent rank is named after it",
    "trainer.plan_only": "print the wrap plan and memory estimate, allocate nothing",
    "trainer.peak_tflops": "per-rank peak for MFU (null: GPU table or CPU probe)",
    "trainer.progress": "tqdm progress bar on rank 0 (false: a line per log point)",
    "trainer.log_level": "console and train.log: debug (every rank), info, warning, error",
    "trainer.profile": "torch.profiler traces and memory timeline in <run dir>/profile",
    "trainer.profile_start": "profile: the first profiled step",
    "trainer.profile_steps": "profile: how many steps are profiled",
    "trainer.profile_record_shapes": "profile: input shapes of each op in the trace",
    "trainer.profile_with_stack": "profile: Python stacks of each op in the trace",
    "trainer.profile_memory": "profile: allocation events (null: on on CPU, off on CUDA)",
    # data
    "data.name": "the source: text, files, tokens or synthetic (pick with data=...)",
    "data.paths": "a glob or a list of globs of your corpus (~ and ** work)",
    "data.format": "auto (by file extension), text, jsonl or parquet",
    "data.text_key": "the JSONL field / Parquet column holding the text",
    "data.tokenizer": "byte, bpe, or a tokenizer.json / Hugging Face tokenizer dir",
    "data.bpe_vocab_size": "tokenizer=bpe: its vocabulary size",
    "data.eos_token": "end-of-document token (null: the tokenizer's own)",
    "data.val_fraction": "the last fraction of the corpus bytes used for validation",
    "data.max_bytes": "cap on the corpus bytes read (null = all)",
    "data.cache_dir": "where tokenized corpora are cached",
    "data.train_path": "tokens: the training split (flat np.uint16 .bin)",
    "data.val_path": "tokens: the validation split (flat np.uint16 .bin)",
    "data.num_tokens": "synthetic: how many random tokens",
    # logger
    "logger.backend": "wandb, csv or none (pick with logger=...)",
    "logger.file": "csv: the CSV's file name in the run dir",
    "logger.mode": "wandb: offline, online or disabled",
    "logger.project": "wandb project",
    "logger.group": "wandb group (null = none)",
    "logger.tags": "wandb tags ([a,b])",
    "logger.name": "wandb run name (null = wandb's default)",
    "logger.system_stats": "wandb's CPU/GPU sampling (probes cloud metadata)",
    # sweep
    "sweep.objective": "what makes a sweep point best: val_loss, loss or tokens_per_s",
    "sweep.direction": "min or max (null: the objective's own)",
    "sweep.mem_cap_gib": "a sweep point above this peak memory scores below all others",
}


def user_options(group: str) -> list[str]:
    """The options of ``group`` a user picks from: conf/<group>/*.yaml."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def user_groups() -> list[str]:
    return sorted(
        p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_GROUPS
    )


def is_schema_option(option: str) -> bool:
    return option.startswith(SCHEMA_PREFIXES)


def _lines(node: DictConfig, prefix: str, indent: str) -> list[str]:
    out = []
    for key in node.keys():
        full = f"{prefix}{key}"
        child = node._get_node(key)
        about = KEY_HELP.get(full, "")
        if isinstance(child, DictConfig) and full not in KEY_HELP:
            out.append(f"{indent}{key}:")
            out.extend(_lines(child, f"{full}.", indent + "  "))
            continue
        if isinstance(child, DictConfig | ListConfig):
            container = OmegaConf.to_container(child, resolve=False)
            value = yaml.safe_dump(container, default_flow_style=True, width=1e9)
            value = value.strip()
        else:
            value = OmegaConf.to_yaml({key: child}).strip().partition(": ")[2]
        line = f"{indent}{key}: {value}"
        out.append(f"{line:<44} # {about}" if about else line)
    return out


def render_help(*, _root_: DictConfig) -> str:
    """The ``--help`` text for the composed config ``_root_`` (Hydra's, with its
    ``hydra`` node)."""
    groups = [
        f"  {g}: {', '.join(o for o in user_options(g) if not is_schema_option(o))}"
        for g in user_groups()
    ]
    choices = _root_.hydra.runtime.choices
    chosen = " ".join(f"{g}={choices[g]}" for g in user_groups() if g in choices)
    app = {k: _root_._get_node(k) for k in _root_.keys() if k != "hydra"}
    keys = []
    for name, node in app.items():
        keys.append(f"{name}:")
        keys.extend(_lines(node, f"{name}.", "  "))
    text = "\n".join(
        [
            "python train.py [group=option ...] [key=value ...]   "
            "(README.md, docs/*.md)",
            "",
            "== Groups (group=option) ==",
            *groups,
            "",
            f"== Keys (key=value), as composed for {chosen} ==",
            *keys,
            "",
            "Lists: key=[a,b]; paths: data.paths=~/corpus/**/*.jsonl; a sweep: "
            "-m key=a,b (docs/sweeps.md).",
            "Flags: --cfg job (print the composed config), -m (multirun), "
            "--info (Hydra's search path, defaults), --hydra-help (Hydra's own).",
        ]
    )
    return text.replace("$", "$$")  # Hydra's string.Template keeps it as is


if not OmegaConf.has_resolver("shardwrap_help"):
    OmegaConf.register_new_resolver("shardwrap_help", render_help, use_cache=False)
