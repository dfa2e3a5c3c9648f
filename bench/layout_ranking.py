"""The layout search's ranking against measured runs: does the layout the planner
predicts fastest train fastest?

For each model, every layout of 2 ranks that the search finds fitting this machine
(``layout_search(..., every=True)``: each degree, pipeline schedule and checkpointing
mode; one micro-batch, since accumulation is another batch shape, not a layout) is
run as printed, one after another in this process's run, as ordinary ``train.py``
runs (``bench.step_time_vs_measured.run``: one thread per rank, a few steps). Per
model: Kendall's tau between the predicted and the measured tokens/s (scipy), and
whether the predicted fastest is the measured fastest or within 5% of it.

    python -m bench.layout_ranking [--models gpt llama moe] [--steps 8] [--rounds 2]
        [--max-drift 0.1 [--tries 3]] [--append-docs]
"""

from __future__ import annotations

import argparse

from scipy.stats import kendalltau

from bench.common import publish, rounds_order
from bench.step_time_vs_measured import run, steady
from src.config.validate import validate
from src.harness import compose_config
from src.planner.constants import machine_budget_bytes
from src.planner.layouts import layout_search

WORLD = 2
#: model -> overrides (each ~1M parameters: a few seconds a run).
MODELS = {
    "gpt": [],
    "llama": ["model=llama_tiny"],
    "moe": ["model=moe_tiny"],
    "hf": ["model=hf", "model.config=tiny_qwen2", "model.block_size=128"],
}
_RUN = ["data=synthetic", "logger=none", f"trainer.devices={WORLD}"]


def layouts(model: list[str]) -> list:
    """The layouts of :data:`WORLD` ranks that fit, with one micro-batch."""
    resolved = validate(compose_config(*_RUN, *model))
    found, _ = layout_search(resolved, WORLD, machine_budget_bytes(WORLD), every=True)
    return [lay for lay in found if "trainer.grad_accum" not in lay.overrides]


def measure(
    name: str,
    steps: int,
    rounds: int = 1,
    max_drift: float | None = None,
    tries: int = 3,
) -> tuple[list[dict], dict]:
    """Each layout's predicted and measured tokens/s, and the model's verdict. With
    ``rounds`` > 1 the list runs again, every other round in reverse order, and a
    layout's figure is its best (:func:`~bench.common.rounds_order`); with
    ``max_drift`` each run is made steady
    (:func:`~bench.step_time_vs_measured.steady`)."""
    found = layouts(MODELS[name])
    best: dict[int, float] = {}
    predicted: dict[int, float] = {}
    for r, i in rounds_order(len(found), rounds):
        overrides = [
            *MODELS[name],
            *found[i].args().split(),
            f"trainer.devices={WORLD}",
        ]
        summary, _, _ = steady(
            lambda o=overrides: (run(o, steps), {"layout": " ".join(o)}),
            overrides,
            max_drift,
            tries,
        )
        best[i] = max(best.get(i, 0.0), summary["tokens_per_s"])
        predicted[i] = summary["predicted_tokens_per_s"]
        print({"model": name, "round": r + 1, "layout": found[i].args(),
               "measured tokens/s": round(summary["tokens_per_s"])}, flush=True)  # fmt: skip
    rows = []
    for i, lay in enumerate(found):
        rows.append({
            "model": name,
            "layout": lay.args() or "(as set)",
            "predicted tokens/s": round(predicted[i]),
            "measured tokens/s": round(best[i]),
            "measured / predicted": round(best[i] / predicted[i], 2),
        })  # fmt: skip
    predicted = [r["predicted tokens/s"] for r in rows]
    measured = [r["measured tokens/s"] for r in rows]
    tau = kendalltau(predicted, measured).statistic
    best_predicted = measured[predicted.index(max(predicted))]
    verdict = {
        "model": name,
        "layouts": len(rows),
        "Kendall tau": round(float(tau), 2),
        "predicted fastest, measured": f"{best_predicted / max(measured):.0%} of the fastest",
    }  # fmt: skip
    return rows, verdict


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=["gpt", "llama", "moe"]
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each layout (its best kept)"
    )
    parser.add_argument(
        "--max-drift",
        type=float,
        default=None,
        help="run a layout again while the prediction from its ops timed again just "
        "after moved more than this share (bench.step_time_vs_measured)",
    )
    parser.add_argument("--tries", type=int, default=3)
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)
    rows, verdicts = [], []
    for name in args.models:
        got, verdict = measure(
            name, args.steps, args.rounds, args.max_drift, args.tries
        )
        rows += got
        verdicts.append(verdict)
        print(verdict, flush=True)
    note = "; ".join(
        f"{v['model']}: tau {v['Kendall tau']} over {v['layouts']} layouts, the "
        f"predicted fastest {v['predicted fastest, measured']}"
        for v in verdicts
    )
    print(note)
    publish(
        rows,
        "Layout search: predicted against measured ranking, 2 ranks",
        note,
        bench="layout_ranking",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
