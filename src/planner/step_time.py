"""The step-time model: one optimizer step of a run plan on a device profile, term by
term (docs/planner.md, "The step-time model"). Formula work over the run plan, the
wrap plan's units and the family's FLOPs formula (``ModelSpec.flops_per_token``, the
one MFU divides by); nothing is traced or run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from src.config.run_plan import RunPlan
from src.models.memory import checkpointed_blocks
from src.planner import work
from src.planner.profiles import (
    GPU_LINKS,
    DeviceProfile,
    Link,
    collective,
    cpu_identity,
    cpu_threads,
    profile_for,
    work_cache,
)
from src.planner.search import n_blocks
from src.planner.tp_census import census
from src.sharding import WrapPlan
from src.sharding.backends import backend_class
from src.sharding.pipeline import bubble_fraction

#: Elements read or written per token by one block's norms and residual adds
#: (forward and backward), in units of its width: two norms (read x, write y: 4) and
#: two residual adds (read 2, write 1: 6) in forward, 10; backward reads what forward
#: wrote and writes the gradients, about twice that: 30. At the copy bandwidth.
ELEMENTWISE_PER_LAYER = 30
#: ... and by the loss per token, in units of the vocabulary, fp32: the logits
#: written, log-softmax read and written, backward read and written, the gradient of
#: the logits read by the head's matmul: 8.
ELEMENTWISE_LOSS = 8
#: The MLP's activation function's elements per token, in units of the width (GPT's
#: 4x hidden; Llama's SwiGLU about 3.5x: counted as 4), forward and backward at the
#: profile's activation bandwidth (5 tensor-widths moved per element).
ACTIVATION_PER_LAYER = 4
#: Bytes fused AdamW's step and the gradient-norm clip move per local parameter
#: (fp32): parameter, gradient and both moments read, parameter and moments written
#: (in place, no temporaries), the norm's read of the gradient and the clip's scaling
#: of it: 10 elements of 4 bytes.
OPTIMIZER_BYTES_PER_PARAM = 40
#: The accelerators with a datasheet profile, as said.
GPUS = ", ".join(name for name, *_ in GPU_LINKS)
#: DDP's gradient buckets (torch's default ``bucket_cap_mb``).
DDP_BUCKET_BYTES = 25 * 2**20
#: A step's all-reduced scalars (the loss with a stop flag per signal number, a
#: norm, a router's counts): a few hundred bytes, latency-bound.
STEP_SCALARS_BYTES = 256


@dataclass(frozen=True)
class ModelShape:
    """What the model's formula work needs of its shape."""

    layers: int
    width: int  # the hidden size
    vocab: int
    seq_len: int
    matmul_flops: float  # per token, forward and backward (6 N)
    attention_flops: float  # per token, forward and backward
    kv_width: int  # keys' (= values') width per layer (what CP gathers)
    moe_layers: int = 0
    top_k: int = 0

    @property
    def head_flops(self) -> float:
        """The output head's share of ``matmul_flops`` (6 V d)."""
        return 6.0 * self.vocab * self.width


def model_shape(resolved: RunPlan, layers: int) -> ModelShape:
    """The shape of ``resolved``'s model with ``layers`` blocks; the family's FLOPs
    formula split into matmuls (at sequence length 0) and attention (the rest)."""
    spec, config = resolved.spec, resolved.model_config
    seq = int(resolved.batch.seq_len)
    matmul = float(spec.flops_per_token(config, 0))
    attention = float(spec.flops_per_token(config, seq)) - matmul
    width = round(attention / (12 * layers * seq)) if layers and seq else 0
    routed = spec.expert_shape and spec.num_experts and spec.num_experts(config)
    experts = spec.expert_shape(config, seq) if routed else None
    return ModelShape(
        layers=layers,
        width=width,
        vocab=int(spec.vocab_size(config)),
        seq_len=seq,
        matmul_flops=matmul,
        attention_flops=attention,
        kv_width=int(spec.kv_width(config)) if spec.kv_width else width,
        moe_layers=experts.layers if experts else 0,
        top_k=experts.top_k if experts else 0,
    )


