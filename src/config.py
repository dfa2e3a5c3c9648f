"""Structured config schema, validation and one-line config errors.

The dataclasses below are registered in Hydra's ConfigStore as ``base_config``, the
first entry of ``conf/config.yaml``'s defaults list, so every group file and every
command-line override is merged into a typed node: an unknown key or a value of the
wrong type fails while Hydra composes. Facts a type cannot express (ranges, choices,
``n_embd % n_head``, importable class paths, meta init needing FSDP2) are checked by
:func:`validate`, which the entry point calls before any rank starts.
:func:`run_cli` turns every config error, Hydra's or ours, into one line on stderr that
names the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import (
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from hydra.experimental.callback import Callback
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
)

from src.checkpoint.layout import resolve_resume, run_checkpoints
from src.cli_help import CONF_DIR, is_schema_option, user_groups, user_options
from src.data.sources import DATA_SOURCES, DataConfig
from src.data.tokenizer import cache_path
from src.errors import ConfigError, RunError, keyed, not_writable
from src.models import ModelSpec, families, get_spec
from src.models.hf import remote_code_dir
from src.observe.loggers import LOGGERS, LoggerConfig, logs_to_wandb, wandb_dirs
from src.observe.logs import LOG_LEVELS, error_line
from src.planner.planner import GRAD_SYNC, budget_bytes
from src.registry import described, or_list
from src.resolved import Resolved, resolve, resolve_devices, tensor_parallel_plan
from src.runs.evaluation import EVAL_SPLITS
from src.runs.from_run import RUN_CONFIG, find_run, run_config, with_changes
from src.runs.resume import (
    RECORD,
    adopt_attempt,
    checkpoint_config,
    differences,
    in_use,
    refusal,
    requested_changes,
    run_progress,
    run_record,
)
from src.runs.resume import (
    with_changes as resumed_with,
)
from src.sharding import BACKENDS, CHECKPOINTING, PRECISIONS, with_capability
from src.sharding.pipeline import SCHEDULES, microbatches_problem, split_blocks
from src.sharding.policies import POLICIES
from src.sharding.transforms import compile_cache_dir
from src.trainer.faults import FULL_ERROR_ENV, RANK_REPORTS
from src.trainer.launch import override_keys, prepare
from src.trainer.loop import RESUME_SCHEDULES, restart_reason, schedule_refusal
from src.trainer.sweep import DIRECTIONS, OBJECTIVES
from src.util import planted_file, unwritable

log = logging.getLogger(__name__)

INIT_DEVICES = ("cpu", "cuda", "meta")

# The groups' schemas below type every key and hold its one-line --help text
# (``described``); its value has one home, the group's YAML in conf/, so a field
# without a default is MISSING.
EXPORTS = (False, True, "hf")


@dataclass
class ShardingConfig:
    backend: str = described(lambda: f"{or_list(BACKENDS)} (pick with sharding=...)")
    # A name or a list of names; OmegaConf 2.3 has no Union of str and list, so Any
    # here and the check in validate().
    policy: Any = described(
        lambda: f"which modules become units: {', '.join(POLICIES)} or a list"
    )
    # a number, or "auto" (src/planner/planner.py chooses)
    min_params: Any = described(
        "size policy: parameters that make a unit (1e8), or auto"
    )
    exclude_wrap_modules: list[str] = described(
        "classes never made units (dotted paths)"
    )
    force_leaf_modules: list[str] = described(
        "classes never split nor made units by themselves"
    )
    reshard_after_forward: Any = described(
        "free gathered parameters after forward (fsdp2: or a group size)"
    )
    forward_prefetch: int | None = described(
        "fsdp2: units gathered ahead in forward (null: default)"
    )
    backward_prefetch: int | None = described("fsdp2: units gathered ahead in backward")
    activation_checkpointing: str = described(
        f"{', '.join(CHECKPOINTING)} or auto, per block"
    )
    activation_checkpointing_every: int = described("full: checkpoint every k-th block")
    compile: bool = described("torch.compile each block")
    replicate: int = described("HSDP: replica groups, each sharding over devices / R")
    tensor_parallel: int = described(
        "fsdp2: T ranks split each block (tp mesh dim); 1 = off"
    )
    sequence_parallel: bool | None = described(
        "with tensor_parallel: norms sharded over the sequence (null: family default)"
    )
    pipeline_parallel: int = described(
        "fsdp2: P pipeline stages (pp mesh dim, outermost); 1 = off"
    )
    pp_schedule: str = described(lambda: f"pipeline schedule: {or_list(SCHEDULES)}")
    pp_microbatches: int = described(
        "pipeline micro-batches per micro-step (each rank's rows split M ways)"
    )
    pp_split: list[int] = described(
        "blocks per pipeline stage (empty: as even as possible)"
    )


@dataclass
class PrecisionConfig:
    name: str = described(lambda: f"{or_list(PRECISIONS)} (pick with precision=...)")


@dataclass
class TrainerConfig:
    devices: Any = described("ranks on this machine: an int, or auto (GPUs, else 1)")
    max_steps: int = described("optimizer steps to train")
    batch_size: int = described(
        "global batch in sequences, whatever the number of ranks"
    )
    grad_accum: Any = described("micro-batches per step, or auto (the planner picks)")
    grad_sync: str = described(
        f"gradient reduction with grad_accum > 1: {or_list(('auto', *GRAD_SYNC))}"
    )
    mem_budget_gib: Any = described(
        "GiB per rank or an accelerator name, for the planner"
    )
    mem_margin: float = described(
        "the planner's safety margin: a fit needs estimate x (1 + m)"
    )
    malloc_mmap_threshold_kib: int | None = described(
        "CPU ranks: heap blocks >= this (KiB) are freed to the OS at once (null: glibc)"
    )
    seed: int = described("seed of the model init and the batches")
    log_every: int = described("steps between logged rows (metrics.jsonl, wandb)")
    val_every: int = described("steps between validations (0 = none)")
    val_batches: int = described("batches per validation")
    sample_every: int = described(
        "steps between greedy samples of sample_prompts (0 = off)"
    )
    sample_prompts: list[str] = described(
        "texts continued by trainer.sample_every (a list)"
    )
    sample_tokens: int = described("new tokens per trainer.sample_every sample")
    lr: float = described("peak learning rate (AdamW)")
    min_lr: float = described("learning rate at the end of the cosine decay")
    warmup_steps: int = described("steps of linear warmup")
    weight_decay: float = described("AdamW weight decay (2-D weights only)")
    betas: list[float] = described("AdamW betas")
    grad_clip: float = described("max global gradient norm (0 = off)")
    ckpt_every: int = described(
        "steps between sharded checkpoints (0 = only on a stop and at the end)"
    )
    ckpt_final: bool = described(
        "save the last step's checkpoint (sample.py, eval.py and a resume read it)"
    )
    keep_last: int = described("newest checkpoints kept (0 = all)")
    ckpt_async: bool = described("write checkpoints in the background")
    resume: str | None = described(
        "null, auto (newest in the run dir) or a checkpoint path"
    )
    # src.trainer.loop.RESUME_SCHEDULES
    resume_schedule: str = described(
        "resuming with another max_steps: keep (refuse) or extend"
    )
    export: Any = described("at the end: false, true (model.safetensors) or hf")
    max_restarts: int = described("restarts of the whole group after a rank fails")
    timeout_s: float = described("collective timeout; a silent rank is named after it")
    plan_only: bool = described(
        "print the wrap plan and memory estimate, allocate nothing"
    )
    peak_tflops: float | None = described(
        "per-rank peak for MFU (null: GPU table or CPU probe)"
    )
    progress: bool = described(
        "tqdm progress bar on rank 0 (false: a line per log point)"
    )
    # one of src.observe.logs.LOG_LEVELS
    log_level: str = described(
        "console and train.log: debug (every rank), info, warning, error"
    )
    profile: bool = described(
        "torch.profiler traces and memory timeline in <run dir>/profile"
    )
    profile_start: int = described("profile: the first profiled step")
    profile_steps: int = described("profile: how many steps are profiled")
    profile_record_shapes: bool = described(
        "profile: input shapes of each op in the trace"
    )
    profile_with_stack: bool = described(
        "profile: Python stacks of each op in the trace"
    )
    profile_memory: bool | None = described(
        "profile: allocation events (null: on on CPU, off on CUDA)"
    )


@dataclass
class SweepConfig:
    """Read by src/trainer/sweep.py: what a job returns to a sweeper and which job of
    a sweep is the best (``objective``, ``direction``: null is the objective's own,
    min for losses, max for tokens_per_s); a job whose peak memory is above the cap
    scores below every job within it."""

    objective: str = described(
        f"what makes a sweep point best: {or_list(OBJECTIVES)}", "val_loss"
    )
    direction: str | None = described(
        f"{or_list(DIRECTIONS)} (null: the objective's own)", None
    )
    mem_cap_gib: float | None = described(
        "a sweep point above this peak memory scores below all others", None
    )


@dataclass
class Config:
    # Typed by the family's schema, which each conf/model/*.yaml picks in its defaults
    # list (`schema/<family>@_here_`; registered below from src/models).
    model: Any = MISSING
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = MISSING  # a source's schema, chosen by the data group
    logger: LoggerConfig = MISSING  # a logger's schema, chosen by the logger group
    sweep: SweepConfig = field(default_factory=SweepConfig)


_store = ConfigStore.instance()
_store.store(name="base_config", node=Config)
for _family in families():
    _store.store(group="model/schema", name=_family, node=get_spec(_family).schema())
# Each data source and logger owns its schema (src/data/sources.py, loggers.py).
for _name, _source in DATA_SOURCES.items():
    _store.store(group="data", name=f"base_{_name}", node=_source.schema)
for _name, _logger in LOGGERS.items():
    _store.store(group="logger/schema", name=_name, node=_logger.schema)


@dataclass
class SampleConfig:
    """``sample.py`` (conf/sample.yaml): what to generate. The model, its tokenizer
    and sharding are the run's own (src/runs/from_run.py)."""

    run: str = MISSING  # a run dir of train.py, or a checkpoint in one
    prompt: str = MISSING
    num_samples: int = MISSING
    max_new_tokens: int = MISSING
    temperature: float = MISSING  # 0 = greedy
    top_k: int | None = MISSING  # null = the whole vocabulary
    seed: int = MISSING
    devices: Any = MISSING  # ranks: an int >= 1 or auto
    kv_cache: bool = MISSING  # native families: decode with a KV cache
    trust_remote_code: bool = MISSING  # run the code the run's config names


