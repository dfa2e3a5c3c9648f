"""A run's activations per micro-batch: the model family's formula, or the blocks traced
on fake tensors (src/planner/trace.py), and what tensor parallelism makes of them."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from src.config.run_plan import RunPlan, tensor_parallel_plan
from src.models.attention import attention_kernel
from src.models.memory import ActivationBytes
from src.planner.constants import EP_IMBALANCE
from src.planner.estimate import Dispatch, RunShape
from src.planner.trace import tp_local, traced_activation_bytes


def tp_activations(
    resolved: RunPlan,
    shape: RunShape,
    acts: ActivationBytes,
    model: torch.nn.Module | int,
) -> ActivationBytes:
    """One rank's activations under tensor parallelism of degree T (unchanged for
    T = 1). With sequence parallelism every saved activation is split T ways (the
    residual stream and norms over the sequence, attention over heads, the MLP over
    its width), but the colwise matmuls save their all-gathered, full-sequence input
    (two per block: attention and MLP; one block input each, what full checkpointing
    keeps) in the blocks that are not checkpointed. Without sequence parallelism only
    the heads and MLP width split: the blocks are traced on one rank's local shapes
    (:func:`run_activation_fn`, a family with a formula too; :func:`traced_locally`).
    A vocabulary-sharded output layer (``loss_parallel``) splits the logits and the
    loss's buffers T ways. The backward working set of one block adds
    its gathered inputs and the all-gather / reduce-scatter buffers (four block
    inputs: the TP collectives' working set). ``model``: the model, or its number of
    blocks."""
    tp = resolved.layout.tp
    if tp == 1:
        return acts
    tpp = tensor_parallel_plan(resolved)
    full = activation_fn(resolved)(
        shape.micro_batch, shape.seq_len, shape.param_bytes, "full", 1
    )
    blocks, checkpointed = _blocks(resolved, shape, model)
    block_input = full.saved // blocks  # one block's input, full sequence
    if traced_locally(resolved, tpp):
        # traced on one rank's local shapes (run_activation_fn): heads and width split
        saved, work = acts.saved, acts.block_transient
    else:
        gathered = 2 * block_input * (blocks - checkpointed)
        saved, work = acts.saved // tp + gathered, acts.block_transient // tp
    split = tp if tpp.loss_parallel else 1
    return ActivationBytes(
        saved=saved,
        head=acts.head // split,
        loss_transient=acts.loss_transient // split,
        block_transient=work + 4 * block_input,
    )


def cp_activations(
    resolved: RunPlan,
    shape: RunShape,
    acts: ActivationBytes,
    model: torch.nn.Module | int,
    cp: int | None = None,
) -> ActivationBytes:
    """One rank's activations under context parallelism of degree C (``cp``, default
    the run's; unchanged for C = 1). ``acts`` are those of its T/C tokens
    (``shape.seq_len``); in each block that is not checkpointed attention keeps the
    keys and values gathered from the cp group (``2 B T kv_width`` elements, split
    over tp) instead of its own 1/C of them, and all blocks share one (T/C x T) mask.
    Backward adds the gathered K/V's gradient and the reduce-scatter's buffer (twice
    the gathered tensor). A checkpointed block gathers again when it is recomputed;
    its backward peaks inside the feed-forward's (traced: Llama 4 x 256, seq 1024,
    CP2, full checkpointing), where that one gathered copy is alive, and attention's
    backward adds the other two only once the feed-forward's hidden activations (two
    of ``B T/C x ffn_width``, the family's ``ffn_width``; none where it has none) are
    freed."""
    cp = cp or resolved.layout.cp
    if cp == 1:
        return acts
    spec, config = resolved.spec, resolved.model_config
    blocks, checkpointed = _blocks(resolved, shape, model)
    width = spec.kv_width(config) // resolved.layout.tp
    seq = shape.seq_len * cp
    gathered = 2 * shape.micro_batch * seq * width * shape.param_bytes
    mask = shape.seq_len * seq * shape.param_bytes
    backward = 2 * gathered if checkpointed < blocks else 0  # a block kept whole
    if checkpointed:
        ffn = spec.ffn_width(config) // resolved.layout.tp if spec.ffn_width else 0
        freed = 2 * shape.micro_batch * shape.seq_len * ffn * shape.param_bytes
        backward = max(backward, gathered + max(0, 2 * gathered - freed))
    return ActivationBytes(
        saved=acts.saved + gathered * (cp - 1) // cp * (blocks - checkpointed) + mask,
        head=acts.head,
        loss_transient=acts.loss_transient,
        block_transient=acts.block_transient + backward,
    )


def ep_dispatch(resolved: RunPlan, shape: RunShape) -> Dispatch | None:
    """Expert parallelism's dispatch beyond the traced activations (None: no EP, or
    a family that does not say its experts' shape). A balanced dispatch gives a rank
    its own share of the assignments, ``B T k / tp`` rows per MoE layer; the bound
    is the capacity where the model has one (a rank's ``E / ep`` experts take at
    most ``capacity`` rows of each of the ep group's sequences), else
    :data:`EP_IMBALANCE` x balanced; both at most the ep group's every row."""
    layout, spec = resolved.layout, resolved.spec
    if layout.ep <= 1 or spec.expert_shape is None:
        return None
    es = spec.expert_shape(resolved.model_config, shape.seq_len)
    sequences = shape.micro_batch * layout.ep_shard  # the ep group's, one micro-batch
    balanced = sequences * shape.seq_len * es.top_k / layout.ep
    if es.capacity is not None:
        bound = es.experts // layout.ep * es.capacity * sequences
        why = (
            f"capacity {es.capacity} per expert per sequence: at most "
            f"{bound / balanced:.2f}x a balanced dispatch"
        )
    else:
        bound = EP_IMBALANCE * balanced
        why = f"no capacity: assumed {EP_IMBALANCE:g}x a balanced dispatch"
    rows = min(bound, balanced * layout.ep)
    act = shape.param_bytes
    extra = (rows - balanced) * es.saved_per_row * act  # one MoE layer's
    recomputed = _checkpointed_moe_layers(shape, es.layers)
    kept = es.layers - recomputed
    # a checkpointed layer keeps its input only: its extra rows live again only
    # while its block's backward recomputes it (one layer at a time)
    saved = extra * kept
    buffers = (balanced + rows) * es.dim * act + (extra if recomputed else 0)
    where = (
        "in every MoE layer"
        if not recomputed
        else f"kept in {kept} of {es.layers} MoE layers (the rest checkpointed: "
        "one layer's, recomputed in its backward)"
    )
    note = (
        f"EP{layout.ep}: a rank receives up to {rows / balanced:.2f}x its own "
        f"{balanced:.0f} rows per MoE layer ({why}), {where}; + one "
        "layer's all-to-all send and receive buffers"
    )
    return Dispatch(saved=int(saved), buffers=int(buffers), note=note)


def _checkpointed_moe_layers(shape: RunShape, moe_layers: int) -> int:
    """How many of ``moe_layers`` full activation checkpointing recomputes: every
    ``ac_every``-th block, counted on the safe side (the fewest, floor)."""
    if shape.checkpointing != "full":
        return 0
    return moe_layers // max(1, shape.ac_every)


def _blocks(
    resolved: RunPlan, shape: RunShape, model: torch.nn.Module | int
) -> tuple[int, int]:
    """The model's blocks (``model``: the model or their number) and how many of
    them full activation checkpointing recomputes."""
    spec, config = resolved.spec, resolved.model_config
    classes = spec.block_classes(config)
    blocks = (
        model
        if isinstance(model, int)
        else sum(isinstance(m, classes) for m in model.modules())
    )
    blocks = max(1, blocks)
    every = shape.ac_every if shape.checkpointing == "full" else 1
    checkpointed = (
        0 if shape.checkpointing != "full" else math.ceil(blocks / max(1, every))
    )
    return blocks, checkpointed


def has_formula(resolved: RunPlan) -> bool:
    """Whether the model family's activation formula covers the run's model config
    (its spec's ``activation_bytes`` and ``formula_covers``); else it is traced."""
    spec = resolved.spec
    if spec.activation_bytes is None:
        return False
    return spec.formula_covers is None or spec.formula_covers(resolved.model_config)


def activation_fn(
    resolved: RunPlan, tp: int = 1, tp_plan: Any = None, trace: bool = False
) -> Callable[..., ActivationBytes]:
    """The model family's activation formula (its spec's ``activation_bytes``), bound
    to the run's model config; for a family without one (``hf``, ``custom``) or a
    config it does not cover (:func:`has_formula`), or with ``trace``, the
    activations traced on fake tensors (src/planner/trace.py), cached per model
    config and tensor-parallel degree: with ``tp > 1`` the blocks are traced as one
    rank of ``tp_plan`` computes them (:func:`~src.planner.trace.tp_local`)."""
    spec, config = resolved.spec, resolved.model_config
    if has_formula(resolved) and not trace:
        return functools.partial(spec.activation_bytes, config)
    tp = tp if tp_plan is not None else 1
    key = (spec.name, repr(config), tp)
    if key not in _TRACED:
        classes = spec.block_classes(config)
        with torch.device("meta"):
            model = spec.build(config, 0)
        if tp > 1:
            model = tp_local(model, classes, tp_plan, tp)
        _TRACED[key] = traced_activation_bytes(model, classes, spec.trace_context)
    return _TRACED[key]


def traced_locally(resolved: RunPlan, tp_plan: Any) -> bool:
    """Whether a run's activations under tensor parallelism are traced on one rank's
    local shapes: a model without a formula (:func:`has_formula`) always; one with a
    formula without sequence parallelism (its formula knows only the sequence split;
    the heads and MLP width split as the plan's Linears do)."""
    return not has_formula(resolved) or not tp_plan.sequence_parallel


def run_activation_fn(resolved: RunPlan) -> Callable[..., ActivationBytes]:
    """:func:`activation_fn` for the run's tensor-parallel degree and plan."""
    tp = resolved.layout.tp
    if tp == 1:
        return activation_fn(resolved)
    plan = tensor_parallel_plan(resolved)
    if not traced_locally(resolved, plan):
        return activation_fn(resolved)
    return activation_fn(resolved, tp, plan, trace=True)


def run_activations(
    resolved: RunPlan, shape: RunShape, model: torch.nn.Module
) -> ActivationBytes:
    """One rank's activations of one micro-batch of ``shape`` (the run's tensor and
    context parallelism applied); ``model``: the run's meta model."""
    acts = run_activation_fn(resolved)(
        shape.micro_batch,
        shape.seq_len,
        shape.param_bytes,
        shape.checkpointing,
        shape.ac_every,
    )
    acts = tp_activations(resolved, shape, acts, model)
    acts = cp_activations(resolved, shape, acts, model)
    acts = documents_activations(resolved, shape, acts, model)
    return frozen_prefix_activations(resolved, acts, model)


def frozen_prefix_activations(
    resolved: RunPlan, acts: ActivationBytes, model: torch.nn.Module | int
) -> ActivationBytes:
    """``trainer.freeze`` of the embedding and the first k blocks: autograd records
    nothing there (no parameter, and no input, needs a gradient), so those blocks
    save no activations: their share of the saved ones is dropped."""
    if isinstance(model, int) or not resolved.freeze:
        return acts
    classes = resolved.spec.block_classes(resolved.model_config)
    blocks, frozen = 0, 0
    for m in model.modules():  # module order: the embedding, then the blocks
        trains = any(p.requires_grad for p in m.parameters(recurse=False))
        if isinstance(m, classes):
            blocks += 1
            trains = any(p.requires_grad for p in m.parameters())
            frozen += frozen == blocks - 1 and not trains
        elif trains and blocks == 0:
            return acts  # a trained parameter before the blocks (the embedding)
    if not frozen:
        return acts
    return replace(acts, saved=acts.saved - acts.saved * frozen // max(1, blocks))


def documents_activations(
    resolved: RunPlan,
    shape: RunShape,
    acts: ActivationBytes,
    model: torch.nn.Module | int,
) -> ActivationBytes:
    """What attention within documents (``data.packing=documents``) adds: the
    per-row positions (int64, ``B T``); with context parallelism a (T/C x T) mask
    per row, no longer one for all; else with SDPA (the CPU's kernel,
    src/models/attention.py) the boolean (B, 1, T, T) mask, made once per forward,
    and the copy of it in the compute dtype that SDPA makes and saves in each
    attention call of a block that is not checkpointed (a checkpointed block's
    while its backward recomputes it). Left out: FlexAttention's block mask (a few
    bytes per 128 x 128 block) and Llama's per-row RoPE tables (``B T head_dim``
    fp32 cos and sin, where plain packing keeps ``T head_dim``)."""
    if not resolved.batch.documents:
        return acts
    rows, seq = shape.micro_batch, shape.seq_len
    positions = 8 * rows * seq
    cp = resolved.layout.cp
    if cp > 1:  # its one additive mask (cp_activations) becomes one per row
        per_row = seq * seq * cp * shape.param_bytes
        return replace(acts, saved=acts.saved + positions + (rows - 1) * per_row)
    if attention_kernel(torch.device(shape.device)) == "flex":
        return replace(acts, saved=acts.saved + positions)
    blocks, checkpointed = _blocks(resolved, shape, model)
    square = rows * seq * seq  # the boolean mask's bytes
    copy = square * shape.param_bytes
    return replace(
        acts,
        saved=acts.saved + positions + square + copy * (blocks - checkpointed),
        block_transient=acts.block_transient + (copy if checkpointed else 0),
    )


_TRACED: dict[tuple[str, str, int], Callable[..., ActivationBytes]] = {}
