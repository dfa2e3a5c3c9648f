"""Backends: how units are wrapped, how the root is wrapped, and the step-time helpers.

One class per backend, all with the interface of :class:`Backend` (building, root
wrap, placement, autocast, grad scaler, clipping, ``no_sync``); :data:`BACKENDS`
lists them by name. The same model code runs under all of them:

- ``fsdp2`` (default): FSDP2 ``fully_shard`` per unit, in place, on a 1-D device mesh,
  or on a 2-D ``(replicate, shard)`` mesh for hybrid sharding (HSDP, ``replicate > 1``).
- ``fsdp1``: ``FullyShardedDataParallel`` per unit (``use_orig_params=True``); with
  ``replicate > 1`` its ``HYBRID_SHARD`` strategy on the same 2-D mesh.
- ``ddp`` (src/sharding/ddp.py): no units; the root is wrapped in
  ``DistributedDataParallel`` (a baseline).
- ``none`` (src/sharding/single.py): one process, nothing wrapped.
- ``plan``: records units without sharding anything (plan-only, on the meta device).

State dicts need no backend method: torch.distributed.checkpoint's ``get_state_dict``
and ``set_state_dict`` read and write every one of them by canonical name.
The root is always wrapped last, so no parameter is left out of a unit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, ShardingStrategy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from src.registry import Registry

from .context_parallel import ContextParallel
from .expert_parallel import expert_parallelize, plan_experts
from .float8 import Float8, byte_all_gather
from .layout import ParallelLayout, ParallelMesh, refusal
from .lora import LoraSpec, is_adapter
from .parallelize import Parallelize, UnitSteps, parallelize_decoder
from .policies import WrapPolicy
from .precision import Precision, get_precision
from .tensor_parallel import TPPlan
from .transforms import UnitTransform
from .wrap import enable_wrap, make_unit


def fsdp1_wrapper(
    module: nn.Module,
    *,
    reshard_after_forward: bool | int = True,
    mp_policy: Precision | None = None,
    device_mesh: DeviceMesh | None = None,
    no_shard: bool = False,
    **kwargs: Any,
) -> FSDP1:
    """``FullyShardedDataParallel`` taking FSDP2's argument names, so the same
    ``wrap(..., reshard_after_forward=False)`` annotation works on both backends.
    A 2-D ``device_mesh`` selects the hybrid strategies (shard within a group,
    replicate across groups), as a 2-D mesh does for FSDP2; ``no_shard``: every rank
    a replica (``NO_SHARD`` over the default group: gradients all-reduced over it)."""
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r}: FSDP1 takes true or "
            "false (resharding to a smaller group after forward is FSDP2's)"
        )
    hybrid = device_mesh is not None and device_mesh.ndim == 2
    strategy = {
        (False, True): ShardingStrategy.FULL_SHARD,
        (False, False): ShardingStrategy.SHARD_GRAD_OP,
        (True, True): ShardingStrategy.HYBRID_SHARD,
        (True, False): ShardingStrategy._HYBRID_SHARD_ZERO2,
    }[hybrid, reshard_after_forward]
    if no_shard:
        strategy, hybrid = ShardingStrategy.NO_SHARD, False
    if hybrid:
        kwargs["device_mesh"] = device_mesh
    kwargs.setdefault("use_orig_params", True)
    if mp_policy is not None:
        kwargs.setdefault("mixed_precision", mp_policy.fsdp1_policy())
    with warnings.catch_warnings():
        # NO_SHARD's deprecation notice: here it is what replicate = world size means
        warnings.filterwarnings("ignore", "The `NO_SHARD`", FutureWarning)
        return FSDP1(module, sharding_strategy=strategy, **kwargs)


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def _trim_after(wrapper_cls: Callable[..., nn.Module | None]) -> Callable:
    """Return freed heap pages to the OS after each unit is sharded (glibc, CPU).

    Building under the wrap context frees each unit's full parameters right after
    sharding them, but glibc's growing mmap threshold keeps later frees on the heap,
    where they stay resident: measured +0.27 GiB per rank on a 3.5 GiB model
    (docs/benchmarks.md). ``malloc_trim`` after each unit brings the peak back to
    P/N plus the process baseline.
    """

    def wrapper(module: nn.Module, **kwargs: Any) -> nn.Module | None:
        out = wrapper_cls(module, **kwargs)
        _LIBC.malloc_trim(0)
        return out

    return wrapper


def record_unit(module: nn.Module, **_: Any) -> nn.Module:
    """A wrapper that shards nothing: ``make_unit`` tags the unit, which is all a
    plan needs."""
    return module


class Backend:
    """One backend, bound to this process's device and ranks.

    The shared interface: building (:meth:`wrapper`, :meth:`wrap_context`,
    :meth:`wrap_root`, :meth:`finish_build`) and the step-time helpers
    (:meth:`autocast`, :meth:`grad_scaler`, :meth:`clip_grad_norm_`, :meth:`no_sync`).
    The base class is one process with nothing wrapped; each subclass changes only
    what its backend does differently. :data:`BACKENDS` lists them by name.
    """

    name: ClassVar[str]
    # Capabilities: the planner and the config checks ask these, never the name. A
    # backend (a class with a ``name``) states every one, in its class or a parent's,
    # or defining it fails (:meth:`__init_subclass__`).
    distributed: ClassVar[bool]  # needs an initialised process group
    wraps_units: ClassVar[bool]  # units are wrapped as the model is built
    shards_parameters: ClassVar[bool]  # each rank holds 1/N of the parameters
    bucketed_gradients: ClassVar[bool]  # gradients copied into reduction buckets
    meta_init: ClassVar[bool]  # can materialise a model built on meta
    hybrid: ClassVar[bool]  # takes replicate > 1 (HSDP)
    partial_reshard: ClassVar[bool]  # reshard_after_forward may be a group size
    explicit_prefetch: ClassVar[bool]  # takes forward/backward prefetch depths
    allocates: ClassVar[bool]  # the built model holds real tensors
    tensor_parallel: ClassVar[bool]  # takes tensor_parallel > 1 (a tp mesh dimension)
    pipeline_parallel: ClassVar[bool]  # takes pipeline_parallel > 1 (a pp mesh dim)
    context_parallel: ClassVar[bool]  # takes context_parallel > 1 (a cp mesh dim)
    # a unit's all-gather output is copied into its parameters' own unsharded
    # tensors (both alive at once while it is gathered)
    gather_copy_out: ClassVar[bool]
    # each parameter a DTensor (per-parameter sharding): the optimizer step and the
    # clip dispatch through DTensor once per tensor
    dtensor_parameters: ClassVar[bool]
    float8: ClassVar[bool]  # takes float8 linear layers (precision=float8)
    expert_parallel: ClassVar[bool]  # takes expert_parallel > 1 (from the shard ranks)
    CAPABILITIES: ClassVar[tuple[str, ...]] = (
        "distributed",
        "wraps_units",
        "shards_parameters",
        "bucketed_gradients",
        "meta_init",
        "hybrid",
        "partial_reshard",
        "explicit_prefetch",
        "allocates",
        "tensor_parallel",
        "pipeline_parallel",
        "context_parallel",
        "gather_copy_out",
        "dtensor_parameters",
        "float8",
        "expert_parallel",
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [c for c in cls.CAPABILITIES if not hasattr(cls, c)]
        if "name" in cls.__dict__ and missing:
            raise TypeError(
                f"backend {cls.name!r} does not state its capabilities "
                f"{', '.join(missing)} (see Backend.CAPABILITIES)"
            )

    def __init__(
        self,
        precision: Precision,
        device: torch.device,
        reshard_after_forward: bool | int = True,
        layout: ParallelLayout | None = None,
        float8: Float8 | None = None,
    ) -> None:
        self.precision, self.device = precision, device
        #: float8 linear layers (precision=float8): which, the recipe, the all-gather
        self.float8_linears = float8
        #: as FSDP2 takes it: True, False, or the (smaller) group size to reshard to
        self.reshard_after_forward = reshard_after_forward
        self.world_size, self.rank = 1, 0
        if self.distributed:
            if not dist.is_initialized():
                raise RuntimeError(
                    f"backend {self.name!r} needs an initialised torch.distributed "
                    "process group (backend 'none' runs without one)"
                )
            self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        #: the run's parallel layout (default: every rank shards, nothing else)
        self.layout = layout or ParallelLayout(self.world_size)
        self.check_layout(self.layout, precision.name)
        if self.distributed and self.layout.world_size != self.world_size:
            raise ValueError(
                f"a layout of {self.layout.world_size} ranks on a process group of "
                f"{self.world_size}"
            )
        #: the layout's device mesh and groups (built by the backends that use one)
        self.parallel: ParallelMesh | None = None
        #: the model's plan, set by build_sharded_model (None: no tensor parallelism)
        self.tp_plan: TPPlan | None = None
        #: this rank's cp group (None: no context parallelism)
        self.cp: ContextParallel | None = None

    @classmethod
    def check_layout(cls, layout: ParallelLayout, precision: str | None = None) -> None:
        """:class:`LayoutError` (naming the dimension) where this backend cannot run
        ``layout`` (in ``precision``): the one rule, :func:`layout.refusal`."""
        err = refusal(layout, cls, precision)
        if err is not None:
            raise err

    def _build_mesh(self) -> None:
        """Build the layout's mesh (the groups units shard on, tp, cp, ep)."""
        self.parallel = self.layout.build_mesh(self.device.type)
        if self.parallel.cp is not None:
            self.cp = ContextParallel(self.parallel.cp)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision.name}, {self.device})"

    @property
    def param_dtype(self) -> torch.dtype:
        return self.precision.param_dtype

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (the rows of the batch it reads)."""
        return self.layout.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own rows of the batch."""
        return self.layout.dp

    def close(self) -> None:
        """Release what the backend made for itself (the plan backend's fake process
        group); nothing for the others."""

    def split_experts(self, module: nn.Module) -> None:
        """Expert parallelism: each expert module under ``module`` split over the
        ep ranks and sharded over the rest (src/sharding/expert_parallel.py)."""
        if self.parallel is None:
            raise ValueError(f"expert parallelism without its mesh on {self.name}")
        _, defaults = self.wrapper()
        defaults = {k: v for k, v in defaults.items() if k != "mesh"}
        expert_parallelize(module, self.parallel, **defaults)

    def unit_steps(
        self,
        transform: UnitTransform | None,
        tp_plan: TPPlan | None,
        lora: LoraSpec | None = None,
    ) -> UnitSteps:
        """The parallelize steps of a build on this backend's mesh."""
        return UnitSteps(
            transform or UnitTransform(),
            self.parallel,
            tp_plan,
            self.split_experts if self.layout.ep > 1 else None,
            lora,
        )

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around forward and backward: ``loss_parallel`` when the plan keeps the
        logits sharded over the vocabulary; the cp group the models read
        (``context_parallel.active``) with context parallelism."""
        stack = contextlib.ExitStack()
        if self.tp_plan is not None:
            stack.enter_context(self.tp_plan.loss_context())
        if self.cp is not None:
            stack.enter_context(self.cp.entered())
        return stack

    def shard_sequence(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each (rows, sequence) tensor of ``batch``: all of it,
        or with context parallelism its load-balanced 1/C of every sequence."""
        if self.cp is None:
            return batch
        return tuple(self.cp.shard(t) for t in batch)

    # -- building -------------------------------------------------------------------
    def wrapper(self) -> tuple[Callable[..., nn.Module | None], dict[str, Any]]:
        """The per-unit wrapper and its context defaults for ``enable_wrap``."""
        raise ValueError(f"backend {self.name!r} has no per-unit wrapper")

    def wrap_context(
        self,
        policy: WrapPolicy | None,
        parallelize: Callable[..., None] | None = None,
    ) -> contextlib.AbstractContextManager:
        """``enable_wrap`` with this backend's wrapper and the run's parallelize
        step; a null context without units."""
        if not self.wraps_units:
            return contextlib.nullcontext()
        wrapper_cls, defaults = self.wrapper()
        if self.device.type == "cpu" and _LIBC is not None:
            wrapper_cls = _trim_after(wrapper_cls)
        return enable_wrap(
            wrapper_cls, policy=policy, parallelize=parallelize, **defaults
        )

    def wrap_root(self, model: nn.Module) -> nn.Module:
        """Wrap the root last (inside the wrap context), so no parameter is left out."""
        return make_unit(model) if self.wraps_units else model

    def finish_build(
        self,
        model: nn.Module,
        init_device: torch.device,
        init_fn: Callable[[str, torch.Tensor], torch.Tensor] | None,
    ) -> nn.Module:
        """After the wrap context: a meta-built model materialised shard by shard from
        ``init_fn``, or the built model placed on this backend's device."""
        if not self.allocates:
            return model  # as built (on meta for a plan): nothing is allocated
        if init_device.type == "meta":
            materialize_meta_(model, init_fn, self.device)
            return model
        return self.place(model)

    def place(self, model: nn.Module) -> nn.Module:
        """The built (not meta) model on this backend's device."""
        return model.to(self.device)

    # -- step-time helpers ------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast, for backends without mixed precision of their own."""
        if not self.precision.is_mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.param_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for fp16, else None."""
        if not self.precision.needs_grad_scaler:
            return None
        return torch.amp.GradScaler(self.device.type)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm; returns that norm (a plain tensor).

        Gradients on different meshes (with tensor parallelism: DTensors on the
        data-parallel x tp mesh, and parameters no plan parallelised on the
        data-parallel mesh alone) are normed per mesh, then combined."""
        if len(_by_mesh(model.parameters())) <= 1:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            return norm.full_tensor() if isinstance(norm, DTensor) else norm
        total = grad_norm(model.parameters())
        clip_grads_with_norm_(model.parameters(), max_norm, total)
        return total

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Skip the gradient reduction (inner gradient-accumulation steps)."""
        return contextlib.nullcontext()

    def after_optimizer_step(self, model: nn.Module) -> None:
        """After each optimizer step: float8 all-gather's scales for the next step."""
        if self.float8_linears is not None:
            self.float8_linears.after_optimizer_step(model)


