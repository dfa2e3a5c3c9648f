"""Packing by documents against stream packing (``data.packing``, docs/data.md):
tokens/s and MFU of a small GPT's training step at several sequence lengths, and
the planner's mask term against a measured run.

The corpus is the Python standard library's top-level definitions (each
``<stdlib>/*.py`` file split at its two blank lines, PEP 8's gap between top-level
definitions), byte-level, each document ending with the end token: short documents
(median under 1 KiB) with a long tail, so a 256-token window mostly holds one
document and a 2048-token one several.

Speed, in this process: ``model=small`` at ``model.block_size=T`` (fp32, AdamW),
``--tokens`` tokens a step in rows of T drawn from the stream; each packing runs the
model's own forward (``docs=`` the rows' document ids, the boundary targets dropped:
src/data/packing.py). The two packings alternate in paired windows of ``--steps``
steps (the first of each pair alternating too), after one warm-up step each; a
pair's ratio compares windows measured moments apart, so a change of the machine's
load moves both. MFU is tokens/s x the FLOPs a token counts (``flops_per_token`` at
the attention span: T for stream, the mean over tokens of their document's length
for documents, i.e. the sum of the documents' squared lengths over the tokens)
over the fp32 matmul peak measured before and after (the larger).

Memory (``--memory-seq``): ``python train.py`` on the same documents (a JSONL
corpus in a temporary directory) for each packing: the planner's peak
(``planned_peak_gib``) and the measured one (``peak_mem_gib``), and the planner's
named term for the documents' mask against the measured difference.

    python -m bench.documents [--seq-lens 256 1024 2048] [--tokens 4096] [--steps 3] [--pairs 3] [--memory-seq 2048] [--peak-seconds 1] [--append-docs]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from bench.common import publish

PACKINGS = ("stream", "documents")
ROOT = Path(__file__).resolve().parent.parent


def corpus() -> list[str]:
    """The standard library's top-level definitions, one document each."""
    docs = []
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py")):
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        docs += [p.strip("\n") for p in text.split("\n\n\n") if p.strip()]
    return docs


def token_stream(docs: list[str], eos: int) -> torch.Tensor:
    """The byte tokens of ``docs``, each followed by the end token."""
    out = bytearray()
    for doc in docs:
        out += doc.encode("utf-8") + bytes([eos])
    return torch.frombuffer(out, dtype=torch.uint8).long()


