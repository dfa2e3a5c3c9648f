"""The run plan: what a run resolves from its config, once, checked there: its parallel
layout (the world size and the degree of each mesh dimension, run by the one rule,
:func:`src.sharding.layout.refusal`), the model family's spec and config, the
precision and its float8 linear layers, the wrap policy, activation checkpointing,
compile, prefetch and resharding, the pipeline's schedule, micro-batches and cut,
sequence parallelism, the batch geometry and what the planner judges it against.

``validate`` (src/config/validate.py) calls :func:`resolve` before any rank starts (a
bad value is a :class:`ConfigError` naming its key, which the command line prints as
one line); the launcher's ``prepare`` resolves the config it prepared (again when the
model's vocabulary followed the tokenizer) and gives the :class:`RunPlan` to every
rank: the builder, the trainer's step path and the planner read it, never the config's
keys. The planner varies it with :func:`varied` (``dataclasses.replace``);
:data:`OVERRIDES` says a field as the override a user types. In src/ only
:func:`resolve` calls :func:`model_spec` and :func:`model_config`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf, open_dict

from src.data.packing import PACKINGS
from src.data.sources import DATA_SOURCES
from src.errors import ConfigError, keyed
from src.models import ModelSpec, get_spec
from src.models.spec import import_module_class
from src.sharding.backends import backend_class
from src.sharding.float8 import ALL_GATHER_RECIPES, Float8
from src.sharding.layout import LayoutError, ParallelLayout, refusal
from src.sharding.lora import LoraSpec
from src.sharding.plan import GIB
from src.sharding.policies import policy_names
from src.sharding.precision import Precision, get_precision


@dataclass(frozen=True)
class WrapSettings:
    """The wrap policy: its names, the size threshold and the user's class lists."""

    policies: tuple[str, ...]
    min_params: Any  # a number, or "auto" until the launcher's prepare chose one
    exclude_wrap_modules: tuple[type[nn.Module], ...] = ()
    force_leaf_modules: tuple[type[nn.Module], ...] = ()


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing: ``none``, ``full`` (every ``every``-th block),
    ``selective`` (or ``auto`` until the launcher's prepare chose one)."""

    mode: str = "none"
    every: int = 1


@dataclass(frozen=True)
class PipelineSettings:
    """A pipeline's schedule, its micro-batches and the user's stage cut."""

    schedule: str = "1f1b"
    microbatches: int = 1
    split: tuple[int, ...] = ()


@dataclass(frozen=True)
class Unit:
    """What each unit does beyond sharding: torch.compile, prefetch depths and
    resharding after forward, and (with tp) sequence parallelism (None: the plan's
    default)."""

    compile: bool = False
    forward_prefetch: Any = None
    backward_prefetch: Any = None
    reshard_after_forward: Any = True
    sequence_parallel: bool | None = None


@dataclass(frozen=True)
class Batch:
    """The batch geometry: sequences per step, micro-batches per step (or
    ``auto``), how their gradients reduce, the model's sequence length and how a
    window reads its documents (``data.packing``: src/data/packing.py)."""

    batch_size: int
    grad_accum: Any
    grad_sync: str
    seq_len: int
    packing: str = PACKINGS[0]

    @property
    def documents(self) -> bool:
        """Attention, positions and the loss within documents."""
        return self.packing == "documents"


@dataclass(frozen=True)
class Budget:
    """What the planner judges a run against: the per-rank budget (GiB or an
    accelerator's name), a sweep's cap, the safety margin, whether a start bigger
    than the machine is refused, whether proposals keep the device count, and the
    logger (its imports are part of the process baseline) and whether the ranks fork
    from a rank server (a smaller baseline, planner ``FORKED_RANK_SAVING``: the
    launcher says so, nothing in the config does)."""

    mem_budget: Any = None
    sweep_cap: Any = None
    margin: float = 0.0
    memory_check: bool = True
    fixed_devices: bool = False
    logger: str = "wandb"
    forked_ranks: bool = False
    layout_precisions: tuple[str, ...] = ()  # the layout search's other precisions


@dataclass(frozen=True)
class RunPlan:
    """A run as resolved from its config, once, and checked there (frozen and
    picklable: the ranks get it); the planner varies it with ``dataclasses.replace``."""

    #: the run's parallel layout: its world size and the degree of each mesh dimension
    layout: ParallelLayout
    spec: ModelSpec
    model_config: Any  # an instance of ``spec.config_cls``
    backend: str
    precision: Precision
    float8: Float8 | None  # precision=float8's linear layers (None: another one)
    wrap: WrapSettings
    checkpointing: Checkpointing
    pipeline: PipelineSettings
    unit: Unit
    batch: Batch
    budget: Budget = Budget()
    model_name: str = ""  # the preset (``model=<name>``), as messages name it
    init_device: str = "cpu"
    pretrained: str | None = None
    seed: int = 0
    lora: LoraSpec | None = None  # model.lora: adapters, the rest frozen
    freeze: tuple[str, ...] = ()  # trainer.freeze: parameter-name patterns
    optimizer: str = "adamw"  # trainer.optimizer (the planner counts its state)
    # trainer.log_every: one step in it is logged, its memory sampled (the planner
    # times that); 0: no step is
    log_every: int = 0
    # The planner's predicted peak_mem_gib (set by the launcher before the ranks
    # start; None when not planned, e.g. the planner failed on a custom model).
    planned_peak_gib: float | None = None
    # ... of a pipeline-parallel run: the pp rank whose stages it is (the worst)
    planned_peak_pp_rank: int | None = None
    # The planner's predicted step (src/planner/step_time.py ``StepTime.summary``:
    # predicted_step_time_s, predicted_tokens_per_s; set by the launcher, empty when
    # not predicted)
    predicted: dict | None = None
    # The layout trainer.layout=fastest chose (src/planner/layouts.py
    # ``Layout.record``), set by the launcher; None otherwise
    layout_chosen: dict | None = None
    # The config as composed, before the launcher prepared it (auto values, the
    # vocabulary following the tokenizer): what a checkpoint records and a resume
    # continues from (src/runs/resume.py). None outside train.py's launcher.
    run_config: dict | None = None
    # What the run dir keeps of the data (src/data/pinning.py ``DataRecord``), made
    # by the launcher's ``prepare`` and written once the run is admitted; None after.
    data_record: Any = None

    @property
    def world_size(self) -> int:
        """The run's ranks."""
        return self.layout.world_size

    @property
    def pp(self) -> int:
        """The pipeline stages."""
        return self.layout.pp


def resolve(cfg: DictConfig, planned_peak_gib: float | None = None) -> RunPlan:
    """Resolve ``cfg`` (:class:`ConfigError` naming the key at the first bad value)."""
    s, t = cfg.sharding, cfg.trainer
    layout = parallel_layout(cfg, world_size(t.devices))
    spec, config = model_spec(cfg), model_config(cfg)
    check_expert_parallel(layout, spec, config)
    precision = keyed("precision.name", get_precision, cfg.precision.name)
    packing = data_packing(cfg, spec)
    check_runnable(
        layout,
        keyed("sharding.backend", backend_class, s.backend),
        precision.name,
        spec.seq_len(config),
    )
    return RunPlan(
        planned_peak_gib=planned_peak_gib,
        layout=layout,
        spec=spec,
        model_config=config,
        backend=s.backend,
        precision=precision,
        float8=float8_linears(cfg),
        wrap=WrapSettings(
            resolve_policies(s.policy),
            s.min_params,
            import_classes(s.exclude_wrap_modules, "sharding.exclude_wrap_modules"),
            import_classes(s.force_leaf_modules, "sharding.force_leaf_modules"),
        ),
        checkpointing=Checkpointing(
            s.activation_checkpointing, s.activation_checkpointing_every
        ),
        pipeline=PipelineSettings(
            s.pp_schedule, s.pp_microbatches, tuple(s.pp_split or ())
        ),
        unit=Unit(
            s.compile,
            s.forward_prefetch,
            s.backward_prefetch,
            s.reshard_after_forward,
            s.sequence_parallel,
        ),
        batch=Batch(
            t.batch_size, t.grad_accum, t.grad_sync, spec.seq_len(config), packing
        ),
        budget=Budget(
            OmegaConf.select(cfg, "trainer.mem_budget_gib"),
            OmegaConf.select(cfg, "sweep.mem_cap_gib", default=None),
            float(OmegaConf.select(cfg, "trainer.mem_margin", default=0.0)),
            bool(OmegaConf.select(cfg, "trainer.memory_check", default=True)),
            bool(OmegaConf.select(cfg, "trainer.fixed_devices", default=False)),
            str(OmegaConf.select(cfg, "logger.backend", default=None) or "wandb"),
            layout_precisions=tuple(
                OmegaConf.select(cfg, "trainer.layout_precisions", default=None) or ()
            ),
        ),
        model_name=str(OmegaConf.select(cfg, "model.name", default="") or ""),
        init_device=cfg.model.init_device,
        pretrained=OmegaConf.select(cfg, "model.pretrained"),
        seed=t.seed,
        lora=lora_spec(cfg, spec, layout),
        freeze=tuple(OmegaConf.select(cfg, "trainer.freeze", default=None) or ()),
        optimizer=str(OmegaConf.select(cfg, "trainer.optimizer", default="adamw")),
        log_every=int(t.log_every),
    )


#: The override a user types for each field of :class:`RunPlan` that a proposal or an
#: error names (the planner's proposals, ``auto`` values, refusals): the one place
#: the run plan meets its config keys.
OVERRIDES = {
    "layout.world_size": "trainer.devices",
    "layout.pp": "sharding.pipeline_parallel",
    "layout.dp_replicate": "sharding.replicate",
    "layout.tp": "sharding.tensor_parallel",
    "layout.ep": "sharding.expert_parallel",
    "layout.cp": "sharding.context_parallel",
    "precision": "precision.name",
    "wrap.policies": "sharding.policy",
    "wrap.min_params": "sharding.min_params",
    "checkpointing.mode": "sharding.activation_checkpointing",
    "checkpointing.every": "sharding.activation_checkpointing_every",
    "pipeline.schedule": "sharding.pp_schedule",
    "pipeline.microbatches": "sharding.pp_microbatches",
    "pipeline.split": "sharding.pp_split",
    "unit.sequence_parallel": "sharding.sequence_parallel",
    "batch.batch_size": "trainer.batch_size",
    "batch.grad_accum": "trainer.grad_accum",
    "batch.grad_sync": "trainer.grad_sync",
    "batch.packing": "data.packing",
    "budget.margin": "trainer.mem_margin",
    "budget.mem_budget": "trainer.mem_budget_gib",
    "budget.memory_check": "trainer.memory_check",
    "budget.fixed_devices": "trainer.fixed_devices",
}

#: The config key of each degree of :class:`ParallelLayout` that a config sets (the
#: others stay 1), from :data:`OVERRIDES`: where the layout is made from them and
#: where a :class:`LayoutError` is named by them.
LAYOUT_KEYS = {
    dim: OVERRIDES[f"layout.{dim}"] for dim in ("pp", "dp_replicate", "tp", "ep", "cp")
}


def field_of(plan: RunPlan, name: str) -> Any:
    """The value of ``plan``'s (dotted) field ``name``, as a config writes it (the
    precision by its name)."""
    if name == "precision":
        return plan.precision.name
    value: Any = plan
    for part in name.split("."):
        value = getattr(value, part)
    return value


def varied(plan: RunPlan, changes: dict[str, Any]) -> RunPlan:
    """``plan`` with its (dotted) fields ``changes`` set, by ``dataclasses.replace``
    (``precision``: a policy's name); a layout that does not fit raises
    :class:`LayoutError`."""
    for name, value in changes.items():
        if name == "precision":
            plan = replace(plan, precision=get_precision(value))
            continue
        head, _, rest = name.partition(".")
        inner = getattr(plan, head)
        plan = replace(
            plan, **{head: replace(inner, **{rest: value}) if rest else value}
        )
    return plan


def overrides_of(changes: dict[str, Any]) -> dict[str, Any]:
    """Plan field changes as the overrides a user types (:data:`OVERRIDES`)."""
    return {OVERRIDES[name]: value for name, value in changes.items()}


def with_overrides(cfg: DictConfig, overrides: dict[str, Any]) -> DictConfig:
    """A copy of ``cfg`` with ``overrides`` (config keys to values) set: what the
    launcher records of the values the planner chose."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        for key, value in overrides.items():
            OmegaConf.update(out, key, value, force_add=True)
    return out


def parallel_layout(cfg: DictConfig, world_size: int) -> ParallelLayout:
    """``cfg.sharding``'s degrees on ``world_size`` ranks (ConfigError naming the
    key of a degree that does not fit)."""
    degrees = {dim: OmegaConf.select(cfg, key) for dim, key in LAYOUT_KEYS.items()}
    with layout_errors_named():
        return ParallelLayout(world_size, **degrees)


@contextlib.contextmanager
def layout_errors_named() -> Iterator[None]:
    """A :class:`LayoutError` raised inside as a ConfigError naming its key."""
    try:
        yield
    except LayoutError as err:
        key = OVERRIDES.get(f"layout.{err.dim}", OVERRIDES.get(err.dim))
        raise ConfigError(key or OVERRIDES["layout.world_size"], str(err)) from None


def check_runnable(
    layout: ParallelLayout,
    backend: type,
    precision: str,
    seq_len: int,
) -> None:
    """ConfigError naming the key of the dimension the one rule refuses
    (:func:`src.sharding.layout.refusal`)."""
    err = refusal(layout, backend, precision, seq_len)
    if err is not None:
        with layout_errors_named():
            raise err


def lora_spec(
    cfg: DictConfig, spec: ModelSpec, layout: ParallelLayout
) -> LoraSpec | None:
    """``model.lora`` as adapters (None: rank 0), ConfigError naming the key for a bad
    value or a layout the adapters do not run on yet."""
    lora = OmegaConf.select(cfg, "model.lora", default=None)
    if lora is None or not lora.rank:
        return None
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 0:
        raise ConfigError(
            "model.lora.rank", f"got {lora.rank!r}, expected an integer >= 0"
        )
    if not lora.alpha > 0:
        raise ConfigError("model.lora.alpha", f"got {lora.alpha!r}, expected > 0")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(
            "model.lora.dropout", f"got {lora.dropout!r}, expected in [0, 1)"
        )
    targets = tuple(lora.targets or spec.lora_targets)
    if not targets:
        raise ConfigError(
            "model.lora.targets",
            f"model family {spec.name!r} names no default targets; give the linear "
            "layers' module names (fnmatch patterns)",
        )
    not_yet = {
        "sharding.pipeline_parallel": layout.pp > 1,
        "sharding.backend": cfg.sharding.backend == "fsdp1",
        "precision.name": cfg.precision.name == "float8",
    }
    for key, refused in not_yet.items():
        if refused:
            raise ConfigError(
                "model.lora.rank",
                f"LoRA adapters do not run with {key}={OmegaConf.select(cfg, key)} "
                "yet (FSDP2, tensor parallelism, DDP or one rank, without float8); set "
                "model.lora.rank=0 "
                f"or change {key}",
            )
    return LoraSpec(
        lora.rank, float(lora.alpha), float(lora.dropout), targets, cfg.trainer.seed
    )


def data_packing(cfg: DictConfig, spec: ModelSpec) -> str:
    """``data.packing`` (a config without it: the default), ConfigError naming it
    for a value not in :data:`PACKINGS`, or ``documents`` where the model family
    or the data source cannot take document ids."""
    key = OVERRIDES["batch.packing"]
    value = OmegaConf.select(cfg, key, default=PACKINGS[0])
    if value not in PACKINGS:
        raise ConfigError(key, f"got {value!r}, expected one of: {', '.join(PACKINGS)}")
    if value == "documents" and not spec.documents:
        raise ConfigError(
            key,
            f"documents: model family {spec.name!r} takes no document ids (its "
            "attention is not masked per document); use stream",
        )
    if value == "documents" and not DATA_SOURCES[cfg.data.name].tokenized:
        raise ConfigError(
            key,
            f"documents needs a tokenizer's end-of-document token: data=text or "
            f"files, not data={cfg.data.name}; use stream",
        )
    return value


def check_expert_parallel(layout: ParallelLayout, spec: ModelSpec, config: Any) -> None:
    """ConfigError naming ``sharding.expert_parallel`` when the model has no experts
    to split, or its experts do not split ``ep`` ways."""
    ep = layout.ep
    if ep <= 1:
        return
    if spec.num_experts is None:
        raise ConfigError(
            LAYOUT_KEYS["ep"],
            f"model family {spec.name!r} has no expert parallelism (a dense model); "
            "use 1",
        )
    try:
        experts = spec.num_experts(config)
    except ValueError as err:  # an MoE architecture that declares no ep plan
        raise ConfigError(LAYOUT_KEYS["ep"], str(err)) from None
    if not experts:
        raise ConfigError(
            LAYOUT_KEYS["ep"],
            "this model has no MoE block to split; use 1",
        )
    if experts % ep:
        raise ConfigError(
            LAYOUT_KEYS["ep"],
            f"{ep} does not divide the model's {experts} experts (model.num_experts)",
        )


def resolve_policies(policy: Any) -> tuple[str, ...]:
    """``sharding.policy`` as the wrap policies' names (ConfigError naming the key)."""
    return tuple(keyed("sharding.policy", policy_names, policy))


