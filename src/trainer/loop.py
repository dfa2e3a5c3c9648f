"""The training loop, run by every rank: a :class:`Trainer` and its parts.

``Trainer.build`` makes the backend and data, the model built shard by shard under
the wrap context, optimizer and schedule; ``step``, ``validate`` and ``checkpoint``
make one step's work; ``finish`` exports and returns the summary; ``fit`` (what
``train`` runs) calls them in order. The global batch and the logged loss (its mean
over the global batch) are the same whatever the number of ranks, so runs on 1 and N
ranks give the same losses.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from src.build import build_model, build_pipeline, make_backend
from src.checkpoint.damage import CheckpointError
from src.checkpoint.dcp import Checkpointer
from src.checkpoint.export import export_consolidated, export_model_hf
from src.checkpoint.folders import (
    incomplete_checkpoints,
    resolve_resume,
    run_checkpoints,
)
from src.checkpoint.values import checked_extra
from src.data.sources import GlobalBatches, load_splits, tokenizer_of
from src.errors import ConfigError, RunError, Stopped
from src.observe.loggers import Logger, build_logger
from src.observe.logs import FILE_ONLY
from src.observe.metrics import (
    CONTENDED,
    ThroughputMeter,
    core_reading,
    interval_line,
    memory_metrics,
    peak_flops_per_rank,
    reduce_max_min,
    reset_peak_memory,
    run_root,
    split_between,
)
from src.observe.profiling import (
    ProfileOptions,
    StepProfiler,
    oom_error,
    watch_cuda_oom,
)
from src.resolved import Resolved
from src.sharding import (
    Backend,
    WrapPlan,
    canonical_name,
    wrap_plan,
)
from src.trainer.faults import RESTART_CAUSE_ENV, signal_point, stop_signal
from src.trainer.pipelined import (
    pipeline_evaluate,
    pipeline_train_step,
    unpipelined_model,
)
from src.trainer.sampling import sample_texts

log = logging.getLogger(__name__)


def build_optimizer(
    model: nn.Module, cfg: DictConfig, resolved: Resolved
) -> torch.optim.AdamW:
    """AdamW with weight decay except where the family's no-decay rule says (biases
    and normalisation gains), decided by canonical name (FSDP1 shards are flat 1-D
    views, so the live tensors cannot tell)."""
    no_decay_name = resolved.spec.no_decay
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            is_nd = no_decay_name(canonical_name(name, model))
            (no_decay if is_nd else decay).append(p)
    t = cfg.trainer
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in zip((decay, no_decay), _weight_decays(t), strict=True)
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas))


def _weight_decays(t: DictConfig) -> tuple[float, float]:
    """The weight decay of :func:`build_optimizer`'s two groups."""
    return t.weight_decay, 0.0


def lr_lambda(cfg: DictConfig):
    """LR multiplier per step: linear warmup to 1, then cosine down to min_lr / lr."""
    t = cfg.trainer
    floor = t.min_lr / t.lr

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def global_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks (each rank holds an equal share)."""
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def train_step(
    model: nn.Module,
    batches: GlobalBatches,
    step: int,
    backend: Backend,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    cfg: DictConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over ``grad_accum`` micro-batches; returns this rank's share
    of the loss and the global gradient norm (before clipping)."""
    t = cfg.trainer
    # The ranks of a tensor-parallel group read the same rows.
    rank, world = backend.dp_rank, backend.dp_size
    model.train()
    loss_sum = torch.zeros((), device=backend.device)
    for micro in range(t.grad_accum):
        x, y = batches.get(step, micro, rank, world)
        x, y = x.to(backend.device), y.to(backend.device)
        # trainer.grad_sync=last: gradients are reduced across ranks only on the
        # last micro-step (unsharded ones are held until then); every: each time.
        sync = micro == t.grad_accum - 1 or t.grad_sync == "every"
        # loss_context: tensor parallelism's loss_parallel, forward and backward.
        with (
            contextlib.nullcontext() if sync else backend.no_sync(model),
            backend.loss_context(),
        ):
            with backend.autocast():
                loss = model(x, y)[1]  # the logits are not kept through backward
            loss = loss / t.grad_accum
            (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = backend.clip_grad_norm_(model, t.grad_clip or math.inf)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, backend: Backend) -> float:
    """Mean loss over the fixed validation batches (the same in every run)."""
    model.eval()
    total = torch.zeros((), device=backend.device)
    for x, y in batches:
        with backend.autocast(), backend.loss_context():
            _, loss = model(x.to(backend.device), y.to(backend.device))
        total += loss.float()
    return global_mean(total / max(1, len(batches)))


