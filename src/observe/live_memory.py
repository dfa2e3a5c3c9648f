"""A CPU rank's peak memory in use, whatever glibc keeps: the resident set less the
bytes glibc's heap holds free, sampled where a training step peaks.

VmHWM, the resident set's high-water mark, counts the heap glibc keeps after a free
(blocks under the mmap threshold stay on the heap, and its free top is returned
only past the trim threshold): with the fast allocator (``trainer.
malloc_mmap_threshold_kib`` 4096 or glibc's own dynamic threshold) a rank's VmHWM
ran 4-24% above the memory its tensors used, and rose step by step as the heap
fragmented (issue 56). What the planner predicts is memory in use: the process's
pages (code, Python, thread stacks, the process group) and the blocks malloc has
handed out. So the measure here is

    in use = VmRSS - fordblks

(``fordblks``: glibc's ``mallinfo2()``, the bytes of free chunks in all arenas, top
included; blocks served by mmap are unmapped when freed and never in it): the
resident set an allocator that returned every free byte at once would leave, the
quantity the planner's constants were measured under (the 64 KiB threshold, where
glibc kept little). It is sampled, not a high-water mark, at the moments a step
peaks (docs/planner.md): after each block in forward (the activations saved so
far), when each block's and each of its direct children's output gradient is
computed in backward (the head's: the loss backward moment; a block child's: the
block's backward working set and its unit's unsharded gradients), after each
autograd node of a block child's backward (up to 64 a child: a peak inside the
child, attention's (T/C x T) scores and their gradient under context parallelism,
missed by 15% between module moments, issue 56), after each child's forward in a
checkpointed block (backward's recomputation), at the end of the model's forward,
and before and after each optimizer step. A peak inside one kernel is not seen;
docs/planner.md says what that leaves out.

The cost: a ``pread`` of /proc/self/statm (~3-10 us) and, when the resident set is
above the peak so far, a ``mallinfo2()`` (~30 us on a fragmented heap) per sample,
plus the hooks' own calls: hundreds of samples a step, 5-10% of a one-process step
of the default model. So a trainer samples only the steps it logs
(:func:`sampling`): the steps are alike, and the peak of the logged ones is the
run's at a tenth of the cost (``trainer.log_every=10``).
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.optim.optimizer as optim


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33, malloc.h's struct mallinfo2 (size_t fields)
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
            "keepcost"
        ).split()
    ]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    fn.restype = _Mallinfo2
    fn.argtypes = []
    return fn


#: The autograd nodes per module :meth:`LiveMemory._hook_nodes` samples after.
_NODES = 64

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class LiveMemory:
    """The sampler: :meth:`sample` reads the memory in use now and keeps the peak;
    :meth:`attach` samples at a model's step moments (hooks)."""

    def __init__(self) -> None:
        self._info = _mallinfo2()
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._statm = None
        self.peak = 0  # bytes in use, the max of the samples
        self.peak_live = 0  # malloc's bytes in use (uordblks + hblkhd), at the peak
        self.samples = 0
        self.watched: nn.Module | None = None  # the model :func:`sampling` hooks
        self._hooks: list = []
        # sample after the autograd nodes inside each block child's backward too
        self.inside = True

    @property
    def available(self) -> bool:
        return self._info is not None and self._statm is not None

    def rss(self) -> int:
        """The resident set now (VmRSS), bytes."""
        return int(os.pread(self._statm, 64, 0).split()[1]) * _PAGE

    def in_use(self) -> tuple[int, int]:
        """(resident set less glibc's free bytes, malloc's live bytes), now."""
        m = self._info()
        return self.rss() - m.fordblks, m.uordblks + m.hblkhd

    def sample(self) -> None:
        """Read the memory in use now; keep it if it is the peak. mallinfo2 only
        when the resident set itself is above the peak (else in use cannot be)."""
        self.samples += 1
        if self.rss() <= self.peak:
            return
        now, live = self.in_use()
        if now > self.peak:
            self.peak, self.peak_live = now, live

    def reset(self) -> None:
        self.peak = self.peak_live = 0
        self.sample()

    # hooks: the moments of a step
    def _after_forward(self, module, args, output) -> None:
        self.sample()
        self._hook_grad(module, args, output)

    def _hook_grad(self, module, args, output) -> None:
        out = output[0] if isinstance(output, tuple | list) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._on_grad)
            if self.inside:
                self._hook_nodes(out.grad_fn, args)

    def _hook_nodes(self, node, args) -> None:
        """Sample after each autograd node between the module's output and its
        inputs computes its gradients (its inputs' gradients and its output's still
        alive): a peak inside a child's backward (attention's (T/C x T) scores and
        their gradient, issue 56) falls between two of these, not between two
        modules. At most :data:`_NODES` nodes per module."""
        stop = {a.grad_fn for a in args if isinstance(a, torch.Tensor)}
        todo, seen = [node], set()
        while todo and len(seen) < _NODES:
            n = todo.pop()
            if n is None or n in stop or n in seen:
                continue
            seen.add(n)
            n.register_hook(self._after_node)
            todo.extend(f for f, _ in n.next_functions)

    def _after_node(self, grad_inputs, grad_outputs) -> None:
        self.sample()

    def _on_grad(self, grad) -> None:
        self.sample()

    def _on_step(self, *args) -> None:
        self.sample()

    def attach(self, model: nn.Module) -> LiveMemory:
        """Sample after the forward of ``model``, of its direct children and of
        every item of an ``nn.ModuleList`` (the blocks), at the gradient of each of
        their outputs and of each block's direct children's (not inside a compiled
        block: a hook there would be traced), and around every optimizer step."""
        for module, in_forward in _moments(model):
            hook = self._after_forward if in_forward else self._hook_grad
            self._hooks.append(module.register_forward_hook(hook))
        self._hooks.append(optim.register_optimizer_step_pre_hook(self._on_step))
        self._hooks.append(optim.register_optimizer_step_post_hook(self._on_step))
        self.sample()
        return self

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        """Detach and close /proc/self/statm: a sampler done with (no longer
        :attr:`available`)."""
        self.detach()
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None