def under_torchrun() -> bool:
    """True when torchelastic (torchrun) started this process as one of its ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def world_size(devices: Any) -> int:
    """The run's ranks: torchrun's world under torchrun, the process group's when
    one is initialised (a rank resolving its own config; whatever
    ``trainer.devices`` says, once it is valid), else :func:`resolve_devices`."""
    ranks = resolve_devices(devices)
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake":
        return dist.get_world_size()
    return ranks


def resolve_devices(devices: Any) -> int:
    """``trainer.devices`` as a rank count: ``auto`` is the number of visible GPUs, or
    1 on a machine without one (CPU training gains nothing from ``auto`` guessing)."""
    if devices == "auto":
        return max(1, torch.cuda.device_count())
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(
            "trainer.devices", f"got {devices!r}, expected an integer >= 1 or 'auto'"
        )
    return devices


def import_classes(paths: Sequence[str], key: str) -> tuple[type[nn.Module], ...]:
    """Dotted ``nn.Module`` class paths (``sharding.exclude_wrap_modules``, ...)."""
    return tuple(
        keyed(f"{key}[{i}]", import_module_class, p) for i, p in enumerate(paths)
    )


#: precision=float8's keys, null under another precision
FLOAT8_KEYS = (
    "precision.recipe",
    "precision.float8_skip",
    "precision.float8_all_gather",
)


def float8_linears(cfg: DictConfig) -> Float8 | None:
    """The float8 linear layers of ``cfg``'s precision (None: not a float8 one):
    ``precision.recipe``, ``precision.float8_skip``, and the FSDP2 float8 all-gather
    (``precision.float8_all_gather``; null: on where it applies, a recipe that takes
    it on a backend that shards parameters)."""
    p = cfg.precision
    if not get_precision(p.name).float8:
        return None
    all_gather = p.float8_all_gather
    shards = backend_class(cfg.sharding.backend).shards_parameters
    if all_gather and p.recipe not in ALL_GATHER_RECIPES:
        raise ConfigError(
            "precision.float8_all_gather",
            f"true needs precision.recipe={' or '.join(ALL_GATHER_RECIPES)}, not "
            f"{p.recipe} (torchao casts whole weights for the all-gather)",
        )
    if all_gather and not shards:
        raise ConfigError(
            "precision.float8_all_gather",
            "true needs a backend that shards parameters, not "
            f"sharding={cfg.sharding.backend}",
        )
    if all_gather is None:
        all_gather = p.recipe in ALL_GATHER_RECIPES and shards
    return keyed(
        "precision.recipe", Float8, p.recipe, tuple(p.float8_skip or ()), all_gather
    )


def tensor_parallel_plan(plan: RunPlan, layout: ParallelLayout | None = None) -> Any:
    """The family's tensor-parallel plan for ``layout``'s ``tp`` degree (default: the
    run's) and the plan's sequence parallelism (None without tensor parallelism);
    ConfigError naming the key when the family has no plan or the shape does not
    split."""
    layout = layout or plan.layout
    spec, config, tp = plan.spec, plan.model_config, layout.tp
    if tp <= 1:
        return None
    if spec.tp_plan is None:
        raise ConfigError(
            LAYOUT_KEYS["tp"],
            f"model family {spec.name!r} has no tensor-parallel plan; use 1",
        )
    tpp = keyed(LAYOUT_KEYS["tp"], spec.tp_plan, config, tp, None)
    sp = plan.unit.sequence_parallel
    if sp is None and layout.pp > 1:
        sp = False  # stages pass whole sequences (a stage cannot know their length)
    if sp is None or sp == tpp.sequence_parallel:
        return tpp
    return keyed(OVERRIDES["unit.sequence_parallel"], spec.tp_plan, config, tp, sp)


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


#: Memory per device (GiB) of the accelerators ``trainer.mem_budget_gib`` can name: the
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


def budget_bytes(value: Any, key: str = "trainer.mem_budget_gib") -> int | None:
    """``trainer.mem_budget_gib`` in bytes: GiB per rank, or a named accelerator from
    :data:`ACCELERATORS_GIB`; None when unset."""
    if value is None:
        return None
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ACCELERATORS_GIB:
            return int(ACCELERATORS_GIB[name] * GIB)
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
    return int(value * GIB)
