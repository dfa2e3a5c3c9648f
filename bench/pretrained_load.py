"""Peak host memory per rank while loading a Hugging Face checkpoint: the trainer's
sharded load (``model=hf model.pretrained=DIR``) against transformers' own
``from_pretrained`` on every rank, in the same run.

A Llama-architecture model of at least ``--params-gb`` GiB (fp32) is built with
transformers and written by ``save_pretrained`` to a temporary directory. Then, in
fresh gloo ranks each:

- ``sharded``: the trainer's ``build_model`` (FSDP2, one unit per decoder layer): built
  on meta, sharded, then each rank reads only its slices of each tensor
  (``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``).
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR)``: the whole model on
  every rank (the baseline a user would otherwise write). Its tensors may stay mapped
  from the file until read, so after either load every value is read once.

Peak is VmHWM (resident set high-water mark) reset right before the load; baseline
the RSS after imports, the process group and a tiny warm-up load. The target: the
sharded peak near ``P/N`` plus one tensor (the largest, here the embedding).

    python -m bench.pretrained_load --append-docs
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.common import publish
from bench.init_memory import malloc_trim, rss_bytes
from src.harness import compose_config, run_distributed
from src.sharding import GIB

MODES = ("sharded", "transformers")


def llama_config(params_gb: float, hidden: int, vocab: int):
    """A transformers LlamaConfig with enough layers for ``params_gb`` GiB of fp32."""
    from transformers import LlamaConfig

    inter = 256 * round(8 * hidden / 3 / 256)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params_gb * GIB / 4 - 2 * vocab * hidden) / per_layer))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
    )


def _cfg(directory: str):
    return compose_config(
        "model=hf",
        f"model.pretrained={directory}",
        "sharding.policy=block",
        "logger=none",
    )


def _load(mode: str, directory: str):
    if mode == "transformers":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(directory)
    from src.build import build_model
    from src.config.run_plan import resolve
    from src.sharding import build_backend

    cfg = _cfg(directory)
    return build_model(resolve(cfg), build_backend("fsdp2", "fp32", "cpu"))


def _status_bytes() -> dict[str, int]:
    """RssAnon and RssFile of this process (bytes)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("RssAnon", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class PeakSampler:
    """The highest RssAnon (process-private memory) and RssFile (mapped file pages,
    here the safetensors being read) seen while inside, sampled every millisecond by a
    thread; VmHWM cannot tell the two apart."""

    def __enter__(self) -> PeakSampler:
        self.peak = _status_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            for key, value in _status_bytes().items():
                self.peak[key] = max(self.peak[key], value)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _measure(mode: str, directory: str, warmup_dir: str) -> dict:
    from src.observe.metrics import cpu_peak_rss_bytes, reset_peak_memory

    _load(mode, warmup_dir)  # lazy imports and first-use costs go to the baseline
    gc.collect()
    malloc_trim()
    baseline, anon0 = rss_bytes(), _status_bytes()["RssAnon"]
    reset_peak_memory(torch.device("cpu"))
    t0 = time.perf_counter()
    with PeakSampler() as sampled:
        model = _load(mode, directory)
        with torch.no_grad():  # read every value: transformers may leave them mmap'd
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).sum()
    load_s = time.perf_counter() - t0
    peak = cpu_peak_rss_bytes()
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
        for p in model.parameters()
    )
    return {
        "baseline": baseline,
        "peak": peak,
        "anon_extra": sampled.peak["RssAnon"] - anon0,
        "local": local,
        "load_s": load_s,
    }


def _rank(rank: int, world: int, mode: str, directory: str, warm: str) -> dict:
    return _measure(mode, directory, warm)


def run(mode: str, world: int, directory: str, warm: str) -> list[dict]:
    return run_distributed(_rank, world, mode, directory, warm, timeout=600)


def save(config, directory: Path, max_shard_size: str | None = None) -> int:
    """Build the model with transformers and ``save_pretrained`` it (in files of at
    most ``max_shard_size``, transformers' default if None); its parameters."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    n = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return n


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-gb", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="save_pretrained's file size limit, e.g. 128MB (default: one file)",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--append-docs", action="store_true")
    args = parser.parse_args(argv)

    config = llama_config(args.params_gb, args.hidden, args.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        big, warm = Path(tmp, "big"), Path(tmp, "warm")
        n = save(config, big, args.max_shard_size)
        tiny = llama_config(0.001, 64, 256)
        tiny.num_hidden_layers = 2
        save(tiny, warm)
        shards = list(big.glob("*.safetensors"))
        files = sum(f.stat().st_size for f in shards)
        param_bytes, largest = 4 * n, 4 * args.vocab * args.hidden
        ideal = param_bytes / args.ranks
        print(
            f"Llama {config.num_hidden_layers} layers x {args.hidden}, vocab "
            f"{args.vocab}: {n / 1e6:.0f}M params, {param_bytes / GIB:.2f} GiB fp32 "
            f"({files / GIB:.2f} GiB in {len(shards)} safetensors file(s)); largest tensor "
            f"{largest / 2**20:.0f} MiB; {args.ranks} ranks",
            flush=True,
        )
        rows = []
        for mode in args.modes:
            ranks = run(mode, args.ranks, str(big), str(warm))
            worst = max(ranks, key=lambda r: r["peak"] - r["baseline"])
            extra = worst["peak"] - worst["baseline"]
            anon = max(r["anon_extra"] for r in ranks)
            rows.append(
                {
                    "load": mode,
                    "VmHWM - baseline / rank (GiB)": f"{extra / GIB:.3f}",
                    "private (RssAnon) peak / rank (GiB)": f"{anon / GIB:.3f}",
                    "P/N + largest tensor (GiB)": f"{(ideal + largest) / GIB:.3f}",
                    "private / (P/N + largest)": f"{anon / (ideal + largest):.2f}",
                    "VmHWM / P": f"{extra / param_bytes:.2f}",
                    "params held / rank (GiB)": f"{worst['local'] / GIB:.3f}",
                    "load (s)": f"{worst['load_s']:.1f}",
                }
            )
            print(rows[-1], flush=True)
    publish(
        rows,
        f"Pretrained load: peak host memory per rank, {args.ranks} gloo ranks, "
        f"{param_bytes / GIB:.2f} GiB of fp32 parameters",
        f"A transformers Llama ({config.num_hidden_layers} layers x "
        f"{args.hidden}, vocab {args.vocab}, {n / 1e6:.0f}M params) written by "
        f"`save_pretrained` in {len(shards)} file(s); `sharded` = `model=hf model.pretrained=DIR` "
        "(FSDP2, one unit per decoder layer, built on meta, "
        "HuggingFaceStorageReader slices); `transformers` = "
        "`AutoModelForCausalLM.from_pretrained` on every rank, in the same run. "
        "VmHWM = resident high-water mark reset before the load: it also counts "
        "the safetensors pages mapped while they are read (page cache, shared "
        "and reclaimable); private = the highest RssAnon (process-private "
        "memory) sampled every 1 ms during the load, minus before "
        "(transformers keeps its parameters mapped from the file: they are "
        "resident as file pages, its VmHWM is the whole model, and the first "
        "optimizer step makes them private). Baseline = "
        "RSS after imports, process group and a tiny warm-up load. Worst rank shown; 1 thread per rank; shared "
        "2-core machine, noisy: compare the ratios, not the seconds.",
        bench="pretrained_load",
        argv=argv,
        append=args.append_docs,
    )
    return rows


if __name__ == "__main__":
    main()
