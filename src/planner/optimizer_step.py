"""The optimizer step's working set, a term of the estimate (issue 55).

The trainer's AdamW is torch's foreach implementation on every device
(src/trainer/optimizer.py ``build_optimizer``: ``foreach=True``). Per parameter group
it computes ``sqrt(exp_avg_sq)`` for all the group's tensors at once, a new tensor the
size of the group's local states, then divides and adds in place into the parameters:

    optimizer step transient = FOREACH_COPIES x local parameter bytes (fp32)

Assumption: one group holds nearly all the parameters (the decayed matrices; the
no-decay group's norms and biases are a small share), so the largest group's copy is
the whole local state; the other in-place foreach ops allocate nothing. Measured on
CPU (2 gloo ranks, 128 MiB of local parameters): 128 MiB above the step's other
parts with foreach against 48 MiB with torch's per-tensor loop (its largest tensor),
docs/benchmarks.md "foreach AdamW" below the speed history.
"""

from __future__ import annotations

import torch

from src.config.run_plan import RunPlan
from src.models import muon_matrices

FOREACH_COPIES = 1  # one fp32 copy of the local states: _foreach_sqrt(exp_avg_sq)

NOTE = "foreach AdamW: sqrt(exp_avg_sq) of all local states, one fp32 copy"


def optimizer_step_transient(local_param_bytes: int) -> int:
    """The update's temporaries, in bytes, on one rank holding ``local_param_bytes``
    of fp32 parameters (its shard; the whole model unsharded)."""
    return FOREACH_COPIES * local_param_bytes


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
