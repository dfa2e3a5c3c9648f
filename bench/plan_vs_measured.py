"""The planner's training-peak estimate against the measured peak, config by config.

For each configuration the planner (src/planner/) predicts the per-rank peak
above the process baseline (``Estimate.training``: every part but ``process``), and
``world`` real ranks run the trainer's own code (``build_model``, ``build_optimizer``,
``train_step``: src/build.py, src/trainer/optimizer.py and step.py) for a few steps
on synthetic tokens:

- CPU: each rank's baseline is its resident set after the imports, the gloo process
  group, the FSDP mesh and the data, just before the model is built; the peak is VmHWM
  (reset at that point) after the steps. Each rank sets glibc's allocator first, as
  train.py's ranks do (``trainer.malloc_mmap_threshold_kib``, default 4 MiB, one
  arena), so a big freed tensor leaves the resident set at once: the figure follows
  memory in use (what the heap keeps of smaller blocks is in the calibrated constants).
- CUDA (run unchanged on a GPU machine): ``torch.cuda.max_memory_allocated`` above
  ``memory_allocated`` at the same point, NCCL.

measured = the max over ranks of (peak - baseline); error = estimate / measured - 1.

``--ordinary``: what a user sees, the figures docs/planner.md reports. Each configuration of :data:`ORDINARY` runs
as ``python train.py <overrides>`` for a few steps (no allocator environment: the ranks
set their own, ``trainer.malloc_mmap_threshold_kib``), and its closing line's two
figures are compared: ``planned_peak_gib`` (the planner's, computed here as the
launcher computes it) against ``peak_mem_gib`` (the max over ranks of the memory in use (CPU: src/observe/live_memory.py) from the
model's build on, the process included).

    python -m bench.plan_vs_measured [--steps 3] [--configs NAME ...] [--append-docs]
    python -m bench.plan_vs_measured --ordinary [--holdout | --audit | --grid] [--configs NAME ...] [--measured FILE] [--jobs N]

``--grid``: bench/plan_grid.py's EP, CP, float8 and combined runs (issue 56), with its
dense twins; ``--jobs N`` runs N of them at once (memory figures, not speed: they do
not depend on the load).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import publish
from bench.plan_grid import GRID
from src.harness import compose_config, run_distributed
from src.sharding import MIB

TARGET = 0.10  # |error| on every configuration

# name -> overrides. Global batch B over grad_accum A and W ranks: B / A / W sequences
# per rank per micro-step. Hugging Face models come from the tiny local configs in
# bench/hf_configs/ (no download).
HF_CONFIGS = Path(__file__).resolve().parent / "hf_configs"


def _gpt(layers: int, width: int, seq: int, batch: int, ranks: int, *more: str):
    return ["model=small", "model.vocab_size=256", "model.n_head=4",
            f"model.n_layer={layers}", f"model.n_embd={width}",
            f"model.block_size={seq}", f"trainer.batch_size={batch}",
            f"trainer.devices={ranks}", *more]  # fmt: skip


def _llama(layers: int, width: int, seq: int, batch: int, ranks: int, *more: str):
    return ["model=llama_tiny", "model.vocab_size=256", f"model.n_layers={layers}",
            f"model.dim={width}", f"model.max_seq_len={seq}",
            f"trainer.batch_size={batch}", f"trainer.devices={ranks}", *more]  # fmt: skip


def _hf(config: str, seq: int, batch: int, ranks: int, *more: str):
    return ["model=hf", f"model.config={HF_CONFIGS / config}", f"model.block_size={seq}",
            f"trainer.batch_size={batch}", f"trainer.devices={ranks}",
            "sharding.policy=block", *more]  # fmt: skip


_BASE = ["data=synthetic", "logger=none"]
CONFIGS: dict[str, list[str]] = {
    "base": _gpt(4, 256, 256, 8, 2),
    "wide": _gpt(2, 768, 128, 8, 2),
    "deep": _gpt(12, 128, 256, 8, 2),
    "long seq": _gpt(4, 256, 1024, 4, 2),
    "big vocab": _gpt(2, 256, 256, 8, 2, "model.vocab_size=8192"),
    "accum 4, sync last": _gpt(4, 512, 128, 16, 2, "trainer.grad_accum=4",
                               "trainer.grad_sync=last"),
    "accum 4, sync every": _gpt(4, 512, 128, 16, 2, "trainer.grad_accum=4",
                                "trainer.grad_sync=every"),
    "AC full": _gpt(4, 256, 512, 8, 2, "sharding.activation_checkpointing=full"),
    "AC full, every 2nd": _gpt(4, 256, 512, 8, 2,
                               "sharding.activation_checkpointing=full",
                               "sharding.activation_checkpointing_every=2"),
    "AC selective": _gpt(4, 256, 512, 8, 2,
                         "sharding.activation_checkpointing=selective",
                         "sharding.policy=block"),
    "1 rank": _gpt(4, 256, 256, 4, 1),
    "fsdp1": _gpt(4, 256, 256, 8, 2, "sharding=fsdp1"),
    "bf16": _gpt(4, 256, 256, 8, 2, "precision=bf16_mixed"),
    "bf16 long seq": _gpt(4, 256, 1024, 4, 2, "precision=bf16_mixed"),
    "bf16 wide": _gpt(2, 768, 128, 8, 2, "precision=bf16_mixed"),
    "fsdp1 bf16": _gpt(4, 256, 256, 8, 2, "sharding=fsdp1", "precision=bf16_mixed"),
    "one unit": _gpt(8, 512, 128, 8, 2, "sharding.min_params=1e8"),
    "ddp": _gpt(4, 384, 256, 8, 2, "sharding=ddp"),
    "ddp bf16": _gpt(4, 384, 256, 8, 2, "sharding=ddp", "precision=bf16_mixed"),
    "4 ranks": _gpt(4, 256, 256, 8, 4),
    "HSDP 2x2, no reshard": _gpt(4, 256, 256, 8, 4, "sharding.replicate=2",
                                 "sharding.reshard_after_forward=false"),
    "llama": _llama(4, 256, 256, 8, 2),
    "llama bf16": _llama(4, 256, 256, 8, 2, "precision=bf16_mixed"),
    "llama fsdp1 bf16": _llama(4, 256, 256, 8, 2, "sharding=fsdp1",
                               "precision=bf16_mixed"),
    "hf qwen2": _hf("qwen2_4x384", 256, 8, 2),
    "hf gpt-neox": _hf("gpt_neox_4x256", 256, 8, 2),
    "hf gemma2": _hf("gemma2_4x256", 256, 8, 2),
    "hf mistral bf16": _hf("mistral_4x256", 256, 8, 2, "precision=bf16_mixed"),
    "hf qwen2, AC full": _hf("qwen2_4x384", 256, 8, 2,
                             "sharding.activation_checkpointing=full"),
}  # fmt: skip


# Ordinary runs: train.py's defaults (data=text, logger=wandb offline, 128 tokens,
# global batch 16) with the layouts named; each runs a few steps, no validation.
HF = "bench/hf_configs"
_PP_GPT = ["model.n_embd=384", "model.block_size=512", "trainer.devices=2",
           "sharding.pipeline_parallel=2", "sharding.pp_microbatches=4"]  # fmt: skip
ORDINARY: dict[str, list[str]] = {
    "gpt 4x384, 4 ranks": ["model.n_embd=384", "trainer.devices=4"],
    "gpt 8x512, one unit": ["model.n_layer=8", "model.n_embd=512",
                            "sharding.min_params=1e8"],
    "gpt 4x256, many small units": ["model.n_embd=256", "sharding.min_params=2e4"],
    "gpt 4x384, ddp": ["model.n_embd=384", "sharding=ddp"],
    "llama fsdp1 bf16": ["model=llama_tiny", "sharding=fsdp1", "precision=bf16_mixed"],
    "llama AC full": ["model=llama_tiny", "sharding.activation_checkpointing=full"],
    "hf qwen2": ["model=hf", f"model.config={HF}/qwen2_4x384"],
    "hf qwen2 fsdp1 bf16": ["model=hf", f"model.config={HF}/qwen2_4x384",
                            "sharding=fsdp1", "precision=bf16_mixed"],
    "hf llama TP2 x FSDP2, 4 ranks": ["model=hf", f"model.config={HF}/llama_4x256",
                                      "trainer.devices=4", "sharding.tensor_parallel=2"],
    "hf phi3": ["model=hf", f"model.config={HF}/phi3_4x256"],
    "hf mixtral (MoE)": ["model=hf", f"model.config={HF}/mixtral_4x256"],
    "hf qwen3-moe (MoE)": ["model=hf", f"model.config={HF}/qwen3_moe_4x256"],
    "custom TinyLM": ["model=custom", "model._target_=tests.test_models.TinyLM",
                      "+model.args.dim=256", "+model.args.depth=4",
                      "model.block_size=256", "sharding.policy=block"],
    # context parallelism: each rank 1/C of every sequence, K and V gathered
    "llama CP2 x FSDP2, 4 ranks, 2048 tokens": [
        "model=llama_tiny", "model.max_seq_len=2048", "trainer.devices=4",
        "sharding.context_parallel=2"],
    "gpt CP2, 2 ranks, 1024 tokens": ["model.block_size=1024",
                                      "sharding.context_parallel=2"],
    # expert parallelism: each rank E-th of every MoE block's experts, tokens by
    # all-to-all (an HF model by its config's base_model_ep_plan)
    "moe_tiny EP2 x FSDP2, 4 ranks": ["model=moe_tiny", "trainer.devices=4",
                                      "sharding.expert_parallel=2"],
    "hf mixtral EP2, 2 ranks": ["model=hf", f"model.config={HF}/mixtral_4x256",
                                "sharding.expert_parallel=2"],
    # ... with tp (the ep group whole tp groups), with capacity (its bound), and
    # Qwen3-MoE
    "moe_tiny EP2 x TP2, 4 ranks": ["model=moe_tiny", "trainer.devices=4",
                                    "sharding.expert_parallel=2",
                                    "sharding.tensor_parallel=2"],
    "moe_tiny EP2 x FSDP2 capacity 1.25": ["model=moe_tiny", "trainer.devices=4",
                                           "model.capacity_factor=1.25",
                                           "sharding.expert_parallel=2"],
    "hf qwen3-moe EP2, 2 ranks": ["model=hf", f"model.config={HF}/qwen3_moe_4x256",
                                  "sharding.expert_parallel=2"],
    # float8 (torchao) blocks, FSDP2 float8 all-gather: the float8 weight copies
    # gathered per unit and what autocast keeps (docs/planner.md "float8")
    "gpt float8": ["precision=float8"],
    "llama float8": ["model=llama_tiny", "precision=float8"],
    # pipeline stages: the worst stage's plan against the max over ranks
    "gpt 4x384 PP2 1F1B, 2 ranks": [*_PP_GPT, "sharding.pp_schedule=1f1b"],
    "gpt 4x384 PP2 GPipe, 2 ranks": [*_PP_GPT, "sharding.pp_schedule=gpipe"],
    "llama PP2 interleaved x FSDP2, 4 ranks": [
        "model=llama_tiny", "model.max_seq_len=512", "trainer.devices=4",
        "sharding.pipeline_parallel=2", "sharding.pp_schedule=interleaved_1f1b",
        "sharding.pp_microbatches=4"],
}  # fmt: skip


# A holdout for --ordinary --holdout: configurations the planner was never fitted
# to nor checked on while it changed (other widths, depths, sequence lengths, units
# of several blocks, AC on GPT, fsdp1 in fp32, 4 ranks, TP without sequence
# parallelism), run once after a change to see whether its figures generalise.
HOLDOUT: dict[str, list[str]] = {
    "gpt 6x320, seq 256": ["model.n_layer=6", "model.n_embd=320",
                           "model.block_size=256"],
    "gpt 8x256, units of 3 blocks": ["model.n_layer=8", "model.n_embd=256",
                                     "sharding.min_params=2e6"],
    "gpt 4x384, AC full": ["model.n_embd=384", "model.block_size=256",
                           "sharding.activation_checkpointing=full"],
    "gpt 6x256, fsdp1 fp32": ["model.n_layer=6", "model.n_embd=256",
                              "sharding=fsdp1"],
    "gpt seq 512, AC selective, 4 ranks": ["model.block_size=512",
                                           "sharding.activation_checkpointing=selective",
                                           "sharding.policy=block", "trainer.devices=4"],
    "llama 6 layers, 4 ranks": ["model=llama_tiny", "model.n_layers=6",
                                "trainer.devices=4"],
    "gpt 4x384 TP2 no SP, 4 ranks": ["model.n_embd=384", "trainer.devices=4",
                                     "sharding.tensor_parallel=2",
                                     "sharding.sequence_parallel=false"],
    "llama TP2 no SP, 4 ranks": ["model=llama_tiny", "trainer.devices=4",
                                 "sharding.tensor_parallel=2",
                                 "sharding.sequence_parallel=false"],
}  # fmt: skip


_LLAMA256 = ["model=llama_tiny", "model.dim=256"]
_GPT8X512 = ["model.n_layer=8", "model.n_embd=512"]
_TINYLM = ["model=custom", "model._target_=tests.test_models.TinyLM"]
# An audit for --ordinary --audit: configurations as a user types them, in none of
# the tables above, measured once to check the planner outside what it was built
# on (docs/benchmarks.md, "The planner on 43 more configurations"). A row may set
# its own steps and validation (its overrides come after the defaults).
AUDIT: dict[str, list[str]] = {
    "gpt 4x256, HSDP 2x2": ["model.n_embd=256", "trainer.devices=4",
                            "sharding.replicate=2"],
    "gpt seq 256 batch 8, accum 2 last": ["model.n_embd=256", "model.block_size=256",
                                          "trainer.batch_size=8", "trainer.grad_accum=2",
                                          "trainer.grad_sync=last"],
    "gpt 4x320, accum 4 every": ["model.n_embd=320", "trainer.grad_accum=4",
                                 "trainer.grad_sync=every"],
    "gpt 6x256, no reshard": ["model.n_layer=6", "model.n_embd=256",
                              "sharding.reshard_after_forward=false"],
    "gpt 4x384, fsdp1 AC full": ["model.n_embd=384", "model.block_size=256",
                                 "sharding=fsdp1",
                                 "sharding.activation_checkpointing=full"],
    "gpt TP2 + SP, 2 ranks": ["model.n_embd=256", "model.block_size=256",
                              "sharding.tensor_parallel=2"],
    "llama TP2 + SP, 4 ranks": [*_LLAMA256, "trainer.devices=4",
                                "sharding.tensor_parallel=2"],
    "llama TP2 + SP + AC full, 4 ranks": [*_LLAMA256, "model.max_seq_len=256",
                                          "trainer.devices=4",
                                          "sharding.tensor_parallel=2",
                                          "sharding.activation_checkpointing=full"],
    "gpt PP2 interleaved": ["model.n_embd=256", "model.block_size=256",
                            "sharding.pipeline_parallel=2",
                            "sharding.pp_schedule=interleaved_1f1b",
                            "sharding.pp_microbatches=4"],
    "llama PP2 GPipe M=8": [*_LLAMA256, "model.max_seq_len=256",
                            "sharding.pipeline_parallel=2",
                            "sharding.pp_schedule=gpipe", "sharding.pp_microbatches=8"],
    "gpt PP2 1F1B x FSDP2, 4 ranks": ["model.n_layer=6", "model.n_embd=256",
                                      "trainer.devices=4",
                                      "sharding.pipeline_parallel=2"],
    "llama PP2 1F1B, accum 2": [*_LLAMA256, "sharding.pipeline_parallel=2",
                                "sharding.pp_microbatches=4", "trainer.grad_accum=2"],
    "gpt seq 512 bf16": ["model.n_embd=256", "model.block_size=512",
                         "precision=bf16_mixed"],
    "llama seq 256 bf16": [*_LLAMA256, "model.max_seq_len=256", "precision=bf16_mixed"],
    "gpt no bias fp16": ["model.n_embd=256", "model.bias=false", "precision=fp16_mixed"],
    "gpt 6x256 fsdp1 no reshard bf16": ["model.n_layer=6", "model.n_embd=256",
                                        "sharding=fsdp1",
                                        "sharding.reshard_after_forward=false",
                                        "precision=bf16_mixed"],
    "gpt block bf16 accum 4 every": ["model.n_embd=384", "model.block_size=256",
                                     "sharding.policy=block", "precision=bf16_mixed",
                                     "trainer.grad_accum=4", "trainer.grad_sync=every"],
    "gpt seq 1024 bf16, 1 rank": ["model.n_embd=256", "model.block_size=1024",
                                  "trainer.devices=1", "trainer.batch_size=8",
                                  "precision=bf16_mixed"],
    "llama seq 1024 bf16 AC selective, 4 ranks": [
        "model=llama_tiny", "model.max_seq_len=1024", "precision=bf16_mixed",
        "sharding.activation_checkpointing=selective", "sharding.policy=block",
        "trainer.devices=4"],
    "TinyLM 6x384": [*_TINYLM, "+model.args.dim=384", "+model.args.depth=6"],
    "TinyLM 6x256 AC full, 4 ranks": [*_TINYLM, "+model.args.dim=256",
                                      "+model.args.depth=6", "model.block_size=256",
                                      "sharding.policy=block",
                                      "sharding.activation_checkpointing=full",
                                      "trainer.devices=4"],
    "hf gpt-neox AC selective": ["model=hf", f"model.config={HF}/gpt_neox_4x256",
                                 "sharding.policy=block",
                                 "sharding.activation_checkpointing=selective"],
    "hf gemma2, 4 ranks": ["model=hf", f"model.config={HF}/gemma2_4x256",
                           "trainer.devices=4"],
    "hf mistral fsdp1": ["model=hf", f"model.config={HF}/mistral_4x256",
                         "sharding=fsdp1"],
    "hf tiny gpt2 (dropout)": ["model=hf", "model.config=conf/hf_configs/tiny_gpt2"],
    "gpt vocab 8192": ["model.n_embd=256", "model.vocab_size=8192"],
    "gpt2 2 layers, vocab 50304": ["model=gpt2", "model.n_layer=2",
                                   "model.block_size=256", "trainer.batch_size=8",
                                   "trainer.max_steps=4"],
    "llama vocab 4096 tied": [*_LLAMA256, "model.vocab_size=4096",
                              "model.tie_embeddings=true"],
    "llama vocab 32000 bf16": ["model=llama_tiny", "model.vocab_size=32000",
                               "precision=bf16_mixed"],
    "gpt sharding=none, 1 rank": ["model.n_embd=256", "sharding=none",
                                  "trainer.devices=1"],
    "llama ddp bf16": [*_LLAMA256, "sharding=ddp", "precision=bf16_mixed"],
    "gpt ddp fp16": ["model.n_embd=256", "sharding=ddp", "precision=fp16_mixed"],
    "gpt 4x384 HSDP 2x2, accum 2 last": ["model.n_embd=384", "trainer.devices=4",
                                         "sharding.replicate=2", "trainer.grad_accum=2",
                                         "trainer.grad_sync=last"],
    "gpt fsdp1 HSDP 2x2": ["model.n_embd=256", "sharding=fsdp1", "trainer.devices=4",
                           "sharding.replicate=2"],
    "gpt batch 64, prefetch 2": ["model.n_embd=256", "trainer.batch_size=64",
                                 "sharding.backward_prefetch=2"],
    "gpt seq 1024 accum 2 bf16 (a fit proposal)": [
        "model.n_embd=256", "model.block_size=1024", "trainer.grad_accum=2",
        "precision=bf16_mixed"],
    "gpt 8x512": _GPT8X512,
    "gpt 8x512, async checkpoint": [*_GPT8X512, "trainer.max_steps=6",
                                    "trainer.ckpt_every=3", "trainer.ckpt_async=true"],
    "gpt 8x512, export": [*_GPT8X512, "trainer.export=true"],
    "gpt 8x512, validation": [*_GPT8X512, "trainer.max_steps=6", "trainer.val_every=3"],
    "gpt 8x512, sample": [*_GPT8X512, "trainer.sample_every=5"],
    "gpt dropout 0.1": ["model.n_embd=256", "model.dropout=0.1"],
    "gpt seq 512 dropout 0.1": ["model.n_embd=256", "model.block_size=512",
                                "model.dropout=0.1"],
}  # fmt: skip


def make_cfg(overrides: list[str]):
    return compose_config(*_BASE, *overrides)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith(field + ":"))


def _rank_setup(mmap_threshold_kib: int | None, rank: int) -> None:
    """Each rank first sets its allocator as train.py's ranks do
    (``trainer.malloc_mmap_threshold_kib``), then its device."""
    from src.observe.metrics import set_malloc_mmap_threshold

    set_malloc_mmap_threshold(mmap_threshold_kib)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)


def _rank(rank: int, world: int, cfg, resolved, steps: int) -> dict:
    from src.build import build_model
    from src.data.sources import GlobalBatches, load_splits
    from src.observe.metrics import _reset_cpu_peak_rss
    from src.sharding import build_backend
    from src.trainer.optimizer import build_optimizer
    from src.trainer.step import train_step

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    t = cfg.trainer
    # RunPlan by the launcher, as train.py's ranks get it (unpickling imports the
    # family's modules, transformers for hf; the config checks ran in the launcher).
    spec, config = resolved.spec, resolved.model_config
    backend = build_backend(
        cfg.sharding.backend,
        cfg.precision.name,
        device,
        cfg.sharding.reshard_after_forward,
        resolved.layout,
    )
    train_split, _ = load_splits(cfg.data, spec.vocab_size(config), t.seed)
    batches = GlobalBatches(
        train_split, t.batch_size // t.grad_accum, spec.seq_len(config), t.seed
    )
    batches.get(0, 0, rank, world)
    with torch.device("meta"):
        spec.build(config, 0)  # the family's classes imported (transformers')
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_kib("VmRSS") * 1024
        _reset_cpu_peak_rss()
    model = build_model(resolved, backend)
    optimizer = build_optimizer(model, cfg, resolved.spec)
    scaler = backend.grad_scaler()
    for step in range(steps):
        train_step(model, batches, step, backend, optimizer, scaler, cfg)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    return {"base": base, "peak": peak}


def measure(cfg, resolved, world: int, steps: int) -> tuple[int, int]:
    """Max over ranks of the training peak above the rank's baseline, and the largest
    baseline (bytes)."""
    pg = "nccl" if torch.cuda.is_available() else "gloo"
    setup = functools.partial(_rank_setup, cfg.trainer.malloc_mmap_threshold_kib)
    rows = run_distributed(
        _rank, world, cfg, resolved, steps, pg_backend=pg, setup=setup
    )
    return max(r["peak"] - r["base"] for r in rows), max(r["base"] for r in rows)


def _model(cfg) -> str:
    m = cfg.model
    if m.family == "hf":
        return f"hf {Path(m.config).name}"
    if m.family == "llama":
        return f"llama {m.n_layers} x {m.dim}, V {m.vocab_size}"
    return f"{m.family} {m.n_layer} x {m.n_embd}, V {m.vocab_size}"


def _row(name: str, cfg, est, measured: int, base: int) -> dict:
    parts, s = est.parts, est.shape
    error = est.training / measured - 1
    ac = s.checkpointing + (
        f" /{s.ac_every}" if s.checkpointing == "full" and s.ac_every > 1 else ""
    )
    hsdp = int(cfg.sharding.replicate)
    return {
        "config": name,
        "backend": f"{s.backend}{f' {hsdp}x{s.world // hsdp}' if hsdp > 1 else ''}, "
        f"{cfg.precision.name}, {s.world} rank(s)",
        "model": _model(cfg),
        "tokens/rank (micro x T)": f"{s.micro_batch} x {s.seq_len}",
        "accum (sync)": f"{s.grad_accum} ({s.grad_sync})",
        "AC": ac,
        "params + optim": f"{(parts['params'] + parts['optimizer']) / MIB:.1f}",
        "gathered": f"{parts['gathered_units'] / MIB:.1f}",
        "grads": f"{parts['grads'] / MIB:.1f}",
        "activations + loss": f"{(parts['activations'] + parts['loss']) / MIB:.1f}",
        "working set": f"{parts['transient'] / MIB:.1f}",
        "runtime": f"{parts['runtime'] / MIB:.0f}",
        "peak at": est.phase,
        "estimate": f"{est.training / MIB:.1f}",
        "measured": f"{measured / MIB:.1f}",
        "error": f"{error:+.1%}",
        f"within {TARGET:.0%}": "yes" if abs(error) <= TARGET else "NO",
        "process: planned / measured": f"{parts['process'] / MIB:.0f} / {base / MIB:.0f}",
    }


def planned_gib(overrides: list[str]) -> float | None:
    """The planner's ``planned_peak_gib`` for ``python train.py <overrides>``: the
    launcher's own path (:func:`src.trainer.launch.prepare`)."""
    from src import entry
    from src.trainer.launch import prepare

    # planned as the measured command starts its ranks: forked from its rank server
    # (src/entry.py), whose baseline is smaller (planner FORKED_RANK_SAVING)
    entry._rank_server = True
    cfg = compose_config(*overrides)
    keys = {o.lstrip("+").split("=", 1)[0] for o in overrides}
    _, resolved = prepare(cfg, user_keys=keys)
    return resolved.planned_peak_gib


