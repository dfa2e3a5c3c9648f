"""The structured config schema: types only (the values live in conf/*.yaml).

The dataclasses below are registered in Hydra's ConfigStore as ``base_config``, the
first entry of ``conf/config.yaml``'s defaults list, so every group file and every
command-line override is merged into a typed node: an unknown key or a value of the
wrong type fails while Hydra composes. Facts a type cannot express are checked by
src/config/validate.py. Importing this module registers the schema. It sits low in the
import order (just above src/data/ and src/observe/, tests/test_layers.py): it imports
no planner, trainer or validation, and holds the allowed values they import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from src.data.sources import DATA_SOURCES, DataConfig
from src.data.token_cache import SPLITS
from src.models import families, get_spec
from src.observe.keys import is_task_metric
from src.observe.loggers import LOGGERS, LoggerConfig
from src.registry import described, or_list
from src.sharding import BACKENDS, CHECKPOINTING, PRECISIONS
from src.sharding.float8 import RECIPES as FLOAT8_RECIPES
from src.sharding.pipeline import SCHEDULES
from src.sharding.policies import POLICIES

# The allowed values of keys that a type cannot restrict, named here (the --help texts
# below) and checked by src/config/validate.py; the code that acts on them imports them
# from here.
INIT_DEVICES = ("cpu", "cuda", "meta")
#: ``trainer.grad_sync`` (besides auto): reduce gradients on the last micro-batch only
#: or on every one (src/planner/ searches them, src/trainer/loop.py acts on them).
GRAD_SYNC = ("last", "every")
#: ``sweep.objective`` -> its own direction (``sweep.direction=null``); read by
#: src/runs/sweep.py.
OBJECTIVES = {"val_loss": "min", "loss": "min", "tokens_per_s": "max"}


def objective_direction(name: str) -> str:
    """A sweep objective's own direction: :data:`OBJECTIVES`', or for a downstream
    task's metric (``eval/<task>/<metric>``, trainer.eval_tasks) max: accuracies
    (``sweep.direction=min`` for a perplexity)."""
    return OBJECTIVES.get(name) or ("max" if is_task_metric(name) else "min")


DIRECTIONS = ("min", "max")
EXPORTS = (False, True, "hf")
#: ``trainer.resume_schedule``: what a resume with another ``max_steps`` does (refuse
#: it, or extend the schedule; src/trainer/loop.py).
RESUME_SCHEDULES = ("keep", "extend")
#: ``trainer.layout``: train the layout as set, or the planner's fastest that fits.
LAYOUT_CHOICES = ("as_set", "fastest")
#: ``trainer.schedule``: the learning rate after the warmup: cosine or linear down to
#: ``min_lr``, wsd (stable at ``lr``, then a linear decay over the last
#: ``trainer.decay_fraction`` of the steps) or constant (src/trainer/optimizer.py).
LR_SCHEDULES = ("cosine", "wsd", "linear", "constant")
#: ``trainer.optimizer``: AdamW; Muon for the weight matrices with AdamW for the
#: embeddings, head, norms and biases; Lion (src/trainer/optimizer.py).
OPTIMIZERS = ("adamw", "muon", "lion")
#: ``trainer.min_lr=null`` (the default): the cosine ends at ``trainer.lr`` times this,
#: so the schedule follows the learning rate a sweep or a command line sets
#: (src/trainer/optimizer.py ``final_lr``).
MIN_LR_RATIO = 0.1

# The groups' schemas below type every key and hold its one-line --help text
# (``described``); its value has one home, the group's YAML in conf/, so a field
# without a default is MISSING.


@dataclass
class ShardingConfig:
    backend: str = described(lambda: f"{or_list(BACKENDS)} (pick with sharding=...)")
    # A name or a list of names; OmegaConf 2.3 has no Union of str and list, so Any
    # here and the check in validate().
    policy: Any = described(
        lambda: f"which modules become units: {', '.join(POLICIES)} or a list"
    )
    # a number, or "auto" (src/planner/auto.py chooses)
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
    context_parallel: int = described(
        "fsdp2: C ranks split each sequence (cp mesh dim); 1 = off"
    )
    sequence_parallel: bool | None = described(
        "with tensor_parallel: norms sharded over the sequence (null: family default)"
    )
    pipeline_parallel: int = described(
        "fsdp2: P pipeline stages (pp mesh dim, outermost); 1 = off"
    )
    expert_parallel: int = described(
        "fsdp2: E ranks split a MoE's experts (from the shard ranks); 1 = off"
    )
    pp_schedule: str = described(
        lambda: (
            "pipeline schedule: "
            + or_list(n for n, s in SCHEDULES.items() if not s.refused)
        )
    )
    pp_microbatches: int = described(
        "pipeline micro-batches per micro-step (each rank's rows split M ways)"
    )
    pp_split: list[int] = described(
        "blocks per pipeline stage (empty: as even as possible)"
    )


@dataclass
class PrecisionConfig:
    name: str = described(lambda: f"{or_list(PRECISIONS)} (pick with precision=...)")
    # precision=float8's own keys (conf/precision/float8.yaml); null elsewhere
    recipe: str | None = described(
        f"float8: {or_list(FLOAT8_RECIPES)} scaling (torchao)", None
    )
    float8_skip: list[str] | None = described(
        "float8: linear layers kept in bf16 (names, dotted suffixes or patterns)", None
    )
    float8_all_gather: bool | None = described(
        "float8: FSDP2 all-gathers weights in float8 (null: where it applies)", None
    )


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
    memory_check: bool = described(
        "refuse a run the planner says this machine cannot hold (false: start it)"
    )
    malloc_mmap_threshold_kib: int | None = described(
        "CPU ranks: heap blocks >= this (KiB) get their own mmap, freed to the OS at "
        "once; default null: glibc's dynamic threshold, the fastest (issue 55)"
    )
    seed: int = described("seed of the model init and the batches")
    log_every: int = described("steps between logged rows (metrics.jsonl, wandb)")
    health_every: int = described(
        "steps between per-block parameter and gradient norms (0 = off; not fsdp1)"
    )
    val_every: int = described("steps between validations (0 = none)")
    val_batches: int = described("batches per validation")
    sample_every: int = described(
        "steps between greedy samples of sample_prompts (0 = off)"
    )
    sample_prompts: list[str] = described(
        "texts continued by trainer.sample_every (a list)"
    )
    sample_tokens: int = described("new tokens per trainer.sample_every sample")
    eval_tasks: list[str] = described(
        "lm-eval tasks scored during training (docs/evaluation.md; [] = none)"
    )
    eval_tasks_every: int = described(
        "steps between trainer.eval_tasks scores (and at the end; 0 = at the end)"
    )
    eval_tasks_dirs: list[str] = described(
        "folders of your own lm-eval task YAMLs, beside conf/eval_tasks/"
    )
    # one of OPTIMIZERS
    optimizer: str = described(lambda: f"the optimizer: {or_list(OPTIMIZERS)}")
    lr: float = described("peak learning rate (every optimizer)")
    min_lr: float | None = described(
        f"learning rate at the end of the decay (null: lr x {MIN_LR_RATIO})"
    )
    warmup_steps: int = described("steps of linear warmup")
    # one of LR_SCHEDULES
    schedule: str = described(
        lambda: f"learning rate after the warmup: {or_list(LR_SCHEDULES)}"
    )
    decay_fraction: float = described(
        "schedule=wsd: the decay to min_lr takes this share of max_steps, at the end"
    )
    weight_decay: float = described("AdamW weight decay (2-D weights only)")
    betas: list[float] = described("AdamW betas (and Lion's)")
    muon_momentum: float = described("optimizer=muon: the matrices' momentum")
    grad_clip: float = described("max global gradient norm (0 = off)")
    ckpt_every: int = described(
        "steps between sharded checkpoints (0 = only on a stop and at the end)"
    )
    ckpt_final: bool = described(
        "save the last step's checkpoint (sample.py, eval.py and a resume read it)"
    )
    keep_last: int = described("newest checkpoints kept (0 = all)")
    keep_best: int = described(
        "also keep the K checkpoints of the lowest val_loss (0 = off; a validation "
        "step among the K best so far is saved)"
    )
    best_metric: str = described(
        "what keep_best and early stopping rank by: val_loss (lowest best), or a "
        "task's eval/<task>/<metric> of trainer.eval_tasks (highest best)"
    )
    early_stop_patience: int = described(
        "stop when val_loss has not improved for N validations (0 = off)"
    )
    early_stop_min_delta: float = described(
        "early stopping: a val_loss is better when below the best by more than this"
    )
    ckpt_async: bool = described("write checkpoints in the background")
    resume: str | None = described(
        "null, auto (newest in the run dir) or a checkpoint path"
    )
    init_from: str | None = described(
        "a new run starts from this checkpoint or run dir's weights (step 0)"
    )
    freeze: list[str] = described(
        "parameters not trained, by canonical-name pattern (fnmatch): 'layers.0.*'"
    )
    # one of RESUME_SCHEDULES
    resume_schedule: str = described(
        "resuming with another max_steps: keep (refuse) or extend"
    )
    export: Any = described("at the end: false, true (model.safetensors) or hf")
    export_every: int = described(
        "also export every N steps, as trainer.export, into exports/step_N (0: never)"
    )
    max_restarts: int = described("restarts of the whole group after a rank fails")
    timeout_s: float = described("collective timeout; a silent rank is named after it")
    plan_only: bool = described(
        "print the wrap plan and memory estimate, allocate nothing"
    )
    fixed_devices: bool = described(
        "the planner's proposals keep trainer.devices as set (change anything else)"
    )
    layout: str = described(
        "as_set, or fastest: train the planner's fastest layout that fits"
    )
    layout_precisions: list[str] = described(
        "precisions the layout search may try besides precision.name"
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
    """Read by src/runs/sweep.py: what a job returns to a sweeper and which job of
    a sweep is the best (``objective``, ``direction``: null is the objective's own,
    min for losses, max for tokens_per_s); a job whose peak memory is above the cap
    scores below every job within it."""

    objective: str = described(
        f"what makes a sweep point best: {or_list(OBJECTIVES)}, or a task's "
        "eval/<task>/<metric> (trainer.eval_tasks)",
        "val_loss",
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
    ckpt: str = MISSING  # latest or best (lowest recorded val_loss)
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
    ckpt: str = MISSING  # latest or best (lowest recorded val_loss)
    data: Any = None  # null: the run's data; else a data option (data=files ...)
    split: str | None = MISSING  # val, train or all (null: see evaluation.eval_split)
    batches: Any = MISSING  # null: the run's trainer.val_batches; an int; or all
    batch_size: int | None = MISSING  # sequences per batch; null: the run's micro-batch
    devices: Any = MISSING  # ranks: an int >= 1 or auto
    trust_remote_code: bool = MISSING  # run the code the run's config names
    tasks: list[str] | None = MISSING  # lm-eval task names; null: loss and perplexity
    tasks_dirs: list[str] = MISSING  # the user's task dirs, beside conf/eval_tasks/


@dataclass
class ExportConfig:
    """``export.py`` (conf/export.yaml): a run's checkpoint written as weights."""

    run: str = MISSING  # a run dir of train.py, or a checkpoint in one
    ckpt: str = MISSING  # latest or best (lowest recorded val_loss)
    format: str = MISSING  # one of EXPORT_FORMATS
    out: str | None = MISSING  # null: <run dir>/exports/step_N/
    devices: Any = MISSING  # ranks: an int >= 1 or auto
    trust_remote_code: bool = MISSING  # run the code the run's config names


_store.store(name="base_sample", node=SampleConfig)
_store.store(name="base_eval", node=EvalConfig)
_store.store(name="base_export", node=ExportConfig)

#: export.py's ``format``: a Hugging Face dir, or one consolidated safetensors file
#: (``trainer.export=hf`` and ``true``).
EXPORT_FORMATS = ("hf", "safetensors")

#: ``ckpt=`` of sample.py and eval.py: the run's newest checkpoint, or its best one.
CKPT_CHOICES = ("latest", "best")

#: eval.py's ``split``: the data's train or val split, or every token of it (``all``).
EVAL_SPLITS = (*SPLITS, "all")