def _by_mesh(params: Iterable[nn.Parameter]) -> dict[Any, list[nn.Parameter]]:
    """The parameters with a gradient, by the mesh of their gradient (None: plain)."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    return groups


def grad_norm(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the gradients of ``params`` (a plain tensor), over every mesh
    they are sharded on: normed per mesh, then combined."""
    return tensors_norm([p.grad for p in params if p.grad is not None])


def tensors_norm(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``tensors`` together (a plain tensor): DTensors normed per mesh
    (a collective on each), then combined; plain ones as they are (replicated, or
    one process's)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(
            t
        )
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([t.detach() for t in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grads_with_norm_(
    params: Iterable[nn.Parameter], max_norm: float, total: torch.Tensor
) -> None:
    """Scale the gradients of ``params`` by ``max_norm / total`` where below 1, one
    mesh at a time."""
    for group in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


#: The backends that train, by ``sharding.backend`` name: each class adds itself
#: with :func:`register_backend` (``ddp`` and ``none`` in their own files, which
#: src/sharding/__init__.py imports).
BACKENDS: Registry[type[Backend]] = Registry("backend")
BackendT = TypeVar("BackendT", bound=type[Backend])


def register_backend(cls: BackendT) -> BackendT:
    """Class decorator: list the backend ``cls`` in :data:`BACKENDS` under its
    ``name`` (``ValueError`` if the name is taken)."""
    BACKENDS.add(cls.name, cls)
    return cls


class _FSDPBackend(Backend):
    """What FSDP2 and FSDP1 share: units, their own mixed precision, a sharded
    gradient scaler, parameters already placed by the wrapper."""

    distributed = True
    wraps_units = True
    shards_parameters = True
    bucketed_gradients = False
    hybrid = True
    allocates = True
    tensor_parallel = False
    pipeline_parallel = False
    context_parallel = False
    gather_copy_out = False  # FSDP1: the flat parameter is the all-gather's output
    dtensor_parameters = False  # FSDP1: flat parameters
    float8 = True
    expert_parallel = False

    def place(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # the wrapper casts (mp_policy)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        if not self.precision.needs_grad_scaler:
            return None
        return ShardedGradScaler(device=self.device.type)


@register_backend
class FSDP2Backend(_FSDPBackend):
    """``fsdp2``: ``fully_shard`` per unit, in place, on a 1-D mesh (2-D for HSDP)."""

    name = "fsdp2"
    tensor_parallel = True
    expert_parallel = True
    pipeline_parallel = True
    context_parallel = True
    meta_init = True
    partial_reshard = True
    explicit_prefetch = True
    gather_copy_out = True
    dtensor_parameters = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._build_mesh()

    def wrapper(self) -> tuple[Callable[..., nn.Module | None], dict[str, Any]]:
        f8 = self.float8_linears
        wrapper = fully_shard
        if f8 is not None and f8.all_gather and self.device.type == "cpu":
            wrapper = _with_byte_all_gather  # gloo has no float8 type
        return wrapper, {
            "mesh": self.parallel.fsdp,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.precision.fsdp2_policy(),
        }

    def wrap_root(self, model: nn.Module) -> nn.Module:
        """FSDP2's root keeps its parameters gathered after forward: backward needs
        them first, so freeing and re-gathering them would only cost a collective."""
        model = make_unit(model, reshard_after_forward=False)
        # A policy may have made the root a unit already, with the defaults.
        model.set_reshard_after_forward(False, recurse=False)
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not isinstance(model, FSDPModule):
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


@register_backend
class FSDP1Backend(_FSDPBackend):
    """``fsdp1``: ``FullyShardedDataParallel`` per unit (``HYBRID_SHARD`` for HSDP)."""

    name = "fsdp1"
    float8 = False  # its flat parameters: no float8 all-gather, untested with torchao
    meta_init = False
    partial_reshard = False
    explicit_prefetch = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # replicate = world size: a shard group of one rank, where torch's FSDP1
        # switches HYBRID_SHARD to NO_SHARD within that group and so never reduces
        # gradients across the replicas (each rank trained on its own batch). Every
        # rank a replica is NO_SHARD over all ranks (the same memory, reduced).
        replicate = self.layout.dp_replicate
        self.no_shard = replicate > 1 and replicate == self.world_size
        if replicate > 1 and not self.no_shard:
            self._build_mesh()

    def wrapper(self) -> tuple[Callable[..., nn.Module | None], dict[str, Any]]:
        # FSDP1 needs device_id even on CPU, where it cannot infer one.
        return fsdp1_wrapper, {
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.precision,
            "device_id": self.device,
            "device_mesh": self.parallel.fsdp if self.parallel is not None else None,
            "no_shard": self.no_shard,
        }

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return model.no_sync()


class PlanBackend(_FSDPBackend):
    """``plan``: records units without sharding or allocating anything (plan-only)."""

    name = "plan"
    distributed = False
    meta_init = True
    partial_reshard = True
    explicit_prefetch = True
    allocates = False
    tensor_parallel = True  # parallelised on meta over a fake process group
    pipeline_parallel = True  # the planner's stage is built as a model of its own
    expert_parallel = True  # planned, not split (src/planner: the experts' share)
    context_parallel = True  # the sequence split changes no parameter's shape

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fake_group = False
        tp = self.layout.tp
        if tp > 1:
            # The plan needs the tp-local shapes: the model is tensor-parallelised on
            # meta for real, over a process group that communicates nothing (torch's
            # fake backend), alive until close (a pipeline's stages are built one
            # after another with it).
            if dist.is_initialized() and dist.get_backend() == "fake":
                dist.destroy_process_group()  # left by a build that failed
            if dist.is_initialized():
                raise RuntimeError(
                    "the plan backend with tensor parallelism builds in a process "
                    "without a process group (it makes a fake one)"
                )
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
            self._fake_group = True
            self.parallel = ParallelLayout(tp, tp=tp).build_mesh("cpu")

    def wrapper(self) -> tuple[Callable[..., nn.Module | None], dict[str, Any]]:
        return record_unit, {}

    def split_experts(self, module: nn.Module) -> None:
        plan_experts(module, self.layout.ep, self.layout.ep_shard)

    def close(self) -> None:
        """Destroy the fake process group (also after a build that failed)."""
        if self._fake_group:
            dist.destroy_process_group()
            self._fake_group = False


def _with_byte_all_gather(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``fully_shard`` whose all-gather moves float8 weights as bytes (gloo)."""
    unit = fully_shard(module, **kwargs)
    byte_all_gather(unit)
    return unit


def backend_class(name: str) -> type[Backend]:
    """The class of backend ``name`` (one of :data:`BACKENDS`, or ``plan``)."""
    cls = PlanBackend if name == "plan" else BACKENDS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown backend {name!r}, expected one of: {', '.join(BACKENDS)}, plan"
        )
    return cls


def with_capability(capability: str) -> list[str]:
    """The names of the training backends that have ``capability``."""
    return [name for name, cls in BACKENDS.items() if getattr(cls, capability)]


def build_backend(
    name: str,
    precision: str | Precision = "fp32",
    device: torch.device | str | None = None,
    reshard_after_forward: bool | int = True,
    layout: ParallelLayout | None = None,
    float8: Float8 | None = None,
) -> Backend:
    """The backend ``name`` (one of :data:`BACKENDS`, or ``plan``) for this process;
    distributed ones need an initialised process group. ``layout`` (default: every
    rank shards the units, nothing else) is the run's :class:`ParallelLayout`: HSDP
    replicas (fsdp2, fsdp1), tensor and pipeline parallelism (fsdp2); the ``plan``
    backend takes the layout of the run it plans. ``float8``: the float8 linear
    layers of a float8 precision (``precision.float8``; None: its defaults)."""
    cls = backend_class(name)
    prec = get_precision(precision) if isinstance(precision, str) else precision
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if prec.float8 and float8 is None:
        float8 = Float8()
    return cls(
        prec, device, reshard_after_forward, layout, float8 if prec.float8 else None
    )


def build_sharded_model(
    model_fn: Callable[[], nn.Module],
    backend: Backend,
    policy: WrapPolicy | None,
    init_device: str | torch.device = "cpu",
    init_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    transform: UnitTransform | None = None,
    tp_plan: TPPlan | None = None,
    parallelize: Parallelize = parallelize_decoder,
    lora: LoraSpec | None = None,
    frozen: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Build the model inside the wrap context, so units are sharded as they are built.

    ``parallelize`` (the family's, src/sharding/parallelize.py) runs with its steps
    bound to the backend's mesh: ``transform`` (float8, checkpointing, compile of
    the blocks), ``tp_plan`` (the model's, with tensor parallelism) and ``lora``
    (adapters on its linear layers, src/sharding/lora.py); ``frozen``: the
    parameters (by canonical name) that do not train, frozen before the root is
    wrapped (DDP registers what trains as it wraps). On the meta
    device nothing is allocated until the end, where each rank allocates and fills
    only its own shards with ``init_fn(canonical_name, param) -> full tensor``.
    """
    init_device = torch.device(init_device)
    tp = backend.layout.tp
    if tp > 1 and tp_plan is None:
        raise ValueError(f"tensor parallelism over {tp} ranks needs the model's plan")
    backend.tp_plan = tp_plan if tp > 1 else None
    if init_device.type == "meta" and not backend.meta_init:
        raise ValueError(
            f"meta-device init is not supported with backend {backend.name!r} "
            f"(use {' or '.join(with_capability('meta_init'))})"
        )
    if init_device.type == "meta" and init_fn is None and backend.allocates:
        raise ValueError("meta-device init needs an init_fn to materialise shards")
    steps = backend.unit_steps(transform, backend.tp_plan, lora)
    if lora is not None and init_fn is not None:  # the adapters' names too
        init_fn = lora.init_fn(init_fn)
    step = functools.partial(parallelize, steps=steps)
    with backend.wrap_context(policy, step), init_device:
        model = model_fn()  # each wrap()-annotated module: step, policy, units
        step(model, unit=False)  # the root as built (what no annotation held)
        if frozen is not None:
            for name, p in model.named_parameters():
                if frozen(canonical_name(name, model)):
                    p.requires_grad_(False)
        if backend.wraps_units and policy is not None:
            model = policy.finalize(model)  # units spanning annotations
        model = backend.wrap_root(model)  # the root last: a unit
    if not backend.wraps_units:
        step(model, unit=True)  # no units: the model is the one
    model = backend.finish_build(model, init_device, init_fn)
    if lora is not None and backend.allocates and init_device.type != "meta":
        # peft drew them from the global generator: by name, as on meta
        fill_(model, lora.init_fn(), backend.device, is_adapter)
    return model


def set_prefetch(
    model: nn.Module, forward: int | None = None, backward: int | None = None
) -> list[FSDPModule]:
    """Explicit FSDP2 prefetch: in forward each unit all-gathers the next ``forward``
    units as soon as its own all-gather is done; in backward, the ``backward`` units
    that run after it. ``None`` keeps FSDP2's default (no explicit forward prefetch,
    the next unit in backward); ``0`` turns prefetching off.

    The order is the units' module order (the root, gathered first, left out), which
    must be the order forward calls them: true for models that call their blocks in
    the order they register them. Returns the units in that order.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for i, unit in enumerate(units):
        if forward is not None:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + forward])
        if backward is not None:
            unit.set_modules_to_backward_prefetch(units[max(0, i - backward) : i][::-1])
    return units


_WRAPPER_SEGMENTS = frozenset(
    {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "base_layer"}
)


def canonical_name(name: str, model: nn.Module | None = None) -> str:
    """A parameter's name as in the unwrapped model (without wrapper prefixes, also
    when several wrappers are stacked)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    if isinstance(model, DDP) and parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def name_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from ``crc32(seed, name)``: one parameter's random init
    depends on nothing else (not the build order, the wrap policy, the ranks or the
    device). zlib.crc32, as Python's ``hash`` of a str changes between processes."""
    return torch.Generator(device="cpu").manual_seed(
        zlib.crc32(f"{seed}/{name}".encode())
    )


@torch.no_grad()
def materialize_meta_(
    model: nn.Module,
    init_fn: Callable[[str, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> None:
    """Allocate a meta-built (and possibly sharded) model on ``device`` and fill it.

    Each rank allocates only its local shards. ``init_fn`` returns the full initial value
    of one parameter at a time; a rank keeps its slice of it, so values equal those of a
    normal (non-meta) build whatever the number of ranks.
    """
    model.to_empty(device=device)
    fill_(model, init_fn, device)


@torch.no_grad()
def fill_(
    model: nn.Module,
    init_fn: Callable[[str, torch.Tensor], torch.Tensor],
    device: torch.device,
    names: Callable[[str], bool] = lambda name: True,
) -> None:
    """Fill the (possibly sharded) parameters and buffers of ``model`` whose canonical
    name ``names`` selects with ``init_fn(canonical_name, tensor)``'s full value,
    each rank its own slice."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        name = canonical_name(name, model)
        if not names(name):
            continue
        full = init_fn(name, tensor).to(device)
        if isinstance(tensor, DTensor):
            local = distribute_tensor(
                full.to(tensor.dtype),
                tensor.device_mesh,
                tensor.placements,
                src_data_rank=None,
            ).to_local()
            tensor.to_local().copy_(local)
        else:
            tensor.copy_(full)