def run_ordinary(overrides: list[str], steps: int) -> float:
    """``peak_mem_gib`` of ``python train.py <overrides>`` run for ``steps`` steps."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as run_dir:
        # the defaults first: a row may set its own steps or validation
        args = [f"trainer.max_steps={steps}", "trainer.val_every=0",
                "trainer.progress=false", *overrides, f"hydra.run.dir={run_dir}"]  # fmt: skip
        subprocess.run([sys.executable, "train.py", *args], cwd=root, check=True)
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    # the resident-set peak beside it (CPU), kept in --measured's file
    _RSS[json.dumps(overrides)] = summary.get("peak_rss_gib")
    return summary["peak_mem_gib"]


_RSS: dict[str, float | None] = {}


def _measure_all(table, names, steps, known, store, jobs: int) -> None:
    """Run the configurations ``names`` not yet in ``known``, ``jobs`` at a time,
    storing each peak as it comes (a failed run is left out, said)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> None:
        key = json.dumps(["ordinary", name, table[name], steps])
        if key in known:
            return
        try:
            known[key] = run_ordinary(table[name], steps)
        except subprocess.CalledProcessError as err:
            print(f"{name}: failed ({err})", flush=True)
            return
        known[json.dumps(["rss", *json.loads(key)[1:]])] = _RSS.get(
            json.dumps(table[name])
        )
        if store:
            store.write_text(json.dumps(known, indent=1))

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(one, names))
    names[:] = [
        n for n in names if json.dumps(["ordinary", n, table[n], steps]) in known
    ]


