"""What tensor parallelism adds to a micro-batch, counted on the model itself.

The run's model is tensor-parallelised on the meta device over a fake process group
(src/planner/inputs.py): every style of its plan, sequence parallelism, a
vocabulary-parallel loss and its checkpointing are as the run builds them. One
forward and backward of one micro-batch runs on it under :class:`_Counter`, a
dispatch mode that sees each op before DTensor does and counts:

- every op with a DTensor argument: DTensor's dispatch (sharding propagation, the
  local op's call, wrapping its output) costs a rank the probe's ``dtensor_op_s`` of
  Python per op beyond the local op's own time;
- every collective the redistributions issue (sequence parallelism's all-gathers and
  reduce-scatters, a row-wise layer's all-reduce without it, the loss's), with the
  bytes of its full tensor;
- each trained parameter whose gradient comes out ``Partial`` on the tp ranks (a
  norm's weight under sequence parallelism, a fused projection's weight): FSDP
  all-reduces each one once a step.

A model written by hand would miss what a family adds (GPT's fused heads, its
biases, the loss's three all-reduces): the 2-rank GPT under TP ran 26 gradient
all-reduces and 38 redistributions a step where a per-block formula counted 16.
The counts are taken on 1 row of the run's sequence (ops do not depend on the rows,
the bytes of activations scale with them) and on at most two blocks of each class
(:func:`by_blocks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: c10d functional ops -> the profile's collective names (src/planner/profiles.py)
_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}


@dataclass(frozen=True)
class TPCensus:
    """What one micro-batch of one row dispatched and sent: DTensor's ops, the
    collectives per kind as ``(count, bytes of their full tensors)``, and the
    gradients all-reduced over the tp ranks once a step as ``(count, bytes)``.
    Counts add and subtract (a block's is two models' difference)."""

    dtensor_ops: int = 0
    collectives: dict[str, tuple[int, int]] = field(default_factory=dict)
    partial_grads: tuple[int, int] = (0, 0)

    @property
    def sent(self) -> int:
        """How many collectives, of every kind."""
        return sum(n for n, _ in self.collectives.values())

    def comm_s(self, links: dict, ranks: int, scale: float = 1.0) -> float:
        """Seconds of the collectives over ``ranks`` on ``links`` (kind -> Link),
        each at its kind's mean bytes x ``scale``."""
        from src.planner.profiles import collective

        return sum(
            n * collective(links[kind], kind, ranks, nbytes / n * scale)
            for kind, (n, nbytes) in self.collectives.items()
        )

    def plus(self, other: TPCensus, times: int = 1) -> TPCensus:
        kinds = self.collectives.keys() | other.collectives.keys()

        def add(a: tuple, b: tuple) -> tuple:
            return tuple(x + times * y for x, y in zip(a, b, strict=True))

        return TPCensus(
            self.dtensor_ops + times * other.dtensor_ops,
            {
                k: add(
                    self.collectives.get(k, (0, 0)), other.collectives.get(k, (0, 0))
                )
                for k in sorted(kinds)
            },
            add(self.partial_grads, other.partial_grads),
        )


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtensor_ops = 0
        self.collectives: dict[str, tuple[int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # DTensor runs it with this mode still on: its collectives and local
            # ops come back here
            self.dtensor_ops += 1
            return NotImplemented
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            # a model reads a value off its data (transformers' packed-sequence
            # check): meta has none; zero or False, the unpacked path
            return False if args[0].dtype == torch.bool else 0
        name = func.overloadpacket.__name__
        if func.namespace in ("_c10d_functional", "c10d_functional") and name in _KINDS:
            kind, tensor = _KINDS[name], args[0]
            nbytes = tensor.numel() * tensor.element_size()
            if kind == "all_gather":
                nbytes *= int(args[1])  # the gathered output
            n, total = self.collectives.get(kind, (0, 0))
            self.collectives[kind] = (n + 1, total + nbytes)
        return func(*args, **(kwargs or {}))


def count(model: torch.nn.Module | None, run) -> TPCensus:
    """Count ``run(model)``: one micro-batch's forward, loss and backward (the
    gradients are dropped after). The caller keeps any process group the model's
    DTensors need alive."""
    from torch.distributed.tensor import DTensor, Partial

    counter = _Counter()
    with counter:
        run(model)
    if model is None:  # ops alone
        return TPCensus(counter.dtensor_ops, counter.collectives)
    partial = [
        p.grad.to_local().numel() * p.grad.element_size()
        for p in model.parameters()
        if isinstance(p.grad, DTensor)
        and any(isinstance(pl, Partial) for pl in p.grad.placements)
    ]
    model.zero_grad(set_to_none=True)
    return TPCensus(
        counter.dtensor_ops, counter.collectives, (len(partial), sum(partial))
    )


def _drop(model: torch.nn.Module, block: torch.nn.Module) -> None:
    """Take ``block`` out of its container (a ModuleList or ModuleDict iterates the
    rest)."""
    for m in model.modules():
        for key, child in list(m._modules.items()):
            if child is block:
                del m._modules[key]
                return


def by_blocks(
    model: torch.nn.Module, blocks: list, run, kinds: list | None = None
) -> TPCensus:
    """The count of ``model`` with all of ``blocks`` (its outer blocks, in order), from
    runs that keep at most two of each kind (``kinds[i]`` is block i's: its class
    and whether it is checkpointed; default its class): one block of a kind is the
    count with two less the count with one; the whole model is the count with one
    of each plus the rest's. A 70B model counts as fast as a small one."""
    groups: dict = {}
    for b, kind in zip(blocks, kinds or [type(b) for b in blocks], strict=True):
        groups.setdefault(kind, []).append(b)
    for same in groups.values():
        for b in same[2:]:
            _drop(model, b)
    current = count(model, run)
    per: dict = {}
    for kind, same in groups.items():
        if len(same) > 1:
            _drop(model, same[1])
            fewer = count(model, run)
            per[kind] = current.plus(fewer, -1)
            current = fewer
    for kind, one in per.items():
        current = current.plus(one, len(groups[kind]) - 1)
    return current


_CACHE: dict[tuple, TPCensus | Exception] = {}


def _census(plan) -> TPCensus:
    from torch.distributed.tensor.parallel import loss_parallel

    from src.build import build_model
    from src.models.memory import checkpointed_blocks
    from src.planner.inputs import plan_backend, with_ac_chosen
    from src.planner.trace import outer_blocks

    plan = with_ac_chosen(plan)
    seq = int(plan.batch.seq_len)

    def step(model: torch.nn.Module) -> None:
        tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
        with loss_parallel():
            model(tokens, tokens)[1].backward()

    classes = tuple(plan.spec.block_classes(plan.model_config))
    ac = plan.checkpointing

    def kind(block: torch.nn.Module, i: int) -> tuple:
        return type(block), checkpointed_blocks(i + 1, ac.mode, ac.every)[i]

    for shallow in (True, False):
        skipped: set[int] = set()
        built = plan
        if shallow and classes:
            parallelize = _first_two_of_each_kind(
                plan.spec.parallelize, classes, kind, skipped
            )
            built = replace(plan, spec=replace(plan.spec, parallelize=parallelize))
        with plan_backend(built) as backend:
            try:
                model = build_model(built, backend, init_device="meta")
            except Exception:
                if built is plan:
                    raise
                continue  # a block left plain broke the build: whole
            blocks = outer_blocks(model, classes)
            kinds = [kind(b, i) for i, b in enumerate(blocks)]
            if skipped <= {id(b) for b in _beyond_two(blocks, kinds)}:
                return by_blocks(model, blocks, step, kinds)
        # built in another order than its modules': a kept block was skipped
    raise AssertionError("unreachable: a whole build skips nothing")


def _beyond_two(blocks: list, kinds: list) -> list:
    """The blocks after the first two of their kind (what :func:`by_blocks` drops)."""
    seen: dict = {}
    beyond = []
    for b, k in zip(blocks, kinds, strict=True):
        seen[k] = seen.get(k, 0) + 1
        if seen[k] > 2:
            beyond.append(b)
    return beyond


class _WithoutTP:
    """A build's parallelize steps with tensor parallelism left out."""

    def __init__(self, steps) -> None:
        self._steps = steps

    def __getattr__(self, name: str):
        return getattr(self._steps, name)

    def tensor_parallel(self, module: torch.nn.Module) -> None:
        pass


def _first_two_of_each_kind(parallelize, classes: tuple, kind, skipped: set[int]):
    """The family's ``parallelize``, with no tensor parallelism for a block past
    the first two of its kind (recorded in ``skipped``), which :func:`by_blocks`
    drops before counting: parallelising every block of a deep model was the
    census's whole cost (gpt_70b: ~0.9 s a census, 9 a plan-only). A block built as
    a unit (GPT, Llama) is skipped as it is built, in build order; one that a module
    holding it parallelises (a transformers model's layers, tensor-parallelised with
    its root) is out of that module while it is. Everything else (adapters, float8,
    checkpointing) is built as the run builds it."""
    from src.planner.trace import outer_blocks

    seen: dict = {}
    built: list[int] = []

    def step(module: torch.nn.Module, steps, *, unit: bool) -> None:
        if isinstance(module, classes):
            if not unit and id(module) not in built:
                built.append(id(module))
                k = kind(module, len(built) - 1)
                seen[k] = seen.get(k, 0) + 1
                if seen[k] > 2:
                    skipped.add(id(module))
            if id(module) in skipped:
                steps = _WithoutTP(steps)
            parallelize(module, steps, unit=unit)
            return
        held = outer_blocks(module, classes)
        kinds = [kind(b, i) for i, b in enumerate(held)]
        beyond = _beyond_two(held, kinds)
        skipped.update(id(b) for b in beyond)
        with _taken_out(module, beyond):
            parallelize(module, steps, unit=unit)

    return step


@contextlib.contextmanager
def _taken_out(model: torch.nn.Module, blocks: list) -> Iterator[None]:
    """``blocks`` replaced by placeholders in ``model`` (each in its place: a
    container's order is kept), put back after."""
    places = {id(b) for b in blocks}
    swapped = []
    for m in model.modules() if blocks else ():
        for key, child in m._modules.items():
            if child is not None and id(child) in places:
                swapped.append((m, key, child))
    for m, key, _ in swapped:
        m._modules[key] = torch.nn.Identity()
    try:
        yield
    finally:
        for m, key, child in swapped:
            m._modules[key] = child


def census(plan) -> TPCensus | None:
    """The :class:`TPCensus` of ``plan``'s model under its tensor parallelism (in
    fp32, as the meta model holds it), cached per model, sequence, degree,
    sequence parallelism, float8 and checkpointing; None without tensor
    parallelism."""
    lay = plan.layout
    if lay.tp <= 1:
        return None
    key = (
        repr(plan.model_config),
        plan.batch.seq_len,
        lay.tp,
        plan.unit.sequence_parallel,
        repr(plan.float8),
        repr(plan.checkpointing),
    )
    if key not in _CACHE:
        try:
            _CACHE[key] = _census(plan)
        except Exception as err:  # a search asks thousands of times: fail once
            _CACHE[key] = err.with_traceback(None)  # not the frames (the model)
    found = _CACHE[key]
    if isinstance(found, Exception):
        raise found
    return found
