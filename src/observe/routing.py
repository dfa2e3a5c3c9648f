"""Routing collapse: one line when a mixture-of-experts layer's busiest expert keeps
taking far more than its share of the tokens.

A router that sends (nearly) every token to the same expert trains on: the loss still
falls (the shared path and one expert learn), so nothing fails, and the other experts'
parameters are dead weight. The family's metrics already carry each layer's
``moe/layer{i}/load_max_over_mean`` (tokens of the busiest expert over the mean; at
most ``num_experts / top_k``, where every token picks that expert); this watch reads
them at each logged step and says, once per layer, when one stayed above
:data:`COLLAPSE_RATIO` for :data:`COLLAPSE_WINDOWS` log points in a row (a single
window above it is the noise of a small batch, or the first steps).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: An expert taking this many times its share of the assignments.
COLLAPSE_RATIO = 2.0
#: ... at this many consecutive logged steps.
COLLAPSE_WINDOWS = 3

_LAYER = re.compile(r"moe/layer(-?\d+)/load_max_over_mean")


@dataclass
class RoutingWatch:
    """Counts, per layer, the consecutive logged steps above the ratio."""

    ratio: float = COLLAPSE_RATIO
    windows: int = COLLAPSE_WINDOWS
    above: dict[int, int] = field(default_factory=dict)
    collapsed: dict[int, dict] = field(default_factory=dict)  # layer -> when, how

    def see(self, row: dict, step: int) -> list[str]:
        """Read a logged row; the lines for the layers that have just collapsed."""
        lines = []
        for key, value in row.items():
            found = _LAYER.fullmatch(key)
            if not found:
                continue
            layer = int(found.group(1))
            run = self.above.get(layer, 0) + 1 if value > self.ratio else 0
            self.above[layer] = run
            if run == self.windows and layer not in self.collapsed:
                self.collapsed[layer] = {"step": step, "max_over_mean": value}
                lines.append(
                    f"step {step}: MoE routing collapsed in layer {layer}: its busiest "
                    f"expert took {value:.2f}x its share of the tokens at the last "
                    f"{self.windows} logged steps (above {self.ratio:g}x); raise "
                    "model.aux_loss_coef or model.bias_update_rate, or see "
                    "docs/models.md (routing balance)"
                )
        return lines

    def metrics(self) -> dict:
        """``moe/collapsed_layers`` (how many so far), for the row and the summary."""
        return {"moe/collapsed_layers": len(self.collapsed)} if self.above else {}
