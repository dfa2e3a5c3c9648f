"""Validation: what the schema's types cannot express (ranges, choices,
``n_embd % n_head``, importable class paths, meta init needing FSDP2), checked by
:func:`validate`, which the entry point calls before any rank starts; and the own keys
of sample.py and eval.py (:func:`validate_sample`, :func:`validate_eval`). A problem
is a :class:`ConfigError`, one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from src.config.cli_help import is_schema_option, user_groups, user_options
from src.config.run_plan import (
    FLOAT8_KEYS,
    LAYOUT_KEYS,
    RunPlan,
    budget_bytes,
    resolve,
    resolve_devices,
    tensor_parallel_plan,
)
from src.config.schema import (
    CKPT_CHOICES,
    DIRECTIONS,
    EVAL_SPLITS,
    EXPORT_FORMATS,
    EXPORTS,
    GRAD_SYNC,
    INIT_DEVICES,
    LAYOUT_CHOICES,
    LR_SCHEDULES,
    MIN_LR_RATIO,
    OBJECTIVES,
    OPTIMIZERS,
    RESUME_SCHEDULES,
)
from src.data.sources import DATA_SOURCES
from src.errors import ConfigError, keyed
from src.models import ModelSpec
from src.observe.keys import is_task_metric
from src.observe.loggers import LOGGERS
from src.observe.logs import LOG_LEVELS
from src.sharding import (
    BACKENDS,
    CHECKPOINTING,
    PRECISIONS,
    ParallelLayout,
    with_capability,
)
from src.sharding.float8 import RECIPES, device_problem
from src.sharding.pipeline import SCHEDULES, microbatches_problem, split_blocks


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
    are the types of a group's options (registered by src/config/schema.py), not
    options: picked on the command line they give a node without a preset's values
    (an 8B-parameter default Llama, ``data.name`` unset). Refused, naming the options
    of conf/."""
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


def check_pretrained(resolved: RunPlan) -> None:
    """``model.pretrained`` (its directory checked by :func:`check_pretrained_dir`):
    tensors of the shapes of the configured model (read from the file headers and a
    meta-device build), for a family with a Hugging Face adapter."""
    path = resolved.pretrained
    if path is None:
        return
    spec, config = resolved.spec, resolved.model_config
    _require(
        spec.hf is not None,
        "model.pretrained",
        f"model family {spec.name!r} has no Hugging Face adapter to load weights with",
    )
    path = os.path.expanduser(path)
    from src.checkpoint.export import stored_layout
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
    keyed("model.pretrained", stored_layout, layout, path)


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


def validate(cfg: DictConfig) -> RunPlan:
    """Check what the schema's types cannot, so a bad run fails before any rank starts,
    and return what it resolved (world size, model spec and config, policy classes)
    for the launcher and the ranks.

    Raises :class:`ConfigError` (one line naming the key) at the first problem.
    """
    reject_unknown_keys(cfg)
    reject_non_finite(cfg)
    refuse_schemas(cfg)
    cap = cfg.sweep.mem_cap_gib
    objective = cfg.sweep.objective
    _require(
        objective in OBJECTIVES or is_task_metric(str(objective)),
        "sweep.objective",
        f"got {objective!r}, expected one of: {', '.join(OBJECTIVES)}, or a task's "
        "eval/<task>/<metric> (trainer.eval_tasks)",
    )
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
    check_pretrained(resolved)
    _check_init(cfg, resolved.spec)
    _check_sharding(cfg, resolved.layout)
    _check_float8(cfg)
    _check_tensor_parallel(resolved)
    _check_context_parallel(resolved)
    _check_pipeline(cfg, resolved.spec, resolved.model_config, resolved.layout.pp)
    _check_batches(cfg, resolved.layout)
    _check_trainer(cfg, resolved.spec, resolved.model_config)
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


