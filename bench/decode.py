"""Decoding with the KV cache vs recomputing the window each step (src/models/generate.py).

``python -m bench.decode [--write]``: GPT and Llama at a 256-token window, 2 sequences,
a 16-token prompt and 240 new tokens (the whole window), greedy; wall time of each
way in the same process, best of ``--repeats``, and the ratio. Both give the same
tokens (checked here too). ``--write`` appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import append_to_benchmarks
from src.models import get_spec
from src.models.generate import generate

SHAPES = {
    "gpt": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=256, block_size=256),
    "llama": dict(
        dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
        multiple_of=64, max_seq_len=256, rope_theta=1e4,
    ),
}  # fmt: skip


def timed(repeats: int, *args, **kwargs) -> tuple[float, torch.Tensor]:
    """The best wall time of ``generate(*args, **kwargs)`` and its tokens."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rows = [
        "| family | new tokens | KV cache s | recompute s | speed-up |",
        "|---|---|---|---|---|",
    ]
    for family, shape in SHAPES.items():
        spec = get_spec(family)
        config = spec.config_cls(**shape)
        model = spec.build(config, 0).eval()
        window = spec.seq_len(config)
        idx = torch.randint(
            0,
            256,
            (args.batch, args.prompt),
            generator=torch.Generator().manual_seed(0),
        )

        new = window - args.prompt
        run = (args.repeats, model, idx, new, window)
        cached_s, cached = timed(*run, temperature=0.0)
        plain_s, plain = timed(*run, temperature=0.0, kv_cache=False)
        assert torch.equal(cached, plain), (
            f"{family}: cached and recomputed tokens differ"
        )
        rows.append(
            f"| {family} | {new} | {cached_s:.2f} | {plain_s:.2f} | {plain_s / cached_s:.1f}x |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    print(table)
    if args.write:
        append_to_benchmarks(
            "Decoding: KV cache vs recomputing the window",
            "python -m bench.decode --write",
            table,
            "4 layers of width 256, a 256-token window (bench/decode.py SHAPES); "
            f"{args.batch} sequences, a {args.prompt}-token prompt, greedy, fp32, one "
            f"process, {torch.get_num_threads()} threads; best of {args.repeats}. Both "
            "ways give the same tokens (asserted). The machine was shared with other "
            "jobs: the ratio is the figure, the seconds are noisy.",
        )


if __name__ == "__main__":
    main()
