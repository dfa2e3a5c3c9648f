"""A native mixture-of-experts family: Llama's attention and norms, and in each block
(after ``n_dense_layers`` dense ones) a routed SwiGLU feed-forward with ``num_experts``
experts, ``top_k`` of them per token, and an optional shared expert (DeepSeek-V3,
Qwen3-MoE). Parameter names::

    layers.{i}.feed_forward.router.gate.weight   (num_experts, dim) router logits
    layers.{i}.feed_forward.router.expert_bias   buffer (num_experts): the auxiliary-loss-free
                                          bias, added to the scores for selection only
    layers.{i}.feed_forward.experts.w{1,3}  (num_experts, dim, moe_hidden_dim)
    layers.{i}.feed_forward.experts.w2      (num_experts, moe_hidden_dim, dim)
    layers.{i}.feed_forward.shared.w{1,2,3}.weight  the shared expert (moe.shared_hidden_dim > 0)
    layers.{i}.feed_forward.w{1,2,3}      a dense block's SwiGLU (i < n_dense_layers)

and Llama's for the rest (src/models/llama.py). The experts of a layer are three
``[num_experts, ...]`` tensors, whatever the sharding, so a checkpoint does not depend
on how experts are placed.

Routing, the same on every layout (it looks at one sequence at a time, never at which
rows a rank holds): scores are the softmax (or sigmoid) of the router logits in fp32;
the ``top_k`` experts of a token are those with the highest score plus
``expert_bias`` (ties go to the lower expert index: a stable sort); the gates are the
unbiased scores of those experts (renormalised to sum 1 if ``norm_topk_prob``). With
``capacity_factor`` set, each expert takes at most ``ceil(capacity_factor * T *
top_k / num_experts)`` tokens of a sequence of T, first come first served in token
order; the rest are dropped (their gate is 0) and counted. Without expert
parallelism the shapes stay fixed, so the dropped assignments are still computed and
discarded; with it they are not sent, so capacity bounds the rows a rank receives.

Load balancing (``load_balance``): ``aux_loss`` adds DeepSeek-V3's sequence-wise
balance loss ``aux_loss_coef * sum_e f_e P_e`` (f: the share of a sequence's
assignments, times num_experts; P: the mean score), summed over layers, to the
gradient (the logged ``loss`` stays the language-model loss; the auxiliary loss is
logged beside it); ``aux_free`` moves each ``expert_bias`` by ``bias_update_rate``
towards balance after every optimizer step, from the step's token counts over all
ranks, outside autograd (:func:`after_step`), and adds the same sequence-wise loss
at ``aux_loss_coef`` as DeepSeek-V3's complementary one (its 0.0001; 0: none);
``none`` does neither.

The experts run as grouped matmuls (``torch._grouped_mm`` with ``offs``: one kernel per
weight over all experts) where it runs for the device and dtype, else as a loop over
the experts (the same numbers; ``torch._grouped_mm`` is a private torch API, so the
loop is kept as the clear fallback).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from src.models.llama import (
    FeedForward,
    Llama,
    LlamaConfig,
    TransformerBlock,
)
from src.models.llama import _init_ as llama_init_
from src.models.llama import tp_plan as llama_tp_plan
from src.models.spec import (
    ExpertShape,
    ModelSpec,
    check_positive_ints,
    check_tp_divides,
    init_tensor_from,
    name_generator,
    register,
)
from src.sharding.expert_parallel import ExpertModule, dispatch, local_weight
from src.sharding.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    Replicate,
    RowwiseParallel,
    Shard,
    TPPlan,
)

LOAD_BALANCE = ("aux_loss", "aux_free", "none")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class MoEConfig(LlamaConfig):
    """Llama's shape keys, and the experts'."""

    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 512  # each expert's SwiGLU width
    shared_hidden_dim: int = 0  # the shared expert's width; 0: none
    n_dense_layers: int = 0  # the first blocks keep a dense SwiGLU (DeepSeek-V3: 3)
    score_func: str = "softmax"
    norm_topk_prob: bool = True
    load_balance: str = "aux_loss"
    aux_loss_coef: float = 0.001
    bias_update_rate: float = 0.001
    capacity_factor: float | None = None
    grouped_mm: bool = True  # False: the per-expert loop even where grouped mm runs

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_ints(self, ("num_experts", "top_k", "moe_hidden_dim"))
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.top_k ({self.top_k}) is above model.num_experts "
                f"({self.num_experts})"
            )
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"model.n_dense_layers must be in 0..{self.n_layers}, "
                f"got {self.n_dense_layers}"
            )
        if self.shared_hidden_dim < 0:
            raise ValueError(
                f"model.shared_hidden_dim must be >= 0, got {self.shared_hidden_dim}"
            )
        for key, allowed in (
            ("load_balance", LOAD_BALANCE),
            ("score_func", SCORE_FUNCS),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"model.{key} must be one of {', '.join(allowed)}, "
                    f"got {getattr(self, key)!r}"
                )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"model.capacity_factor must be > 0 or null, got {self.capacity_factor}"
            )

    def capacity(self, seq_len: int) -> int | None:
        """Assignments each expert takes from one sequence (None: unbounded)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.num_experts)

    @property
    def moe_layers(self) -> range:
        return range(self.n_dense_layers, self.n_layers)