def _check_sharding(cfg: DictConfig, layout: ParallelLayout) -> None:
    """The ``sharding`` and ``precision`` keys, and the run's parallel layout (its
    degrees already fit the world size), against what the backend can do."""
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
    _check_fsdp2_knobs(s, layout.fsdp_shard)
    _require(
        backend.distributed or layout.world_size == 1,
        "trainer.devices",
        f"sharding={s.backend} trains one process, got {layout.world_size} devices; "
        f"use trainer.devices=1 or sharding={'/'.join(with_capability('distributed'))}",
    )


def _check_float8(cfg: DictConfig) -> None:
    """precision=float8's keys (null under another precision) and the GPU it needs
    (sm89+); its all-gather keys are checked where they are read
    (``src.config.run_plan.float8_linears``)."""
    p = cfg.precision
    if not PRECISIONS[p.name].float8:
        for key in FLOAT8_KEYS:
            value = OmegaConf.select(cfg, key)
            _require(value is None, key, f"{value!r}: read by precision=float8 only")
        return
    _choice(cfg, "precision.recipe", RECIPES)
    if torch.cuda.is_available():
        problem = device_problem(torch.device("cuda", 0))
        _require(problem is None, "precision.name", f"float8: {problem}")


def _check_tensor_parallel(resolved: RunPlan) -> None:
    """``sharding.sequence_parallel`` and the family's tensor-parallel plan for the
    shape (the tp degree itself is checked with the layout)."""
    sp = resolved.unit.sequence_parallel
    _require(
        sp is None or resolved.layout.tp > 1 or not sp,
        "sharding.sequence_parallel",
        f"true needs {LAYOUT_KEYS['tp']} > 1 (it shards along the tp ranks)",
    )
    tensor_parallel_plan(resolved)


def _check_context_parallel(resolved: RunPlan) -> None:
    """With context parallelism: the model can split its sequences (the family's
    check, naming its key; the 2C chunks are the layout rule's, checked by
    ``resolve``)."""
    cp = resolved.layout.cp
    if cp <= 1:
        return
    spec, config = resolved.spec, resolved.model_config
    _require(
        spec.context_parallel is not None and spec.kv_width is not None,
        LAYOUT_KEYS["cp"],
        f"model family {spec.name!r} cannot split its sequences; use 1",
    )
    keyed(LAYOUT_KEYS["cp"], spec.context_parallel, config)


PP_KEY = LAYOUT_KEYS["pp"]

#: What a pipeline-parallel run does not do yet: the key, the value that is
#: refused, and why.
PP_UNSUPPORTED = (
    ("sharding.sequence_parallel", lambda v: bool(v), "sequence parallelism"),
)


