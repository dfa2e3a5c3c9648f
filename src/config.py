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
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import (
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
)

from src.models import ModelSpec, families, get_spec
from src.sharding import CHECKPOINTING

BACKENDS = ("fsdp2", "fsdp1", "ddp", "none")
PRECISIONS = ("fp32", "bf16_mixed", "fp16_mixed")
POLICIES = ("size", "block", "manual")
INIT_DEVICES = ("cpu", "cuda", "meta")
LOGGERS = ("wandb", "none")
WANDB_MODES = ("offline", "online", "disabled")
DATA_SOURCES = ("text", "files", "tokens", "synthetic")
DATA_FORMATS = ("text", "jsonl", "parquet")
GRAD_SYNC = ("auto", "last", "every")
# Memory per device (GiB) of the accelerators ``trainer.mem_budget_gib`` can name: the
#: total the driver reports (nvidia-smi / rocm-smi), not the marketing figure.
ACCELERATORS_GIB: dict[str, float] = {
    "a100_40gb": 39.4,
    "a100_80gb": 79.2,
    "h100_80gb": 79.1,
    "h100_94gb": 93.1,
    "h200": 139.8,
    "b200": 178.4,
    "l40s": 44.4,
    "a10g": 22.0,
    "mi300x": 191.5,
}


@dataclass
class ShardingConfig:
    backend: str = "fsdp2"
    # A name or a list of names; OmegaConf 2.3 has no Union of str and list, so Any
    # here and the check in validate().
    policy: Any = "size"
    min_params: Any = (
        1e8  # a number, or "auto" (the planner chooses; src/trainer/planner.py)
    )
    exclude_wrap_modules: list[str] = field(default_factory=list)
    force_leaf_modules: list[str] = field(default_factory=list)
    reshard_after_forward: bool = True
    # none | full | selective (or auto: the planner chooses), per block
    activation_checkpointing: str = "none"
    activation_checkpointing_every: int = 1  # full: checkpoint blocks 0, k, 2k, ...
    compile: bool = False  # torch.compile per block (regional)
    replicate: int = 1  # HSDP: replica groups, each sharding over devices / replicate


@dataclass
class PrecisionConfig:
    name: str = "fp32"


@dataclass
class TrainerConfig:
    devices: Any = 1  # an int >= 1 or "auto"
    max_steps: int = 100
    batch_size: int = 16
    grad_accum: Any = 1  # an int >= 1, or "auto"
    # FSDP gradient reduction with grad_accum > 1: "last" (only the last micro-batch;
    # unsharded gradients are held meanwhile), "every" (reduce-scatter each one), or
    # "auto" (last if it fits the memory budget, else every).
    grad_sync: str = "auto"
    mem_budget_gib: Any = None  # GiB per rank or an accelerator name (planner)
    seed: int = 0
    log_every: int = 10
    val_every: int = 50
    val_batches: int = 4
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    ckpt_every: int = 0
    keep_last: int = 2
    resume: str | None = None
    export: bool = False
    max_restarts: int = 0
    timeout_s: float = 600.0
    plan_only: bool = False
    peak_tflops: float | None = None
    progress: bool = True


@dataclass
class DataConfig:
    """The key every source has. Each option of the ``data`` group selects its own
    schema below (``defaults: [base_<source>]`` in conf/data/), so a key of another
    source is an unknown key."""

    name: str = MISSING


@dataclass
class FilesDataConfig(DataConfig):
    """``data=files`` (and its preset ``data=text``): local files, tokenized once into
    the token cache (src/trainer/token_cache.py)."""

    name: str = "files"
    paths: Any = MISSING  # a glob or a list of globs
    format: str = "text"  # one of DATA_FORMATS
    text_key: str = "text"  # the JSONL field / Parquet column holding the text
    tokenizer: str = "byte"  # byte, bpe, or a tokenizer.json / tokenizer directory
    bpe_vocab_size: int = 4096
    eos_token: str | None = None  # null: the tokenizer's own end-of-text token
    val_fraction: float = 0.05
    max_bytes: int | None = None
    cache_dir: str = "${oc.env:SHARDWRAP_CACHE,'~/.cache/shardwrap'}"


@dataclass
class TokensDataConfig(DataConfig):
    name: str = "tokens"
    train_path: str = "data/train.bin"
    val_path: str = "data/val.bin"


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_tokens: int = 1_000_000


DATA_SCHEMAS = {
    "files": FilesDataConfig,
    "tokens": TokensDataConfig,
    "synthetic": SyntheticDataConfig,
}


@dataclass
class LoggerConfig:
    backend: str = "wandb"
    mode: str = "offline"
    project: str = "shardwrap"
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    name: str | None = None  # the run's name; null = wandb's default
    system_stats: bool = False  # wandb's CPU/GPU sampling (probes cloud metadata)