def batch(stream: torch.Tensor, rows: int, seq: int, seed: int):
    """``rows`` windows of ``seq`` + 1 tokens at random offsets: inputs, targets."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq - 1, (rows,), generator=gen)
    data = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def window(model, optimizer, x, y, docs, steps: int) -> float:
    """Seconds per training step over ``steps`` steps."""
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y, docs=docs)
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - t0) / steps


def speed_rows(seq: int, args: argparse.Namespace, stream) -> list[dict]:
    """One row per packing at sequence ``seq``: tokens/s (median over the paired
    windows), the counted attention, the FLOP/s it achieves (``achieved``, for
    MFU) and documents' paired ratio."""
    from src.data.packing import Documents
    from src.data.tokenizer import byte_tokenizer
    from src.harness import compose_config
    from src.models import get_spec

    spec = get_spec("gpt")
    cfg = spec.make_config(
        compose_config("model=small", f"model.block_size={seq}").model
    )
    documents = Documents(byte_tokenizer().eos_id)
    rows = max(1, args.tokens // seq)
    x, y = batch(stream, rows, seq, seed=seq)
    inputs = {
        "stream": (y, None),
        "documents": (documents.targets(x, y), documents.ids(x)),
    }
    span = {"stream": float(seq), "documents": documents.attention_span(x)}
    torch.manual_seed(0)
    model = spec.build(cfg, 0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for packing in PACKINGS:  # warm-up
        window(model, optimizer, x, *inputs[packing], 1)
    times: dict[str, list[float]] = {p: [] for p in PACKINGS}
    for pair in range(args.pairs):
        for packing in PACKINGS[:: 1 if pair % 2 == 0 else -1]:
            seconds = window(model, optimizer, x, *inputs[packing], args.steps)
            times[packing].append(seconds)
    ratios = [s / d for s, d in zip(times["stream"], times["documents"], strict=True)]
    out = []
    for packing in PACKINGS:
        tps = x.numel() / statistics.median(times[packing])
        fpt = spec.flops_per_token(cfg, span[packing])
        attention = fpt - spec.flops_per_token(cfg, 0)
        out.append(
            {
                "seq": seq,
                "packing": packing,
                "rows x seq": f"{rows} x {seq}",
                "docs/row": f"{float((documents.ids(x)[:, -1] + 1).float().mean()):.1f}",
                "span (keys/query)": f"{span[packing]:.0f}",
                "attn GFLOP/step": f"{attention * x.numel() / 1e9:.2f}",
                "GFLOP/step": f"{fpt * x.numel() / 1e9:.2f}",
                "tokens/s": f"{tps:,.0f}",
                "achieved": tps * fpt,
                "tokens/s vs stream (paired)": (
                    "1.00"
                    if packing == "stream"
                    else f"{statistics.median(ratios):.2f} "
                    f"({min(ratios):.2f}-{max(ratios):.2f})"
                ),
            }
        )
    return out


def memory_rows(seq: int, args: argparse.Namespace, docs: list[str]) -> list[dict]:
    """``python train.py`` for each packing at ``seq``: planned and measured peaks,
    and the planner's mask term against the measured difference."""
    out, planned, measured = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "defs.jsonl"
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        for packing in PACKINGS:
            run_dir = Path(tmp) / packing
            overrides = [
                "model=small", f"model.block_size={seq}", "data=files",
                f"data.paths={data}", f"data.cache_dir={tmp}/cache",
                f"data.packing={packing}", "sharding=none", "trainer.devices=1",
                f"trainer.batch_size={max(1, args.tokens // seq)}",
                "trainer.max_steps=2", "trainer.val_every=0", "trainer.ckpt_every=0",
                "trainer.progress=false", "trainer.peak_tflops=1", "logger=none",
                f"hydra.run.dir={run_dir}",
            ]  # fmt: skip
            subprocess.run(
                [sys.executable, "train.py", *overrides], cwd=ROOT, check=True
            )
            summary = json.loads((run_dir / "summary.json").read_text())
            planned[packing] = summary["planned_peak_gib"] * 1024
            measured[packing] = summary["peak_mem_gib"] * 1024
            term = _mask_term(overrides)
            out.append(
                {
                    "seq": seq,
                    "packing": packing,
                    "planned peak (MiB)": f"{planned[packing]:.0f}",
                    "measured peak (MiB)": f"{measured[packing]:.0f}",
                    "planned/measured": f"{planned[packing] / measured[packing]:.3f}",
                    "mask term (MiB)": f"{term:.1f}" if term else "-",
                }
            )
    out.append(
        {
            "seq": seq,
            "packing": "documents - stream",
            "planned peak (MiB)": f"{planned['documents'] - planned['stream']:.0f}",
            "measured peak (MiB)": f"{measured['documents'] - measured['stream']:.0f}",
            "planned/measured": "",
            "mask term (MiB)": "",
        }
    )
    return out


def _mask_term(overrides: list[str]) -> float:
    """The planner's named activations term for the documents' mask (MiB; 0 for
    stream packing), as the run's plan computes it."""
    from src.config.run_plan import resolve
    from src.harness import compose_config
    from src.models.memory import ActivationBytes
    from src.planner.activations import documents_activations
    from src.planner.inputs import build_meta_model, run_shape

    cfg = compose_config(*[o for o in overrides if not o.startswith("hydra.")])
    resolved = resolve(cfg)
    shape = run_shape(resolved, 1)
    zero = ActivationBytes(0, 0, 0, 0)
    model = build_meta_model(resolved)
    return documents_activations(resolved, shape, zero, model).saved / 2**20


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    p.add_argument("--steps", type=int, default=3, help="steps per window")
    p.add_argument("--pairs", type=int, default=3, help="paired windows")
    p.add_argument("--memory-seq", type=int, default=2048, help="0: no memory runs")
    p.add_argument("--peak-seconds", type=float, default=1.0)
    p.add_argument("--append-docs", action="store_true")
    args = p.parse_args(argv)
    from src.data.tokenizer import byte_tokenizer
    from src.observe.metrics import measure_matmul_flops

    docs = corpus()
    stream = token_stream(docs, byte_tokenizer().eos_id)
    cpu = torch.device("cpu")
    peak = measure_matmul_flops(cpu, torch.float32, args.peak_seconds)
    rows = [r for seq in args.seq_lens for r in speed_rows(seq, args, stream)]
    peak = max(peak, measure_matmul_flops(cpu, torch.float32, args.peak_seconds))
    for row in rows:  # over the larger peak, before or after
        row["MFU"] = f"{row.pop('achieved') / peak:.1%}"
    lengths = sorted(len(d.encode("utf-8")) + 1 for d in docs)
    note = (
        f"{len(docs)} documents (the stdlib's top-level definitions), median "
        f"{statistics.median(lengths):.0f} tokens, mean {statistics.mean(lengths):.0f}; "
        f"{torch.get_num_threads()} threads; fp32 matmul peak "
        f"{peak / 1e9:.0f} GFLOP/s. The attention FLOPs counted: 12 n_layer n_embd x "
        "span per token (fwd + bwd), span = T for stream and sum(len^2) / tokens for "
        "documents."
    )
    publish(
        rows,
        "Packing by documents: tokens/s and MFU",
        note,
        bench="documents",
        argv=argv,
        append=args.append_docs,
    )
    if args.memory_seq:
        memory = memory_rows(args.memory_seq, args, docs)
        publish(
            memory,
            "Packing by documents: the planner's mask term against a measured run",
            "python train.py, model=small, 2 steps, one rank (peak_mem_gib: memory "
            "in use from the model's build on, the process included).",
            bench="documents",
            argv=argv,
            append=args.append_docs,
        )
        rows += memory
    return rows


if __name__ == "__main__":
    main()