def resume(
    cfg: DictConfig,
    ckpt: Checkpointer,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rank: int,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """Restore the checkpoint named by ``trainer.resume``; returns its step (0 if none)
    and, when the schedule was extended, what ``summary.json`` records about it.

    After an elastic restart (``trainer.max_restarts``) or a SLURM requeue the ranks
    resume from the newest good checkpoint by themselves, whatever ``trainer.resume``
    says. The optimizer's hyperparameters are this run's (:func:`apply_hyperparameters`:
    a resume that changed them applies them). The schedule depends on
    ``trainer.max_steps``: with ``trainer.resume_schedule=keep`` a checkpoint resumes
    only with the ``max_steps`` it was written with (ConfigError otherwise); with
    ``extend`` the learning rate follows the schedule of the new ``max_steps`` from
    the resumed step on.
    """
    restarted = restart_reason(cfg)
    wanted = "auto" if restarted else cfg.trainer.resume
    if wanted == "auto":
        for skipped, reason in incomplete_checkpoints(ckpt.directory):
            log.info("skipping checkpoint dir %s: %s", skipped, reason)
    try:
        path = resolve_resume(wanted, ckpt.directory, ckpt.verify, _report_skip(rank))
    except CheckpointError as err:  # not resume=null: the dir holds a run
        raise CheckpointError(f"{err}; start over in another hydra.run.dir") from None
    if restarted:
        found = "resuming from the newest good checkpoint"
        log.info(f"{restarted}; {found if path else 'no checkpoint yet: from step 0'}")
    if path is None:
        if wanted == "auto" and not restarted:
            log.info(
                "trainer.resume=auto: no checkpoint in %s; starting at step 1",
                ckpt.directory,
            )
        return 0, None
    state = ckpt.load(path, model, optimizer, scheduler, verify=False)
    step = state["step"]
    saved_max = checked_extra(
        path, {"max_steps": cfg.trainer.max_steps, **state}, "max_steps", 1
    )
    if saved_max < 1:
        raise CheckpointError(
            f"checkpoint {path} is damaged: meta.json: extra.max_steps is "
            f"{saved_max}, not an integer >= 1"
        )
    if saved_max != cfg.trainer.max_steps and cfg.trainer.resume_schedule != "extend":
        raise schedule_refusal(cfg.trainer.max_steps, saved_max, path)
    before = scheduler.get_last_lr()[0]
    apply_hyperparameters(optimizer, scheduler, cfg)
    after = scheduler.get_last_lr()[0]
    extended = None
    if saved_max != cfg.trainer.max_steps:
        extended = _extended(cfg, path, step, saved_max, before, after)
    elif after != before:
        log.info(
            "from step %d the learning rate follows this run's trainer.lr, min_lr "
            "and warmup_steps (lr %.3g -> %.3g)",
            step,
            before,
            after,
        )
    if scaler is not None and state.get("scaler"):  # fp16 resume stays exact
        scaler.load_state_dict(
            checked_extra(path, state, "scaler", scaler.state_dict())
        )
    log.info("resumed from %s (step %d)", path, step)
    return step, extended


#: ``trainer.resume_schedule``: what a resume with another ``max_steps`` does.
RESUME_SCHEDULES = ("keep", "extend")


def schedule_refusal(max_steps: int, saved_max: int, path: Path | str) -> ConfigError:
    """A resume with another ``trainer.max_steps`` under ``resume_schedule=keep``."""
    return ConfigError(
        "trainer.max_steps",
        f"got {max_steps}, but {path} belongs to a run of {saved_max} steps and "
        f"the learning-rate schedule depends on it; resume with "
        f"trainer.max_steps={saved_max}, or add trainer.resume_schedule=extend to "
        f"continue on the schedule of {max_steps} steps",
    )


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: Any, cfg: DictConfig
) -> None:
    """This run's learning rate, schedule, weight decay and betas in the restored
    optimizer and scheduler (a checkpoint brings back its own; a resume that changed
    them trains with the new ones). The learning rate of the resumed step is the
    scheduler's formula with this run's numbers, so an unchanged resume keeps it bit
    for bit."""
    t = cfg.trainer
    for group, decay in zip(optimizer.param_groups, _weight_decays(t), strict=True):
        group.update(weight_decay=decay, betas=tuple(t.betas), initial_lr=t.lr)
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _extended(
    cfg: DictConfig, path: Path, step: int, saved_max: int, before: float, after: float
) -> dict[str, Any]:
    """``trainer.max_steps`` changed on resume with ``resume_schedule=extend``: the
    learning rate follows the schedule of the new ``max_steps`` (the scheduler is
    built with it); said, and recorded in the summary."""
    t = cfg.trainer
    log.info(
        f"trainer.resume_schedule=extend: max_steps {saved_max} -> {t.max_steps}; "
        f"from step {step} the learning rate follows the schedule of "
        f"{t.max_steps} steps (lr {before:.3g} -> {after:.3g})"
    )
    return {
        "schedule": "extend",
        "from_step": step,
        "checkpoint": str(path),
        "max_steps_before": saved_max,
        "max_steps": t.max_steps,
        "lr_before": before,
        "lr_after": after,
    }