@dataclass
class EvalConfig:
    """``eval.py`` (conf/eval.yaml): loss and perplexity of a run's checkpoint."""

    run: str = MISSING  # a run dir of train.py, or a checkpoint in one
    data: Any = None  # null: the run's data; else a data option (data=files ...)
    split: str | None = MISSING  # val, train or all (null: see evaluation.eval_split)
    batches: Any = MISSING  # null: the run's trainer.val_batches; an int; or all
    batch_size: int | None = MISSING  # sequences per batch; null: the run's micro-batch
    devices: Any = MISSING  # ranks: an int >= 1 or auto
    trust_remote_code: bool = MISSING  # run the code the run's config names


_store.store(name="base_sample", node=SampleConfig)
_store.store(name="base_eval", node=EvalConfig)


# ------------------------------------------------------------------- validation


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _choice(cfg: DictConfig, key: str, allowed: Sequence[str]) -> None:
    value = OmegaConf.select(cfg, key)
    _require(
        value in allowed, key, f"got {value!r}, expected one of: {', '.join(allowed)}"
    )


def _positive_int(cfg: DictConfig, key: str, minimum: int = 1) -> None:
    value = OmegaConf.select(cfg, key)
    _require(value >= minimum, key, f"got {value}, expected an integer >= {minimum}")


MAX_TIMEOUT_S = 2_147_483  # s: 2^31 - 1 ms (tested with gloo; Python's timedelta
# overflows near 1e14 s)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def reject_non_finite(node: DictConfig) -> None:
    """Fail on a number that is not finite (``inf``, ``nan``, or ``1e400``, which
    YAML reads as inf) at any key: no float setting means infinity."""

    def walk(value: Any, key: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"got {value}, expected a finite number")
        items = value.items() if isinstance(value, dict) else ()
        if isinstance(value, list):
            items = ((f"[{i}]", v) for i, v in enumerate(value))
        for k, v in items:
            walk(v, f"{key}{'' if str(k).startswith('[') else '.'}{k}".lstrip("."))

    try:
        values = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException:
        return  # an interpolation that does not resolve: reported where it is read
    walk(values, "")


