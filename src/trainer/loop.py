"""The training loop, run by every rank: a :class:`Trainer` and its parts.

``Trainer.build`` makes the backend and data, the model built shard by shard under
the wrap context, optimizer and schedule; ``step``, ``validate`` and ``checkpoint``
make one step's work; ``finish`` exports and returns the summary; ``fit`` (what
``train`` runs) calls them in order. The global batch and the logged loss (its mean
over the global batch) are the same whatever the number of ranks, so runs on 1 and N
ranks give the same losses.
"""

from __future__ import annotations

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
from src.checkpoint.dcp import SCORE, Checkpointer, best_checkpoints
from src.checkpoint.export import export_model, export_name
from src.checkpoint.folders import run_checkpoints, run_exports, step_dir
from src.config.run_plan import RunPlan
from src.data.mixture import (
    MIX_STATE,
    MixCounter,
    MixedStream,
    ValBatches,
    make_batches,
)
from src.data.packing import Documents, mean_attention_span
from src.data.sources import load_splits, tokenizer_of
from src.errors import Stopped
from src.models.attention import kernel_line
from src.observe import live_memory
from src.observe.attempts import ATTEMPTS, earlier_attempts, run_figures
from src.observe.keys import source_val_key, val_line
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
from src.observe.routing import RoutingWatch
from src.sharding import canonical_name, wrap_plan
from src.text import plural
from src.trainer.best import EARLY_STOP, Best
from src.trainer.downstream import LoopTasks
from src.trainer.faults import mean_and_stop, signal_point, stop_signal
from src.trainer.header import log_float8, log_wrap_plan, millions
from src.trainer.health import block_norms
from src.trainer.optimizer import build_optimizer, lr_lambda
from src.trainer.pipelined import (
    pipeline_evaluate,
    pipeline_train_step,
    unpipelined_model,
)
from src.trainer.resume import ORIGIN, init_weights, resume
from src.trainer.sampling import sample_texts
from src.trainer.step import (
    check_finite,
    evaluate,
    evaluate_sources,
    global_mean,
    train_step,
)

log = logging.getLogger(__name__)