def restart_reason(cfg: DictConfig) -> str | None:
    """An elastic restart or a SLURM requeue, in words (None otherwise): the ranks
    then resume from the newest good checkpoint, whatever ``trainer.resume`` says."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart:
        # The launcher names the failure (torchrun does not: "a rank failed").
        cause = os.environ.get(RESTART_CAUSE_ENV, "a rank failed").removeprefix(
            "error: "
        )
        return f"elastic restart {restart} of {cfg.trainer.max_restarts} after {cause}"
    requeue = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    if requeue:
        job = os.environ.get("SLURM_JOB_ID", "?")
        return f"SLURM job {job} requeued ({requeue}x)"
    return None


def _report_skip(rank: int):
    def report(path: Path, reason: str) -> None:
        log.info("skipping checkpoint %s: %s", path, reason)

    return report


class NonFiniteLossError(RunError):
    """The loss or the gradient norm became NaN or inf."""


def check_finite(
    loss: float,
    grad_norm: torch.Tensor,
    step: int,
    scaler: torch.amp.GradScaler | None,
    ckpt: Checkpointer,
) -> int:
    """Stop on a NaN/inf loss, naming the step; with the fp16 scaler, overflowing
    gradients only skip the step (the scaler did not apply it). Returns 1 if skipped.

    The run stops before any later checkpoint is written, so the last good checkpoint
    stays intact and ``trainer.resume=auto`` continues from it.
    """
    norm = float(grad_norm)
    if math.isfinite(loss) and math.isfinite(norm):
        return 0
    if scaler is not None and math.isfinite(loss):
        return 1
    last = ckpt.latest()
    where = f"last good checkpoint: {last}" if last else "no checkpoint was written"
    raise NonFiniteLossError(
        f"non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; "
        f"stopping ({where})"
    )


def log_wrap_plan(plan: WrapPlan, logger: Logger, rank: int) -> None:
    if plan.units:  # ddp and none have no units
        log.info(plan.tree())
    logger.log_table("wrap_plan", plan.rows())


class Trainer:
    """One rank's training run, in parts that can be called one by one.

    :meth:`build` (backend, data, the model sharded as it is built, optimizer and
    schedule, resume), then per step :meth:`step` (one optimizer step; at a log point
    it logs and returns the row), :meth:`validate` and :meth:`checkpoint`, and
    :meth:`finish` (export, summary). :meth:`fit` runs them as ``train.py`` does; a
    benchmark calls them itself. The process group must be initialised.
    """

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: str,
        device: torch.device,
        resolved: Resolved,
        logger: Logger | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.resolved = resolved
        self.logger = logger or Logger()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.summary: dict[str, Any] = {}
        self.skipped_steps = 0
        self.start_step = 0
        self.extended: dict[str, Any] | None = None  # resume_schedule=extend
        self.samples: list[dict[str, Any]] = []  # trainer.sample_every's rows
        self.loss = math.nan  # the last step's loss, mean over the global batch

    # -- build ------------------------------------------------------------------------
    def build(self) -> Trainer:
        """Everything the steps need; each rank builds only its own shards."""
        cfg, t, rank = self.cfg, self.cfg.trainer, self.rank
        torch.manual_seed(t.seed)  # dropout; parameters are seeded per name
        self._start_time = time.perf_counter()
        self.backend = make_backend(cfg, self.device, self.resolved.layout)
        # Before the model's memory phase starts: rank 0's CPU peak-FLOP/s probe
        # allocates matrices that are no part of training's peak.
        self.meter = self._throughput_meter()
        self._build_data()
        self._build_model()
        self.optimizer = build_optimizer(self.model, cfg, self.resolved)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg)
        )
        self.scaler = self.backend.grad_scaler()
        self._resume()
        self.logger.log(
            {
                "init_peak_mem_gib": self.init_mem["init_peak_mem_gib"],
                "num_params": self.num_params,
                "wrap_units": len(self.plan.units),
                **self._planned(),
            },
            step=self.start_step,
        )
        log.info(self.startup_line())
        self.profiler = self._profiler() if t.profile else None
        self.oom_snapshot = watch_cuda_oom(self.run_dir, rank)
        self.bar = tqdm(
            total=t.max_steps,
            initial=self.start_step,
            disable=rank != 0 or not t.progress,
            desc="train",
            dynamic_ncols=True,
        )
        return self

    def _build_data(self) -> None:
        """Every rank sees the same global batches and takes its own rows."""
        t = self.cfg.trainer
        spec, model_cfg = self.resolved.spec, self.resolved.model_config
        block_size = spec.seq_len(model_cfg)
        micro_batch = t.batch_size // t.grad_accum  # global sequences per micro-step
        train_split, val_split = load_splits(
            self.cfg.data, spec.vocab_size(model_cfg), t.seed
        )
        self.batches = GlobalBatches(train_split, micro_batch, block_size, t.seed)
        self.tokenizer = tokenizer_of(self.cfg.data) if t.sample_every else None
        self.val_set = []
        if t.val_every and t.val_batches:
            self.val_set = GlobalBatches(
                val_split, micro_batch, block_size, t.seed
            ).val_batches(t.val_batches, self.backend.dp_rank, self.backend.dp_size)

    def _build_model(self) -> None:
        """The model, sharded as it is built (its construction peak measured on its
        own), and its wrap plan."""
        reset_peak_memory(self.device)
        self.pipeline = None  # sharding.pipeline_parallel > 1: this rank's stages
        self._whole: nn.Module | None = None  # ... and the model without them
        if self.backend.layout.pp > 1:
            self.pipeline = build_pipeline(self.cfg, self.backend, self.resolved)
            self.model = self.pipeline.model
        else:
            self.model = build_model(self.cfg, self.backend, self.resolved)
        self.init_mem = reduce_max_min(memory_metrics(self.device, prefix="init_"))
        self.plan = wrap_plan(self.model, self.backend.layout)
        if self.pipeline is not None:  # the plan is this rank's stages
            roles = self.pipeline.roles
            self.plan.stages = tuple(r.index for r in roles)
            self.plan.num_stages = roles[0].num_stages
        log_wrap_plan(self.plan, self.logger, self.rank)
        self.num_params = sum(u.numel for u in self.plan.units) or sum(
            p.numel() for p in self.model.parameters()
        )
        if self.pipeline is not None:  # the plan is this rank's stage's
            self.num_params = self.resolved.spec.num_params(self.resolved.model_config)

    def _resume(self) -> None:
        """The checkpointer, and the state of the checkpoint resumed from (if any)."""
        t = self.cfg.trainer
        self.ckpt = Checkpointer(
            run_checkpoints(self.run_dir),
            keep_last=t.keep_last,
            async_save=t.ckpt_async,
            writing=lambda step: signal_point("checkpoint", step),
        )
        self.start_step, self.extended = resume(
            self.cfg,
            self.ckpt,
            self.model,
            self.optimizer,
            self.scheduler,
            self.rank,
            self.scaler,
        )
        if self.start_step < t.max_steps:
            # Only now, with a resume accepted and steps to train, does the wandb run
            # start (the same one again on a resume): a refused start or "nothing to
            # train" makes none.
            self.logger.begin(resumed=self.start_step > 0)
        # One row per step: an earlier attempt's rows past this start go (all but
        # step 0's when it starts over); a row at this step is merged into.
        dropped = self.logger.drop_rows_after(self.start_step)
        if dropped:
            log.info(
                "metrics.jsonl: dropped %d rows past step %d (logged by the "
                "interrupted run)",
                dropped,
                self.start_step,
            )

    def _throughput_meter(self) -> ThroughputMeter:
        """Tokens/s and MFU. Only rank 0 reports MFU, so only it runs the (CPU)
        peak-FLOP/s probe; it also says once when the hardware does not accelerate
        the run's precision."""
        t = self.cfg.trainer
        spec, model_cfg = self.resolved.spec, self.resolved.model_config
        block_size = spec.seq_len(model_cfg)
        peak = waited = others = root = None
        if self.rank == 0:
            # rank 0 says whose threads held the cores (the run's or others')
            root = run_root()
            before = core_reading(root)
            found = peak_flops_per_rank(
                self.device, self.backend.param_dtype, t.peak_tflops
            )
            if found.warning:
                log.warning("precision=%s: %s", self.cfg.precision.name, found.warning)
            peak, waited = found.flops, found.cpu_wait
            split = split_between(waited, before, core_reading(root))
            others = waited if split is None else split[1]
            if others is not None and others > CONTENDED:
                log.warning(
                    "MFU: the peak probe waited for a core %.0f%% of the time while "
                    "other processes held this machine's cores: its peak reads low "
                    "and MFU high; set trainer.peak_tflops for a fixed peak",
                    100 * others,
                )
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        return ThroughputMeter(
            tokens_per_step=t.batch_size * block_size,
            flops_per_token=spec.flops_per_token(model_cfg, block_size),
            peak_flops_per_rank=peak,
            world_size=self.world,
            probe_cpu_wait=waited,
            probe_cpu_wait_others=others,
            run_root=root,
            compute_threads=local * torch.get_num_threads(),
        )

    def startup_line(self) -> str:
        """What runs, in one line: model size, backend and units, precision,
        checkpointing, compile, devices, batch and tokens per step."""
        cfg, t, s = self.cfg, self.cfg.trainer, self.cfg.sharding
        units = f", {len(self.plan.units)} units" if self.plan.units else ""
        layout = self.backend.layout
        hsdp = layout.describe()
        if layout.pp > 1:
            hsdp += (
                f", PP{layout.pp} {s.pp_schedule} x "
                f"{s.pp_microbatches} micro-batches (units: pp rank 0's stages)"
            )
        tokens = self.meter.tokens_per_step
        return (
            f"run: {self.num_params / 1e6:.2f}M params | {s.backend}{units}{hsdp} | "
            f"{cfg.precision.name} | checkpointing {s.activation_checkpointing} | "
            f"compile {'on' if s.compile else 'off'} | {self.world} x "
            f"{self.device.type} | batch {t.batch_size} x {tokens // t.batch_size} "
            f"(grad_accum {t.grad_accum}) = {tokens:,} tokens/step"
        )

    def _profiler(self) -> StepProfiler:
        """``trainer.profile``'s window over every unit of the plan and every block."""
        t, spec = self.cfg.trainer, self.resolved.spec
        if self.start_step >= t.profile_start:
            log.warning(
                "trainer.profile: the window starts at step %d, this run at step %d "
                "(resumed): nothing is profiled",
                t.profile_start,
                self.start_step + 1,
            )
        blocks = spec.block_classes(self.resolved.model_config)
        units = {u.path for u in self.plan.units}
        modules: dict[str, nn.Module] = {}
        for name, module in self.model.named_modules():
            path = canonical_name(name, self.model)
            if path in units or (blocks and isinstance(module, blocks)):
                modules.setdefault(path or "<root>", module)
        options = ProfileOptions(
            t.profile_start,
            t.profile_steps,
            t.profile_record_shapes,
            t.profile_with_stack,
            t.profile_memory,
        )
        return StepProfiler(
            options,
            self.run_dir,
            self.rank,
            self.device,
            modules,
            t.max_steps,
            on_done=self._profiled,
        )

    def _profiled(self, directory: Path, rows: list[dict]) -> None:
        """Every rank wrote its files: rank 0 logs the table and the folder (wandb
        artifact of type ``profile``)."""
        dist.barrier()
        self.logger.log_table("profile", rows)
        self.logger.log_artifact("profile", "profile", directory)

    def _planned(self) -> dict[str, float]:
        """The planner's ``peak_mem_gib`` (launcher's estimate), logged beside it (a
        pipeline's: its worst stage's, and that stage's pp rank)."""
        planned, pp_rank = (
            self.resolved.planned_peak_gib,
            self.resolved.planned_peak_pp_rank,
        )
        if planned is None:
            return {}
        stage = {} if pp_rank is None else {"planned_peak_pp_rank": pp_rank}
        return {"planned_peak_gib": planned, **stage}

    # -- the parts of a step ------------------------------------------------------------
    def step(self, step: int) -> dict[str, Any] | None:
        """Optimizer step ``step`` (1-based). At a log point (the first and the last
        step, every ``trainer.log_every``) its row is logged and returned, else None."""
        t = self.cfg.trainer
        lr = self.scheduler.get_last_lr()[0]
        if self.profiler is not None:
            self.profiler.before_step(step)
        signal_point("step", step)  # a test's Ctrl-C, mid-step (src/trainer/faults.py)
        try:
            if self.pipeline is not None:
                loss, grad_norm = pipeline_train_step(
                    self.pipeline,
                    self.batches,
                    step - 1,
                    self.backend,
                    self.optimizer,
                    self.cfg,
                )
            else:
                loss, grad_norm = train_step(
                    self.model,
                    self.batches,
                    step - 1,
                    self.backend,
                    self.optimizer,
                    self.scaler,
                    self.cfg,
                )
        except torch.OutOfMemoryError as err:
            raise oom_error(err, self.oom_snapshot, self.rank, step) from None
        self.scheduler.step()
        self.loss = global_mean(loss)  # one scalar all-reduce: every rank sees it
        if self.profiler is not None:
            self.profiler.after_step(step)
        self.skipped_steps += check_finite(
            self.loss, grad_norm, step, self.scaler, self.ckpt
        )
        self.bar.update(1)
        log_now = step == 1 or step % t.log_every == 0 or step == t.max_steps
        speed = self.meter.step(step, log=log_now)  # None before the first full window
        if not log_now:
            return None
        metrics = {
            "loss": self.loss,
            "lr": lr,
            "grad_norm": float(grad_norm),
            **(speed or {}),
            **reduce_max_min(memory_metrics(self.device)),
            **self._planned(),
        }
        if self.scaler is not None:
            metrics["loss_scale"] = self.scaler.get_scale()
            metrics["skipped_steps"] = self.skipped_steps
        self.logger.log(metrics, step=step)
        self.summary.update(metrics)
        if speed and "mfu" not in speed:
            self.summary.pop("mfu", None)  # the last window's, or none (omitted)
        if self.rank == 0:  # only rank 0 measures MFU
            # On the console without the bar; in train.log either way.
            extra = None if self.bar.disable else FILE_ONLY
            log.info(interval_line(step, metrics), extra=extra)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        return metrics

    def validate(self, step: int) -> float:
        """The loss on the fixed validation batches, logged at ``step``."""
        signal_point("validation")  # a test's Ctrl-C (src/trainer/faults.py)
        if self.pipeline is not None:
            val_loss = global_mean(
                pipeline_evaluate(self.pipeline, self.val_set, self.backend)
            )
        else:
            val_loss = evaluate(self.model, self.val_set, self.backend)
        self.logger.log({"val_loss": val_loss}, step=step)
        self.summary["val_loss"] = val_loss
        log.info("step %d: val_loss %.4f", step, val_loss)
        self.meter.restart(step)  # validation time is not training throughput
        return val_loss

    def whole_model(self) -> nn.Module:
        """The model whole on these ranks (sharded, not cut into stages): the model,
        or under pipeline parallelism the stages' weights gathered into the model
        built without them (built once). A collective."""
        if self.pipeline is None:
            return self.model
        if self._whole is None:
            self._whole = unpipelined_model(self.cfg, self.resolved, self.device)
        self.pipeline.gather_into(self._whole)
        return self._whole

    def sample(self, step: int) -> list[dict[str, Any]]:
        """Greedy continuations of ``trainer.sample_prompts`` (every rank decodes, in
        step; the random streams are untouched), logged at ``step``: the console,
        ``sample_<i>`` in metrics.jsonl, and the ``samples`` table (wandb Table and
        samples.json) of every step so far."""
        t = self.cfg.trainer
        prompts = list(t.sample_prompts)
        texts = sample_texts(
            self.whole_model(),
            self.resolved,
            self.tokenizer,
            prompts,
            max_new_tokens=t.sample_tokens,
            temperature=0.0,
            device=self.device,
            # A compiled block would compile again for each cache position.
            kv_cache=not self.cfg.sharding.compile,
        )
        rows = [
            {"step": step, "prompt": p, "text": out[0]}
            for p, out in zip(prompts, texts, strict=True)
        ]
        self.samples.extend(rows)
        self.logger.log({f"sample_{i}": r["text"] for i, r in enumerate(rows)}, step)
        self.logger.log_table("samples", self.samples)
        for r in rows:
            log.info("step %d: sample %r", step, r["text"])
        self.meter.restart(step)  # sampling time is not training throughput
        return rows

    def checkpoint(self, step: int) -> Path:
        """A sharded checkpoint of ``step`` (a collective; in the background with
        ``trainer.ckpt_async``)."""
        # The config it was saved with: a resume continues from it (src/runs/resume.py).
        config = self.resolved.run_config or OmegaConf.to_container(self.cfg)
        extra = {"max_steps": self.cfg.trainer.max_steps, "config": config}
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        path = self.ckpt.save(
            step, self.model, self.optimizer, self.scheduler, extra=extra
        )
        how = "writing in the background" if self.cfg.trainer.ckpt_async else "saved"
        log.info("step %d: checkpoint %s to %s", step, how, path)
        return path

    # -- the end ------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        """Wait for the last checkpoint, export (``trainer.export``), then log and
        return the run's summary."""
        t = self.cfg.trainer
        self.ckpt.wait()  # the last background save is published before the run ends
        self.bar.close()
        if t.export:
            if t.export == "hf":
                export_path = Path(self.run_dir) / "hf"
                # The run's tokenizer goes next to the weights (rank 0 writes).
                tokenizer = tokenizer_of(self.cfg.data) if self.rank == 0 else None
                export_model_hf(
                    self.whole_model(),
                    export_path,
                    self.resolved.spec.hf,
                    self.resolved.model_config,
                    tokenizer,
                )
                what = "weights, config.json" + (
                    f" and the {tokenizer.name} tokenizer" if tokenizer else ""
                )
            else:
                export_path = Path(self.run_dir) / "model.safetensors"
                export_consolidated(self.whole_model(), export_path)
                what = "consolidated weights"
            log.info("exported %s to %s", what, export_path)
        if self.extended:
            self.summary["resume"] = self.extended
        self.summary.update(
            steps=t.max_steps,
            world_size=self.world,
            num_params=self.num_params,
            wrap_units=len(self.plan.units),
            init_peak_mem_gib=self.init_mem["init_peak_mem_gib"],
            wall_time_s=time.perf_counter() - self._start_time,
            **self._planned(),
            **self.meter.contention(),
        )
        self.logger.log_summary(self.summary)
        return self.summary

    def fit(self) -> dict[str, Any]:
        """Build, then every step with validation and checkpoints when due, finish."""
        t = self.cfg.trainer
        self.build()
        if self.start_step >= t.max_steps:
            self.bar.close()
            log.info(
                "nothing to train: the checkpoint is at step %d and "
                "trainer.max_steps=%d; summary.json kept",
                self.start_step,
                t.max_steps,
            )
            return {}
        for step in range(self.start_step + 1, t.max_steps + 1):
            self.step(step)
            last = step == t.max_steps
            if self.val_set and (step % t.val_every == 0 or last):
                self.validate(step)
            if t.sample_every and (step % t.sample_every == 0 or last):
                self.sample(step)
            saved = (last and t.ckpt_final) or (
                t.ckpt_every and step % t.ckpt_every == 0
            )
            if saved:
                path = self.checkpoint(step)
            self.stop_if_asked(step, None if not saved else path)
        return self.finish()

    def stop_if_asked(self, step: int, saved: Path | None) -> None:
        """After a stop signal on any rank (a collective: all stop at this step), write
        a checkpoint unless ``saved`` is this step's, and raise :class:`Stopped`."""
        signum = stop_signal(self.backend.device)
        if not signum or step >= self.cfg.trainer.max_steps:
            return
        path = saved or self.checkpoint(step)
        self.ckpt.wait()
        self.bar.close()
        stop = Stopped(signum, step, path)
        # summary.json says so (the completed run's summary replaces it).
        by = signal.Signals(signum).name
        self.summary["stopped"] = {"by": by, "step": step, "checkpoint": str(path)}
        self.logger.log_summary(self.summary)
        raise stop


def train(
    cfg: DictConfig,
    run_dir: str,
    device: torch.device,
    resolved: Resolved,
) -> dict[str, Any]:
    """Train on this rank (the process group is already initialised); rank 0 logs to
    the console, ``run_dir`` (metrics.jsonl, summary.json) and wandb. ``resolved``:
    the run object of ``cfg`` (from ``validate`` and the launcher's ``prepare``).
    Returns the summary."""
    # A failed run (exception, NaN, a dead peer) still closes its files and marks its
    # wandb run failed, so the next job of a sweep does not inherit it.
    with build_logger(cfg, run_dir, dist.get_rank(), begin=False) as logger:
        return Trainer(cfg, run_dir, device, resolved, logger).fit()
