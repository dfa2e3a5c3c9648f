"""A GPT-2 style decoder-only transformer, in one nanoGPT-style file.

Layout (parameter names are the *canonical* names used everywhere: init, checkpoints,
export)::

    wte.weight                      token embedding, tied with the output head
    wpe.weight                      learned position embedding
    h.{i}.ln_1.{weight,bias}        pre-norm before attention
    h.{i}.attn.c_attn.{weight,bias} fused q, k, v projection
    h.{i}.attn.c_proj.{weight,bias} attention output projection
    h.{i}.ln_2.{weight,bias}        pre-norm before the MLP
    h.{i}.mlp.c_fc.{weight,bias}    MLP up-projection (4x)
    h.{i}.mlp.c_proj.{weight,bias}  MLP down-projection
    ln_f.{weight,bias}              final LayerNorm
    lm_head.weight                  the same Parameter object as wte.weight

Every block is annotated with ``wrap(...)`` as it is built, so inside an ``enable_wrap``
context each block is sharded the moment it exists; outside one, ``wrap`` is a no-op.

Initialisation is deterministic per parameter *name*: :func:`init_tensor` derives the
value of a parameter from ``(seed, canonical name)`` alone, so the initial model is the
same whatever the number of ranks, the wrap policy or the device it is built on. The
model has no registered buffers (the causal mask comes from SDPA), so it can be built on
the meta device and materialised later by calling :func:`init_tensor` per parameter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn

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
    FusedHeadsParallel,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    TPPlan,
)


@dataclass
class GPTConfig:
    """GPT shape, with minGPT / nanoGPT names."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50304
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2

    def __post_init__(self) -> None:
        check_positive_ints(
            self, ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")
        )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by "
                f"model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")


# --------------------------------------------------------------------------- init

_INIT_STD = 0.02
# Modules whose weight is drawn from N(0, 0.02); c_proj is scaled down (GPT-2).
_NORMAL_INIT = {"wte", "wpe", "c_attn", "c_fc"}


def _init_(name: str, out: torch.Tensor, config: GPTConfig, seed: int) -> torch.Tensor:
    """Fill the CPU fp32 contiguous tensor ``out`` with the initial value of the
    parameter with canonical ``name``.

    GPT-2 init: normal(0, 0.02) for Linear and Embedding weights, the residual
    projections (``c_proj.weight``) normal(0, 0.02 / sqrt(2 * n_layer)), biases 0,
    LayerNorm weight 1. Random values come from a ``torch.Generator`` seeded from
    ``crc32(seed, name)``, so one parameter's value depends on nothing else (not on the
    order of construction, the wrap policy, the rank count or the device).
    ``lm_head.weight`` is the tied ``wte.weight`` and gets the same value.
    """
    if name == "lm_head.weight":
        name = "wte.weight"  # tied: one value under both names
    parts = name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
    if leaf == "bias":
        return out.zero_()
    if leaf == "weight" and module.startswith("ln_"):
        return out.fill_(1.0)
    if leaf == "weight" and module == "c_proj":
        std = _INIT_STD / math.sqrt(2 * config.n_layer)
    elif leaf == "weight" and module in _NORMAL_INIT:
        std = _INIT_STD
    else:
        raise ValueError(f"init_tensor: not a GPT parameter name: {name!r}")
    return out.normal_(0.0, std, generator=name_generator(seed, name))


init_tensor = init_tensor_from(_init_)


