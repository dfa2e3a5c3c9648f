"""The optimizers torch lacks or cannot shard: Muon for the weight matrices and
AdamW for the rest in one optimizer (the Moonlight recipe: one state dict, one
scheduler, one distributed checkpoint), and Lion."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

# torch.optim.Muon's coefficients and learning-rate adjustment.
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _adjust_lr

#: A param group's flag: Muon updates its parameters (2-D matrices), AdamW the others.
MUON = "muon"
NS_STEPS = 5
NS_EPS = 1e-7


class MuonAdamW(torch.optim.AdamW):
    """AdamW whose groups flagged :data:`MUON` take Muon's update instead: momentum
    (Nesterov), the Newton-Schulz orthogonalised update, its learning rate scaled to
    AdamW's RMS (``match_rms_adamw``, so ``trainer.lr`` serves both), decoupled weight
    decay. A sharded matrix's update is orthogonalised whole: its gradient momentum
    is gathered on every rank (one all-gather of the matrix per step, the bytes of
    FSDP's forward all-gather) and each rank keeps its shard of the result."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _loss(closure)
        groups = self.param_groups
        try:  # AdamW's step over its own groups only
            self.param_groups = [g for g in groups if not g.get(MUON)]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group.get(MUON):
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(
                p, memory_format=torch.preserve_format
            )
            # AdamW.load_state_dict reads every parameter's step
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - momentum)
        update = p.grad.lerp(buf, momentum)  # Nesterov
        whole = update.full_tensor() if isinstance(update, DTensor) else update
        ortho = newton_schulz(whole).to(p.dtype)
        if isinstance(p, DTensor):  # this rank's shard, sliced locally (no scatter)
            ortho = distribute_tensor(
                ortho, p.device_mesh, p.placements, src_data_rank=None
            )
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-_adjust_lr(lr, "match_rms_adamw", p.shape))


def _loss(closure) -> torch.Tensor | None:
    """An optimizer step's ``closure()``, with gradients, if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation of the whole matrix
    ``g``, in its own dtype: torch's runs in bf16, where a gradient that a sharded
    reduction rounded 1e-7 otherwise can flip a bf16 rounding and move a weight by
    1e-5 (fp32 training then differs from one rank's)."""
    x = g.T if g.size(0) > g.size(1) else g
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(
            x,
            torch.addmm(gram, gram, gram, beta=DEFAULT_B, alpha=DEFAULT_C),
            x,
            beta=DEFAULT_A,
        )
    return x.T if g.size(0) > g.size(1) else x


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the
    sign of an interpolated momentum, one state buffer (AdamW keeps two); every op is
    elementwise, so a shard's update is the whole tensor's, on any layout."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay=0.0):
        super().__init__(
            params, {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = _loss(closure)
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                avg = state["exp_avg"]
                update = avg.lerp(p.grad, 1 - beta1).sign_()
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr)
                avg.lerp_(p.grad, 1 - beta2)
        return loss
