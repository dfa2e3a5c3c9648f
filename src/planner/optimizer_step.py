"""The optimizer step's working set, a term of the estimate (issues 55, 58).

The trainer's AdamW is torch's fused implementation on every device
(src/trainer/optimizer.py ``build_optimizer``: ``fused=True``): one kernel per tensor
updates the parameter and both states in place, so the step allocates nothing beyond
them. Lion and Muon (src/trainer/optimizers.py) loop over tensors in Python, each
update a new tensor the size of its parameter (Muon's also gathered whole), planned
as before at one fp32 copy of the local states, an upper bound:

    optimizer step transient = STEP_COPIES[optimizer] x local parameter bytes (fp32)

Measured on CPU (docs/benchmarks.md, "fused AdamW" and "foreach AdamW"): over 128
MiB of local parameters on 2 gloo ranks, foreach's copy was 128 MiB above the step's
other parts and torch's per-tensor loop 48 MiB (its largest tensor); over two steps
of 80 MiB of parameters fused's resident-set peak was 82 MiB below foreach's and
129 MiB below the loop's.
"""

from __future__ import annotations

import torch

from src.config.run_plan import RunPlan
from src.models import muon_matrices

#: ``trainer.optimizer`` -> fp32 copies of the local states its update allocates.
STEP_COPIES = {"adamw": 0, "muon": 1, "lion": 1}

NOTES = {
    "adamw": "fused AdamW: each tensor updated in place, no temporaries",
    "muon": "Muon: each matrix's update a new tensor (and gathered whole); at most "
    "one fp32 copy of the local states",
    "lion": "Lion: each tensor's update a new tensor; at most one fp32 copy of the "
    "local states",
}


def optimizer_step_copies(plan: RunPlan) -> float:
    """Local-state copies the update allocates (:data:`STEP_COPIES`); fp16's gradient
    scaler keeps AdamW foreach (``_foreach_sqrt`` of a whole group: one copy)."""
    if plan.optimizer == "adamw" and plan.precision.needs_grad_scaler:
        return 1
    return STEP_COPIES[plan.optimizer]


def step_note(plan_optimizer: str, copies: float) -> str:
    """The estimate's note on the step's transient."""
    if plan_optimizer == "adamw" and copies:
        return (
            "foreach AdamW (fp16's gradient scaler): one fp32 copy of the local states"
        )
    return NOTES[plan_optimizer]


#: ``trainer.optimizer`` -> fp32 state buffers per trained parameter: AdamW's exp_avg
#: and exp_avg_sq, Lion's exp_avg; Muon's matrices keep one momentum buffer
#: (:data:`MUON_MATRIX_STATES`), its other parameters AdamW's two.
STATES = {"adamw": 2, "muon": 2, "lion": 1}
MUON_MATRIX_STATES = 1


def optimizer_states(plan: RunPlan) -> float:
    """State buffers per trained parameter, on average over the model: Muon's share of
    the parameters (its meta model's matrices, tied ones once) keeps one, the rest two."""
    states = STATES[plan.optimizer]
    if plan.optimizer != "muon":
        return states
    with torch.device("meta"):
        model = plan.spec.build(plan.model_config, 0)
    vocab = plan.spec.vocab_size(plan.model_config)
    matrices = muon_matrices(model, plan.spec.no_decay, vocab)
    numel = {id(p): p.numel() for p in model.parameters()}
    share = sum(numel[i] for i in matrices) / max(1, sum(numel.values()))
    return states - share * (states - MUON_MATRIX_STATES)
