"""Activation memory of any model, traced rather than written by hand.

For a family without an ``activation_bytes`` formula (``hf``, ``custom``) the planner
asks :func:`traced_activation_bytes`: the model, built on the meta device, runs one
forward and backward of one micro-batch on fake tensors (``FakeTensorMode``: shapes,
dtypes and storages, no data, nothing allocated), and what autograd keeps is read off
``torch.autograd.graph.saved_tensors_hooks``; the backward's working set is followed
op by op (every storage alive at once). Only the first block of each block class
runs; the later ones hand on its output, so a 70B model traces as fast as one layer.

Per checkpointing mode (src/sharding/transforms.py applies the very same wrapper to
the traced block) it measures:

- each block class's ``kept`` bytes: the tensors its forward saves for backward,
  including its hidden-state input (with ``full``: the checkpoint's saved inputs;
  with ``selective``: those and the outputs of the matmuls and attention that the
  selective policy keeps);
- ``excess``: the most its backward holds above what it kept (gradients in flight,
  with checkpointing the recomputed forward), parameter gradients excluded (the
  planner counts those per unit);
- the head's saved bytes (embeddings, final norm, output head, loss; tensors every
  block shares, such as rotary tables and masks) and the loss's backward buffers.

:func:`compose` turns them into :class:`ActivationBytes` for ``n`` blocks as the
hand-written formulas do (tests/test_planner.py checks both agree on GPT and Llama).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from src.models.memory import ActivationBytes, backward_peak, checkpointed_blocks
from src.sharding import CHECKPOINTING
from src.sharding.transforms import SAVED_OPS, checkpointed

HEAD = "head"


@dataclass(frozen=True)
class BlockTrace:
    kept: int  # bytes kept from its forward to its backward
    excess: int  # its backward's peak above what it kept


@dataclass(frozen=True)
class Trace:
    """One forward + backward of one micro-batch in one checkpointing mode."""

    head: int
    loss_transient: int
    blocks: dict[type, BlockTrace]


def _storage(t: torch.Tensor) -> Any:
    return t.untyped_storage()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _Tracker(TorchDispatchMode):
    """Storages alive during backward, and what each region keeps in forward."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params = params  # storages of parameters and buffers (and their casts)
        self.region: Any = HEAD  # the block class whose forward runs, or HEAD
        self.selective = False
        # storage -> (the region that made it, a weak ref: addresses are reused)
        self.created: dict[int, tuple[Any, StorageWeakRef]] = {}
        self.kept: dict[int, tuple[Any, int, StorageWeakRef]] = {}  # storage -> owner
        self.hidden: dict[Any, int] = {}  # block class -> storage of its input
        self.backward = False
        self.serials: dict[int, int] = {}  # storage -> its serial (addresses reused)
        self.refs: list[tuple[int, StorageWeakRef]] = []  # serial -> (bytes, ref)
        self.active: set[int] = set()
        self.grads: set[int] = set()
        self.snapshots: list[tuple[Any, int, tuple[int, ...]]] = []
        self.window: Any = HEAD  # whose backward runs
        self.window_base = 0

    # -- forward: who keeps what
    def keep(self, t: torch.Tensor) -> None:
        s = _storage(t)
        key = s._cdata
        if key in self.params or key in self.kept:
            return
        owner = self.region
        made = self.created.get(key)
        if owner is not HEAD and not (
            (made and made[0] is owner and not made[1].expired())
            or self.hidden.get(owner) == key
        ):
            owner = HEAD  # made outside the block and shared by all: rotary, masks
        self.kept[key] = (owner, s.nbytes(), StorageWeakRef(s))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.keep(t)
        return t

    # -- backward: what is alive, op by op (parameter gradients left out: the
    # planner counts them per unit)
    def track(self, s: Any) -> None:
        serial = self.serials.get(s._cdata)
        if serial is None or self.refs[serial][1].expired():
            serial = self.serials[s._cdata] = len(self.refs)
            self.refs.append((s.nbytes(), StorageWeakRef(s)))
            self.active.add(serial)

    def enter(self, region: Any) -> None:
        self.window = region
        self.window_base = sum(
            n for _, n, ref in self.kept.values() if not ref.expired()
        )

    def grad(self, p: torch.Tensor) -> None:
        """A parameter's gradient has been accumulated: not an activation."""
        if p.grad is not None:
            serial = self.serials.get(_storage(p.grad)._cdata)
            if serial is not None:
                self.grads.add(serial)
        p.grad = None

    def start_backward(self) -> None:
        self.backward = True
        for key, (_, n, ref) in self.kept.items():
            if not ref.expired():
                self.serials[key] = len(self.refs)
                self.active.add(len(self.refs))
                self.refs.append((n, ref))
        self.enter(HEAD)

    def peaks(self) -> dict[Any, int]:
        """Per window, the most alive at once above what was kept at its start."""
        out: dict[Any, int] = {}
        for window, base, live in self.snapshots:
            now = sum(self.refs[i][0] for i in live if i not in self.grads) - base
            out[window] = max(out.get(window, 0), now)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _run(func, args, kwargs or {})
        outs = _tensors(out)
        if not self.backward:
            if func is torch.ops.aten._to_copy.default and _storage(args[0])._cdata in (
                self.params
            ):
                self.params.update(_storage(t)._cdata for t in outs)  # autocast copies
            for t in outs:
                s = _storage(t)
                made = self.created.get(s._cdata)
                if made is None or made[1].expired():
                    self.created[s._cdata] = (self.region, StorageWeakRef(s))
                if self.selective and func in SAVED_OPS:
                    self.keep(t)  # what the selective policy stores
            return out
        for t in outs:
            s = _storage(t)
            if s._cdata not in self.params:
                self.track(s)
        self.active = {i for i in self.active if not self.refs[i][1].expired()}
        self.snapshots.append((self.window, self.window_base, tuple(self.active)))
        return out


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on fake tensors. The meta kernel of a grouped matmul (MoE experts)
    accepts bf16 only, as CUDA's does; CPU runs it in any dtype: its output's shape is
    the bf16 one's, in the inputs' dtype (ops called here reach the fake mode below
    this one, untracked)."""
    if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
        low = [a.to(torch.bfloat16) if i < 2 else a for i, a in enumerate(args)]
        dtype = kwargs.get("out_dtype") or args[0].dtype
        return func(*low, **{**kwargs, "out_dtype": None}).to(dtype)
    return func(*args, **kwargs)


@contextlib.contextmanager
def on_fake_tensors(model: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """A copy of ``model`` (a meta-device model) on fake tensors, inside their mode:
    its floating parameters in ``dtype`` (as FSDP's mixed precision casts them;
    buffers stay as they are)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = copy.deepcopy(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        yield model


def trace(
    model: nn.Module,
    block_classes: Sequence[type[nn.Module]],
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype = torch.float32,
    checkpointing: str = "none",
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Trace:
    """Trace one training micro-batch of ``model`` (a meta-device model; a copy is
    traced) in ``checkpointing`` mode, its parameters in ``dtype`` (as FSDP's mixed
    precision casts them; buffers stay as they are); ``context``: the family's
    (its spec's ``trace_context``)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}")
    classes = tuple(block_classes)
    with on_fake_tensors(model, dtype) as model:
        params = list(model.parameters())
        held = {_storage(t)._cdata for t in [*params, *model.buffers()]}
        tracker = _Tracker(held)
        for p in params:
            p.register_post_accumulate_grad_hook(tracker.grad)
        _instrument_blocks(model, classes, tracker, checkpointing)
        traced = _instrument_blocks(model, classes, tracker, checkpointing)
        idx = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        hooks = torch.autograd.graph.saved_tensors_hooks(tracker.pack, _same)
        with context() if context else contextlib.nullcontext(), tracker, hooks:
            logits, loss = model(idx, torch.zeros_like(idx))
            del logits
            kept: dict[Any, int] = {}
            for owner, n, _ in tracker.kept.values():
                kept[owner] = kept.get(owner, 0) + n
            tracker.start_backward()
            loss.backward()
    peaks = tracker.peaks()
    return Trace(
        head=kept.get(HEAD, 0),
        loss_transient=peaks.get(HEAD, 0),
        blocks={cls: BlockTrace(kept.get(cls, 0), peaks.get(cls, 0)) for cls in traced},
    )


def _instrument_blocks(
    model: nn.Module,
    classes: tuple[type[nn.Module], ...],
    tracker: _Tracker,
    checkpointing: str,
    outputs: dict[type, Any] | None = None,
) -> list[type]:
    """Make the first block of each class traced (checkpointed as the run would)
    and every later one hand on that block's output, kept in ``outputs`` (a caller
    that runs the model again clears it after each step: a kept output keeps its
    graph, and with it hooks on its parameters' gradient nodes, alive); returns the
    traced classes."""
    first: dict[type, nn.Module] = {}
    outputs = {} if outputs is None else outputs
    for m in outer_blocks(model, classes):
        cls = type(m)
        if cls in first:
            m.forward = functools.partial(_replay, outputs, cls)
        else:
            first[cls] = m
            m.forward = _traced_forward(m.forward, cls, tracker, checkpointing, outputs)
    return list(first)


def _replay(outputs: dict[type, Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    return outputs[cls]


def _traced_forward(
    forward: Callable, cls: type, tracker: _Tracker, checkpointing: str, outputs: dict
) -> Callable:
    if checkpointing != "none":
        forward = checkpointed(forward, checkpointing == "selective")

    def run(*args: Any, **kwargs: Any) -> Any:
        inputs = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        if inputs:
            tracker.hidden[cls] = _storage(inputs[0])._cdata
            if inputs[0].requires_grad:  # its gradient: the block's backward is done
                inputs[0].register_hook(lambda g: tracker.enter(None))
        before = tracker.region, tracker.selective
        tracker.region, tracker.selective = cls, checkpointing == "selective"
        try:
            out = forward(*args, **kwargs)
        finally:
            tracker.region, tracker.selective = before
        grads = [t for t in _tensors(out) if t.requires_grad]
        if grads:  # its gradient arrives: the block's backward starts
            grads[0].register_hook(lambda g: tracker.enter(cls))
        outputs[cls] = out
        return out

    return run


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def compose(
    traces: dict[str, Trace],
    order: Sequence[type],
    checkpointing: str,
    every: int,
) -> ActivationBytes:
    """The :class:`ActivationBytes` of a model whose blocks, in build order, are of
    the classes ``order``, from the traces of mode ``none`` and ``checkpointing``."""
    none = traces["none"]
    ckpt = checkpointed_blocks(len(order), checkpointing, every)
    per = [
        (traces[checkpointing] if c else none).blocks[cls]
        for cls, c in zip(order, ckpt, strict=True)
    ]
    kept = [b.kept for b in per]
    return ActivationBytes(
        saved=sum(kept),
        head=none.head,
        loss_transient=none.loss_transient,
        block_transient=backward_peak(kept, [b.excess for b in per]),
    )


def tp_local(
    model: nn.Module, classes: Sequence[type[nn.Module]], plan: Any, tp: int
) -> nn.Module:
    """A copy of ``model`` (on the meta device) whose blocks (``classes``) compute
    what one rank of tensor parallelism of degree ``tp`` computes under ``plan`` (a
    src.sharding.TPPlan): each Linear inside a block whose style shards its output
    (colwise; a fused q|k|v projection, which keeps its own heads of each part)
    keeps ``1/tp`` of its output features, each whose style takes a sharded input
    (rowwise) ``1/tp`` of its input features. Attention then runs on
    ``1/tp`` of the heads and the MLP on ``1/tp`` of its width, as a tensor-parallel
    block's local tensors do; the residual stream stays whole. Styles that keep both
    sides whole (``colwise_rep``, embeddings) change nothing, nor does the plan
    outside the blocks (the head: the planner splits its buffers itself)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from src.sharding.tensor_parallel import FusedHeadsParallel

    model = copy.deepcopy(model)
    inside = {
        id(m)
        for b in model.modules()
        if isinstance(b, tuple(classes))
        for m in b.modules()
    }
    for target in model.modules():
        styles = next(
            (st for cls, st in plan.modules.items() if isinstance(target, cls)), {}
        )
        for pattern, style in styles.items():
            depth = len(pattern.split("."))
            for name, sub in target.named_modules():
                if (
                    id(sub) not in inside
                    or not isinstance(sub, nn.Linear)
                    or len(name.split(".")) != depth
                    or not fnmatch.fnmatchcase(name, pattern)
                ):
                    continue
                if (
                    isinstance(style, ColwiseParallel)
                    and isinstance(style.output_layouts[0], Shard)
                ) or isinstance(style, FusedHeadsParallel):
                    _shrink(sub, 0, tp)
                elif isinstance(style, RowwiseParallel) and isinstance(
                    style.input_layouts[0], Shard
                ):
                    _shrink(sub, 1, tp)
    return model


def _shrink(linear: nn.Linear, dim: int, tp: int) -> None:
    """``linear`` with ``1/tp`` of its output (``dim=0``) or input (1) features."""
    weight = linear.weight
    shape = list(weight.shape)
    shape[dim] //= tp
    linear.weight = nn.Parameter(weight.new_empty(shape), weight.requires_grad)
    if dim == 0:
        linear.out_features = shape[0]
        if linear.bias is not None:
            linear.bias = nn.Parameter(
                linear.bias.new_empty(shape[0]), linear.bias.requires_grad
            )
    else:
        linear.in_features = shape[1]


def outer_blocks(
    model: nn.Module, classes: Sequence[type[nn.Module]]
) -> list[nn.Module]:
    """``model``'s blocks of ``classes`` in build (module) order, outermost only (a
    block inside another is the outer one's)."""
    blocks, inside, classes = [], set(), tuple(classes)
    for m in model.modules():
        if id(m) not in inside and isinstance(m, classes):
            inside.update(id(c) for c in m.modules())
            blocks.append(m)
    return blocks


def block_order(model: nn.Module, classes: Sequence[type[nn.Module]]) -> list[type]:
    """The classes of ``model``'s blocks in build (module) order, outermost only."""
    return [type(m) for m in outer_blocks(model, classes)]


def traced_activation_bytes(
    model: nn.Module,
    classes: Sequence[type[nn.Module]],
    context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> Callable[..., ActivationBytes]:
    """A family formula's twin for ``model`` (on the meta device): ``(micro_batch,
    seq_len, act_bytes, checkpointing, every) -> ActivationBytes``, traced. Traces are
    cached; a micro-batch above 2 is extrapolated from 1 and 2 sequences (activations
    are linear in it), so a search over micro-batches traces each mode twice."""
    order = block_order(model, classes)
    cache: dict[tuple, Trace] = {}

    def get(mb: int, seq_len: int, act_bytes: int, mode: str) -> Trace:
        key = (mb, seq_len, act_bytes, mode)
        if key not in cache:
            dtype = torch.float32 if act_bytes >= 4 else torch.bfloat16
            cache[key] = trace(model, classes, mb, seq_len, dtype, mode, context)
        return cache[key]

    def at(mb: int, seq_len: int, act_bytes: int, mode: str) -> Trace:
        if mb <= 2:
            return get(mb, seq_len, act_bytes, mode)
        one, two = get(1, seq_len, act_bytes, mode), get(2, seq_len, act_bytes, mode)

        def line(a: int, b: int) -> int:
            return a + (b - a) * (mb - 1)

        return Trace(
            head=line(one.head, two.head),
            loss_transient=line(one.loss_transient, two.loss_transient),
            blocks={
                cls: BlockTrace(
                    line(one.blocks[cls].kept, two.blocks[cls].kept),
                    line(one.blocks[cls].excess, two.blocks[cls].excess),
                )
                for cls in one.blocks
            },
        )

    def activation_bytes(
        micro_batch: int,
        seq_len: int,
        act_bytes: int,
        checkpointing: str = "none",
        every: int = 1,
    ) -> ActivationBytes:
        traces = {"none": at(micro_batch, seq_len, act_bytes, "none")}
        if checkpointing != "none":
            traces[checkpointing] = at(micro_batch, seq_len, act_bytes, checkpointing)
        return compose(traces, order, checkpointing, every)

    return activation_bytes