def refuse_null_groups(args: Sequence[str]) -> None:
    """``trainer=null`` on the command line for a group of conf/: Hydra's defaults
    list fails on it with a traceback. One line naming the group and its options
    instead. (``logger=none`` is an option, not null.)"""
    groups = set(user_groups())
    for arg in args:
        key, sep, value = arg.partition("=")
        group = key.lstrip("+")
        value = value.strip()
        if sep and group in groups and value.lower() == "null":
            raise ConfigError(
                group,
                f"got {value}, expected one of: {', '.join(user_options(group))}",
            )


def reject_unknown_keys(node: DictConfig, prefix: str = "") -> None:
    """Fail on a key that no schema declares, at any depth.

    Hydra's ``+key=value`` adds keys to structured nodes (it opens them for the
    append), so a typo written with ``+`` would otherwise be accepted silently.
    Nodes without a dataclass type (free-form dicts) are left alone.
    """
    schema = OmegaConf.get_type(node)
    known = (
        {f.name for f in dataclasses.fields(schema)}
        if dataclasses.is_dataclass(schema)
        else None
    )
    for key in node.keys():
        full_key = f"{prefix}{key}"
        _require(
            known is None or key in known,
            full_key,
            f"unknown key, expected one of: {', '.join(sorted(known or ()))}",
        )
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing():
            reject_unknown_keys(child, f"{full_key}.")


def refuse_schemas(cfg: DictConfig) -> None:
    """``model=schema/<family>``, ``data=base_<source>`` and ``logger=schema/<name>``
    are the types of a group's options (registered above), not options: picked on the
    command line they give a node without a preset's values (an 8B-parameter default
    Llama, ``data.name`` unset). Refused, naming the options of conf/."""
    unset = {
        "model": ("name", not cfg.model.get("name")),
        "data": ("name", OmegaConf.is_missing(cfg.data, "name")),
        "logger": ("backend", OmegaConf.is_missing(cfg.logger, "backend")),
    }
    for group, (key, schema) in unset.items():
        if not schema:
            continue
        chosen = _chosen_option(group)
        if chosen is not None and not is_schema_option(chosen):
            # An option's own YAML (a new one, most likely) lacks the key that names it.
            raise ConfigError(
                f"{group}.{key}",
                f"not set by the {group}={chosen} option; its YAML must set it "
                "(docs/architecture.md, Where to add)",
            )
        options = [o for o in user_options(group) if not is_schema_option(o)]
        raise ConfigError(
            group,
            f"an internal schema was picked, not an option; expected {group}= one "
            f"of: {', '.join(options)}",
        )