def _check_pipeline(cfg: DictConfig, spec: ModelSpec, config: Any, pp: int) -> None:
    """``sharding.pipeline_parallel`` and the ``sharding.pp_*`` keys: the backend,
    the mesh, the schedule, the family's layout and the stage cut."""
    s = cfg.sharding
    _choice(cfg, "sharding.pp_schedule", tuple(SCHEDULES))
    _positive_int(cfg, "sharding.pp_microbatches")
    if pp == 1:
        _require(
            not s.pp_split,
            "sharding.pp_split",
            f"{list(s.pp_split)} cuts pipeline stages, but {PP_KEY}=1 (no "
            f"pipeline); set {PP_KEY} or sharding.pp_split=[]",
        )
        return
    refused = SCHEDULES[s.pp_schedule].refused
    _require(not refused, "sharding.pp_schedule", f"{s.pp_schedule}: {refused}")
    _require(
        spec.pipeline is not None and spec.init_tensor is not None,
        PP_KEY,
        f"model family {spec.name!r} has no pipeline layout (ModelSpec.pipeline) "
        "and per-parameter init",
    )
    layout = keyed(PP_KEY, spec.pipeline, config)
    for key, refuses, what in PP_UNSUPPORTED:
        value = OmegaConf.select(cfg, key)
        _require(
            not refuses(value),
            key,
            f"{value!r}: {what} with {PP_KEY} > 1 is not supported yet",
        )
    with torch.device("meta"):
        model = spec.build(config, 0)
    blocks = len(model.get_submodule(layout.blocks))
    stages = pp * SCHEDULES[s.pp_schedule].stages_per_rank
    keyed(
        "sharding.pp_split" if s.pp_split else PP_KEY,
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


def _check_batches(cfg: DictConfig, layout: ParallelLayout) -> None:
    """The step counts, gradient accumulation, the memory budget, and a batch that
    splits into micro-batches over the ranks."""
    t = cfg.trainer
    for key in ("max_steps", "batch_size", "log_every"):
        _positive_int(cfg, f"trainer.{key}")
    for key in ("val_every", "val_batches", "ckpt_every", "warmup_steps", "keep_last"):
        _positive_int(cfg, f"trainer.{key}", minimum=0)
    for key in ("keep_best", "early_stop_patience"):
        _positive_int(cfg, f"trainer.{key}", minimum=0)
        _require(
            not t[key]
            or t.best_metric != "val_loss"
            or (t.val_every and t.val_batches),
            f"trainer.{key}",
            f"{t[key]} ranks checkpoints by val_loss, but trainer.val_every="
            f"{t.val_every} trainer.val_batches={t.val_batches} never validate",
        )
    _require(
        t.early_stop_min_delta >= 0,
        "trainer.early_stop_min_delta",
        f"{t.early_stop_min_delta} is negative (an improvement is by more than it)",
    )
    _positive_int(cfg, "trainer.max_restarts", minimum=0)
    _positive_int(cfg, "trainer.sample_every", minimum=0)
    _positive_int(cfg, "trainer.sample_tokens")
    _require(
        not t.sample_every or DATA_SOURCES[cfg.data.name].tokenized,
        "trainer.sample_every",
        f"samples need text: data={cfg.data.name} has no tokenizer",
    )
    _check_eval_tasks(cfg)
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
    dp = layout.dp  # the ranks of a tp group, and the pp stages, read the same rows
    _require(
        t.plan_only or (t.batch_size % accum == 0 and micro % dp == 0),
        "trainer.batch_size",
        f"{t.batch_size} must split into trainer.grad_accum={t.grad_accum} micro-batches"
        f" that divide evenly over {dp} data-parallel rank(s)",
    )
    m = cfg.sharding.pp_microbatches
    _require(
        t.plan_only or layout.pp == 1 or (micro // max(1, dp)) % m == 0,
        "sharding.pp_microbatches",
        f"{m} does not divide each rank's {micro // max(1, dp)} rows per micro-step "
        f"(trainer.batch_size={t.batch_size} / grad_accum / {dp} data-parallel ranks)",
    )


def _check_trainer(cfg: DictConfig, spec: ModelSpec, config: Any) -> None:
    """Export, the optimizer's numbers, timeouts, peak FLOPs and resuming."""
    t = cfg.trainer
    _require(
        t.export in EXPORTS,
        "trainer.export",
        f"got {t.export!r}, expected false, true (model.safetensors) or hf",
    )
    if t.export == "hf":
        check_hf_export(spec, config, "trainer.export")
    _require(
        t.export_every >= 0 and (not t.export_every or t.export),
        "trainer.export_every",
        f"got {t.export_every}, expected 0 or, with trainer.export=true or hf (what "
        "each export writes), the steps between exports",
    )
    _require(t.lr > 0, "trainer.lr", f"got {t.lr}, expected > 0")
    _require(
        t.min_lr is None or 0 <= t.min_lr <= t.lr,
        "trainer.min_lr",
        f"got {t.min_lr}, expected a number in [0, trainer.lr={t.lr:g}], or null "
        f"(the default: trainer.lr x {MIN_LR_RATIO})",
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
    _choice(cfg, "trainer.layout", LAYOUT_CHOICES)
    _choice(cfg, "trainer.schedule", LR_SCHEDULES)
    _choice(cfg, "trainer.optimizer", OPTIMIZERS)
    _require(
        t.optimizer != "muon" or cfg.sharding.backend != "fsdp1",
        "trainer.optimizer",
        "muon orthogonalises each weight matrix, and sharding=fsdp1 holds them as "
        "flat 1-D shards: use sharding=fsdp2, ddp or none",
    )
    _require(
        0 < t.decay_fraction <= 1,
        "trainer.decay_fraction",
        f"got {t.decay_fraction:g}, expected a share of max_steps in (0, 1]",
    )
    _require(
        t.resume in (None, "auto") or os.path.exists(os.path.expanduser(t.resume)),
        "trainer.resume",
        f"got {t.resume!r}, expected null, auto or an existing checkpoint path",
    )


def validate_sample(cfg: DictConfig) -> None:
    """sample.py's own keys (the run's config is checked by :func:`validate`)."""
    reject_unknown_keys(cfg)
    reject_non_finite(cfg)
    _choice(cfg, "ckpt", CKPT_CHOICES)
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


def _check_eval_tasks(cfg: DictConfig) -> None:
    """trainer.eval_tasks's keys (the tasks themselves are found by launch.prepare,
    before any rank starts)."""
    t = cfg.trainer
    _check_task_names(t.eval_tasks, "trainer.eval_tasks")
    _check_task_names(t.eval_tasks_dirs, "trainer.eval_tasks_dirs")
    _positive_int(cfg, "trainer.eval_tasks_every", minimum=0)
    metric = str(t.best_metric)
    _require(
        metric == "val_loss"
        or (is_task_metric(metric) and metric.split("/")[1] in t.eval_tasks),
        "trainer.best_metric",
        f"got {metric!r}, expected val_loss or eval/<task>/<metric> of a task in "
        f"trainer.eval_tasks ({', '.join(t.eval_tasks) or 'none'})",
    )
    _require(
        not t.eval_tasks or DATA_SOURCES[cfg.data.name].tokenized,
        "trainer.eval_tasks",
        f"tasks are text: data={cfg.data.name} has no tokenizer",
    )


def _check_task_names(names: Any, key: str, allow_none: bool = False) -> None:
    """A list of names (downstream tasks, their dirs): none empty, none twice."""
    if names is None and allow_none:
        return
    names = list(names or [])
    _require(
        all(isinstance(n, str) and n.strip() for n in names)
        and len(set(names)) == len(names),
        key,
        f"got {names!r}, expected a list of distinct non-empty names",
    )


def check_hf_export(spec: ModelSpec, config: Any, key: str, hint: str = "") -> None:
    """A Hugging Face export of ``spec``'s model ``config`` (``trainer.export=hf``,
    export.py's ``format=hf``) is possible: the family has an adapter, and
    transformers' class holds the shape (GPT without bias it cannot); a
    ConfigError naming ``key`` (with ``hint``) otherwise."""
    _require(
        spec.hf is not None,
        key,
        f"hf needs a Hugging Face adapter, which model family {spec.name!r} has not"
        + hint,
    )
    keyed(key, spec.hf.hf_config, config)


def validate_export(cfg: DictConfig) -> None:
    """export.py's own keys (the run's config is checked by :func:`validate`)."""
    reject_unknown_keys(cfg)
    _choice(cfg, "ckpt", CKPT_CHOICES)
    _choice(cfg, "format", EXPORT_FORMATS)
    keyed("devices", resolve_devices, cfg.devices)


def validate_eval(cfg: DictConfig) -> None:
    """eval.py's own keys (the run's config, with ``data`` replaced, is checked by
    :func:`validate`)."""
    reject_unknown_keys(cfg)
    reject_non_finite(cfg)
    _choice(cfg, "ckpt", CKPT_CHOICES)
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
    _check_task_names(cfg.tasks, "tasks", allow_none=True)
    _check_task_names(cfg.tasks_dirs, "tasks_dirs")