@dataclass
class SweepConfig:
    """Read by src/trainer/sweep.py: a job whose peak memory is above the cap scores
    below every job within it (for sweepers such as Optuna)."""

    mem_cap_gib: float | None = None


@dataclass
class Config:
    # Typed by the family's schema, which each conf/model/*.yaml picks in its defaults
    # list (`schema/<family>@_here_`; registered below from src/models).
    model: Any = MISSING
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = MISSING  # a schema of DATA_SCHEMAS, chosen by the data group
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)


_store = ConfigStore.instance()
_store.store(name="base_config", node=Config)
for _family in families():
    _store.store(group="model/schema", name=_family, node=get_spec(_family).schema())
for _name, _schema in DATA_SCHEMAS.items():
    _store.store(group="data", name=f"base_{_name}", node=_schema)


class ConfigError(ValueError):
    """A config value that cannot work; ``str()`` is one line naming the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


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


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def policy_names(policy: Any) -> list[str]:
    """``sharding.policy`` as a list of names (a single name or a list composes)."""
    names = [policy] if isinstance(policy, str) else list(policy or [])
    _require(
        bool(names) and all(n in POLICIES for n in names),
        "sharding.policy",
        f"got {policy!r}, expected one of {', '.join(POLICIES)} or a list of them",
    )
    return names


def import_class(path: str, key: str) -> type:
    """Import ``package.module.Class`` from a dotted path, failing with the config key."""
    module_name, _, cls_name = str(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError):
        cls = None
    _require(
        isinstance(cls, type) and issubclass(cls, torch.nn.Module),
        key,
        f"cannot import an nn.Module class from {path!r}; "
        "give a dotted class path such as torch.nn.LayerNorm",
    )
    return cls


def import_classes(paths: Sequence[str], key: str) -> list[type]:
    """Resolve a list of dotted class paths (``sharding.exclude_wrap_modules``, ...)."""
    return [import_class(p, f"{key}[{i}]") for i, p in enumerate(paths)]


def under_torchrun() -> bool:
    """True when torchelastic (torchrun) started this process as one of its ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def resolve_devices(devices: Any) -> int:
    """``trainer.devices`` as a rank count: ``auto`` is the number of visible GPUs, or
    1 on a machine without one (CPU training gains nothing from ``auto`` guessing)."""
    if devices == "auto":
        return max(1, torch.cuda.device_count())
    _require(
        isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1,
        "trainer.devices",
        f"got {devices!r}, expected an integer >= 1 or 'auto'",
    )
    return devices


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


def _model_error(err: ValueError) -> ConfigError:
    """A model family's ``ValueError("model.<key> ...")`` as a ConfigError on that key."""
    key, _, rest = str(err).partition(" ")
    if not key.startswith("model"):
        key, rest = "model", str(err)
    return ConfigError(key.rstrip(":"), rest)


def model_spec(cfg: DictConfig) -> ModelSpec:
    """The spec of ``cfg.model``'s family (ConfigError if unknown)."""
    try:
        return get_spec(cfg.model.family)
    except ValueError as err:
        raise _model_error(err) from None


def model_config(cfg: DictConfig) -> Any:
    """``cfg.model`` as its family's config (ConfigError naming the key if bad)."""
    try:
        return model_spec(cfg).make_config(cfg.model)
    except ValueError as err:
        raise _model_error(err) from None