# ------------------------------------------------------------------------ experts


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped mm's
    backward refuses the zero-stride gradient that ``.sum()`` hands back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` with ``offs`` runs here (probed once, on a tiny
    problem, without autograd: the first call may come inside a checkpointed
    forward, which must not see the probe's tensors; on real tensors: the first may
    come while the planner traces the model on fake ones (its dispatch modes off:
    a fake grouped matmul accepts bf16 only)."""
    from torch.utils._python_dispatch import _disable_current_modes

    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.no_grad(), _disable_current_modes():
            x = torch.ones(4, 16, device=device_type, dtype=dtype)
            w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
            offs = torch.tensor([1, 4], device=device_type, dtype=torch.int32)
            torch._grouped_mm(x, w, offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool
) -> torch.Tensor:
    """``x`` (N, a) sorted by expert, ``counts[e]`` rows for expert ``e``, times each
    expert's ``w[e]`` (a, b) -> (N, b)."""
    x = x.to(w.dtype)
    if x.is_meta:  # the planner's census (shapes only): no counts to split by
        return x @ w[0]
    # grouped mm wants rows of whole 16-byte multiples
    aligned = all(n * x.element_size() % 16 == 0 for n in w.shape[1:])
    if grouped and aligned and grouped_mm_runs(x.device.type, x.dtype):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offs))
    chunks = x.split(counts.tolist())
    return torch.cat([c @ w[e] for e, c in enumerate(chunks)])


class Experts(ExpertModule):
    """``num_experts`` SwiGLU experts as three stacked weights (``local`` of them when
    expert parallelism places the rest on other ranks)."""

    def __init__(self, config: MoEConfig, local: int | None = None) -> None:
        super().__init__()
        n, d, h = local or config.num_experts, config.dim, config.moe_hidden_dim
        self.grouped = config.grouped_mm
        self.w1 = nn.Parameter(torch.empty(n, d, h))
        self.w2 = nn.Parameter(torch.empty(n, h, d))
        self.w3 = nn.Parameter(torch.empty(n, d, h))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, dim) sorted by expert, ``counts`` (experts,) -> (N, dim)."""
        g = self.grouped
        w1, w2, w3 = (local_weight(w, self) for w in (self.w1, self.w2, self.w3))
        h = F.silu(grouped_matmul(x, w1, counts, g)) * grouped_matmul(x, w3, counts, g)
        return grouped_matmul(h, w2, counts, g)


class SharedExpert(FeedForward):
    """The expert every token goes through: Llama's SwiGLU at its own width."""

    def __init__(self, dim: int, hidden: int) -> None:
        nn.Module.__init__(self)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class Router(nn.Module):
    """Top-k routing (see the module docstring)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.empty(config.num_experts))

    def forward(self, x: torch.Tensor):
        """``x`` (B, T, dim) -> (scores (B, T, E) fp32, experts (B, T, k), gates
        (B, T, k) fp32, zero where dropped, the assignments kept (B, T, k) bool, or
        None without capacity)."""
        c = self.config
        logits = F.linear(x.float(), self.gate.weight.float())
        if c.score_func == "softmax":
            scores = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
        choose = scores.detach()
        if c.load_balance == "aux_free":
            choose = choose + self.expert_bias.float()
        # stable: of equal scores the lower expert index comes first
        experts = choose.sort(dim=-1, descending=True, stable=True).indices[
            ..., : c.top_k
        ]
        gates = scores.gather(-1, experts)
        if c.norm_topk_prob or c.score_func == "sigmoid":
            gates = gates / gates.sum(-1, keepdim=True)
        capacity = c.capacity(x.size(1))
        keep = None
        if capacity is not None:
            B, T, k = experts.shape
            # place of each assignment in its expert's queue, in token order
            hot = F.one_hot(experts.reshape(B, T * k), c.num_experts)
            place = (hot.cumsum(1) * hot).sum(-1).view(B, T, k) - 1
            keep = place < capacity
            gates = gates * keep
        return scores, experts, gates, keep


def balance_loss(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Sequence-wise balance loss, the mean over sequences of ``sum_e f_e P_e``:
    ``f_e`` the share of the sequence's assignments to ``e`` times E, ``P_e`` its mean
    (normalised) score. 1 when balanced."""
    B, T, E = scores.shape
    k = experts.size(-1)
    counts = torch.zeros(B, E, device=scores.device).scatter_add_(
        1, experts.reshape(B, -1), torch.ones(B, T * k, device=scores.device)
    )
    f = counts * E / (T * k)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (f * p).sum(-1).mean()


def recomputing() -> bool:
    """True inside a backward pass (activation checkpointing recomputes a forward):
    the step's statistics were counted the first time."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """The routed feed-forward of one block; it keeps the step's routing statistics
    (:data:`STATS` per layer) for :func:`after_step`."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = Router(config)
        self.experts = Experts(config)
        if config.shared_hidden_dim:
            self.shared = SharedExpert(config.dim, config.shared_hidden_dim)
        self.aux_loss: torch.Tensor | None = (
            None  # this forward's, for the model's loss
        )
        self.stats: torch.Tensor | None = None  # summed since the last after_step
        self.bytes_sent = 0  # by expert parallelism's all-to-alls, forward, ever

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        c = self.config
        scores, experts, gates, keep = self.router(x)
        dropped = torch.zeros((), dtype=torch.long, device=x.device)
        if keep is not None:
            dropped = (~keep).sum()
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # the assignments grouped by expert
        counts = torch.zeros(c.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        token = order // c.top_k
        xs = x.reshape(-1, d)[token]
        if self.experts.ep_mesh is None:
            ys = self.experts(xs, counts)
        else:
            kept = None if keep is None else keep.reshape(-1)[order]
            ys = self._across_ranks(xs, flat[order], kept)
        ys = ys * gates.reshape(-1)[order, None].to(ys.dtype)
        out = torch.zeros(B * T, d, dtype=ys.dtype, device=x.device)
        out = out.index_add(0, token, ys).view(B, T, d).to(x.dtype)
        if c.shared_hidden_dim:
            out = out + self.shared(x)
        self.aux_loss = None
        if self.training:
            # outside the loss, the balance loss is only a metric: no graph (which
            # activation checkpointing's recompute would not make again)
            in_loss = c.load_balance == "aux_loss" or (
                c.load_balance == "aux_free" and c.aux_loss_coef > 0
            )
            with torch.set_grad_enabled(in_loss and torch.is_grad_enabled()):
                aux = balance_loss(scores, experts)
            self.aux_loss = aux if in_loss else None
            if not recomputing():
                self._count(scores.detach(), counts, dropped, aux.detach(), B)
        return out

    def _across_ranks(
        self, xs: torch.Tensor, expert: torch.Tensor, kept: torch.Tensor | None
    ) -> torch.Tensor:
        """Expert parallelism: the rows ``xs`` (grouped by ``expert``) to the ranks
        holding their experts and back; the assignments capacity dropped (``kept``
        false) are not sent: their output is 0, as their gate is."""
        rows = xs
        if kept is not None:
            index = kept.nonzero().squeeze(1)
            rows, expert = xs[index], expert[index]
        counts = torch.zeros(
            self.config.num_experts, dtype=torch.long, device=xs.device
        )
        counts.scatter_add_(0, expert, torch.ones_like(expert))
        sent = dispatch(rows, counts, self.experts.ep_mesh, self.experts.tp_mesh)
        ys = sent.combine(self.experts(sent.rows, sent.counts))
        if not recomputing():
            self.bytes_sent += sent.bytes_moved
        if kept is None:
            return ys
        return ys.new_zeros(xs.size(0), ys.size(1)).index_copy(0, index, ys)

    @torch.no_grad()
    def _count(self, scores, counts, dropped, aux, rows) -> None:
        p = scores / scores.sum(-1, keepdim=True)
        entropy = -(p * p.clamp_min(1e-20).log()).sum(-1).sum()
        n = scores.shape[0] * scores.shape[1]
        rest = [dropped, aux * rows, entropy, torch.tensor(rows), torch.tensor(n)]
        row = torch.cat(
            [counts.double(), torch.stack([t.double().to(counts.device) for t in rest])]
        )
        self.stats = row if self.stats is None else self.stats + row


class MoEBlock(TransformerBlock):
    """Llama's pre-norm block with a routed feed-forward (a dense one before
    ``n_dense_layers``)."""

    @staticmethod
    def make_feed_forward(config: MoEConfig, index: int) -> nn.Module:
        return FeedForward(config) if index < config.n_dense_layers else MoE(config)

    @staticmethod
    def fill_(name: str, out: torch.Tensor, config: MoEConfig, seed: int):
        return _init_(name, out, config, seed)


class MoETransformer(Llama):
    """Llama with :class:`MoEBlock` blocks."""

    block_cls = MoEBlock

    def loss(
        self, logits: torch.Tensor, targets: torch.Tensor | None
    ) -> torch.Tensor | None:
        """As Llama's; in training the balance loss enters the gradient, not the
        loss's value (the logged loss stays the language model's)."""
        loss = super().loss(logits, targets)
        aux = [m.aux_loss for m in moe_layers(self) if m.aux_loss is not None]
        if loss is not None and aux:
            extra = self.config.aux_loss_coef * torch.stack(aux).sum()
            loss = loss + (extra - extra.detach())
        return loss


def moe_layers(model: nn.Module) -> list[MoE]:
    """The routed feed-forwards of ``model``, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


# ----------------------------------------------------- after each optimizer step

#: The columns of a layer's statistics after its per-expert token counts.
STATS = ("dropped", "aux_sum", "entropy_sum", "rows", "tokens")


@torch.no_grad()
def after_step(model: nn.Module, replicas: int = 1) -> dict[str, float]:
    """Once per optimizer step on every rank: sum the step's routing statistics over
    all ranks (one all-reduce; ``replicas``: ranks that saw the same tokens, e.g. a
    tensor-parallel group), move the auxiliary-loss-free biases towards balance, and
    return the step's MoE metrics (per layer ``moe/layer{i}/...``: tokens per expert
    max and mean, their ratio, dropped assignments, balance loss, router entropy;
    and over the layers ``moe/load_max_over_mean`` (the worst), ``moe/dropped``,
    ``moe/aux_loss`` (summed, as it enters the loss), ``moe/entropy`` (mean))."""
    layers = [m for m in moe_layers(model) if m.stats is not None]
    if not layers:
        return {}
    stats = summed_over_ranks([m.stats for m in layers], replicas)
    E = layers[0].config.num_experts
    rows: dict[str, float] = {}
    index = {id(m): i for i, m in numbered(model, MoE)}
    for m, s in zip(layers, stats, strict=True):
        m.stats = None
        counts, (dropped, aux, entropy, nrows, tokens) = s[:E], s[E:]
        if m.config.load_balance == "aux_free":
            bias = m.router.expert_bias
            bias += m.config.bias_update_rate * torch.sign(counts.mean() - counts).to(
                bias
            )
        rows.update(
            layer_metrics(
                index[id(m)], counts, dropped.item(), aux / nrows, entropy / tokens
            )
        )
    return overall_metrics(rows, layers[0].config.aux_loss_coef)


def summed_over_ranks(stats: list[torch.Tensor], replicas: int) -> torch.Tensor:
    """Each layer's statistics row summed over all ranks (one all-reduce), divided
    by ``replicas`` (ranks that counted the same tokens)."""
    out = torch.stack(stats)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(out)
    return out / replicas


def layer_metrics(
    layer: int, counts: torch.Tensor, dropped: float, aux: object, entropy: object
) -> dict[str, float]:
    """One MoE layer's metrics ``moe/layer{i}/...``: tokens per expert (max, mean,
    their ratio), dropped assignments, its balance loss and mean router entropy."""
    p = f"moe/layer{layer}/"
    return {
        p + "tokens_max": counts.max().item(),
        p + "tokens_mean": counts.mean().item(),
        p + "load_max_over_mean": (counts.max() / counts.mean()).item(),
        p + "dropped": int(dropped),
        p + "aux_loss": float(aux),
        p + "entropy": float(entropy),
    }


def overall_metrics(rows: dict[str, float], coef: float) -> dict[str, float]:
    """``rows`` (every layer's :func:`layer_metrics`) and the metrics over the
    layers: the worst ``load_max_over_mean``, dropped assignments, the balance
    losses summed times ``coef`` (as they enter the loss), the mean entropy."""
    per = [k for k in rows if k.endswith("load_max_over_mean")]
    rows["moe/load_max_over_mean"] = max(rows[k] for k in per)
    rows["moe/dropped"] = sum(v for k, v in rows.items() if k.endswith("/dropped"))
    aux = [v for k, v in rows.items() if k.endswith("/aux_loss")]
    rows["moe/aux_loss"] = coef * sum(aux)
    ent = [v for k, v in rows.items() if k.endswith("/entropy")]
    rows["moe/entropy"] = sum(ent) / len(ent)
    return rows


def numbered(model: nn.Module, cls: type[nn.Module]):
    """(layer index, module) of each ``cls`` module of ``model``, the index from its
    name ``...layers.{i}....`` (-1 outside one)."""
    for name, m in model.named_modules():
        if isinstance(m, cls):
            found = re.search(r"layers\.(\d+)\.", name + ".")
            yield int(found.group(1)) if found else -1, m


# --------------------------------------------------------------------------- init

_OWN = re.compile(r"experts\.w[123]$|shared\.w[123]\.weight$")


def _init_(name: str, out: torch.Tensor, config: MoEConfig, seed: int) -> torch.Tensor:
    """The initial value of ``name``: the router bias 0, the experts' (drawn whole,
    so any slice of them is the same on every layout) and the shared expert's
    matrices normal(0, 0.02), their ``w2`` scaled by 1 / sqrt(2 n_layers) as
    Llama's residual projections; every other name as Llama's."""
    if name.endswith("router.expert_bias"):
        return out.zero_()
    if not _OWN.search(name):
        return llama_init_(name, out, config, seed)
    std = 0.02 / (math.sqrt(2 * config.n_layers) if ".w2" in name else 1.0)
    return out.normal_(0.0, std, generator=name_generator(seed, name))


init_tensor = init_tensor_from(_init_)


def flops_per_token(config: MoEConfig, seq_len: int) -> int:
    """Training FLOPs per token as Llama's, counting each token's active parameters:
    ``top_k`` experts, the shared expert and the router in a MoE block."""
    d, kv = config.dim, config.kv_heads * config.head_dim
    attn = 2 * d * d + 2 * d * kv + 2 * d
    dense = 3 * d * config.hidden_dim
    moe = 3 * d * (config.top_k * config.moe_hidden_dim + config.shared_hidden_dim)
    moe += d * config.num_experts
    n_moe = len(config.moe_layers)
    per = config.n_layers * attn + (config.n_layers - n_moe) * dense + n_moe * moe
    n_matmul = per + d + config.vocab_size * d
    return 6 * n_matmul + 12 * config.n_layers * d * seq_len


def expert_shape(config: MoEConfig, seq_len: int) -> ExpertShape:
    """The routed experts for the planner: per row an expert computes, autograd keeps
    its input and four ``moe_hidden_dim`` activations (``x w1``, its SiLU, ``x w3``,
    their product)."""
    return ExpertShape(
        layers=len(config.moe_layers),
        experts=config.num_experts,
        top_k=config.top_k,
        dim=config.dim,
        saved_per_row=config.dim + 4 * config.moe_hidden_dim,
        capacity=config.capacity(seq_len),
    )


def tp_plan(config: MoEConfig, tp: int, sequence_parallel: bool | None) -> TPPlan:
    """Llama's plan (src/models/llama.py) with the feed-forwards styled per module: a
    dense block's SwiGLU as Llama's, the shared expert colwise / rowwise on the MoE
    block's whole input; the router stays replicated over tp, and the routed experts
    are split by expert parallelism (its ep group spans the tp group: each tp rank
    dispatches its share of the assignments, src/sharding/expert_parallel.py) or,
    without it, replicated. With sequence parallelism the MoE block all-gathers the
    sequence and hands back this rank's part of it: routing, capacity and the balance
    loss see whole sequences on every layout."""
    llama = llama_tp_plan(config, tp, sequence_parallel)
    if config.shared_hidden_dim:
        check_tp_divides(tp, {"shared_hidden_dim": config.shared_hidden_dim})
    sp = llama.sequence_parallel
    block = {
        k: v
        for k, v in llama.modules[TransformerBlock].items()
        if not k.startswith("feed_forward")
    }
    inner = Shard(1) if sp else Replicate()
    dense: dict = {
        "w1": ColwiseParallel(),
        "w2": RowwiseParallel(output_layouts=inner),
        "w3": ColwiseParallel(),
    }
    shared = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
    # first match wins: SharedExpert is a FeedForward
    modules: dict = {Llama: llama.modules[Llama], TransformerBlock: block}
    modules.update({SharedExpert: shared, FeedForward: dense})
    if sp:
        dense[""] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        modules[MoE] = {
            "": PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            )
        }
    return TPPlan(modules, sequence_parallel=sp, loss_parallel=True)


register(
    ModelSpec(
        name="moe",
        config_cls=MoEConfig,
        key_help={
            "dim": "MoE: hidden size",
            "n_layers": "MoE: transformer blocks",
            "n_heads": "MoE: attention heads",
            "n_kv_heads": "MoE: key/value heads (null = n_heads)",
            "multiple_of": "MoE: a dense block's SwiGLU size is rounded up to it",
            "ffn_dim_multiplier": "MoE: scales a dense block's SwiGLU size",
            "norm_eps": "MoE: RMSNorm epsilon",
            "rope_theta": "MoE: RoPE base frequency",
            "max_seq_len": "MoE: the run's sequence length (and RoPE's table)",
            "tie_embeddings": "MoE: share the input embedding and the output head",
            "num_experts": "MoE: routed experts per MoE block",
            "top_k": "MoE: experts each token is sent to",
            "moe_hidden_dim": "MoE: each routed expert's SwiGLU width",
            "shared_hidden_dim": "MoE: the shared expert's SwiGLU width (0: none)",
            "n_dense_layers": "MoE: the first blocks keep a dense feed-forward",
            "score_func": "MoE: router scores, softmax or sigmoid",
            "norm_topk_prob": "MoE: renormalise the chosen experts' gates to sum 1",
            "load_balance": "MoE: aux_loss, aux_free (DeepSeek-V3's router bias) "
            "or none",
            "aux_loss_coef": "MoE: weight of the sequence-wise balance loss "
            "(load_balance=aux_loss; with aux_free DeepSeek-V3's complementary one, "
            "0: none)",
            "bias_update_rate": "MoE: step of the router bias per optimizer step "
            "(load_balance=aux_free)",
            "capacity_factor": "MoE: tokens per expert per sequence, times "
            "T * top_k / num_experts (null: no capacity, nothing dropped)",
            "grouped_mm": "MoE: experts as torch._grouped_mm where it runs "
            "(false: a loop over the experts)",
        },
        build=lambda config, seed: MoETransformer(config, seed=seed),
        block_classes=lambda config: (MoEBlock,),
        flops_per_token=flops_per_token,
        init_tensor=init_tensor,
        seq_len=lambda config: config.max_seq_len,
        # attention and the shared expert (the routed experts are not nn.Linear)
        lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
        kv_cache=True,
        documents=True,
        routes_tokens=lambda config: len(config.moe_layers) > 0,
        tp_plan=tp_plan,
        after_step=after_step,
        num_experts=lambda config: config.num_experts if config.moe_layers else 0,
        expert_shape=expert_shape,
        forward_ops=(140, 40),
    )
)
