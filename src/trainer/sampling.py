"""Text from a model: ``sample.py`` (a trained checkpoint) and
``trainer.sample_every`` (during training).

Every rank runs the same decoding (a sharded model needs all of them in each
forward); rank 0's tokens are broadcast at each step so the ranks never drift apart.
The native families (GPT, Llama: ``spec.kv_cache``) decode with a KV cache, a family
with its own ``spec.generate`` (Hugging Face: ``generate()``) through it, any other by
recomputing the window each step (src/models/generate.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from src.config.run_plan import LAYOUT_KEYS, RunPlan, world_size
from src.data.chat import prompt_text
from src.data.packing import Documents
from src.data.tokenizer import Tokenizer
from src.models import ModelSpec
from src.models.generate import generate
from src.sharding import ParallelLayout

# A trained run opened again (sample.py, eval.py, a PP run's whole model): sharded
# over its ranks only (the checkpoint, DCP, loads on any layout; an HSDP, TP or PP
# run's on any number of ranks), and decoding one token at a time has no sequence to
# split over tensor-parallel ranks.
SHARDED_ONLY = {
    **dict.fromkeys(LAYOUT_KEYS.values(), 1),
    "sharding.pp_split": [],
    "sharding.sequence_parallel": None,
}
# What sample.py changes in the run's config: decoding is not training.
SAMPLING_CHANGES = {
    "trainer.resume": None,
    "trainer.plan_only": False,
    "sharding.activation_checkpointing": "none",
    "sharding.compile": False,  # each new length would compile again
    **SHARDED_ONLY,
}


def sampling_plan(plan: RunPlan) -> RunPlan:
    """``plan`` as :data:`SAMPLING_CHANGES` has it: sharded over all its ranks only,
    without checkpointing or compile."""
    return replace(
        plan,
        layout=ParallelLayout(plan.world_size),
        checkpointing=replace(plan.checkpointing, mode="none"),
        pipeline=replace(plan.pipeline, split=()),
        unit=replace(plan.unit, compile=False, sequence_parallel=None),
    )


# A family that decodes through its own generate() (Hugging Face) calls into the
# model's inner modules, past the root unit's hooks: it gets the whole model, one rank.
WHOLE_MODEL = {"trainer.devices": 1, "sharding.backend": "none"}


def spread_over(backend: str, ranks: int) -> dict[str, Any]:
    """A one-process run (``sharding=none``) opened on several ranks (sample.py's
    and eval.py's ``devices``): its model sharded over them with FSDP2, which loads
    any checkpoint (DCP reshards). It was refused naming train.py's keys."""
    return {"sharding.backend": "fsdp2"} if backend == "none" and ranks > 1 else {}


def sampling_changes(
    spec: ModelSpec, devices: Any, backend: str
) -> tuple[dict[str, Any], str]:
    """The changes to the run's config for sampling on ``devices`` ranks, and a note
    (empty, or why the ranks differ from the ones asked for); ``backend``: the
    run's (:func:`spread_over`). Decoding reads no
    training batch: the run's ``trainer.batch_size`` becomes one row per rank (no
    accumulation), so any number of ranks passes the batch's check (it refused
    ``devices=3`` for a run of 16 sequences, naming a key sample.py has not)."""
    ranks = world_size(devices)
    changes = {
        **SAMPLING_CHANGES,
        "trainer.devices": devices,
        "trainer.batch_size": ranks,
        "trainer.grad_accum": 1,
        **spread_over(backend, ranks),
    }
    if spec.generate is None:
        return changes, ""
    note = ""
    if devices != 1:
        note = (
            f"model family {spec.name!r} decodes with its own generate() on the whole "
            f"model: sampling on 1 rank, not devices={devices}"
        )
    return {**changes, **WHOLE_MODEL}, note


@contextlib.contextmanager
def _root_gathered(model: nn.Module) -> Iterator[None]:
    """An FSDP2 root's own parameters (embeddings, final norm, head) gathered for
    the duration: transformers' ``generate()`` calls the model's inner modules, past
    the root unit's forward hooks, which would otherwise leave them sharded (a
    DTensor error on every rank, unless a forward without backward, such as
    validation, had just gathered them). A collective, as every decoding step is."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _broadcast_from_rank0(tokens: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tokens, src=0)
    return tokens


@torch.no_grad()
def continued(
    model: nn.Module,
    resolved: RunPlan,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    seed: int,
    vocab_size: int,
    kv_cache: bool = True,
) -> torch.Tensor:
    """``idx`` (B, T) followed by ``max_new_tokens`` tokens of ``model``, decoded on
    every rank in step: through the family's own ``generate()`` if it has one, else
    src/models/generate.py's loop, rank 0's tokens broadcast at each step."""
    spec, config = resolved.spec, resolved.model_config
    if spec.generate is not None:
        with torch.random.fork_rng(), _root_gathered(model):
            torch.manual_seed(seed)
            return spec.generate(
                model, idx, max_new_tokens, temperature, top_k, vocab_size
            )
    return generate(
        model,
        idx,
        max_new_tokens,
        spec.seq_len(config),
        temperature=temperature,
        top_k=top_k,
        generator=torch.Generator(device=idx.device).manual_seed(seed),
        vocab_size=vocab_size,
        kv_cache=kv_cache and spec.kv_cache,
        agree=_broadcast_from_rank0,
    )


@torch.no_grad()
def sample_texts(
    model: nn.Module,
    resolved: RunPlan,
    tokenizer: Tokenizer,
    prompts: list[str],
    *,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = None,
    seed: int = 0,
    device: torch.device,
    kv_cache: bool = True,
) -> list[list[str]]:
    """``num_samples`` texts (prompt and continuation) for each prompt, decoded on
    every rank in step. An empty prompt starts from the end-of-document token.
    Temperature 0 is greedy decoding; the random draws come from their own
    generator seeded by ``seed`` (the global RNG streams are left alone). A run
    packed by documents (``data.packing=documents``) decodes within one: from the
    prompt's last document, each text ending before its first new end token. A run
    on conversations (``tokenizer.chat``) is asked as a user: the prompt rendered by
    its chat template, with the generation prompt."""
    # The whole model, root included: the training step restores train mode only when
    # the root is in eval (src/trainer/step.py), and a family's generate() may set a
    # submodule alone.
    model.eval()
    out = []
    documents = Documents(tokenizer.eos_id) if resolved.batch.documents else None
    for prompt in prompts:
        if tokenizer.chat is not None:
            prompt = prompt_text(tokenizer.chat, prompt)
        ids = tokenizer.encode_text(prompt) or [tokenizer.eos_id]
        if documents is not None:
            ids = documents.last(ids)
        idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
        tokens = continued(
            model,
            resolved,
            idx,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            vocab_size=tokenizer.vocab_size,
            kv_cache=kv_cache,
        )
        rows = [row.tolist() for row in tokens]
        if documents is not None:
            rows = [documents.until_end(row, len(ids)) for row in rows]
        out.append([tokenizer.decode(row) for row in rows])
    return out