@dataclass(frozen=True)
class Term:
    """One line of the prediction: seconds per optimizer step, and how they come."""

    name: str
    seconds: float
    how: str
    #: the times a step's ranks meet in its collectives (where they wait for
    #: each other: the waiting line's count)
    syncs: float = 0.0


@dataclass
class StepTime:
    """A predicted step: its terms (the total is the step), the figures it gives."""

    terms: list[Term]
    total_s: float
    tokens_per_step: int
    world: int
    model_flops_per_rank: float  # per step, for MFU (no recomputation)
    peak_flops: float  # the profile's matmul rate a rank gets in the compute dtype
    profile: DeviceProfile
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_rank / self.total_s / self.peak_flops

    @property
    def source(self) -> str:
        """Which profile the figures come from, as said."""
        return f"{self.profile.name} ({self.profile.source})"

    def summary(self) -> dict[str, float]:
        """The figures summary.json records."""
        return {
            "predicted_step_time_s": self.total_s,
            "predicted_tokens_per_s": self.tokens_per_s,
        }

    def table(self) -> str:
        """The prediction, term by term, as plan-only prints it."""
        lines = [f"step time (predicted from {self.source}):"]
        for t in self.terms:
            lines.append(f"  {t.name:<34} {_ms(t.seconds):>12}  ({t.how})")
        lines.append(
            f"  {'step':<34} {_ms(self.total_s):>12}  {self.tokens_per_s:,.0f} "
            f"tokens/s, {self.tokens_per_s / self.world:,.0f} per device, MFU "
            f"{self.mfu:.1%}"
        )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _flops(flops: float, rate: float, dtype: str) -> str:
    return f"{flops / 1e9:,.2f} GFLOP at {rate / 1e9:,.1f} GFLOP/s {dtype}".rstrip()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


@dataclass(frozen=True)
class Rates:
    """What one rank of this run gets of the profile."""

    matmul: float  # FLOP/s in the compute dtype
    attention: float  # FLOP/s of causal attention, forward and backward
    memory: float  # bytes/s of a copy
    activation: float  # bytes/s of the activation function, forward and backward
    op_s: float
    traced_op_s: float  # per traced op, beyond its replay (src/planner/work.py)
    fsdp_unit_s: float  # per FSDP unit and micro-batch (the profile's, shared)
    dtensor_op_s: float  # per op DTensor dispatches under tensor parallelism
    dtensor_comm_s: float  # per collective DTensor sends, beyond its link
    dtensor_param_s: float  # per parameter tensor of the optimizer, as DTensors
    param_s: float  # per parameter tensor of the clip and optimizer step
    dtype: str
    threads: int
    notes: tuple[str, ...] = ()


def rank_rates(profile: DeviceProfile, world: int, dtype_bytes: int) -> Rates:
    """The matmul rate, bandwidth and op time one of ``world`` ranks gets (on a CPU:
    the ranks split the cores; more ranks than cores share them, each rate divided
    by the ranks per core, said)."""
    dtype = "fp32" if dtype_bytes >= 4 else "bf16"
    notes = []
    if dtype_bytes < 2:
        notes.append("float8 matmuls counted at the bf16 rate")
    threads, share = 1, 1.0
    if profile.cores:  # a CPU: the ranks split its cores
        threads = cpu_threads(world, profile.cores)
        share = min(1.0, profile.cores / (world * threads))
    if share < 1.0:
        notes.append(
            f"{world} ranks x {threads} thread(s) share {profile.cores} cores: each "
            f"rank gets 1/{1 / share:.3g} of {threads} thread(s)' rates"
        )
    if profile.cores and world > 2:
        notes.append("collectives as the probe measured them between 2 ranks")

    def rate(table: dict[int, float]) -> float:
        return profile.rate(table, threads) * share

    return Rates(
        rate(profile.matmul[dtype]),
        rate(profile.attention[dtype]),
        rate(profile.memory_bw),
        rate(profile.activation_bw),
        profile.op_s / share,
        profile.traced_op_s / share,
        profile.fsdp_unit_s / share,
        profile.dtensor_op_s / share,
        profile.dtensor_comm_s / share,
        profile.dtensor_param_s / share,
        profile.param_s / share,
        dtype,
        threads,
        tuple(notes),
    )