def _chosen_option(group: str) -> str | None:
    """The option of ``group`` this Hydra job composed (None outside a Hydra job)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get(group)
    except ValueError:
        return None


def check_pretrained_dir(cfg: DictConfig) -> None:
    """``model.pretrained``: an existing directory of safetensors (checked before the
    model is resolved: ``model=hf`` reads its config from there)."""
    path = cfg.model.pretrained
    if path is None:
        return
    path = os.path.expanduser(path)
    _require(os.path.isdir(path), "model.pretrained", f"no such directory {path!r}")
    _require(
        any(f.endswith(".safetensors") for f in os.listdir(path)),
        "model.pretrained",
        f"no .safetensors files in {path!r} (save with save_pretrained)",
    )


def check_pretrained(cfg: DictConfig, resolved: Resolved) -> None:
    """``model.pretrained`` (its directory checked by :func:`check_pretrained_dir`):
    tensors of the shapes of the configured model (read from the file headers and a
    meta-device build), for a family with a Hugging Face adapter."""
    path = cfg.model.pretrained
    if path is None:
        return
    spec, config = resolved.spec, resolved.model_config
    _require(
        spec.hf is not None,
        "model.pretrained",
        f"model family {spec.name!r} has no Hugging Face adapter to load weights with",
    )
    path = os.path.expanduser(path)
    from src.checkpoint.export import check_hf_shapes
    from src.checkpoint.hf_layout import HFLayout

    with torch.device("meta"):
        model = spec.build(config, 0)
    shapes = {
        spec.hf.to_hf_name(n): p.shape[::-1] if spec.hf.transposed(n) else p.shape
        for n, p in model.named_parameters()
    }
    layout = keyed(
        "model.pretrained", HFLayout, spec.hf.converting_model(config), shapes
    )
    keyed("model.pretrained", check_hf_shapes, layout.disk_shapes, path)


def _check_fsdp2_knobs(s: DictConfig, shard_size: int) -> None:
    """``reshard_after_forward`` as FSDP2 takes it, and the prefetch depths."""
    raf = s.reshard_after_forward
    key = "sharding.reshard_after_forward"
    backend = BACKENDS[s.backend]
    if not isinstance(raf, bool):
        partial = " or sharding=".join(with_capability("partial_reshard"))
        _require(
            isinstance(raf, int) and backend.partial_reshard,
            key,
            f"got {raf!r}, expected true, false or (sharding={partial}) a group size",
        )
        _require(
            1 < raf < shard_size and shard_size % raf == 0,
            key,
            f"got {raf}, expected true, false or a divisor of the {shard_size} ranks "
            "each parameter is sharded over, strictly between 1 and that number",
        )
    for knob in ("forward_prefetch", "backward_prefetch"):
        depth = s[knob]
        _require(
            depth is None or depth >= 0,
            f"sharding.{knob}",
            f"got {depth}, expected null (FSDP2's default) or a depth >= 0",
        )
        _require(
            depth is None or backend.explicit_prefetch,
            f"sharding.{knob}",
            f"explicit prefetch needs sharding="
            f"{' or sharding='.join(with_capability('explicit_prefetch'))}; "
            f"got sharding={s.backend}",
        )


def validate(cfg: DictConfig) -> Resolved:
    """Check what the schema's types cannot, so a bad run fails before any rank starts,
    and return what it resolved (world size, model spec and config, policy classes)
    for the launcher and the ranks.

    Raises :class:`ConfigError` (one line naming the key) at the first problem.
    """
    reject_unknown_keys(cfg)
    reject_non_finite(cfg)
    refuse_schemas(cfg)
    cap = cfg.sweep.mem_cap_gib
    _choice(cfg, "sweep.objective", OBJECTIVES)
    _require(
        cfg.sweep.direction is None or cfg.sweep.direction in DIRECTIONS,
        "sweep.direction",
        f"got {cfg.sweep.direction!r}, expected null (the objective's own), "
        + " or ".join(DIRECTIONS),
    )
    _require(
        cap is None or cap > 0, "sweep.mem_cap_gib", f"got {cap}, expected null or > 0"
    )
    check_pretrained_dir(cfg)  # first: model=hf reads its config from there
    resolved = resolve(cfg)
    check_pretrained(cfg, resolved)
    _check_init(cfg, resolved.spec)
    _check_sharding(cfg, resolved.world_size)
    _check_tensor_parallel(cfg, resolved)
    _check_pipeline(cfg, resolved)
    _check_batches(cfg, resolved.world_size)
    _check_trainer(cfg, resolved)
    # The chosen data source and logger check their own keys.
    _choice(cfg, "data.name", DATA_SOURCES)
    DATA_SOURCES[cfg.data.name].check(cfg.data)
    _choice(cfg, "logger.backend", LOGGERS)
    LOGGERS[cfg.logger.backend].check(cfg.logger)
    return resolved


def _check_init(cfg: DictConfig, spec: ModelSpec) -> None:
    """``model.init_device`` against the family and the backend (checked here)."""
    m, s = cfg.model, cfg.sharding
    _choice(cfg, "model.init_device", INIT_DEVICES)
    _require(
        m.init_device != "meta" or spec.init_tensor is not None,
        "model.init_device",
        f"meta needs a per-parameter init, which model family {spec.name!r} has not",
    )
    _choice(cfg, "sharding.backend", BACKENDS)
    _require(
        m.init_device != "meta" or BACKENDS[s.backend].meta_init,
        "model.init_device",
        f"meta needs sharding={' or sharding='.join(with_capability('meta_init'))}, "
        f"not sharding={s.backend}",
    )
    _require(
        m.init_device != "cuda" or torch.cuda.is_available(),
        "model.init_device",
        "cuda requested but no CUDA device is visible; use cpu or meta",
    )


def _check_sharding(cfg: DictConfig, world_size: int) -> None:
    """The ``sharding`` and ``precision`` keys, against what the backend can do."""
    s = cfg.sharding
    backend = BACKENDS[s.backend]
    _require(
        s.min_params == "auto" or (_is_number(s.min_params) and s.min_params >= 0),
        "sharding.min_params",
        f"got {s.min_params!r}, expected a number >= 0 (such as 1e8) or auto",
    )
    _choice(cfg, "sharding.activation_checkpointing", (*CHECKPOINTING, "auto"))
    _positive_int(cfg, "sharding.activation_checkpointing_every")
    _choice(cfg, "precision.name", PRECISIONS)
    _require(
        s.replicate >= 1, "sharding.replicate", f"got {s.replicate}, expected >= 1"
    )
    _require(
        s.replicate == 1 or backend.hybrid,
        "sharding.replicate",
        f"hybrid sharding (replicate={s.replicate}) needs sharding="
        f"{' or '.join(with_capability('hybrid'))}, not sharding={s.backend}",
    )
    _require(
        world_size % s.replicate == 0,
        "sharding.replicate",
        f"{s.replicate} does not divide the {world_size} devices "
        "(each replica group shards over devices / replicate ranks)",
    )
    tp = s.tensor_parallel if s.tensor_parallel >= 1 else 1
    _check_fsdp2_knobs(s, world_size // s.replicate // tp)
    _require(
        backend.distributed or world_size == 1,
        "trainer.devices",
        f"sharding={s.backend} trains one process, got {world_size} devices; "
        f"use trainer.devices=1 or sharding={'/'.join(with_capability('distributed'))}",
    )


def _check_tensor_parallel(cfg: DictConfig, resolved: Resolved) -> None:
    """``sharding.tensor_parallel`` and ``sharding.sequence_parallel``: the backend,
    the mesh (T divides each replica group) and the family's plan for the shape."""
    s, world_size = cfg.sharding, resolved.world_size
    backend = BACKENDS[s.backend]
    tp = s.tensor_parallel
    _require(tp >= 1, "sharding.tensor_parallel", f"got {tp}, expected >= 1")
    _require(
        tp == 1 or backend.tensor_parallel,
        "sharding.tensor_parallel",
        f"tensor parallelism needs sharding="
        f"{' or sharding='.join(with_capability('tensor_parallel'))}, "
        f"not sharding={s.backend}",
    )
    _require(
        (world_size // s.replicate) % tp == 0,
        "sharding.tensor_parallel",
        f"{tp} does not divide the {world_size // s.replicate} ranks of each replica "
        f"group ({world_size} devices / replicate={s.replicate})",
    )
    _require(
        s.sequence_parallel is None or tp > 1 or not s.sequence_parallel,
        "sharding.sequence_parallel",
        "true needs sharding.tensor_parallel > 1 (it shards along the tp ranks)",
    )
    tensor_parallel_plan(cfg, resolved.spec, resolved.model_config)


#: What a pipeline-parallel run does not do yet: the key, the value that is
#: refused, and why.
PP_UNSUPPORTED = (
    ("precision.name", lambda v: v == "fp16_mixed", "fp16's gradient scaler"),
    ("sharding.sequence_parallel", lambda v: bool(v), "sequence parallelism"),
)


def _check_pipeline(cfg: DictConfig, resolved: Resolved) -> None:
    """``sharding.pipeline_parallel`` and the ``sharding.pp_*`` keys: the backend,
    the mesh, the schedule, the family's layout and the stage cut."""
    s, spec, world_size = cfg.sharding, resolved.spec, resolved.world_size
    pp = s.pipeline_parallel
    _require(pp >= 1, "sharding.pipeline_parallel", f"got {pp}, expected >= 1")
    _choice(cfg, "sharding.pp_schedule", tuple(SCHEDULES))
    _positive_int(cfg, "sharding.pp_microbatches")
    if pp == 1:
        _require(
            not s.pp_split,
            "sharding.pp_split",
            f"{list(s.pp_split)} cuts pipeline stages, but sharding.pipeline_parallel"
            "=1 (no pipeline); set sharding.pipeline_parallel or sharding.pp_split=[]",
        )
        return
    _require(
        BACKENDS[s.backend].pipeline_parallel,
        "sharding.pipeline_parallel",
        f"pipeline parallelism needs sharding="
        f"{' or sharding='.join(with_capability('pipeline_parallel'))}, "
        f"not sharding={s.backend}",
    )
    refused = SCHEDULES[s.pp_schedule].refused
    _require(not refused, "sharding.pp_schedule", f"{s.pp_schedule}: {refused}")
    per_group = s.replicate * s.tensor_parallel
    _require(
        world_size % (pp * per_group) == 0,
        "sharding.pipeline_parallel",
        f"{pp} stages x replicate={s.replicate} x tensor_parallel="
        f"{s.tensor_parallel} do not divide the {world_size} devices",
    )
    _require(
        spec.pipeline is not None and spec.init_tensor is not None,
        "sharding.pipeline_parallel",
        f"model family {spec.name!r} has no pipeline layout (ModelSpec.pipeline) "
        "and per-parameter init",
    )
    layout = keyed("sharding.pipeline_parallel", spec.pipeline, resolved.model_config)
    for key, refuses, what in PP_UNSUPPORTED:
        value = OmegaConf.select(cfg, key)
        _require(
            not refuses(value),
            key,
            f"{value!r}: {what} with sharding.pipeline_parallel > 1 is not supported "
            "yet",
        )
    with torch.device("meta"):
        model = spec.build(resolved.model_config, 0)
    blocks = len(model.get_submodule(layout.blocks))
    stages = pp * SCHEDULES[s.pp_schedule].stages_per_rank
    keyed(
        "sharding.pp_split" if s.pp_split else "sharding.pipeline_parallel",
        split_blocks,
        blocks,
        stages,
        list(s.pp_split),
    )
    _require(
        s.pp_microbatches >= pp,
        "sharding.pp_microbatches",
        f"got {s.pp_microbatches}, expected at least the {pp} pipeline stages",
    )
    problem = microbatches_problem(s.pp_schedule, pp, s.pp_microbatches)
    _require(not problem, "sharding.pp_microbatches", f"{s.pp_microbatches}: {problem}")


def _check_batches(cfg: DictConfig, world_size: int) -> None:
    """The step counts, gradient accumulation, the memory budget, and a batch that
    splits into micro-batches over the ranks."""
    t = cfg.trainer
    for key in ("max_steps", "batch_size", "log_every"):
        _positive_int(cfg, f"trainer.{key}")
    for key in ("val_every", "val_batches", "ckpt_every", "warmup_steps", "keep_last"):
        _positive_int(cfg, f"trainer.{key}", minimum=0)
    _positive_int(cfg, "trainer.max_restarts", minimum=0)
    _positive_int(cfg, "trainer.sample_every", minimum=0)
    _positive_int(cfg, "trainer.sample_tokens")
    _require(
        not t.sample_every or DATA_SOURCES[cfg.data.name].tokenized,
        "trainer.sample_every",
        f"samples need text: data={cfg.data.name} has no tokenizer",
    )
    _choice(cfg, "trainer.log_level", LOG_LEVELS)
    _positive_int(cfg, "trainer.profile_start")
    _positive_int(cfg, "trainer.profile_steps")
    _require(
        not t.profile or t.profile_start <= t.max_steps,
        "trainer.profile_start",
        f"got {t.profile_start}, after the last step (trainer.max_steps={t.max_steps})",
    )
    accum = t.grad_accum
    _require(
        accum == "auto" or (_is_number(accum) and int(accum) == accum and accum >= 1),
        "trainer.grad_accum",
        f"got {accum!r}, expected an integer >= 1 or auto",
    )
    _choice(cfg, "trainer.grad_sync", ("auto", *GRAD_SYNC))
    budget_bytes(t.mem_budget_gib)
    _require(
        _is_number(t.mem_margin) and 0 <= t.mem_margin < 1,
        "trainer.mem_margin",
        f"got {t.mem_margin!r}, expected a fraction in [0, 1) such as 0.1",
    )
    mmap = t.malloc_mmap_threshold_kib
    _require(
        mmap is None or (_is_number(mmap) and int(mmap) == mmap and 0 < mmap <= 32768),
        "trainer.malloc_mmap_threshold_kib",
        f"got {mmap!r}, expected KiB in 1..32768 (glibc's limit) or null",
    )
    accum = 1 if accum == "auto" else int(accum)
    micro = t.batch_size // accum
    # the ranks of a tp group, and the stages of a pipeline, read the same rows
    dp = world_size // (cfg.sharding.tensor_parallel * cfg.sharding.pipeline_parallel)
    _require(
        t.plan_only or (t.batch_size % accum == 0 and micro % dp == 0),
        "trainer.batch_size",
        f"{t.batch_size} must split into trainer.grad_accum={t.grad_accum} micro-batches"
        f" that divide evenly over {dp} data-parallel rank(s)",
    )
    m = cfg.sharding.pp_microbatches
    _require(
        t.plan_only
        or cfg.sharding.pipeline_parallel == 1
        or (micro // max(1, dp)) % m == 0,
        "sharding.pp_microbatches",
        f"{m} does not divide each rank's {micro // max(1, dp)} rows per micro-step "
        f"(trainer.batch_size={t.batch_size} / grad_accum / {dp} data-parallel ranks)",
    )


def _check_trainer(cfg: DictConfig, resolved: Resolved) -> None:
    """Export, the optimizer's numbers, timeouts, peak FLOPs and resuming."""
    t, spec = cfg.trainer, resolved.spec
    _require(
        t.export in EXPORTS,
        "trainer.export",
        f"got {t.export!r}, expected false, true (model.safetensors) or hf",
    )
    _require(
        t.export != "hf" or spec.hf is not None,
        "trainer.export",
        f"hf needs a Hugging Face adapter, which model family {spec.name!r} has not",
    )
    if t.export == "hf":  # a shape transformers' class cannot hold (GPT without bias)
        keyed("trainer.export", spec.hf.hf_config, resolved.model_config)
    _require(t.lr > 0, "trainer.lr", f"got {t.lr}, expected > 0")
    _require(
        0 <= t.min_lr <= t.lr, "trainer.min_lr", f"got {t.min_lr}, expected [0, lr]"
    )
    _require(
        len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas),
        "trainer.betas",
        f"got {list(t.betas)}, expected two numbers in [0, 1)",
    )
    _require(t.weight_decay >= 0, "trainer.weight_decay", "expected a number >= 0")
    _require(t.grad_clip >= 0, "trainer.grad_clip", "expected >= 0 (0 = off)")
    _require(
        0 < t.timeout_s <= MAX_TIMEOUT_S,
        "trainer.timeout_s",
        f"got {t.timeout_s:g}, expected seconds > 0 and <= {MAX_TIMEOUT_S} (24 days)",
    )
    _require(
        t.peak_tflops is None or t.peak_tflops > 0,
        "trainer.peak_tflops",
        "expected null (table or probe) or a positive number",
    )
    _choice(cfg, "trainer.resume_schedule", RESUME_SCHEDULES)
    _require(
        t.resume in (None, "auto") or os.path.exists(os.path.expanduser(t.resume)),
        "trainer.resume",
        f"got {t.resume!r}, expected null, auto or an existing checkpoint path",
    )


def written_dirs(cfg: DictConfig, wandb: bool = True) -> list[tuple[str, str, str]]:
    """Every directory outside its run dir a training run of ``cfg`` writes to: (the
    key or environment variable that moves it, the directory, what writes there);
    wandb's only with ``wandb`` (a command that logs as the run did). The token cache
    only where it does not exist yet: an existing one (perhaps shared, read-only) is
    written only when an entry must be built, and checked there (``build_lock``)."""
    if OmegaConf.select(cfg, "trainer.plan_only", default=False):
        return []  # reads no data, starts no rank
    dirs = []
    if OmegaConf.select(cfg, "data.cache_dir", default=None) is not None:
        cache = cache_path(cfg.data)
        if not os.path.isdir(os.path.expanduser(cache)):
            dirs.append(("data.cache_dir", cache, "the token cache"))
    if wandb and logs_to_wandb(cfg):
        dirs += [(var, path, "wandb") for var, path in wandb_dirs()]
    if OmegaConf.select(cfg, "sharding.compile", default=False):
        dirs.append((*compile_cache_dir(), "torch.compile (sharding.compile=true)"))
    if OmegaConf.select(cfg, "model.trust_remote_code", default=False):
        what = "transformers (model.trust_remote_code=true)"
        dirs.append((*remote_code_dir(), what))
    return dirs


def check_writable(
    cfg: DictConfig,
    first: tuple[str, str, str] | None = None,
    others: bool = True,
    wandb: bool = True,
) -> None:
    """ConfigError naming the key (or environment variable) to change, if a
    directory the command writes to cannot be written: ``first`` (the key, the
    directory, what writes there: the run dir) and, with ``others``, the
    :func:`written_dirs` of ``cfg`` (wandb's with ``wandb``)."""
    dirs = ([first] if first else []) + (written_dirs(cfg, wandb) if others else [])
    home = os.path.expanduser("~")
    for key, path, what in dirs:
        problem = unwritable(os.path.expanduser(path))
        if problem is None and first is not None and key == first[0]:
            # its own files: the top level, Hydra's record and the ranks' reports
            # (checkpoints/ is verified file by file; wandb/ is wandb's own links)
            planted = planted_file(os.path.expanduser(path), (RECORD, RANK_REPORTS))
            if planted:
                # eval.py's run= names the run it reads: no other directory will do
                elsewhere = (
                    "" if key == "run" else f" (or set {key} to another directory)"
                )
                raise ConfigError(
                    key,
                    f"{what} writes to {path}: {planted}; it writes only to its own "
                    f"regular files there: remove it{elsewhere}",
                )
        if problem is None:
            continue
        err = not_writable(key, path, what, problem)
        if key not in os.environ and "." not in key and path.startswith(home + os.sep):
            err = ConfigError(
                key, f"{err.message} (or HOME, {home}: it is there by default)"
            )
        raise err


class WritableDirs(Callback):
    """Hydra callback (conf/config.yaml): before Hydra creates the run dir and starts
    its job logging (which writes ``train.log`` there), the run (or sweep) dir and
    the other directories the run writes to are checked (:func:`check_writable`);
    one that cannot be written ends the command in one line naming the key (exit 2)
    instead of Hydra's logging set-up failing over 50 lines. A resume's own dirs are
    its recorded config's: :func:`continue_run` checks them."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    def _check(self, config: DictConfig, key: str) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra, before = HydraConfig.instance(), HydraConfig.instance().cfg
        hydra.set_config(config)  # for ${hydra:...} in the dir, as Hydra's run_job
        try:
            what = "the sweep" if key == "hydra.sweep.dir" else "the run"
            first = (key, str(OmegaConf.select(config, key)), what)
            resume = OmegaConf.select(config, "trainer.resume", default=None)
            # sys.exit inside: Hydra turns a callback's exception into a warning
            with exit_on_config_error():
                check_writable(config, first, others=resume in (None, "none"))
        finally:
            hydra.cfg = before


def refuse_recorded_code(cfg: DictConfig, where: str, key: str, given: bool) -> None:
    """A recorded config (a checkpoint's meta.json, a run's ``.hydra/config.yaml``)
    is data: code it names in a directory (``model.trust_remote_code=true``: the HF
    config dir's own classes) runs only when this command line says so (``given``:
    ``key``=true on it). ConfigError naming ``key``, and the directory, otherwise;
    checked before anything reads the model's config, which would run that code."""
    if given or not OmegaConf.select(cfg, "model.trust_remote_code", default=False):
        return
    directory = OmegaConf.select(cfg, "model.config", default=None)
    raise ConfigError(
        key,
        f"{where} records model.trust_remote_code=true, which runs the Python code "
        f"in {directory}; a recorded config is data and runs no code on its own "
        f"word: give {key}=true on the command line to run it",
    )


def compose_run(saved: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """A saved run's config (``<run dir>/.hydra/config.yaml``) typed by today's
    schema: conf/ composed with the run's command-line ``overrides``, the saved values
    merged over it, so keys the run predates get today's defaults. If that fails (an
    option removed since), the saved config as it is."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    try:
        if GlobalHydra.instance().is_initialized():  # inside sample.py's, eval.py's
            base = compose("config", overrides=list(overrides))
        else:
            with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
                base = compose("config", overrides=list(overrides))
        return OmegaConf.merge(base, saved)
    except (HydraException, OmegaConfBaseException, ValueError):
        return saved


def continue_run(cfg: DictConfig, run_dir: str) -> tuple[DictConfig, set[str] | None]:
    """train.py's config in ``run_dir`` (this Hydra job's) and the keys its user set
    (None: this command line's), decided before any rank starts; see
    :func:`resume_config`. The directories that config writes to are checked
    (:func:`check_writable`: a resume's are those of the config it resumes, a
    sweep job's its own)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        hydra = HydraConfig.get()
    except ValueError:  # not a Hydra job: the config is the run's as it is
        cfg, user_keys = cfg, None
    else:
        cfg, user_keys = resume_config(
            cfg,
            run_dir,
            [str(o) for o in hydra.overrides.task],
            dict(hydra.runtime.choices),
            hydra.output_subdir,
        )
    check_writable(cfg)
    return cfg, user_keys


def resume_config(
    cfg: DictConfig,
    run_dir: str,
    overrides: Sequence[str],
    choices: Mapping[str, str],
    attempt: str | None,
) -> tuple[DictConfig, set[str] | None]:
    """A run dir is a run (src/runs/resume.py). A fresh start (``trainer.resume=null``)
    in a dir that holds a run is refused. A resume starts from the config its
    checkpoint was saved with (before there is one, the run's record): the command
    line's ``overrides`` (``cfg`` composed from them, ``choices`` its groups' options)
    are changes to it, each said in one line; one the checkpoint cannot take is
    refused naming the key and the recorded value. ``attempt``: where Hydra wrote
    this attempt's files (``.hydra`` for the run's first). Returns the config and the
    keys its user set (None: the command line's)."""
    if _rank0() and in_use(run_dir):
        return cfg, None  # the launcher refuses it, naming the live run
    progress = run_progress(run_dir)
    wanted = "auto" if restart_reason(cfg) else cfg.trainer.resume
    if wanted is None:
        if progress is not None:
            raise ConfigError(
                "trainer.resume",
                f"null, but {run_dir} holds a run ({progress.describe()}); resume it "
                f"with `python train.py hydra.run.dir={run_dir} trainer.resume=auto` "
                "(changes after it), or start over in another hydra.run.dir (or "
                "after deleting this one)",
            )
        _adopt(run_dir, attempt)  # the record's attempt never trained
        return cfg, None
    try:
        checkpoint = resolve_resume(wanted, run_checkpoints(run_dir))
    except FileNotFoundError as err:
        raise ConfigError("trainer.resume", str(err).partition(": ")[2]) from None
    record = None if attempt == RECORD else keyed("hydra.run.dir", run_record, run_dir)
    saved = checkpoint_config(checkpoint) if checkpoint is not None else None
    if saved is None and (record is None or progress is None):
        # Nothing recorded to continue from: this command line is the run's config.
        _adopt(run_dir, attempt)
        return cfg, None
    base = OmegaConf.create(saved) if saved is not None else record.config
    base_overrides = record.overrides if record is not None else list(overrides)
    base = compose_run(base, base_overrides)
    changes = requested_changes(
        cfg, list(overrides), dict(choices), record.choices if record else {}
    )
    changes["trainer.resume"] = cfg.trainer.resume
    where = f"checkpoint {checkpoint}" if saved is not None else f"{run_dir}/{RECORD}"
    refuse_recorded_code(
        base,
        where,
        "model.trust_remote_code",
        changes.get("model.trust_remote_code") is True,
    )
    new = resumed_with(base, changes)
    changed = differences(base, new)
    for key, before, after in changed if checkpoint is not None else ():
        reason = refusal(key)
        if reason:
            raise ConfigError(
                key,
                f"{before!r} was recorded by {where}, got {after!r}: {reason} "
                "(train another in a new hydra.run.dir)",
            )
        if key == "trainer.max_steps" and new.trainer.resume_schedule != "extend":
            raise schedule_refusal(after, before, checkpoint)
    if changed:
        source = "its checkpoint's" if saved is not None else "its recorded"
        log.info(
            "resuming %s with %d change(s) to %s config:",
            run_dir,
            len(changed),
            source,
        )
    for key, before, after in changed:
        log.info("  %s: %r -> %r", key, before, after)
    if attempt == RECORD:  # this attempt's own record: the config it trains with
        OmegaConf.save(new, Path(run_dir) / RECORD / "config.yaml")
    return new, override_keys(base_overrides) | set(changes)


def _adopt(run_dir: str, attempt: str | None) -> None:
    """This attempt's Hydra files become the record of a run dir whose record's
    attempt never trained (by rank 0 alone under torchrun)."""
    if attempt not in (None, RECORD) and _rank0():
        adopt_attempt(run_dir, attempt)


def _rank0() -> bool:
    """This process is rank 0 (under torchrun every rank runs train.py; the others
    read the same run dir and never hold its lock)."""
    return int(os.environ.get("RANK", 0)) == 0


def open_run(
    run: str,
    changes: Callable[[DictConfig], Mapping[str, Any]],
    record: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Path, Path, DictConfig, Resolved]:
    """The start of sample.py and eval.py: the run dir and checkpoint of ``run=``, and
    the config the checkpoint was saved with (else the run's record) typed by today's
    schema (:func:`compose_run`), changed by
    ``changes(config)``, validated and prepared as train.py prepares it (the keys its
    user set stay theirs). Before anything is prepared, the dirs the command writes
    to are checked (:func:`check_writable`): with ``record`` (a file it writes in the
    run dir, and logs to wandb as the run did: eval.py) the run dir and wandb's too.
    The code the run's config names runs only with ``trust_remote_code`` (the
    command's own key: :func:`refuse_recorded_code`). A problem is a ConfigError
    naming the key."""
    run_dir, checkpoint = find_run(run)
    cfg, overrides = run_config(run_dir)
    saved = checkpoint_config(checkpoint)  # a resume may have changed the record's
    cfg = compose_run(cfg if saved is None else OmegaConf.create(saved), overrides)
    where = f"checkpoint {checkpoint}" if saved else f"{run_dir}/{RUN_CONFIG}"
    refuse_recorded_code(cfg, where, "trust_remote_code", trust_remote_code)
    cfg = with_changes(cfg, changes(cfg))
    resolved = validate(cfg)
    first = ("run", str(run_dir), record) if record else None
    check_writable(cfg, first, wandb=record is not None)
    cfg, resolved = prepare(cfg, resolved, override_keys(overrides))
    return run_dir, checkpoint, cfg, resolved


def validate_sample(cfg: DictConfig) -> None:
    """sample.py's own keys (the run's config is checked by :func:`validate`)."""
    reject_unknown_keys(cfg)
    reject_non_finite(cfg)
    _positive_int(cfg, "num_samples")
    _positive_int(cfg, "max_new_tokens")
    _require(
        cfg.temperature >= 0, "temperature", f"got {cfg.temperature}, expected >= 0"
    )
    _require(
        cfg.top_k is None or cfg.top_k >= 1,
        "top_k",
        f"got {cfg.top_k}, expected null or an integer >= 1",
    )
    keyed("devices", resolve_devices, cfg.devices)


def validate_eval(cfg: DictConfig) -> None:
    """eval.py's own keys (the run's config, with ``data`` replaced, is checked by
    :func:`validate`)."""
    reject_unknown_keys(cfg)
    reject_non_finite(cfg)
    _require(
        cfg.split is None or cfg.split in EVAL_SPLITS,
        "split",
        f"got {cfg.split!r}, expected null (val; all of data= given) or one of: "
        f"{', '.join(EVAL_SPLITS)}",
    )
    batches = cfg.batches
    _require(
        batches in (None, "all") or (_is_number(batches) and int(batches) >= 1),
        "batches",
        f"got {batches!r}, expected null (the run's trainer.val_batches), an integer "
        ">= 1 or all",
    )
    _require(
        cfg.batch_size is None or cfg.batch_size >= 1,
        "batch_size",
        f"got {cfg.batch_size}, expected null (the run's micro-batch) or >= 1",
    )
    keyed("devices", resolve_devices, cfg.devices)


# ------------------------------------------------------------ one-line errors


def _allowed_keys(cause: OmegaConfBaseException) -> list[str]:
    """The schema's keys next to the unknown key of ``cause`` (the family's schema for
    a ``model.*`` key)."""
    schema = getattr(cause, "object_type", None)
    if dataclasses.is_dataclass(schema):
        return [f.name for f in dataclasses.fields(schema)]
    parent = cause.full_key.rpartition(".")[0]
    node = OmegaConf.structured(Config)
    node = OmegaConf.select(node, parent) if parent else node
    return list(node.keys()) if isinstance(node, DictConfig) else []


def one_line(err: BaseException) -> str:
    """A config error as one line that starts with the key (Hydra's and OmegaConf's
    messages run over several lines and end with a hint about HYDRA_FULL_ERROR)."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, MissingConfigException) and err.options:
        group = (err.missing_cfg_file or "").rpartition("/")[0] or "config"
        wanted = (err.missing_cfg_file or "").rpartition("/")[2]
        return (
            f"{group}: no option {wanted!r}, expected one of: {', '.join(err.options)}"
        )
    if isinstance(err, OverrideParseException):
        return f"{err.override}: {err.message.splitlines()[0]}"
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        msg = str(getattr(cause, "msg", cause)).strip().splitlines()[0]
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            allowed = _allowed_keys(cause)
            if allowed:
                msg = f"unknown key, expected one of: {', '.join(allowed)}"
        return f"{cause.full_key}: {msg}"
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


CONFIG_ERRORS = (ConfigError, HydraException, OmegaConfBaseException)

# An element of an override's value (the whole value, or an item of a list or of a
# sweep) that starts with ``~`` (a home path) or holds ``<``/``>`` (``<stdlib>``): the
# characters Hydra's override lexer has no token for.
_PATH_ELEMENT = re.compile(r"(?:(?<=^)|(?<=[\[,]))\s*([^,\[\]'\"]*[~<>][^,\[\]'\"]*)")


def quote_paths(args: Sequence[str]) -> list[str]:
    """The command line's overrides with home paths and ``<stdlib>`` made parseable.

    ``model.pretrained=~/ckpt``, ``data.paths=~/corpus/**/*.jsonl`` and
    ``data.paths=[~/a/*.parquet,~/b/*.parquet]`` (as the docs write them) stop in
    Hydra's lexer: ``~`` is not a character of an unquoted value. An override that
    Hydra cannot parse gets each such element expanded (``~`` -> the home directory,
    as a shell does) and quoted; every other argument is passed on as it is.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()

    def parses(arg: str) -> bool:
        try:
            parser.parse_override(arg)
        except HydraException:  # the lexer's and the parser's errors
            return False
        return True

    def quoted(match: re.Match) -> str:
        element = os.path.expanduser(match.group(1).strip())
        return f"'{element}'" if "'" not in element else f'"{element}"'

    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if arg.startswith("-") or not eq or parses(arg):
            out.append(arg)
            continue
        fixed = f"{key}={_PATH_ELEMENT.sub(quoted, value)}"
        out.append(fixed if parses(fixed) else arg)  # else Hydra reports the original
    return out


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Turn a config error raised inside into one line on stderr and exit status 2
    (a RunError, such as a damaged checkpoint found by sample.py's or eval.py's
    ranks: ``error: ...``, exit status 1).

    ``sys.exit`` (not an exception) also inside a Hydra job: Hydra would print its
    own "Error executing job" line first.
    """
    try:
        yield
    except (*CONFIG_ERRORS, RunError) as err:
        config = isinstance(err, CONFIG_ERRORS)
        line = f"{'config error' if config else 'error'}: {one_line(err)}"
        error_line(log, line)  # stderr (and train.log once Hydra set it up)
        exit_ = SystemExit(2 if config else 1)
        exit_.add_note(line)  # what a sweep records for the job (src/trainer/sweep.py)
        raise exit_ from err


def run_cli(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function; a config error exits 2 with one line on stderr.

    Hydra prints override errors over several lines and strips tracebacks only for its
    own exceptions; with ``HYDRA_FULL_ERROR=1`` it re-raises instead, which lets us
    format them. A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full report.
    """
    sys.argv[1:] = quote_paths(sys.argv[1:])
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ[FULL_ERROR_ENV] = "1"  # the ranks show tracebacks too
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    with exit_on_config_error():
        refuse_null_groups(sys.argv[1:])
        try:
            main()
        except OSError as err:  # e.g. Hydra cannot create the run dir
            error_line(log, f"error: {err}")
            sys.exit(1)