# ------------------------------------------------------------------------ modules


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerKV | None = None,
        *,
        cp: ContextParallel | None = None,
        mask: object = None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        # q, k, v of this rank's heads: all of them, or n_head / tp under tensor
        # parallelism (the head count is read from the width, never assumed).
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim)
        q, k, v = (
            t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v)
        )
        dropout = self.dropout if self.training else 0.0
        if cp is not None:  # this rank's queries over the gathered keys and values
            y = cp.attention(q, k, v, dropout_p=dropout)
        elif cache is None:  # causal, or within documents (``mask``)
            y = attend(q, k, v, mask, dropout_p=dropout)
        else:  # decoding: the new tokens attend over the cached ones too
            y = cache.attend(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block; ``index`` gives its canonical prefix ``h.{index}.``."""

    def __init__(self, config: GPTConfig, index: int, seed: int = 0) -> None:
        super().__init__()
        device = default_device()
        with on_meta():  # no default init: init_tensor sets every value
            self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention(config)
            self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP(config)
        materialize({f"h.{index}.": self}, device, _init_, config, seed)

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerKV | None = None,
        *,
        cp: ContextParallel | None = None,
        mask: object = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, cp=cp, mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT(Decoder):
    """The decoder (src/models/decoder.py) with GPT-2's parts: token and learned
    position embeddings, :class:`Block` blocks, the final LayerNorm and the head."""

    block_cls = Block  # the `block` wrap policy wraps every instance of this class
    context_key = "model.block_size"

    def __init__(self, config: GPTConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.seed = seed
        device = default_device()
        # Built on meta (skipping torch's default init), materialised below.
        with on_meta():
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        # Each block initialises itself (and is sharded by `wrap` inside enable_wrap).
        self.h = nn.ModuleList(
            wrap(Block(config, i, seed)) for i in range(config.n_layer)
        )
        with on_meta():
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        own = {"wte.": self.wte, "wpe.": self.wpe, "ln_f.": self.ln_f}
        materialize(own, device, _init_, config, seed)
        tie_(self.lm_head, self.wte)  # one Parameter object

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if hasattr(self.lm_head, "weight") and hasattr(self.wte, "weight"):
            # again: _apply may have untied them (see tie_); a pipeline stage may
            # hold neither
            tie_(self.lm_head, self.wte)
        return self

    @property
    def blocks(self) -> nn.Module:
        return self.h

    @property
    def context(self) -> int:
        return self.config.block_size

    @property
    def attention_dropout(self) -> float:
        return self.config.dropout

    def embed(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:
            return self.drop(self.wte(idx) + self.wpe(positions))
        # Per-document positions (B, T), looked up sequence-major: tensor
        # parallelism's sequence-sharded output (dim 0) then splits them as it
        # splits the tokens' embeddings (dim 1).
        pos = self.wpe(positions.t().flatten()).unflatten(0, (-1, idx.size(0)))
        return self.drop(self.wte(idx) + pos.transpose(0, 1))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of (unique) parameters; the tied head is counted once. With
        ``non_embedding`` the position embedding is left out (the token embedding
        stays: it is also the output head's weight), as in nanoGPT."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n


# -------------------------------------------------------------------------- FLOPs


def count_params(config: GPTConfig) -> int:
    """Parameter count of ``GPT(config)`` from its shape alone (tied head counted once)."""
    d, b = config.n_embd, int(config.bias)
    ln = d * (1 + b)  # one LayerNorm
    per_block = 2 * ln + (12 * d * d) + b * (3 * d + d + 4 * d + d)
    return (
        config.vocab_size * d + config.block_size * d + config.n_layer * per_block + ln
    )


def flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward) of ``GPT(config)`` at ``seq_len``.

    PaLM (appendix B) / torchtitan convention::

        6 * N + 12 * n_layer * n_embd * seq_len

    ``N`` is the number of parameters that take part in matmuls: every parameter
    except the position embedding (a lookup), with the tied token embedding counted
    once, for the output-head matmul. Each such weight costs 2 FLOPs per token in the
    forward pass and 4 in the backward (grad of input and of weight). The second term
    is attention: Q.K^T and attn.V are 2 * seq_len * n_embd FLOPs each per token and
    layer in the forward, x3 for forward + backward; causal masking is not discounted
    (the full seq_len x seq_len score matrix is counted, as PaLM and FlopCounterMode
    do). Left out: LayerNorm, softmax, GELU, residual adds, dropout, the embedding
    lookup, the loss, and the optimizer step. Biases and LayerNorm parameters are in
    ``N`` (they are < 0.5% of it for real shapes). Activation recomputation is not
    counted (this is *model* FLOPs, for MFU).

    Checked in tests/test_model.py against ``torch.utils.flop_counter.FlopCounterMode``
    (within 1.5% on small shapes). Note that torch 2.13's FlopCounterMode has no formula
    for the CPU SDPA kernel (``aten._scaled_dot_product_flash_attention_for_cpu``), so
    on CPU it counts attention only under the math backend
    (``sdpa_kernel(SDPBackend.MATH)``); on CUDA its flash/efficient formulas count the
    backward's recomputation of the scores too (14 rather than 12 in the second term).
    """
    n_matmul = count_params(config) - config.block_size * config.n_embd
    return 6 * n_matmul + 12 * config.n_layer * config.n_embd * seq_len


def activation_bytes(
    config: GPTConfig,
    micro_batch: int,
    seq_len: int,
    act_bytes: int,
    checkpointing: str = "none",
    every: int = 1,
) -> ActivationBytes:
    """Activation memory of ``GPT(config)`` for one micro-batch of ``micro_batch``
    sequences of ``seq_len`` tokens, activations ``act_bytes`` wide (4 fp32, 2 bf16).

    Counted from what autograd saves (checked exactly against saved-tensor hooks in
    tests/test_planner.py), per block with n = micro_batch * seq_len tokens, width d::

        16 n d  activations: block input, ln_1 out, q/k/v (3), attention out,
                residual, ln_2 out, MLP hidden before and after GELU (4 + 4)
      + 4 n     LayerNorm mean and rstd (2 norms)
      + 4 n h   attention log-sum-exp, always fp32 (bytes, not x act_bytes)

    Head: the final norm's input, output and statistics (2 n d + 2 n), the fp32
    log-probabilities of the loss (4 n V bytes), token ids, targets and positions
    (int64), the loss's total weight. Loss backward: the gradients of the
    log-probabilities and of the fp32 logits (8 n V bytes). Block backward: the
    gradient flowing in plus the gradient of the MLP hidden layer (5 n d).
    Checkpointing (src/sharding/transforms.py): ``full`` keeps each checkpointed
    block's input (n d) and recomputes the block in backward (its full activations
    are then alive once); with ``every=k`` only blocks 0, k, 2k, ... are checkpointed.
    ``selective`` (every block) keeps the outputs of the matmuls and attention (input,
    q/k/v, attention out, its projection, MLP hidden, MLP out: 11 n d) and recomputes
    the norms and GELU.

    Without dropout only (the spec's ``formula_covers``): a config with
    ``dropout > 0`` is traced (src/planner/trace.py), since what dropout keeps
    depends on the kernels: on a CPU each dropout saves a mask as wide as its input
    and attention with dropout takes the math kernel, which keeps the T x T
    probabilities (tests/test_planner.py).
    """
    s, d, L = act_bytes, config.n_embd, config.n_layer
    n = micro_batch * seq_len
    block = s * (16 * n * d + 4 * n) + 4 * n * config.n_head
    kept = {
        "full": s * n * d,
        "selective": s * 11 * n * d + 4 * n * config.n_head,
    }
    head = (
        s * (2 * n * d + 2 * n)
        + 4 * n * config.vocab_size
        + 8 * (2 * n + seq_len)
        + 4  # the loss's total weight (a 0-d fp32)
    )
    loss = 8 * n * config.vocab_size
    return block_activations(
        L, block, kept, checkpointing, every, head, loss, 5 * s * n * d
    )


def tp_plan(config: GPTConfig, tp: int, sequence_parallel: bool | None) -> TPPlan:
    """Megatron-style tensor parallelism (docs/sharding.md): the MLP colwise (``c_fc``)
    then rowwise (``c_proj``), attention's output rowwise; the fused q|k|v projection
    ``c_attn`` stays whole on the tp ranks (its rows interleave q, k and v, so no
    contiguous split gives a rank whole heads) and each rank keeps its own heads of
    its output. The token embedding is sharded over the vocabulary and the head,
    tied to it, keeps its logits vocabulary-sharded into the loss (``loss_parallel``).
    With sequence parallelism (the default) the norms and the residual stream
    between the matmuls are sharded over the sequence, so the rowwise outputs are
    reduce-scattered and gathered again before the next colwise matmul."""
    check_tp_divides(tp, {"n_head": config.n_head})
    sp = True if sequence_parallel is None else sequence_parallel
    seq = Shard(1)
    inner = seq if sp else Replicate()
    block = {
        "attn.c_attn": FusedHeadsParallel(3, input_layouts=inner),
        "attn.c_proj": RowwiseParallel(output_layouts=inner),
        "mlp.c_fc": ColwiseParallel(input_layouts=inner),
        "mlp.c_proj": RowwiseParallel(output_layouts=inner),
    }
    root = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=inner),
        # positions (T,) -> (T, C): the sequence is dim 0 of its output
        "wpe": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate()
        ),
        "lm_head": ColwiseParallel(
            input_layouts=inner, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        block.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
        root["ln_f"] = SequenceParallel()
    return TPPlan({GPT: root, Block: block}, sequence_parallel=sp, loss_parallel=True)


# ------------------------------------------------------------- Hugging Face names

HF_PREFIX = "transformer."  # GPT2LMHeadModel's body; its lm_head is tied to wte
_CONV1D = re.compile(
    r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight"
)


def to_hf_name(name: str) -> str:
    """Our canonical name -> transformers' ``GPT2LMHeadModel`` name: the same module
    names (this file follows GPT-2's), under ``transformer.``; the head is tied to
    ``transformer.wte.weight`` (and never written: it is that tensor)."""
    return name if name == "lm_head.weight" else HF_PREFIX + name


def hf_transposed(name: str) -> bool:
    """GPT-2's projections are ``Conv1D`` modules, whose weight is (in, out): the
    transpose of our ``nn.Linear``'s (out, in)."""
    return _CONV1D.fullmatch(name) is not None


def to_hf_config(config: GPTConfig):
    """The ``transformers.GPT2Config`` of the same model: exact GELU (``gelu``, as
    ``nn.GELU()``; GPT-2's own is the tanh approximation ``gelu_new``), LayerNorm eps
    1e-5, dropout everywhere, head tied to the token embedding. The special token ids
    are left to the export, which knows the tokenizer (GPT-2's 50256 is not ours)."""
    if not config.bias:
        raise ValueError(
            "model.bias=false: transformers' GPT2LMHeadModel always has biases; "
            "export with trainer.export=true (model.safetensors) instead"
        )
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_inner=4 * config.n_embd,
        activation_function="gelu",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5,
        scale_attn_weights=True,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        architectures=["GPT2LMHeadModel"],
    )