def _compiled(module: nn.Module) -> bool:
    return hasattr(module.forward, "_torchdynamo_orig_callable") or hasattr(
        module, "_orig_mod"
    )


def _moments(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The modules whose forward or output gradient is a moment worth a sample (see
    :meth:`LiveMemory.attach`), each with whether its forward's end is one (a block's
    children: their gradients only, the block's end samples their forward; in a
    checkpointed block also their forward, which backward's recomputation reruns)."""
    picked = {id(model): (model, True)}
    for child in model.children():
        if not isinstance(child, nn.ModuleList):
            picked[id(child)] = (child, True)
    for parent in model.modules():
        if not isinstance(parent, nn.ModuleList):
            continue
        for block in parent:
            picked[id(block)] = (block, True)
            if _compiled(block):
                continue
            # a checkpointed block (its forward replaced on the instance) recomputes
            # its children in backward: their forward's end is then the moment
            recomputed = "forward" in vars(block)
            for child in block.children():
                if not isinstance(child, nn.ModuleList):
                    picked.setdefault(id(child), (child, recomputed))
    return list(picked.values())


#: This process's sampler, once a trainer has attached one (CPU ranks).
_ACTIVE: LiveMemory | None = None


def watch(
    model: nn.Module, device: torch.device, attach: bool = True
) -> LiveMemory | None:
    """This process's sampler for ``model`` on a CPU rank with glibc (None on CUDA,
    where the caching allocator counts its own peak, or without mallinfo2): from
    then on ``memory_metrics`` reports its peak as ``peak_mem_gib``. Attached now,
    or (``attach=False``) only inside :func:`sampling`."""
    global _ACTIVE
    if torch.device(device).type != "cpu":
        return None
    stop()
    sampler = LiveMemory()
    if not sampler.available:
        return None
    _ACTIVE, sampler.watched = sampler, model
    if attach:
        sampler.attach(model)
    else:
        sampler.sample()
    return _ACTIVE


@contextmanager
def sampling(on: bool):
    """Sample the step run inside at its moments when ``on`` (the watched model's
    hooks attached for it, removed after); else nothing is hooked or read."""
    if not on or _ACTIVE is None or _ACTIVE._hooks:
        yield
        return
    _ACTIVE.attach(_ACTIVE.watched)
    try:
        yield
    finally:
        _ACTIVE.detach()


def active() -> LiveMemory | None:
    return _ACTIVE


def stop() -> None:
    """Detach and close this process's sampler (a test's model, a finished run)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.close()
    _ACTIVE = None
