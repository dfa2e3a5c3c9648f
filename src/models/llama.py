"""Llama (2/3 architecture), in one file: RMSNorm, rotary position embedding (RoPE),
grouped-query attention, SwiGLU feed-forward, an untied or tied output head.

Config field names are Meta's (``dim n_layers n_heads n_kv_heads multiple_of
ffn_dim_multiplier norm_eps rope_theta max_seq_len``), parameter names torchtitan's::

    tok_embeddings.weight                       token embedding
    layers.{i}.attention_norm.weight            RMSNorm before attention
    layers.{i}.attention.w{q,k,v,o}.weight      attention projections (k, v: n_kv_heads)
    layers.{i}.ffn_norm.weight                  RMSNorm before the feed-forward
    layers.{i}.feed_forward.w{1,2,3}.weight     SwiGLU: w2(silu(w1 x) * w3 x)
    norm.weight                                 final RMSNorm
    output.weight                               output head (tok_embeddings.weight if tied)
    rope.inv_freq                               buffer: RoPE inverse frequencies

RoPE rotates the two halves of each head (``rotate_half``, as Hugging Face's
``LlamaForCausalLM``), so Hugging Face Llama checkpoints map onto these parameters by
name alone (``HF_NAMES`` below), with no permutation of q and k.

As the GPT, every block is annotated with ``wrap()`` as it is built, and every
parameter **and buffer** gets its initial value from its canonical name alone
(:func:`init_tensor`), so a meta-device build is materialised shard by shard with the
same values as a CPU build. The rotary frequencies are a buffer like any other: a
build that left them to ``to_empty()`` would train from garbage (tests/test_llama.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.models.attention import attend
from src.models.decoder import Decoder
from src.models.generate import LayerKV
from src.models.memory import ActivationBytes, block_activations
from src.models.spec import (
    HFAdapter,
    ModelSpec,
    check_positive_ints,
    check_tp_divides,
    default_device,
    init_tensor_from,
    materialize,
    name_generator,
    on_meta,
    register,
    tie_,
)
from src.sharding import wrap
from src.sharding.context_parallel import ContextParallel
from src.sharding.pipeline import PipelineLayout
from src.sharding.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    TPPlan,
)


@dataclass
class LlamaConfig:
    """Llama shape, with the field names of Meta's ``ModelArgs``."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads
    vocab_size: int = 128256
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of it
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192  # the run's sequence length (and RoPE's table)
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        check_positive_ints(
            self, ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of")
        )
        if self.max_seq_len < 1:
            raise ValueError(f"model.max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.dim % (2 * self.n_heads):
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by 2 * model.n_heads "
                f"({self.n_heads}): RoPE rotates pairs within each head"
            )
        if self.n_kv_heads is not None and (
            self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads
        ):
            raise ValueError(
                f"model.n_kv_heads ({self.n_kv_heads}) must divide model.n_heads "
                f"({self.n_heads})"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width, as Meta computes it: 2/3 of 4 * dim, times the multiplier,
        rounded up to ``multiple_of`` (Llama 3 8B: 14336)."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


# ------------------------------------------------------------------------ modules


class RotaryEmbedding(nn.Module):
    """cos and sin of the RoPE angles of the tokens' positions (fp32, computed per
    forward from the ``inv_freq`` buffer: no table to keep in sync with the length)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", torch.empty(config.head_dim // 2), persistent=False
        )

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For the (T,) ``positions`` (after any cached tokens; global ones under
        context parallelism), or (B, T) ones (per document): (B, 1, T, head_dim)."""
        pos = positions.to(self.inv_freq.device, torch.float32)
        freqs = pos[..., None] * self.inv_freq.float()  # (..., T, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, head_dim): both halves
        if emb.dim() == 3:  # one row of positions per sequence: broadcast over heads
            emb = emb[:, None]
        return emb.cos(), emb.sin()


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """``1 / theta^(2i / head_dim)``, the true value of ``rope.inv_freq``."""
    d = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) by the position angles."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: ``n_kv_heads`` key/value heads shared by groups
    of ``n_heads / n_kv_heads`` query heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.head_dim = config.head_dim
        kv_dim = self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        *,
        cp: ContextParallel | None = None,
        mask: object = None,
    ):
        B, T, _ = x.shape
        # Head counts come from the widths (-1): under tensor parallelism each rank
        # holds n_heads / tp query and n_kv_heads / tp key/value heads.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if cp is not None:  # this rank's queries over the gathered keys and values
            y = cp.attention(q, k, v, enable_gqa=gqa)
        elif cache is None:  # causal, or within documents (``mask``)
            y = attend(q, k, v, mask, enable_gqa=gqa)
        else:  # decoding: the new tokens attend over the cached ones too
            y = cache.attend(q, k, v, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_dim
        self.w1 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block; ``index`` gives its canonical prefix ``layers.{index}.``."""

    def __init__(self, config: LlamaConfig, index: int, seed: int = 0) -> None:
        super().__init__()
        device = default_device()
        with on_meta():  # no default init: init_tensor sets every value
            self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
            self.attention = Attention(config)
            self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
            self.feed_forward = self.make_feed_forward(config, index)
        materialize({f"layers.{index}.": self}, device, self.fill_, config, seed)

    # A family built on Llama's blocks (src/models/moe.py) overrides these two.
    @staticmethod
    def make_feed_forward(config: LlamaConfig, index: int) -> nn.Module:
        return FeedForward(config)

    @staticmethod
    def fill_(name: str, out: torch.Tensor, config: LlamaConfig, seed: int):
        return _init_(name, out, config, seed)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: LayerKV | None = None,
        *,
        cp: ContextParallel | None = None,
        mask: object = None,
    ):
        h = self.attention(self.attention_norm(x), cos, sin, cache, cp=cp, mask=mask)
        x = x + h
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(Decoder):
    """The decoder (src/models/decoder.py) with Llama's parts: the token embedding,
    RoPE's cos and sin given to every block, the final RMSNorm and the output head."""

    block_cls = TransformerBlock
    context_key = "model.max_seq_len"

    def __init__(self, config: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        device = default_device()
        with on_meta():
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
            self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(
            wrap(self.block_cls(config, i, seed)) for i in range(config.n_layers)
        )
        with on_meta():
            self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        own = {
            "tok_embeddings.": self.tok_embeddings,
            "rope.": self.rope,
            "norm.": self.norm,
        }
        if not config.tie_embeddings:
            own["output."] = self.output
        materialize(own, device, self.block_cls.fill_, config, seed)
        if config.tie_embeddings:
            tie_(self.output, self.tok_embeddings)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # again (see tie_); a pipeline stage may hold neither
        if self.config.tie_embeddings and hasattr(self.output, "weight"):
            tie_(self.output, self.tok_embeddings)
        return self

    @property
    def blocks(self) -> nn.Module:
        return self.layers

    @property
    def context(self) -> int:
        return self.config.max_seq_len

    def embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)

    def block_args(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.rope(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


# --------------------------------------------------------------------------- init

_INIT_STD = 0.02
_RESIDUAL = re.compile(r"(attention\.wo|feed_forward\.w2)\.weight$")


def _init_(
    name: str, out: torch.Tensor, config: LlamaConfig, seed: int
) -> torch.Tensor:
    """Fill ``out`` with the initial value of ``name``: norms 1, the RoPE buffer its
    frequencies, matrices normal(0, 0.02), the residual projections (``wo``, ``w2``)
    scaled by 1 / sqrt(2 n_layers) (GPT-2's rule); the tied head is the embedding."""
    if name == "output.weight" and config.tie_embeddings:
        name = "tok_embeddings.weight"
    if name == "rope.inv_freq":
        return out.copy_(rope_inv_freq(config))
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    if not name.endswith(".weight"):
        raise ValueError(f"init_tensor: not a Llama parameter name: {name!r}")
    std = _INIT_STD
    if _RESIDUAL.search(name):
        std /= math.sqrt(2 * config.n_layers)
    return out.normal_(0.0, std, generator=name_generator(seed, name))


init_tensor = init_tensor_from(_init_)


# -------------------------------------------------------------------------- FLOPs


def flops_per_token(config: LlamaConfig, seq_len: int) -> int:
    """Training FLOPs per token: ``6 N + 12 n_layers dim seq_len`` as for the GPT
    (PaLM / torchtitan), N = the parameters in matmuls: all but the input embedding
    (a lookup; with a tied head it is counted once, for the head)."""
    d, kv = config.dim, config.kv_heads * config.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * config.hidden_dim + 2 * d
    n_matmul = config.n_layers * per_layer + d + config.vocab_size * d
    return 6 * n_matmul + 12 * config.n_layers * d * seq_len


# ------------------------------------------------------------- Hugging Face names

HF_NAMES = {  # ours -> transformers' LlamaForCausalLM (per layer: "layers.{i}." prefix)
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


def to_hf_name(name: str) -> str:
    """Our canonical parameter name -> the Hugging Face Llama name."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return f"model.layers.{m.group(1)}.{HF_NAMES[m.group(2)]}"
    return HF_NAMES[name]


def to_hf_config(config: LlamaConfig):
    """The ``transformers.LlamaConfig`` of the same model."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        # Llama's own 1 and 2 are not our tokenizers' ids: the export sets them.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def activation_bytes(
    config: LlamaConfig,
    micro_batch: int,
    seq_len: int,
    act_bytes: int,
    checkpointing: str = "none",
    every: int = 1,
) -> ActivationBytes:
    """Activation memory of ``Llama(config)`` for one micro-batch (see
    src/models/memory.py; exact against saved-tensor hooks in tests/test_planner.py).

    Per layer, n tokens, width d, key/value width kv, SwiGLU width F, h heads::

        2 x (8 n d + 4 n)  each RMSNorm (nn.RMSNorm computes in fp32: its fp32 input,
                           normalised input and rstd), whatever the compute dtype
      + s (4 n d + 2 n kv + 4 n F)  the norms' outputs (2), q, k, v, attention out,
                           w1 out, silu out, w3 out, their product
      + 4 n h              attention log-sum-exp (fp32)

    Head: the final norm (8 n d + 4 n + s n d), the loss's fp32 log-probabilities
    (4 n V), token ids and targets (int64), RoPE's fp32 cos and sin (T x head_dim
    each), the loss's total weight. Loss backward: 8 n V. Block backward: the gradient
    flowing in and two of the SwiGLU's hidden gradients alive at once, s (n d + 2 n F)
    (what the fake-tensor trace of src/planner/trace.py follows op by op).
    Checkpointing: ``full`` keeps each checkpointed layer's input (s n d) and
    recomputes it; ``selective`` keeps the input and the matmul and attention outputs
    (q, k, v, attention out, wo, w1, w3, w2 outs: s (5 n d + 2 n kv + 2 n F) + 4 n h).
    """
    s, d, L = act_bytes, config.dim, config.n_layers
    kv, F, h = config.kv_heads * config.head_dim, config.hidden_dim, config.n_heads
    n = micro_batch * seq_len
    norm = 8 * n * d + 4 * n
    block = 2 * norm + s * (4 * n * d + 2 * n * kv + 4 * n * F) + 4 * n * h
    kept = {
        "full": s * n * d,
        "selective": s * (5 * n * d + 2 * n * kv + 2 * n * F) + 4 * n * h,
    }
    head = (
        norm
        + s * n * d
        + 4 * n * config.vocab_size
        + 16 * n
        + 2 * 4 * seq_len * config.head_dim
        + 4
    )
    loss = 8 * n * config.vocab_size
    return block_activations(
        L, block, kept, checkpointing, every, head, loss, s * (n * d + 2 * n * F)
    )


def tp_plan(config: LlamaConfig, tp: int, sequence_parallel: bool | None) -> TPPlan:
    """torchtitan's Llama plan (docs/sharding.md): ``wq``/``wk``/``wv`` and ``w1``/``w3``
    colwise, ``wo`` and ``w2`` rowwise, the token embedding sharded over the vocabulary,
    the output layer colwise with its logits vocabulary-sharded into the loss
    (``loss_parallel``). With sequence parallelism (the default) the RMSNorms and the
    residual stream are sharded over the sequence: each rowwise output is
    reduce-scattered, and the attention and feed-forward inputs are all-gathered."""
    check_tp_divides(
        tp,
        {"n_heads": config.n_heads, "n_kv_heads": config.kv_heads},
    )
    sp = True if sequence_parallel is None else sequence_parallel
    inner = Shard(1) if sp else Replicate()
    block: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=inner),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=inner),
        "feed_forward.w3": ColwiseParallel(),
    }
    root: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=inner
        ),
        "output": ColwiseParallel(
            input_layouts=inner, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        block.update(
            {
                "attention_norm": SequenceParallel(),
                # (x, cos, sin, cache): only x is redistributed
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
        root["norm"] = SequenceParallel()
    return TPPlan(
        {Llama: root, TransformerBlock: block},
        sequence_parallel=sp,
        loss_parallel=True,
    )


register(
    ModelSpec(
        name="llama",
        config_cls=LlamaConfig,
        key_help={
            "dim": "Llama: hidden size",
            "n_layers": "Llama: transformer blocks",
            "n_heads": "Llama: attention heads",
            "n_kv_heads": "Llama: key/value heads (grouped-query attention; "
            "null = n_heads)",
            "multiple_of": "Llama: the SwiGLU hidden size is rounded up to a "
            "multiple of it",
            "ffn_dim_multiplier": "Llama: scales the SwiGLU hidden size (null = 1)",
            "norm_eps": "Llama: RMSNorm epsilon",
            "rope_theta": "Llama: RoPE base frequency",
            "max_seq_len": "Llama: the run's sequence length (and RoPE's table)",
            "tie_embeddings": "Llama: share the input embedding and the output head",
        },
        build=lambda config, seed: Llama(config, seed=seed),
        block_classes=lambda config: (Llama.block_cls,),
        flops_per_token=flops_per_token,
        init_tensor=init_tensor,
        seq_len=lambda config: config.max_seq_len,
        activation_bytes=activation_bytes,
        hf=HFAdapter(to_hf_name=to_hf_name, hf_config=to_hf_config),
        kv_cache=True,
        tp_plan=tp_plan,
        context_parallel=lambda config: None,  # every config
        documents=True,
        kv_width=lambda config: config.kv_heads * config.head_dim,
        ffn_width=lambda config: config.hidden_dim,
        lora_targets=("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
        forward_ops=(65, 35),
        pipeline=lambda config: PipelineLayout(
            blocks="layers", first=("tok_embeddings",), last=("norm", "output")
        ),
    )
)