register(
    ModelSpec(
        name="gpt",
        config_cls=GPTConfig,
        key_help={
            "n_layer": "GPT: transformer blocks",
            "n_head": "GPT: attention heads",
            "n_embd": "GPT: hidden size (a multiple of n_head)",
            "dropout": "GPT: dropout probability (0 = off)",
            "bias": "GPT: biases in Linear and LayerNorm layers, as in GPT-2",
        },
        build=lambda config, seed: GPT(config, seed=seed),
        block_classes=lambda config: (GPT.block_cls,),
        flops_per_token=flops_per_token,
        init_tensor=init_tensor,
        activation_bytes=activation_bytes,
        # dropout is traced: its masks and attention kernel depend on the device
        formula_covers=lambda config: config.dropout == 0,
        kv_cache=True,
        tp_plan=tp_plan,
        context_parallel=lambda config: None,  # every config
        documents=True,
        kv_width=lambda config: config.n_embd,
        ffn_width=lambda config: 4 * config.n_embd,
        lora_targets=("c_attn", "c_proj", "c_fc"),
        pipeline=lambda config: PipelineLayout(
            blocks="h", first=("wte", "wpe"), last=("ln_f", "lm_head")
        ),
        hf=HFAdapter(
            to_hf_name=to_hf_name, hf_config=to_hf_config, transposed=hf_transposed
        ),
    )
)