#: ``summary.json``'s ``validation`` of a run without a validation split.
NO_VAL_SPLIT = "none: data.val_fraction=0"


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
        resolved: RunPlan,
        logger: Logger | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.resolved = resolved
        self.logger = logger or Logger()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.summary: dict[str, Any] = {}
        self.routing = RoutingWatch()  # a mixture of experts' collapse, said once
        # trainer.health_every: per-block norms (not with fsdp1: its flat shards)
        self.health_every = int(cfg.trainer.get("health_every") or 0)
        if resolved.backend == "fsdp1":
            self.health_every = 0
        self.health: dict[str, float] = {}
        self.skipped_steps = 0
        self.start_step = 0
        self.extended: dict[str, Any] | None = None  # resume_schedule=extend
        self.origin: dict[str, Any] | None = None  # trainer.init_from's checkpoint
        self.samples: list[dict[str, Any]] = []  # trainer.sample_every's rows
        self.loss = math.nan  # the last step's loss, mean over the global batch

    # -- build ------------------------------------------------------------------------
    def build(self) -> Trainer:
        """Everything the steps need; each rank builds only its own shards."""
        cfg, t, rank = self.cfg, self.cfg.trainer, self.rank
        torch.manual_seed(t.seed)  # dropout; parameters are seeded per name
        self._start_time = time.perf_counter()
        self.backend = make_backend(self.resolved, self.device)
        # Before the model's memory phase: rank 0's peak-FLOP/s probe is no part of it.
        self.meter = self._throughput_meter()
        self._build_data()
        self._build_model()
        spec, config = self.resolved.spec, self.resolved.model_config
        self.scaler = self.backend.grad_scaler()  # fp16's, which fused AdamW refuses
        vocab, fused = spec.vocab_size(config), self.scaler is None
        self.optimizer = build_optimizer(self.model, cfg, spec, vocab, fused=fused)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg)
        )
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
        self.batches = make_batches(train_split, micro_batch, block_size, t.seed)
        # a mixture (data.weights): the tokens each source gave
        self.mix = (
            MixCounter(self.batches) if isinstance(train_split, MixedStream) else None
        )
        self.tasks = LoopTasks(t)  # trainer.eval_tasks (src/trainer/downstream.py)
        text = t.sample_every or self.tasks.names
        self.tokenizer = tokenizer_of(self.cfg.data) if text else None
        self.documents = None  # data.packing=documents: its end-of-document id
        if self.resolved.batch.documents:
            self.documents = Documents(tokenizer_of(self.cfg.data).eos_id)
            # MFU counts the attention the document mask computes
            span = mean_attention_span(self.documents, self.batches, t.max_steps)
            self.meter.flops_per_token = spec.flops_per_token(model_cfg, span)
        self.val_set = []
        self.no_val_split = len(val_split) == 0  # data.val_fraction=0
        if self.no_val_split and t.val_every and t.val_batches:
            log.info("training without a validation split (data.val_fraction=0)")
        elif t.val_every and t.val_batches:
            self.val_set = make_batches(
                val_split, micro_batch, block_size, t.seed
            ).val_batches(t.val_batches, self.backend.dp_rank, self.backend.dp_size)

    def _build_model(self) -> None:
        """The model, sharded as it is built (its construction peak measured on its
        own), and its wrap plan."""
        reset_peak_memory(self.device)
        self.pipeline = None  # the layout's pp > 1: this rank's stages
        self._whole: nn.Module | None = None  # ... and the model without them
        if self.backend.layout.pp > 1:
            self.pipeline = build_pipeline(self.resolved, self.backend)
            self.model = self.pipeline.model
        else:
            self.model = build_model(self.resolved, self.backend)
        self.init_mem = reduce_max_min(memory_metrics(self.device, prefix="init_"))
        # CPU: peak_mem_gib from here on is the memory in use at the moments of the
        # logged steps (sampling every step costs 5-10% of a small model's step)
        live_memory.watch(self.model, self.device, attach=False)
        self.plan = wrap_plan(self.model, self.backend.layout)
        if self.pipeline is not None:  # the plan is this rank's stages
            roles = self.pipeline.roles
            self.plan.stages = tuple(r.index for r in roles)
            self.plan.num_stages = roles[0].num_stages
        # Every module in train mode once: train_step re-enters it only when the
        # root is in eval (after validation or sampling), not at every step.
        self.model.train()
        log_wrap_plan(self.plan, self.logger, self.rank)
        if self.resolved.float8 is not None and self.rank == 0:
            log_float8(self.model, self.backend, self.resolved.float8)
        self.num_params = sum(u.numel for u in self.plan.units) or sum(
            p.numel() for p in self.model.parameters()
        )
        if self.pipeline is not None:  # the plan is this rank's stage's
            self.num_params = self.resolved.spec.num_params(self.resolved.model_config)
        # LoRA or trainer.freeze: what trains (the run header; summary.json)
        self.trained_params = self.num_params  # a stage's plan: not the model's
        if self.pipeline is None:
            self.trained_params = sum(u.trained_numel for u in self.plan.units)
        if self.trained_params < self.num_params:
            self.summary["trainable_params"] = self.trained_params

    def _resume(self) -> None:
        """The checkpointer, and the state of the checkpoint resumed from (if any)."""
        t = self.cfg.trainer
        self.ckpt = Checkpointer(
            run_checkpoints(self.run_dir),
            keep_last=t.keep_last,
            async_save=t.ckpt_async,
            writing=lambda step: signal_point("checkpoint", step),
            keep_best=t.keep_best,
        )
        self.start_step, self.extended, tokens, self.origin, saved = resume(
            self.cfg,
            self.ckpt,
            self.model,
            self.optimizer,
            self.scheduler,
            self.rank,
            self.scaler,
        )
        if self.start_step == 0 and t.init_from is not None:
            self.origin = init_weights(self.cfg, self.ckpt, self.model, self.rank)
        self.best = Best.start(
            t.keep_best, t.early_stop_patience, self.ckpt.directory, saved[EARLY_STOP],
            t.early_stop_min_delta, t.warmup_steps, t.best_metric,
        )  # fmt: skip
        if self.mix is not None:
            gone = self.mix.restore(saved[MIX_STATE])
            if gone:
                log.info(
                    "data.weights: the checkpoint's sources %s are not mixed", gone
                )
        self.earlier_attempts = (
            earlier_attempts(self.run_dir, self.start_step) if self.rank == 0 else []
        )
        # Tokens trained on, across resumes (a resume may change the batch); a
        # checkpoint from before they were recorded: its steps at this batch.
        per_step = self.meter.tokens_per_step
        self.tokens_seen = self.start_step * per_step if tokens is None else tokens
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
                "%s past step %d (logged by the interrupted run)",
                ", ".join(
                    f"{f}: dropped {plural(n, 'row')}" for f, n in dropped.items()
                ),
                self.start_step,
            )

    def _throughput_meter(self) -> ThroughputMeter:
        """Tokens/s and MFU. Only rank 0 reports MFU, so only it runs the (CPU)
        peak-FLOP/s probe; it also says once when the hardware does not accelerate
        the run's precision."""
        t = self.cfg.trainer
        spec, model_cfg = self.resolved.spec, self.resolved.model_config
        block_size = spec.seq_len(model_cfg)
        peak = waited = others = root = source = None
        if self.rank == 0:
            # rank 0 says whose threads held the cores (the run's or others')
            root = run_root()
            before = core_reading(root)
            found = peak_flops_per_rank(
                self.device, self.backend.param_dtype, t.peak_tflops
            )
            if found.warning:
                log.warning("precision=%s: %s", self.cfg.precision.name, found.warning)
            peak, waited, source = found.flops, found.cpu_wait, found.source
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
            peak_source=source,
        )

    def startup_line(self) -> str:
        """What runs, in one line: model size, backend and units, precision,
        checkpointing, compile, devices, batch and tokens per step."""
        cfg, t, s = self.cfg, self.cfg.trainer, self.cfg.sharding
        units = f", {plural(len(self.plan.units), 'unit')}" if self.plan.units else ""
        layout = self.backend.layout
        hsdp = layout.describe()
        if layout.pp > 1:
            hsdp += (
                f", PP{layout.pp} {s.pp_schedule} x "
                f"{s.pp_microbatches} micro-batches (units: pp rank 0's stages)"
            )
        tokens = self.meter.tokens_per_step
        if self.documents is not None:
            dropout = getattr(self.model, "attention_dropout", 0.0) > 0
            hsdp += (
                f" | attention within documents: {kernel_line(self.device, dropout)}"
            )
        params = f"{self.num_params / 1e6:.2f}M params"
        if self.trained_params < self.num_params:
            params = f"trainable {millions(self.trained_params)} of {params}"
        return (
            f"run: {params} | {s.backend}{units}{hsdp} | "
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
        pipeline's: its worst stage's, and that stage's pp rank), and its predicted
        step time and tokens/s."""
        planned, pp_rank = (
            self.resolved.planned_peak_gib,
            self.resolved.planned_peak_pp_rank,
        )
        predicted = dict(self.resolved.predicted or {})
        if self.resolved.layout_chosen is not None:
            predicted["layout"] = self.resolved.layout_chosen
        if planned is None:
            return dict(predicted)
        stage = {} if pp_rank is None else {"planned_peak_pp_rank": pp_rank}
        return {"planned_peak_gib": planned, **stage, **predicted}

    def _after_step(self) -> dict[str, float]:
        """The family's work after each optimizer step (a MoE's router bias) and its
        metrics of the step (routing), where its spec has any."""
        after = self.resolved.spec.after_step
        if after is None:
            return {}
        replicas = self.backend.world_size // self.backend.dp_size
        return after(self.model, replicas)

    # -- the parts of a step ------------------------------------------------------------
    def _train_step(
        self, step: int, health: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward and the optimizer step of ``step``: this rank's loss
        and the gradient norm; ``health``: each block's norms into ``self.health``."""
        inspect = None
        if health:
            gather = self.pipeline is not None

            def inspect() -> None:
                self.health = block_norms(self.model, gather)

        if self.pipeline is not None:
            return pipeline_train_step(
                self.pipeline, self.batches, step - 1, self.backend,
                self.optimizer, self.cfg, self.documents, inspect,
            )  # fmt: skip
        return train_step(
            self.model, self.batches, step - 1, self.backend, self.optimizer,
            self.scaler, self.cfg, self.documents, inspect,
        )  # fmt: skip

    def step(self, step: int) -> dict[str, Any] | None:
        """Optimizer step ``step`` (1-based). At a log point (the first and the last
        step, every ``trainer.log_every``) its row is logged and returned, else None."""
        t = self.cfg.trainer
        lr = self.scheduler.get_last_lr()[0]
        if self.profiler is not None:
            self.profiler.before_step(step)
        signal_point("step", step)  # a test's Ctrl-C, mid-step (src/trainer/faults.py)
        health = bool(self.health_every) and step % self.health_every == 0
        log_now = step == 1 or step % t.log_every == 0 or step == t.max_steps or health
        try:
            with live_memory.sampling(log_now):
                loss, grad_norm = self._train_step(step, health)
        except torch.OutOfMemoryError as err:
            raise oom_error(err, self.oom_snapshot, self.rank, step) from None
        family = self._after_step()
        self.scheduler.step()
        # One all-reduce: the loss's global mean (every rank sees it) and the stop
        # check's flags, read by stop_if_asked unless the step went on to more work.
        self.loss, self.stop_signum = mean_and_stop(loss)
        if self.profiler is not None:
            self.profiler.after_step(step)
        self.skipped_steps += check_finite(
            self.loss, grad_norm, step, self.scaler, self.ckpt
        )
        self.bar.update(1)
        self.tokens_seen += self.meter.tokens_per_step
        if self.mix is not None:
            self.mix.count(step - 1, t.grad_accum)
        speed = self.meter.step(step, log=log_now)  # None before the first full window
        if not log_now:
            return None
        metrics = {
            "loss": self.loss,
            "tokens_seen": self.tokens_seen,
            **(self.mix.shares() if self.mix is not None else {}),
            "lr": lr,
            "grad_norm": float(grad_norm),
            **(speed or {}),
            **reduce_max_min(memory_metrics(self.device)),
            **self._planned(),
            **family,
            **(self.health if health else {}),
        }
        collapsed = self.routing.see(family, step)
        metrics.update(self.routing.metrics())
        if self.routing.collapsed:
            self.summary["routing_collapse"] = {
                str(k): v for k, v in self.routing.collapsed.items()
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
            for line in collapsed:
                log.warning(line)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        return metrics

    def validate(self, step: int) -> float:
        """The loss on the fixed validation batches, logged at ``step``."""
        signal_point("validation")  # a test's Ctrl-C (src/trainer/faults.py)
        sources: dict[str, float] = {}
        if self.pipeline is not None:
            val_loss = global_mean(
                pipeline_evaluate(
                    self.pipeline, self.val_set, self.backend, self.documents
                )
            )
        elif isinstance(self.val_set, ValBatches):  # a mixture: each source's too
            val_loss, per_source = evaluate_sources(
                self.model, self.val_set, self.backend, self.documents
            )
            sources = {source_val_key(n): v for n, v in per_source.items()}
        else:
            val_loss = evaluate(self.model, self.val_set, self.backend, self.documents)
        row = {"val_loss": val_loss, **sources}
        self.logger.log({**row, "tokens_seen": self.tokens_seen}, step)
        self.summary.update(row)
        log.info("step %d: %s", step, val_line(row))
        self.meter.restart(step)  # validation time is not training throughput
        return val_loss

    def whole_model(self) -> nn.Module:
        """The model whole on these ranks (sharded, not cut into stages): the model,
        or under pipeline parallelism the stages' weights gathered into the model
        built without them (built once). A collective."""
        if self.pipeline is None:
            return self.model
        if self._whole is None:
            self._whole = unpipelined_model(self.resolved, self.device)
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

    def checkpoint(self, step: int, score: float | None = None) -> Path:
        """A sharded checkpoint of ``step`` (a collective; in the background with
        ``trainer.ckpt_async``); ``score``: the step's by ``trainer.best_metric``
        (lower is best: best.score_of), which ranks it (``trainer.keep_best``)."""
        # The config it was saved with: a resume continues from it (src/runs/resume.py).
        config = self.resolved.run_config or OmegaConf.to_container(self.cfg)
        extra = {
            "max_steps": self.cfg.trainer.max_steps,
            "config": config,
            "tokens_seen": self.tokens_seen,
        }
        if self.origin is not None:
            extra[ORIGIN] = self.origin
        if self.scaler is not None:
            extra["scaler"] = self.scaler.state_dict()
        if score is not None:
            extra[SCORE] = score
        if self.best.state() is not None:
            extra[EARLY_STOP] = self.best.state()
        if self.mix is not None:
            extra[MIX_STATE] = self.mix.state()
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
            self.export()
        if self.extended:
            self.summary["resume"] = self.extended
        if self.origin is not None:
            self.summary[ORIGIN] = self.origin
        if self.no_val_split:
            self.summary["validation"] = NO_VAL_SPLIT
        if self.mix is not None:
            self.summary[MIX_STATE] = self.mix.summary()
        if self.best.keep_best and self.best.kept:
            found = best_checkpoints(self.ckpt.directory, 1)
            if found:
                self.summary["best_checkpoint"] = {
                    SCORE: found[0][0],
                    "path": str(found[0][1]),
                }
        self.summary.update(
            steps=self.early_stop["step"] if self.early_stop else t.max_steps,
            world_size=self.world,
            num_params=self.num_params,
            wrap_units=len(self.plan.units),
            init_peak_mem_gib=self.init_mem["init_peak_mem_gib"],
            **self._planned(),
            **self.meter.contention(),
        )
        self._record_attempt(t.max_steps, "finished")
        self.logger.log_summary(self.summary)
        return self.summary

    def _record_attempt(self, step: int, ended: str) -> None:
        """This attempt (from the resumed step to ``step``) after the earlier ones in
        the summary, and the whole run's figures from them all (src/observe/attempts.py).
        """
        this = {
            "start_step": self.start_step,
            "end_step": step,
            "wall_time_s": time.perf_counter() - self._start_time,
            "ended": ended,
            **self.meter.measured(),
        }
        attempts = [*self.earlier_attempts, this]
        self.summary[ATTEMPTS] = attempts
        self.summary.update(run_figures(attempts))
        if "mfu" not in self.summary:
            self.summary.pop("mfu", None)

    def export_path(self, step: int | None = None) -> Path:
        """Where ``trainer.export`` writes (``hf/``, or the consolidated file): in the
        run dir, or for ``step`` (``trainer.export_every``) in its export dir."""
        where = Path(self.run_dir)
        if step is not None:
            where = step_dir(run_exports(where), step)
        return where / export_name(self.cfg.trainer.export == "hf")

    def export(self, step: int | None = None) -> None:
        """Write the model as ``trainer.export`` asks (a collective), at the end or
        for ``step`` (:meth:`export_path`)."""
        path = self.export_path(step)
        hf = self.cfg.trainer.export == "hf"
        # The run's tokenizer goes next to the weights (rank 0 writes).
        tokenizer = tokenizer_of(self.cfg.data) if hf and self.rank == 0 else None
        what = export_model(
            self.whole_model(),
            path,
            self.resolved.spec.hf if hf else None,
            self.resolved.model_config,
            tokenizer,
            written=lambda: signal_point("export"),  # a test's kill
        )
        log.info("exported %s to %s", what, path)

    def fit(self) -> dict[str, Any]:
        """Build, then every step with validation and checkpoints when due, finish."""
        t = self.cfg.trainer
        self.build()
        self.early_stop: dict | None = None
        if self.start_step >= t.max_steps or self.best.exhausted:
            self.bar.close()
            log.info(
                "nothing to train: the checkpoint is at step %d and "
                "trainer.max_steps=%d%s; summary.json kept",
                self.start_step,
                t.max_steps,
                f" (it stopped early: trainer.early_stop_patience={t.early_stop_patience})"
                if self.best.exhausted
                else "",
            )
            if t.export and not self.export_path().exists():
                # A run killed while it exported: its export is finished now.
                log.info(
                    "trainer.export=%s: %s is missing: exporting it now",
                    t.export,
                    self.export_path(),
                )
                self.export()
            return {}
        # Read once: a DictConfig lookup costs ~20 us of CPU, at every step.
        max_steps, val_every, sample_every, ckpt_every, export_every = (
            t.max_steps,
            t.val_every,
            t.sample_every,
            t.ckpt_every,
            t.export_every,
        )
        for step in range(self.start_step + 1, max_steps + 1):
            self.step(step)
            last = step == max_steps
            val_loss = None
            if self.val_set and (step % val_every == 0 or last):
                val_loss = self.validate(step)
            if sample_every and (step % sample_every == 0 or last):
                self.sample(step)
            tasks = self.tasks.run(self, step) if self.tasks.due(step, last) else {}
            score = self.tasks.score(val_loss, tasks)  # trainer.best_metric's
            best = score is not None and self.best.seen(step, score)
            stop = score is not None and self.best.exhausted
            saved = (
                ((last or stop) and t.ckpt_final)
                or (ckpt_every and step % ckpt_every == 0)
                or best
            )
            if saved:
                path = self.checkpoint(step, score)
            if export_every and step % export_every == 0:
                self.export(step)
            if stop:
                log.info(self.best.line(step))
                self.early_stop = self.summary["early_stop"] = self.best.summary(step)
                break
            # after validation, sampling or a checkpoint a signal may have come since
            # the step's all-reduce: ask again (a collective of its own)
            busy = (
                val_loss is not None
                or saved
                or (sample_every and step % sample_every == 0)
                or self.tasks.due(step, False)
            )
            self.stop_if_asked(step, None if not saved else path, recheck=bool(busy))
        return self.finish()

    def stop_if_asked(
        self, step: int, saved: Path | None, recheck: bool = False
    ) -> None:
        """After a stop signal on any rank (all stop at this step), write a checkpoint
        unless ``saved`` is this step's, and raise :class:`Stopped`. The signal is the
        one the step's all-reduce carried (:func:`mean_and_stop`); ``recheck``: ask
        again, a collective of its own."""
        signum = stop_signal(self.backend.device) if recheck else self.stop_signum
        if not signum or step >= self.cfg.trainer.max_steps:
            return
        path = saved or self.checkpoint(step)
        self.ckpt.wait()
        self.bar.close()
        stop = Stopped(signum, step, path)
        # summary.json says so (the completed run's summary replaces it).
        by = signal.Signals(signum).name
        self.summary["stopped"] = {"by": by, "step": step, "checkpoint": str(path)}
        self._record_attempt(step, f"stopped by {by}")
        self.logger.log_summary(self.summary)
        raise stop


def train(
    cfg: DictConfig,
    run_dir: str,
    device: torch.device,
    resolved: RunPlan,
) -> dict[str, Any]:
    """Train on this rank (the process group is already initialised); rank 0 logs to
    the console, ``run_dir`` (metrics.jsonl, summary.json) and wandb. ``resolved``:
    the run object of ``cfg`` (from ``validate`` and the launcher's ``prepare``).
    Returns the summary."""
    # A failed run (exception, NaN, a dead peer) still closes its files and marks its
    # wandb run failed, so the next job of a sweep does not inherit it.
    with build_logger(cfg, run_dir, dist.get_rank(), begin=False) as logger:
        try:
            return Trainer(cfg, run_dir, device, resolved, logger).fit()
        finally:  # the sampler watched this run's model: none after it
            live_memory.stop()
