"""The planner's grid over the layouts issue 56 found under-predicted: native MoE with
expert parallelism (top-k, experts, capacity, sequence length, accumulation,
checkpointing, EP / TP / HSDP degrees), context parallelism (sequence 1024-4096,
accumulation, checkpointing, with FSDP2 / TP), float8 (``sharding.policy=block``)
and their combinations, plus the dense twins the issue named. Shapes no test uses
(tests/ use the default moe_tiny, llama_tiny and GPT shapes).

    python -m bench.plan_vs_measured --ordinary --grid [--jobs 2] [--measured FILE]
"""

from __future__ import annotations

_BASE = ["data=synthetic", "logger=none"]


def _moe(dim: int, layers: int, seq: int, batch: int, ranks: int, *more: str):
    return [*_BASE, "model=moe_tiny", f"model.dim={dim}", f"model.n_layers={layers}",
            f"model.moe_hidden_dim={dim}", f"model.shared_hidden_dim={dim}",
            f"model.max_seq_len={seq}", f"trainer.batch_size={batch}",
            f"trainer.devices={ranks}", *more]  # fmt: skip


def _llama(dim: int, layers: int, seq: int, batch: int, ranks: int, *more: str):
    return [*_BASE, "model=llama_tiny", f"model.dim={dim}", f"model.n_layers={layers}",
            f"model.max_seq_len={seq}", f"trainer.batch_size={batch}",
            f"trainer.devices={ranks}", *more]  # fmt: skip


def _gpt(layers: int, width: int, seq: int, batch: int, ranks: int, *more: str):
    return [*_BASE, "model=small", "model.vocab_size=256", "model.n_head=4",
            f"model.n_layer={layers}", f"model.n_embd={width}",
            f"model.block_size={seq}", f"trainer.batch_size={batch}",
            f"trainer.devices={ranks}", *more]  # fmt: skip


EP2, EP4 = "sharding.expert_parallel=2", "sharding.expert_parallel=4"
CP2 = "sharding.context_parallel=2"
PP2 = "sharding.pipeline_parallel=2"
AC = "sharding.activation_checkpointing=full"
ACC2 = "trainer.grad_accum=2"
F8 = ["precision=float8", "sharding.policy=block"]
BF16 = "precision=bf16_mixed"


def _k(k: int) -> str:
    return f"model.top_k={k}"


def _e(e: int) -> str:
    return f"model.num_experts={e}"


def _cap(c: float) -> str:
    return f"model.capacity_factor={c}"