def validate(cfg: DictConfig) -> None:
    """Check what the schema's types cannot, so a bad run fails before any rank starts.

    Raises :class:`ConfigError` (one line naming the key) at the first problem.
    """
    reject_unknown_keys(cfg)
    m, s, t = cfg.model, cfg.sharding, cfg.trainer
    cap = cfg.sweep.mem_cap_gib
    _require(
        cap is None or cap > 0, "sweep.mem_cap_gib", f"got {cap}, expected null or > 0"
    )
    spec = model_spec(cfg)
    model_config(cfg)
    _choice(cfg, "model.init_device", INIT_DEVICES)
    _require(
        m.init_device != "meta" or spec.init_tensor is not None,
        "model.init_device",
        f"meta needs a per-parameter init, which model family {spec.name!r} has not",
    )
    _choice(cfg, "sharding.backend", BACKENDS)
    _require(
        m.init_device != "meta" or s.backend in ("fsdp2", "none"),
        "model.init_device",
        f"meta needs sharding=fsdp2 or sharding=none, not sharding={s.backend}",
    )
    _require(
        m.init_device != "cuda" or torch.cuda.is_available(),
        "model.init_device",
        "cuda requested but no CUDA device is visible; use cpu or meta",
    )
    policy_names(s.policy)
    _require(
        s.min_params == "auto" or (_is_number(s.min_params) and s.min_params >= 0),
        "sharding.min_params",
        f"got {s.min_params!r}, expected a number >= 0 (such as 1e8) or auto",
    )
    import_classes(s.exclude_wrap_modules, "sharding.exclude_wrap_modules")
    import_classes(s.force_leaf_modules, "sharding.force_leaf_modules")
    _choice(cfg, "sharding.activation_checkpointing", (*CHECKPOINTING, "auto"))
    _positive_int(cfg, "sharding.activation_checkpointing_every")
    _choice(cfg, "precision.name", PRECISIONS)

    # Under torchrun the world is torchrun's, whatever trainer.devices says.
    world_size = resolve_devices(t.devices)
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    _require(
        s.replicate >= 1, "sharding.replicate", f"got {s.replicate}, expected >= 1"
    )
    _require(
        s.replicate == 1 or s.backend in ("fsdp2", "fsdp1"),
        "sharding.replicate",
        f"hybrid sharding (replicate={s.replicate}) needs sharding=fsdp2 or fsdp1, "
        f"not sharding={s.backend}",
    )
    _require(
        world_size % s.replicate == 0,
        "sharding.replicate",
        f"{s.replicate} does not divide the {world_size} devices "
        "(each replica group shards over devices / replicate ranks)",
    )
    _require(
        s.backend != "none" or world_size == 1,
        "trainer.devices",
        f"sharding=none trains one process, got {world_size} devices; "
        "use trainer.devices=1 or sharding=fsdp2/fsdp1/ddp",
    )
    for key in ("max_steps", "batch_size", "log_every"):
        _positive_int(cfg, f"trainer.{key}")
    for key in ("val_every", "val_batches", "ckpt_every", "warmup_steps", "keep_last"):
        _positive_int(cfg, f"trainer.{key}", minimum=0)
    _positive_int(cfg, "trainer.max_restarts", minimum=0)
    accum = t.grad_accum
    _require(
        accum == "auto" or (_is_number(accum) and int(accum) == accum and accum >= 1),
        "trainer.grad_accum",
        f"got {accum!r}, expected an integer >= 1 or auto",
    )
    _choice(cfg, "trainer.grad_sync", GRAD_SYNC)
    budget_bytes(t.mem_budget_gib)
    accum = 1 if accum == "auto" else int(accum)
    micro = t.batch_size // accum
    _require(
        t.plan_only or (t.batch_size % accum == 0 and micro % world_size == 0),
        "trainer.batch_size",
        f"{t.batch_size} must split into trainer.grad_accum={t.grad_accum} micro-batches"
        f" that divide evenly over {world_size} rank(s)",
    )
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
    _require(t.timeout_s > 0, "trainer.timeout_s", "expected seconds > 0")
    _require(
        t.peak_tflops is None or t.peak_tflops > 0,
        "trainer.peak_tflops",
        "expected null (table or probe) or a positive number",
    )
    _require(
        t.resume is None or t.resume == "auto" or os.path.exists(t.resume),
        "trainer.resume",
        f"got {t.resume!r}, expected null, auto or an existing checkpoint path",
    )

    _choice(cfg, "data.name", DATA_SOURCES)
    _require(
        not OmegaConf.is_missing(cfg.data, "paths"),
        "data.paths",
        "required with data=files: a glob or a list of globs of your corpus",
    )
    if cfg.data.name == "tokens":
        for key in ("train_path", "val_path"):
            path = os.path.expanduser(cfg.data[key])
            _require(os.path.isfile(path), f"data.{key}", f"no such file {path!r}")

    _choice(cfg, "logger.backend", LOGGERS)
    _choice(cfg, "logger.mode", WANDB_MODES)


def budget_bytes(value: Any, key: str = "trainer.mem_budget_gib") -> int | None:
    """``trainer.mem_budget_gib`` in bytes: GiB per rank, or a named accelerator from
    :data:`ACCELERATORS_GIB`; None when unset."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ACCELERATORS_GIB:
            return int(ACCELERATORS_GIB[name] * 2**30)
        try:
            value = float(name)
        except ValueError:
            raise ConfigError(
                key,
                f"got {value!r}, expected GiB per rank (> 0) or one of: "
                + ", ".join(ACCELERATORS_GIB),
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(key, f"got {value!r}, expected GiB per rank > 0")
    return int(value * 2**30)


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


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Turn a config error raised inside into one line on stderr and exit status 2.

    ``sys.exit`` (not an exception) also inside a Hydra job: Hydra would print its
    own "Error executing job" line first.
    """
    try:
        yield
    except CONFIG_ERRORS as err:
        print(f"config error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


def run_cli(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function; a config error exits 2 with one line on stderr.

    Hydra prints override errors over several lines and strips tracebacks only for its
    own exceptions; with ``HYDRA_FULL_ERROR=1`` it re-raises instead, which lets us
    format them. A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full report.
    """
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    with exit_on_config_error():
        main()