def ordinary(args) -> list[dict]:
    """The ``--ordinary`` table: planned against measured ``peak_mem_gib``."""
    store = Path(args.measured) if args.measured else None
    known = json.loads(store.read_text()) if store and store.exists() else {}
    pstore = Path(args.planned) if args.planned else None
    plans = json.loads(pstore.read_text()) if pstore and pstore.exists() else {}
    rows = []
    table = (
        HOLDOUT if args.holdout else AUDIT if args.audit else GRID if args.grid
        else ORDINARY
    )  # fmt: skip
    names = [n for n in args.configs or list(table) if n in table]
    _measure_all(table, names, args.steps, known, store, args.jobs)
    for name in names:
        key = json.dumps(["ordinary", name, table[name], args.steps])
        measured = known[key]
        pkey = json.dumps(["planned", table[name]])
        if pkey not in plans:
            plans[pkey] = planned_gib(table[name])
            if args.planned:
                Path(args.planned).write_text(json.dumps(plans, indent=1))
        planned = plans[pkey]
        error = measured / planned - 1 if planned else None
        under = planned / measured - 1 if planned else None  # < 0: under-predicted
        rows.append({
            "config": name,
            "overrides": " ".join(table[name]),
            "planned GiB": f"{planned:.3f}" if planned else "no estimate",
            "measured GiB": f"{measured:.3f}",
            "measured vs planned": f"{error:+.1%}" if error is not None else "-",
            "error": f"{under:+.1%}" if under is not None else "-",
            f"within {TARGET:.0%}": "yes" if under is not None and abs(under) <= TARGET else "NO",
        })  # fmt: skip
        print(rows[-1], flush=True)
    signed = [float(r["error"].rstrip("%")) for r in rows if r["error"] != "-"]
    errors = [abs(e) for e in signed]
    summary = (
        f"error = planned / measured - 1: n {len(errors)}, median |error| "
        f"{statistics.median(errors):.1f}%, worst {max(errors):.1f}% (most under "
        f"{min(signed):+.1f}%, most over {max(signed):+.1f}%), "
        f"{sum(e <= 100 * TARGET for e in errors)} of {len(rows)} within "
        f"{TARGET:.0%}"
        if errors
        else "no estimates"
    )
    print(summary)
    publish(
        rows,
        "Planner in ordinary runs: the closing line's planned against measured peak"
        + (
            ", holdout"
            if args.holdout
            else ", audit"
            if args.audit
            else ", grid"
            if args.grid
            else ""
        ),  # fmt: skip
        "Each row is `python train.py <overrides> trainer.max_steps="
        f"{args.steps} trainer.val_every=0` with no allocator environment (the "
        "ranks set glibc's allocator themselves, trainer.malloc_mmap_threshold_kib"
        "'s default); planned: the launcher's planned_peak_gib; measured: peak_mem_gib, the max "
        "over ranks of the memory in use from the model's build on (CPU: resident set less glibc's free heap, sampled; the process included), the two "
        f"figures of the run's closing line. {summary}.",
        bench="plan_vs_measured",
        argv=args.argv,
        append=args.append_docs,
    )
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs", nargs="+", choices=[*CONFIGS, *ORDINARY, *HOLDOUT, *AUDIT, *GRID]
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--ordinary",
        action="store_true",
        help="run train.py as a user does and compare its closing line's figures",
    )
    p.add_argument(
        "--holdout",
        action="store_true",
        help="with --ordinary: the HOLDOUT configurations instead of ORDINARY",
    )
    p.add_argument(
        "--audit",
        action="store_true",
        help="with --ordinary: the AUDIT configurations instead of ORDINARY",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="with --ordinary: bench/plan_grid.py's EP, CP, float8 and combined runs",
    )
    p.add_argument(
        "--planned",
        metavar="JSON",
        help="with --ordinary: reuse the planned peaks stored in this file (by "
        "overrides), store new ones there; delete it after a planner change",
    )
    p.add_argument("--jobs", type=int, default=1, help="with --ordinary: runs at once")
    p.add_argument("--append-docs", action="store_true")
    p.add_argument(
        "--measured",
        metavar="JSON",
        help="reuse the measured peaks stored in this file for configs whose "
        "overrides are unchanged, and store new ones there (run it in pieces)",
    )
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    from src.config.run_plan import resolve, with_overrides
    from src.planner.auto import resolve_auto
    from src.planner.run_estimate import estimate_plan

    args = _parser().parse_args(argv)
    args.argv = argv
    if args.ordinary:
        return ordinary(args)
    store = Path(args.measured) if args.measured else None
    known = json.loads(store.read_text()) if store and store.exists() else {}

    rows = []
    for name in args.configs or list(CONFIGS):
        cfg = make_cfg(CONFIGS[name])
        resolved = resolve(cfg)
        resolved, _, chosen = resolve_auto(resolved)
        cfg = with_overrides(cfg, chosen)
        world = int(cfg.trainer.devices)
        _, est = estimate_plan(resolve(cfg), world)
        key = json.dumps([name, CONFIGS[name], args.steps])
        if key not in known:
            known[key] = measure(cfg, resolved, world, args.steps)
            if store:
                store.write_text(json.dumps(known, indent=1))
        measured, base = known[key]
        rows.append(_row(name, cfg, est, measured, base))
        print(rows[-1], flush=True)
    publish(
        rows,
        "Planner: estimated against measured training peak per rank",
        "All figures MiB per rank, above the process baseline. Estimate: "
        "`Estimate.training` of src/planner/estimate.py (every part but the "
        "process baseline; parts shown: sharded fp32 parameters + AdamW "
        "states, all-gathered units, gradients held at the peak, saved "
        "activations + head/loss (GPT and Llama: their formulas; hf: traced on "
        "fake tensors, src/planner/trace.py), the backward or step working set, "
        "the calibrated runtime constant). Measured: the same config run by the "
        f"trainer's build_model / build_optimizer / train_step for {args.steps} "
        "steps on synthetic tokens, 1 thread per rank, the ranks given the "
        "launcher's RunPlan as train.py's are; max over ranks of VmHWM "
        "minus the rank's RSS just before the model is built (its classes "
        "already built once on meta), each rank's glibc mmap threshold set as "
        "train.py's ranks set it (trainer.malloc_mmap_threshold_kib). process: the planned "
        "process baseline (PROCESS_BYTES + the family's imports) against the "
        "largest measured rank baseline. GPT: size policy with min_params=1.5e5 "
        "(each block a unit + the root) unless said, n_head=4, V=256; "
        "Hugging Face: bench/hf_configs/ (tiny local configs, no download), "
        "block policy. Shared 2-core machine (load ~15): the figures are "
        "memory, not time, and repeat to within ~1-2 MiB.",
        bench="plan_vs_measured",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
