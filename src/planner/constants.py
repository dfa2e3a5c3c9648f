"""What the planner knows of machines: the calibrated runtime and process constants
(bench/plan_vs_measured.py, docs/benchmarks.md) and this machine's memory. The
accelerators a budget can name, and a budget in bytes, are resolved with the run plan
(src/config/run_plan.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from src.sharding import GIB, MIB


def available_memory() -> tuple[int, str]:
    """Memory this machine has for a run, and what it is: one GPU's (each rank has
    its own), else the RAM available to new processes (``MemAvailable``: free memory
    and the caches the kernel gives back), which all local ranks share."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"{torch.cuda.get_device_name(0)}'s memory"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable"
    except (OSError, KeyError, ValueError):
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 8 * GIB
        return avail, "free memory"


def machine_budget_bytes(world: int) -> int:
    """Memory one rank may use on this machine: the GPU's, else available RAM / ranks
    (:func:`available_memory`)."""
    have, _ = available_memory()
    return have if torch.cuda.is_available() else have // max(1, world)


#: What training adds above the parts the estimate counts (code and kernels first
#: touched by backward and the optimizer, gloo buffers, autograd bookkeeping), per
#: device type and compute-dtype width. CPU: measured, fitted to
#: bench/plan_vs_measured.py (the mean residual of its configurations; peak RSS above
#: the process baseline, glibc retention removed, the model's classes built once on
#: meta before the baseline); bf16 on CPU adds ~12 MiB whatever the model size
#: (oneDNN's bf16 kernels and their scratch buffers). CUDA: assumed, not calibrated
#: yet (no GPU in the calibration runs): a margin for the allocator's cached blocks
#: and workspaces.
RUNTIME_BYTES: dict[str, dict[int, int]] = {
    "cpu": {4: 21 * MIB, 2: 33 * MIB},
    "cuda": {4: 512 * MIB, 2: 512 * MIB},
}


def runtime_bytes(device: str, param_bytes: int) -> int:
    """The calibrated runtime constant (:data:`RUNTIME_BYTES`)."""
    table = RUNTIME_BYTES.get(device, RUNTIME_BYTES["cuda"])
    return table.get(param_bytes, table[4])


#: The process itself before the model exists: Python + torch + the process group
#: + the model's code. CPU (measured): a train.py rank's resident set just before its
#: model is built (Hydra, the sinks' files, the data and logging set-up), its allocator
#: set as ranks set it (``trainer.malloc_mmap_threshold_kib``): 297 MiB, plus
#: ``torch._dynamo``, which the first step imports (~20 MiB): 316 MiB, the ranks
#: without the logger of bench/plan_vs_measured.py's ``--ordinary`` runs
#: (docs/benchmarks.md). The run's measure is memory in use (the resident set less
#: glibc's free heap, src/observe/live_memory.py, issue 56), so what the heap keeps
#: after a free (the 16 MiB this constant carried under the resident-set measure with
#: the 4 MiB threshold, issue 47) is not in it.
#: CUDA (assumed): the context, outside the allocator's counters.
PROCESS_BYTES: dict[str, int] = {"cpu": 316 * MIB, "cuda": 600 * MIB}

#: What a rank forked from the rank server (src/entry.py) holds less than one that
#: imported and composed itself, at the peak: the file-backed pages of the libraries
#: it imported that it has not touched again (a fork copies no page table entries of
#: shared file mappings; its anonymous memory is the same). CPU (measured, 2 ranks,
#: logger=none, 3 steps, a 0.2 ms poller of /proc/self/statm): model=tiny 0.287 GiB
#: in use forked, 53 MiB of it file-backed, against 0.338 with 103 MiB under
#: torchrun; before the model is built 258-261 MiB against 319-323 (tiny, the
#: default, llama_tiny, moe_tiny alike); Llama with CP2 and checkpointing 54 against
#: 105 MiB file-backed. CUDA: host memory is not counted there.
FORKED_RANK_SAVING: dict[str, int] = {"cpu": 48 * MIB}


#: What a model family's own imports (its spec's ``imports``) and the logger's
#: (``LoggerOption.imports``, rank 0) add to the process baseline, CPU resident set
#: (measured in the same ``--ordinary`` runs): transformers with its model classes
#: (an ``hf`` rank's baseline against a GPT rank's), wandb with its offline run (rank 0 against rank 1 at the peak,
#: rank 0 alone logs), and ``sharding.compile=true``'s inductor with its compiled
#: block graphs (regional: one graph per block class, whatever the width: GPT 4x256
#: and Llama dim 256 runs against the same runs uncompiled, +70 and +51 MiB at the
#: peak; a bare process: importing inductor ~45 MiB, the first compiled step ~52).
#: transformers: 80 MiB imported (the 30 more that its import left on the heap under
#: the resident-set measure are free heap, not in use: issue 56).
IMPORT_BYTES: dict[str, int] = {
    "transformers": 80 * MIB,
    # wandb 0.31.0 (2026-12-07): the default `python train.py` (2 ranks, 50 steps)
    # peaks 0.414 GiB in use with it, 0.327 with logger=none (+89 MiB; importing it
    # is 20 of them); 25 MiB was wandb's figure on 2026-12-03
    "wandb": 90 * MIB,
    "torch.compile": 60 * MIB,
    # precision=float8: torchao.float8 and its CPU float8 kernels, what a float8 run's
    # peak has above bf16_mixed's at the same shape on 2 ranks, less the float8
    # parts the estimate counts (default GPT +36.9 MiB, llama_tiny +34.8: under
    # 1 MiB of either is float8 weights; docs/planner.md)
    "torchao.float8": 35 * MIB,
    # model.lora: peft (its LoRA layers) imports transformers' model machinery and
    # torchao: a forked rank of a LoRA run against the same run without adapters,
    # +94 MiB in use at the peak, +112 with the gradients and AdamW state of the
    # frozen weights it no longer holds (Llama 4 x 256, 2 ranks; a bare process:
    # +142 MiB after torch alone, +122 after transformers)
    "peft": 112 * MIB,
}


#: Where each device's constants come from, said beside them in every estimate.
CONSTANTS_SOURCE: dict[str, str] = {
    "cpu": "CPU-measured, docs/benchmarks.md",
    "cuda": "assumed: not calibrated on a GPU yet",
}


def process_bytes(
    device: str, imports: Iterable[str] = (), forked: bool = False
) -> int:
    """The process baseline on ``device`` with the modules ``imports`` loaded (host
    memory: on CUDA only the context counts, outside the allocator), of a rank
    forked from the rank server when ``forked`` (:data:`FORKED_RANK_SAVING`)."""
    base = PROCESS_BYTES.get(device, PROCESS_BYTES["cuda"])
    if forked:
        base -= FORKED_RANK_SAVING.get(device, 0)
    return base + (
        sum(IMPORT_BYTES.get(m, 0) for m in imports) if device == "cpu" else 0
    )


#: Expert parallelism without capacity: the rows a rank receives are planned as this
#: factor times a balanced dispatch's (its own tokens' share of the assignments).
#: Nothing bounds them without capacity (up to ep times); 1.25 is the margin this
#: planner names and says, not a measurement: compare ``moe/load_max_over_mean`` of a
#: run (per expert; a rank averages its E / ep experts' loads).
EP_IMBALANCE = 1.25
