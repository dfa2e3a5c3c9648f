"""What a run resolves from its config, once: its parallel layout (the world size and
the degree of each mesh dimension), the model family's spec and config, and the wrap
policy's names and classes.

``validate`` (src/config/validate.py) calls :func:`resolve` before any rank starts (a
bad value is a :class:`ConfigError` naming its key, which the command line prints as
one line) and hands the :class:`Resolved` result to the launcher, which gives it to
every rank: the trainer reads these from it, never from ``src/config/``. The launcher's
``prepare`` resolves again only when the model's vocabulary followed the tokenizer; the
planner reads the same object. In src/ only :func:`resolve` calls :func:`model_spec`
and :func:`model_config`: what runs after it reads ``spec`` and ``model_config``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from src.errors import ConfigError, keyed
from src.models import ModelSpec, get_spec
from src.models.spec import import_module_class
from src.sharding.backends import backend_class
from src.sharding.float8 import ALL_GATHER_RECIPES, Float8
from src.sharding.layout import LayoutError, ParallelLayout
from src.sharding.policies import policy_names
from src.sharding.precision import get_precision


@dataclass(frozen=True)
class Resolved:
    """The objects a run needs from its config (picklable: the ranks get it)."""

    #: the run's parallel layout: its world size and the degree of each mesh dimension
    layout: ParallelLayout
    spec: ModelSpec
    model_config: Any  # an instance of ``spec.config_cls``
    policies: tuple[str, ...]
    exclude_wrap_modules: tuple[type[nn.Module], ...]
    force_leaf_modules: tuple[type[nn.Module], ...]
    # The planner's predicted peak_mem_gib (set by the launcher before the ranks
    # start; None when not planned, e.g. the planner failed on a custom model).
    planned_peak_gib: float | None = None
    # ... of a pipeline-parallel run: the pp rank whose stages it is (the worst)
    planned_peak_pp_rank: int | None = None
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


def resolve(cfg: DictConfig, planned_peak_gib: float | None = None) -> Resolved:
    """Resolve ``cfg`` (:class:`ConfigError` naming the key at the first bad value)."""
    s = cfg.sharding
    layout = parallel_layout(cfg, world_size(cfg.trainer.devices))
    spec, config = model_spec(cfg), model_config(cfg)
    check_expert_parallel(layout, spec, config)
    return Resolved(
        planned_peak_gib=planned_peak_gib,
        layout=layout,
        spec=spec,
        model_config=config,
        policies=resolve_policies(s.policy),
        exclude_wrap_modules=import_classes(
            s.exclude_wrap_modules, "sharding.exclude_wrap_modules"
        ),
        force_leaf_modules=import_classes(
            s.force_leaf_modules, "sharding.force_leaf_modules"
        ),
    )


#: The config key of each degree of :class:`ParallelLayout` that a config sets (the
#: others stay 1): the one place the layout meets its keys, where it is made from
#: them and where a :class:`LayoutError` is named by them.
LAYOUT_KEYS = {
    "pp": "sharding.pipeline_parallel",
    "dp_replicate": "sharding.replicate",
    "tp": "sharding.tensor_parallel",
    "ep": "sharding.expert_parallel",
    "cp": "sharding.context_parallel",
}


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
        raise ConfigError(
            LAYOUT_KEYS.get(err.dim, "trainer.devices"), str(err)
        ) from None


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
    if all_gather is None:
        all_gather = (
            p.recipe in ALL_GATHER_RECIPES
            and backend_class(cfg.sharding.backend).shards_parameters
        )
    return keyed(
        "precision.recipe", Float8, p.recipe, tuple(p.float8_skip or ()), all_gather
    )


def tensor_parallel_plan(
    cfg: DictConfig, spec: ModelSpec, config: Any, layout: ParallelLayout
) -> Any:
    """The family's tensor-parallel plan for the layout's ``tp`` degree and
    ``sharding.sequence_parallel`` (None without tensor parallelism); ConfigError
    naming the key when the family has no plan or the shape does not split."""
    tp = layout.tp
    if tp <= 1:
        return None
    if spec.tp_plan is None:
        raise ConfigError(
            LAYOUT_KEYS["tp"],
            f"model family {spec.name!r} has no tensor-parallel plan; use 1",
        )
    plan = keyed(LAYOUT_KEYS["tp"], spec.tp_plan, config, tp, None)
    sp = cfg.sharding.sequence_parallel
    if sp is None and layout.pp > 1:
        sp = False  # stages pass whole sequences (a stage cannot know their length)
    if sp is None or sp == plan.sequence_parallel:
        return plan
    return keyed("sharding.sequence_parallel", spec.tp_plan, config, tp, sp)


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