GRID: dict[str, list[str]] = {
    # native MoE, expert parallelism
    "moe 128x2 EP2 seq 512 top-2": _moe(128, 2, 512, 8, 2, EP2),
    "moe 128x2 EP2 seq 512 top-1 16e": _moe(128, 2, 512, 8, 2, EP2, _e(16), _k(1),
                                           "model.shared_hidden_dim=0"),
    "moe 128x2 EP2 seq 512 top-4 16e": _moe(128, 2, 512, 8, 2, EP2, _e(16), _k(4)),
    "moe 128x2 EP2 seq 1024 top-2": _moe(128, 2, 1024, 4, 2, EP2),
    "moe 128x2 EP2 seq 256 top-2 batch 16": _moe(128, 2, 256, 16, 2, EP2),
    "moe 128x2 EP2 seq 512 capacity 1.0 top-1": _moe(128, 2, 512, 8, 2, EP2, _cap(1.0),
                                                    _k(1)),
    "moe 128x2 EP2 seq 512 capacity 1.25": _moe(128, 2, 512, 8, 2, EP2, _cap(1.25)),
    "moe 128x2 EP2 capacity 1.0 top-4 16e": _moe(128, 2, 512, 8, 2, EP2, _cap(1.0),
                                                _e(16), _k(4)),
    "moe 128x2 EP2 seq 512 accum 2": _moe(128, 2, 512, 16, 2, EP2, ACC2),
    "moe 128x4 EP2 AC full": _moe(128, 4, 512, 8, 2, EP2, AC),
    "moe 128x4 EP2 x FSDP2 AC full every 2": _moe(
        128, 4, 512, 8, 4, EP2, AC, "sharding.activation_checkpointing_every=2"),
    "moe 192x3 EP2 x FSDP2, 4 ranks": _moe(192, 3, 512, 8, 4, EP2),
    "moe 128x2 EP4, 4 ranks": _moe(128, 2, 512, 8, 4, EP4),
    "moe 128x2 EP4 64e top-2": _moe(128, 2, 256, 8, 4, EP4, _e(64)),
    "moe 128x2 EP2 x TP2": _moe(128, 2, 512, 8, 4, EP2, "sharding.tensor_parallel=2"),
    "moe 128x2 HSDP 2 x EP2": _moe(128, 2, 512, 8, 4, EP2, "sharding.replicate=2"),
    "moe 128x2 EP2 bf16": _moe(128, 2, 512, 8, 2, EP2, BF16),
    "moe 128x2 FSDP2 no EP seq 512": _moe(128, 2, 512, 8, 2),
    "moe 128x2 EP2 seq 512 sigmoid aux-free": _moe(128, 2, 512, 8, 2, EP2,
                                              "model.score_func=sigmoid",
                                              "model.load_balance=aux_free"),
    # context parallelism
    "llama 4x256 seq 2048 CP2 accum 2": _llama(256, 4, 2048, 4, 2, CP2, ACC2),
    "llama 4x256 seq 2048 CP2 x FSDP2": _llama(256, 4, 2048, 8, 4, CP2),
    "llama 2x256 seq 4096 CP2": _llama(256, 2, 4096, 2, 2, CP2),
    "llama 4x256 seq 1024 CP2 AC full": _llama(256, 4, 1024, 8, 2, CP2, AC),
    "llama 4x256 seq 2048 CP2 bf16": _llama(256, 4, 2048, 4, 2, CP2, BF16),
    "gpt 4x256 seq 2048 CP2 x FSDP2 accum 2": _gpt(4, 256, 2048, 8, 4, CP2, ACC2),
    "gpt 4x256 seq 1024 CP2": _gpt(4, 256, 1024, 4, 2, CP2),
    "gpt 2x256 seq 4096 CP2": _gpt(2, 256, 4096, 2, 2, CP2),
    "llama 4x256 seq 2048 CP2 x TP2": _llama(256, 4, 2048, 4, 4, CP2,
                                             "sharding.tensor_parallel=2"),
    # float8 (the block policy, where float8 trains)
    "gpt 4x256 float8 seq 512": _gpt(4, 256, 512, 8, 2, *F8),
    "gpt 6x384 float8 seq 256": _gpt(6, 384, 256, 8, 2, *F8),
    "gpt 4x512 float8 seq 256, 4 ranks": _gpt(4, 512, 256, 8, 4, *F8),
    "llama 4x256 float8 seq 1024": _llama(256, 4, 1024, 4, 2, *F8),
    "llama 4x384 float8 accum 2": _llama(384, 4, 512, 8, 2, *F8, ACC2),
    "gpt 4x256 float8 AC full": _gpt(4, 256, 512, 8, 2, *F8, AC),
    "gpt 4x256 float8 rowwise": _gpt(4, 256, 512, 8, 2, *F8,
                                     "precision.recipe=rowwise"),
    # combinations
    "gpt 4x256 seq 1024 CP2 AC full": _gpt(4, 256, 1024, 4, 2, CP2, AC),
    "moe 128x4 EP2 AC full accum 2": _moe(128, 4, 512, 8, 2, EP2, AC, ACC2),
    "llama 4x256 CP2 float8": _llama(256, 4, 1024, 4, 2, CP2, *F8),
    "gpt 4x256 float8 HSDP 2x2": _gpt(4, 256, 512, 8, 4, *F8, "sharding.replicate=2"),
    "moe 128x2 EP2 float8": _moe(128, 2, 512, 8, 2, EP2, *F8),
    "gpt 4x256 float8 PP2 x FSDP2, 4 ranks": _gpt(4, 256, 512, 8, 4, *F8, PP2),
    "llama 4x256 float8 PP2 x TP2, 4 ranks": _llama(256, 4, 512, 8, 4, *F8, PP2,
                                                    "sharding.tensor_parallel=2"),
    "moe 128x2 EP4 float8, 4 ranks": _moe(128, 2, 512, 8, 4, EP4, *F8),
    # dense twins (issue 56)
    "gpt 6x1024 seq 64": _gpt(6, 1024, 64, 16, 2),
    "llama 4x256 seq 2048": _llama(256, 4, 2048, 4, 2),
    "llama 6x512 bf16": _llama(512, 6, 256, 8, 2, BF16),
    "gpt 6x512 bf16": _gpt(6, 512, 256, 8, 2, BF16),
}  # fmt: skip

#: The grid's dense rows (the rest are EP, CP, float8 or combined).
DENSE = {"gpt 6x1024 seq 64", "llama 4x256 seq 2048", "llama 6x512 bf16",
         "gpt 6x512 bf16"}  # fmt: skip