def _link(profile: DeviceProfile, kind: str, span: int) -> Link:
    """The link of a group whose ranks lie within ``span`` consecutive ranks (its
    size times the inner degrees' product): a node's when they fit one."""
    within = span <= profile.ranks_per_node
    return (profile.links if within else profile.inter_links)[kind]


def predict(
    resolved: RunPlan,
    plan: WrapPlan,
    profile: DeviceProfile,
    world: int | None = None,
    blocks: int | None = None,
) -> StepTime:
    """The step time of ``resolved`` on ``world`` ranks (default: its devices) with
    ``plan``'s units (a pipeline's: its worst stage's) on ``profile`` (``blocks``:
    the model's, where counted already)."""
    world = world or resolved.world_size
    shape = model_shape(resolved, blocks or n_blocks(resolved))
    step = _Step(resolved, plan, profile, world, shape)
    return step.result()


class _Step:
    """The terms of one step, computed once (:func:`predict`)."""

    def __init__(self, resolved, plan, profile, world, shape: ModelShape) -> None:
        self.r, self.plan, self.profile, self.world, self.m = (
            resolved, plan, profile, world, shape,
        )  # fmt: skip
        lay = resolved.layout
        self.lay = lay
        self.accum = int(resolved.batch.grad_accum)
        self.pp_micro = int(resolved.pipeline.microbatches) if lay.pp > 1 else 1
        self.tokens = int(resolved.batch.batch_size) * shape.seq_len
        self.pbytes = resolved.precision.param_dtype.itemsize
        if resolved.float8 is not None:
            self.pbytes = 1
        self.rbytes = resolved.precision.reduce_dtype.itemsize
        self.rates = rank_rates(profile, world, self.pbytes)
        # a micro-batch's tokens on one rank (a pipeline micro-batch's, pipelined)
        dp = max(1, lay.dp)
        self.micro_tokens = self.tokens / dp / lay.cp / self.accum / self.pp_micro
        self.micro = self.accum * self.pp_micro  # micro-batches a rank runs per step
        self.local_layers = shape.layers / lay.pp
        self.notes: list[str] = []
        # the compute outside the blocks (embeddings, head, loss), where timed
        self.head_s = 0.0
        self.tp = self._tp_census()

    def _tp_census(self):
        """The model's count of what tensor parallelism dispatches and sends
        (src/planner/tp_census.py); None without it, or, said, where the model does
        not run on the meta device."""
        if self.lay.tp <= 1:
            return None
        try:
            return census(self.r)
        except Exception as err:  # noqa: BLE001 - any model code may fail on meta
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            self.notes.append(
                "tensor parallelism's collectives and DTensor dispatch not counted: "
                f"the model does not run on the meta device ({first[:120]})"
            )
            return None

    # -- compute ------------------------------------------------------------------

    def compute_terms(self) -> list[Term]:
        timed = self._timed_terms()
        if timed is not None:
            return timed + self._dtensor_terms()
        m, rates = self.m, self.rates
        per_rank = self.tokens / self.world
        mm = m.matmul_flops * per_rank
        att = m.attention_flops * per_rank
        elem, act = self._elementwise_bytes(), self._activation_bytes()
        terms = [
            Term("matmuls", mm / rates.matmul, _flops(mm, rates.matmul, rates.dtype)),
            Term("attention", att / rates.attention, _flops(att, rates.attention, "")),
            Term(
                "activation function",
                act / rates.activation,
                f"{act / 2**20:,.1f} MiB at {rates.activation / 1e9:,.2f} GB/s",
            ),
            Term(
                "norms, residuals, loss",
                elem / rates.memory,
                f"{elem / 2**20:,.1f} MiB at {rates.memory / 1e9:,.1f} GB/s",
            ),
        ]
        terms += self._recompute(mm - m.head_flops * per_rank, att, act)
        block, outside = self.r.spec.forward_ops
        ops = self.micro * (block * self.local_layers + outside)
        terms.append(
            Term(
                "op dispatch",
                ops * rates.op_s,
                f"{ops:,.0f} ops x {rates.op_s * 1e6:.1f} us",
            )
        )
        return terms + self._dtensor_terms()

    def _dtensor_terms(self) -> list[Term]:
        each, tp = self.rates.dtensor_op_s, self.tp
        if tp is None or not each:
            return []
        ops = self.micro * tp.dtensor_ops / self.lay.pp
        return [
            Term(
                "DTensor dispatch (TP)",
                ops * each,
                f"{ops:,.0f} ops on DTensors x {each * 1e6:,.1f} us (the probe's)",
            )
        ]

    def _timed_terms(self) -> list[Term] | None:
        """On a probed CPU whose cores the ranks do not share: the model's own ops
        of one micro-batch, timed here (src/planner/work.py), times the micro-batches
        a rank runs; under CP each rank's queries meet the whole sequence's keys
        (its attention ``cp`` times the local sequence's)."""
        p, r, lay = self.profile, self.r, self.lay
        if not (p.cores and p.traced_op_s) or self.world > p.cores:
            return None
        micro_batch = int(r.batch.batch_size) // max(1, lay.dp) // self.micro
        seq = self.m.seq_len // lay.cp
        if micro_batch < 1 or seq < 1:
            return None
        dtype = torch.float32 if self.pbytes >= 4 else torch.bfloat16
        threads = self.rates.threads
        # the run's other ranks on this machine compute beside each one
        neighbours = min(self.world, p.cores // threads) - 1
        path = work_cache(cpu_identity(), threads, neighbours)
        times = work.op_times(path, threads, neighbours)
        try:
            total = work.micro_batch_work(
                r, micro_batch, seq, dtype, r.checkpointing.mode, times, self._counted
            )
        except Exception:  # a model the fake tensors cannot trace: the formula's
            return None
        times.save()
        if lay.ep > 1:
            self.notes.append(
                "the experts' ops timed as one rank runs all of them (the same "
                "FLOPs; expert parallelism's shapes are not traced)"
            )
        per_op, sampled = total["per_op"], total["sampled_per_op"]
        total = {k: v * self.micro for k, v in total.items()}
        total["attention"] *= lay.cp
        self.head_s = total["head"]
        n_ops, each = total["ops"], per_op or self.rates.traced_op_s
        whose = "this model's, run here" if per_op else "the probe's"
        how = f"{total['distinct'] / self.micro:,.0f} distinct ops of the model timed"
        how += " on this CPU"
        terms = [
            Term("matmuls", total["matmul"], how),
            Term("attention", total["attention"], "its ops timed" + (
                f", x {lay.cp} (CP: queries against the whole sequence)"
                if lay.cp > 1 else "")),
            Term("other ops", total["other"], "norms, activations, loss, routing: "
                 "timed"),
            Term("autograd and modules", n_ops * each,
                 f"{n_ops:,.0f} ops x {each * 1e6:.1f} us ({whose})"),
        ]  # fmt: skip
        if sampled and r.log_every > 0:
            terms.append(
                Term("memory sampling (logged steps)", n_ops * sampled / r.log_every,
                     f"{n_ops * sampled * 1e3:,.2f} ms in 1 step of "
                     f"trainer.log_every={r.log_every} (this model's hooks, run here)")
            )  # fmt: skip
        return terms

    def _counted(self, call: work.OpCall) -> float:
        """An op not run: FLOPs at the matmul rate, bytes at the copy bandwidth."""
        rates = self.rates
        return call.flops() / rates.matmul + call.nbytes() / rates.memory + rates.op_s

    def _recompute(self, blocks_mm: float, att: float, act: float) -> list[Term]:
        """Checkpointing's second forward of its blocks (a third of their work:
        forward is 1 of forward + backward's 3): ``full`` all of it, ``selective``
        the activation function's (the matmul and attention outputs are kept)."""
        ck, rates, layers = self.r.checkpointing, self.rates, self.m.layers
        share = sum(checkpointed_blocks(layers, ck.mode, int(ck.every)))
        share /= max(1, layers)
        if ck.mode == "none" or not share:
            return []
        act_s = act * share * 2 / 5 / rates.activation  # forward: 2 of its 5 widths
        if ck.mode == "selective":
            return [Term("recompute (checkpointing)", act_s, "selective: the "
                         "activation function's forward again")]  # fmt: skip
        work = blocks_mm * share / 3 / rates.matmul + att * share / 3 / rates.attention
        return [
            Term(
                "recompute (checkpointing)",
                work + act_s,
                f"full, {share:.0%} of blocks: their forward again",
            )
        ]

    def _layer_tokens(self) -> float:
        """Tokens one rank's blocks see per step (tp ranks split their width)."""
        return self.tokens / max(1, self.lay.dp) / self.lay.cp * self.local_layers

    def _activation_bytes(self) -> float:
        width = ACTIVATION_PER_LAYER * self.m.width / self.lay.tp
        return self._layer_tokens() * width * 5 * self.pbytes

    def _elementwise_bytes(self) -> float:
        m, lay = self.m, self.lay
        blocks = self._layer_tokens() * ELEMENTWISE_PER_LAYER * m.width * self.pbytes
        loss = ELEMENTWISE_LOSS * m.vocab / lay.tp * 4
        return blocks + self.tokens / max(1, lay.dp) / lay.cp * loss

    def optimizer_terms(self) -> list[Term]:
        local = self.plan.bytes_per_rank() / 4
        nbytes = OPTIMIZER_BYTES_PER_PARAM * local
        terms = [
            Term(
                "optimizer step",
                nbytes / self.rates.memory,
                f"AdamW and clipping over {local / 1e6:,.2f}M local parameters",
            )
        ]
        tensors = sum(u.tensors for u in self.plan.units)
        if self.rates.param_s and tensors:
            terms.append(
                Term("optimizer per tensor", tensors * self.rates.param_s,
                     f"{tensors} parameter tensors x {self.rates.param_s * 1e6:,.1f} "
                     "us: clip, fused AdamW, zeroing (the probe's)")
            )  # fmt: skip
        each = self.rates.dtensor_param_s
        dtensors = backend_class(self.r.backend).dtensor_parameters or self.lay.tp > 1
        if each and dtensors and tensors:
            terms.append(
                Term("optimizer on DTensors", tensors * each,
                     f"{tensors} parameter tensors x {each * 1e6:,.0f} us (the "
                     "probe's)")
            )  # fmt: skip
        return terms

    # -- communication --------------------------------------------------------------

    def fsdp_comm(self, compute_s: float) -> list[tuple[float, float, int]]:
        """Per unit: (all-gather seconds, reduce-scatter seconds, collectives) per
        step; where the profile measured them beside compute, the share of a
        unit's collectives its compute (``compute_s`` split by parameters, as
        prefetching spreads them) runs beside moves at that bandwidth."""
        r, lay, p = self.r, self.lay, self.profile
        n = lay.fsdp_shard if _shards(r.backend) else 1
        if n <= 1:
            return []
        sync_every = str(r.batch.grad_sync) == "every" or self.accum == 1
        scatters = self.accum if sync_every else 1
        reshard = r.unit.reshard_after_forward is not False
        span = n * lay.tp  # the shard ranks lie outside the tp ranks
        ag, rs = _link(p, "all_gather", span), _link(p, "reduce_scatter", span)
        links = [(ag, rs)]
        if p.fsdp_bandwidth:  # as FSDP meets them, its copies in (the CPU probe)
            links = [
                (Link(ag.latency_s, bw), Link(rs.latency_s, bw))
                for bw in (
                    p.fsdp_bandwidth,
                    p.fsdp_loaded_bandwidth or p.fsdp_bandwidth,
                )
            ]
        total = sum(u.local_numel for u in self.plan.units) or 1
        out = []
        each: dict[tuple, tuple[float, float, int]] = {}  # a 70B's 80 blocks: one
        for unit in self.plan.units:
            numel = unit.local_numel
            again = reshard and unit.path != "" and lay.pp == 1
            if (numel, again) not in each:
                gathers = self.micro * (2 if again else 1)
                times = [
                    (gathers * collective(g, "all_gather", n, numel * self.pbytes),
                     scatters * collective(s, "reduce_scatter", n, numel * self.rbytes))
                    for g, s in links
                ]  # fmt: skip
                free, busy = times[0], times[-1]  # without compute beside, with
                beside = min(1.0, compute_s * numel / total / max(sum(busy), 1e-12))
                gather, scatter = (
                    beside * b + (1 - beside) * f
                    for f, b in zip(free, busy, strict=True)
                )
                each[numel, again] = (gather, scatter, gathers + scatters)
            out.append(each[numel, again])
        return out

    def comm_terms(self) -> list[Term]:
        r, lay, p, m = self.r, self.lay, self.profile, self.m
        act = self.micro_tokens * m.width * self.pbytes  # one block input, one rank
        layers = self.local_layers
        terms = []
        if not _shards(r.backend) and lay.dp > 1:  # replicated: DDP
            terms.append(self._ddp())
        if _shards(r.backend) and lay.dp_replicate > 1:
            nbytes = self.plan.bytes_per_rank() / 4 * self.rbytes
            link = _link(p, "all_reduce", lay.stage_size)
            t = len(self.plan.units) * collective(
                link, "all_reduce", lay.dp_replicate, nbytes / len(self.plan.units)
            )
            terms.append(
                Term("HSDP all-reduce", t, f"{lay.dp_replicate} replicas",
                     syncs=len(self.plan.units))
            )  # fmt: skip
        terms += self._tp_comm()
        if lay.cp > 1:
            kv = 2 * self.micro_tokens * lay.cp * m.kv_width * self.pbytes
            each = collective(
                _link(p, "all_gather", lay.cp * lay.tp), "all_gather", lay.cp, kv
            )
            rs = _link(p, "reduce_scatter", lay.cp * lay.tp)
            each += collective(rs, "reduce_scatter", lay.cp, kv)
            terms.append(
                Term("CP K/V gathers", self.micro * layers * each,
                     "K and V gathered per block, their gradients reduce-scattered",
                     syncs=2 * self.micro * layers)
            )  # fmt: skip
        if lay.ep > 1 and m.moe_layers:
            sent = self.micro_tokens * m.top_k * m.width * self.pbytes * lay.ep
            link = _link(p, "all_to_all", lay.ep_shard * lay.tp * lay.cp)
            t = (
                self.micro
                * m.moe_layers
                / lay.pp
                * 4
                * collective(link, "all_to_all", lay.ep, sent)
            )
            # and the splits' own exchange before each dispatch
            syncs = self.micro * m.moe_layers / lay.pp * 5
            terms.append(
                Term("EP all-to-alls", t, "dispatch and combine, forward and backward",
                     syncs=syncs)
            )  # fmt: skip
        if lay.pp > 1:
            link = _link(p, "p2p", self.world)
            transfers = 2 if lay.pp == 2 else 4
            t = self.micro * transfers * collective(link, "p2p", 2, act)
            terms.append(Term("PP send/recv", t, f"{transfers} per micro-batch"))
            # (its stages' waits are its bubble: no syncs counted)
        return terms + self._step_all_reduces()

    def _tp_comm(self) -> list[Term]:
        """Tensor parallelism's collectives as the model sent them (its census, on 1
        row of the run's sequence in fp32: scaled to the rank's micro-batch and
        dtype; a pipeline stage's share of the model's), and the gradients left
        partial on the tp ranks, all-reduced once a step; each beyond its link's
        time costs the probe's ``dtensor_comm_s`` (a redistribution's own work and
        the ranks' waits at it)."""
        tp, lay, p = self.tp, self.lay, self.profile
        if tp is None:
            return []
        scale = self.micro_tokens / self.m.seq_len * self.pbytes / 4
        extra = self.rates.dtensor_comm_s
        links = {kind: _link(p, kind, lay.tp) for kind in tp.collectives}
        t = tp.comm_s(links, lay.tp, scale) + tp.sent * extra
        sent = [
            f"{n / lay.pp:,.0f} {kind.replace('_', '-')}s"
            for kind, (n, _) in tp.collectives.items()
        ]
        beyond = f" + {extra * 1e3:,.2f} ms each (the probe's)" if extra else ""
        terms = [
            Term("TP collectives", self.micro * t / lay.pp,
                 f"{', '.join(sent)} a micro-batch (counted on the model){beyond}",
                 syncs=self.micro * tp.sent / lay.pp)
        ]  # fmt: skip
        n, nbytes = tp.partial_grads
        if n:
            link = _link(p, "all_reduce", lay.tp)
            each = collective(link, "all_reduce", lay.tp, nbytes / n * self.rbytes / 4)
            terms.append(
                Term("TP gradient all-reduces", n / lay.pp * (each + extra),
                     f"{n / lay.pp:,.0f} replicated parameters' partial gradients",
                     syncs=n / lay.pp)
            )  # fmt: skip
        return terms

    def _step_all_reduces(self) -> list[Term]:
        """The trainer's small all-reduces once a step: the loss's mean with the stop
        check's flags; the gradient norm's, where the parameters are split across
        ranks (FSDP, TP, PP stages); a MoE's routing counts."""
        if self.world <= 1:
            return []
        parts = ["the loss and stop flags"]
        if _shards(self.r.backend) or self.lay.tp > 1 or self.lay.pp > 1:
            parts.append("the gradient norm")
        if self.m.moe_layers:
            parts.append("the routers' counts")
        link = _link(self.profile, "all_reduce", self.world)
        each = collective(link, "all_reduce", self.world, STEP_SCALARS_BYTES)
        return [
            Term("step all-reduces", len(parts) * each,
                 f"{len(parts)} x {each * 1e6:,.0f} us: {', '.join(parts)}",
                 syncs=len(parts))
        ]  # fmt: skip

    def _ddp(self) -> Term:
        lay, p = self.lay, self.profile
        nbytes = self.plan.bytes_per_rank() / 4 * self.rbytes
        buckets = max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))
        if p.ddp_bandwidth:  # as DDP meets it, its copies in (the 2-rank probe's)
            ring = 2 * (lay.dp - 1) / lay.dp  # 1 on the probe's 2 ranks
            once = buckets * p.ddp_bucket_s + ring * nbytes / p.ddp_bandwidth
        else:
            link = _link(p, "all_reduce", lay.stage_size)
            once = buckets * collective(link, "all_reduce", lay.dp, nbytes / buckets)
        every = str(self.r.batch.grad_sync) == "every"
        times = self.accum if every else 1
        return Term(
            "DDP all-reduce",
            times * once,
            f"{nbytes / 2**20:,.1f} MiB of gradients in {buckets} bucket(s), "
            f"{times} time(s) per step",
            syncs=times * buckets,
        )

    # -- the step ---------------------------------------------------------------

    def result(self) -> StepTime:
        compute = self.compute_terms()
        comm = self.comm_terms()
        compute_s = sum(t.seconds for t in compute)
        units = self.fsdp_comm(compute_s)
        terms = list(compute)
        if units:
            terms.append(self._fsdp_term(units, compute_s))
        if _shards(self.r.backend) and self.rates.fsdp_unit_s:
            # every unit's hooks run, its parameters sharded or not (HSDP's
            # replicas of one rank, TP's dp of 1)
            count = self.micro * len(self.plan.units)
            each = self.rates.fsdp_unit_s
            terms.append(
                Term("FSDP hooks and copies", count * each,
                     f"{count} unit passes x {each * 1e6:,.0f} us (the probe's)")
            )  # fmt: skip
        terms += comm
        # a pipeline's stages wait for each other in its bubble (below)
        if self.world > 1 and self.profile.sync_wait and self.lay.pp == 1:
            terms.append(self._waiting(compute_s, sum(t.syncs for t in terms)))
        if self.lay.pp > 1:
            terms.append(self._bubble(sum(t.seconds for t in terms)))
        terms += self.optimizer_terms()
        notes = list(self.rates.notes) + self.notes
        total = sum(t.seconds for t in terms)
        return StepTime(
            terms=terms,
            total_s=total,
            tokens_per_step=self.tokens,
            world=self.world,
            model_flops_per_rank=(self.m.matmul_flops + self.m.attention_flops)
            * self.tokens
            / self.world,
            peak_flops=self.rates.matmul,
            profile=self.profile,
            notes=notes,
        )

    def _waiting(self, compute_s: float, syncs: float) -> Term:
        """The ranks' waits for each other at their ``syncs`` meetings a step: a
        share of the compute that grows as the compute between two meetings
        shrinks (the profile's ``sync_wait`` at the probe's burst, times the ratio
        to the power ``sync_wait_exponent``), at most all of it."""
        p = self.profile
        share, how = p.sync_wait, f"{p.sync_wait:.1%} of the compute (the probe's"
        if syncs > 0 and p.sync_wait_exponent and p.sync_burst_s:
            between = compute_s / syncs
            ratio = between / p.sync_burst_s
            share = min(1.0, p.sync_wait * ratio**p.sync_wait_exponent)
            how = (
                f"{share:.1%} of the compute: {syncs:,.0f} synchronisations a step, "
                f"{between * 1e3:,.2f} ms of compute between (the probe's "
                f"{p.sync_wait:.1%} at {p.sync_burst_s * 1e3:.3g} ms x "
                f"{ratio:.3g}^{p.sync_wait_exponent:.2f}"
            )
        return Term(
            "waiting for the slower rank",
            share * compute_s,
            how + ": two ranks' same work ends apart)",
        )

    def _bubble(self, busy: float) -> Term:
        """A pipeline's fill and drain: ``bubble / (1 - bubble)`` of a stage's busy
        time (the schedule's idle share of equal stages). The stage predicted is
        the worst, whose busy time holds the embeddings, the head and the loss;
        while it fills and drains it waits for the other stages, which hold none
        of them but an embedding: where timed, the idle share is of its time less
        them (Llama's 1F1B and GPipe on 2 ranks measured 15-30% faster than the
        whole stage's share said, docs/benchmarks.md)."""
        schedule = str(self.r.pipeline.schedule)
        bubble = bubble_fraction(schedule, self.lay.pp, self.pp_micro)
        idle = (busy - self.head_s) * bubble / (1 - bubble)
        what = f"{bubble:.0%} of the step idle ({schedule})"
        if self.head_s:
            what += ", of the stages' time less the head's"
        return Term("pipeline bubble", idle, what)

    def _fsdp_term(self, units: list[tuple[float, float]], compute_s: float) -> Term:
        """FSDP's collectives: each unit's next gather runs beside this unit's compute
        where the profile overlaps (max of the two per unit, the first gather
        exposed); else they add up."""
        comm = sum(g + s for g, s, _ in units)
        syncs = sum(n for _, _, n in units)
        n = self.lay.fsdp_shard
        if not self.profile.overlap:
            return Term(
                "FSDP all-gather + reduce-scatter",
                comm,
                f"{len(units)} unit(s) over {n} ranks, not overlapped (gloo on the "
                "cores the ranks compute on)",
                syncs=syncs,
            )
        total = sum(u.local_numel for u in self.plan.units) or 1
        exposed = units[0][0] / self.micro
        for unit, (g, s, _) in zip(self.plan.units, units, strict=True):
            work = compute_s * unit.local_numel / total
            exposed += max(0.0, g + s - work)
        return Term(
            "FSDP all-gather + reduce-scatter",
            exposed,
            f"{len(units)} unit(s) over {n} ranks, {comm * 1e3:,.2f} ms overlapped "
            "with compute (the exposed part)",
            syncs=syncs,
        )


def _shards(backend: str) -> bool:
    return backend_class(backend).shards_parameters


def predicted_step(
    resolved: RunPlan, plan: WrapPlan, world: int | None = None
) -> tuple[StepTime | None, str]:
    """``(prediction, '')`` of ``resolved`` on the profile of the device its plan is
    for (:func:`~src.planner.profiles.profile_for`), or ``(None, why not)``."""
    from src.planner.settings import accelerator_name, device_type

    device, accelerator = device_type(resolved), accelerator_name(resolved)
    try:  # a prediction is a figure beside the plan, never in its way
        profile = profile_for(device, accelerator)
        if profile is None:
            return None, f"no device profile for {accelerator!r} (datasheets: {GPUS})"
        return predict(resolved, plan, profile, world), ""
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"
