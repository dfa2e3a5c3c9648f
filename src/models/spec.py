"""The model spec: everything the trainer, plan-only, checkpoint export and the
benchmarks know about a model family, and the registry of families.

A family is one :class:`ModelSpec`: its config dataclass (which is also the Hydra schema
of the ``model`` group, with the keys every family shares from :class:`ModelKeys`), a
build function that constructs the model with its units annotated by ``wrap()``, the
block classes (``sharding.policy=block``), the per-parameter init by canonical name (for
``model.init_device=meta``), FLOPs per token (MFU) and the no-decay rule. Nothing outside
``src/models/`` names a model class: it asks :func:`get_spec` (see docs/models.md).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, get_type_hints

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from src.models.memory import ActivationBytes
from src.registry import Registry, described, or_list
from src.sharding import canonical_name
from src.sharding.backends import name_generator  # noqa: F401 (the families' init)
from src.sharding.parallelize import Parallelize, parallelize_decoder

# The keys of the ``model`` group every family shares (the family's own config
# dataclass brings the rest, with its own field names), with their --help lines.


@dataclass
class LoraKeys:
    """``model.lora``: low-rank adapters on the linear layers, the rest frozen."""

    rank: int = described("LoRA adapters' rank (0: no adapters, the model trains)", 0)
    alpha: float = described("the adapters' output is scaled by alpha / rank", 16.0)
    dropout: float = described("dropout on the adapters' input", 0.0)
    targets: list[str] | None = described(
        "linear layers adapted (fnmatch on module names); null: the family's "
        "attention and MLP projections",
        None,
    )


@dataclass
class ModelKeys:
    name: str = described("the preset (conf/model/<name>.yaml)", "")
    init_device: str = described(
        "where parameters are first created: cpu, cuda or meta", "cpu"
    )
    # families with `hf`
    pretrained: str | None = described(
        "a local Hugging Face dir whose safetensors are loaded, sharded", None
    )
    lora: LoraKeys = field(
        default_factory=LoraKeys,
        metadata={"help": "LoRA adapters (model.lora.rank > 0), the base frozen"},
    )


#: The --help lines of keys many families' configs have (a family's own
#: ``ModelSpec.key_help`` may say otherwise).
SHARED_KEY_HELP = {
    "vocab_size": "vocabulary size; follows data.tokenizer unless set",
    "block_size": "the run's sequence length in tokens",
}


def default_no_decay(name: str) -> bool:
    """No weight decay for biases and normalisation gains, by canonical name: the leaf
    is ``bias``, or its module's name contains ``norm`` or starts with ``ln`` (GPT's
    ``ln_1``/``ln_f``, Llama's ``attention_norm``, Hugging Face's ``input_layernorm``,
    ``final_layer_norm``...). Embeddings and every other matrix decay."""
    parts = name.split(".")
    if parts[-1] == "bias":
        return True
    module = parts[-2].lower() if len(parts) >= 2 else ""
    return "norm" in module or module.startswith("ln")


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face side: parameter names and config, for
    ``model.pretrained`` (load a transformers checkpoint into the sharded model) and
    ``trainer.export=hf`` (a directory ``from_pretrained`` opens)."""

    to_hf_name: Callable[[str], str]  # our canonical name -> the transformers name
    # (config) -> transformers.PretrainedConfig; ValueError naming the model.* key
    # for a shape transformers' class cannot hold.
    hf_config: Callable[[Any], Any]
    # (our canonical name) -> True where transformers stores the transpose of our
    # 2-D weight (GPT-2's Conv1D keeps (in, out), nn.Linear (out, in)).
    transposed: Callable[[str], bool] = lambda name: False
    # (config) -> the transformers model on the meta device, whose weight conversion
    # (transformers' conversion_mapping: fused MoE experts in memory, one tensor per
    # expert on disk) maps those names to the layout save_pretrained writes; None:
    # the names are the on-disk ones.
    skeleton: Callable[[Any], nn.Module] | None = None

    def converting_model(self, config: Any) -> nn.Module | None:
        """The model whose weight conversion applies (None: names only)."""
        return self.skeleton(config) if self.skeleton is not None else None


@dataclass(frozen=True)
class ExpertShape:
    """A model's routed experts as the planner sizes expert parallelism's dispatch
    (:attr:`ModelSpec.expert_shape`)."""

    layers: int  # MoE blocks
    experts: int  # routed experts per block
    top_k: int  # experts each token is sent to
    dim: int  # a dispatched row's width (the hidden size)
    saved_per_row: int  # elements the experts keep for backward per row they compute
    capacity: int | None  # assignments an expert takes per sequence (None: unbounded)


@dataclass(frozen=True)
class ModelSpec:
    """One model family. ``config`` below is an instance of ``config_cls``."""

    name: str  # the family: the value of ``model.family``
    config_cls: type  # a dataclass; its fields are the family's ``model.*`` keys
    build: Callable[[Any, int], nn.Module]  # (config, seed) -> model, units wrap()ped
    block_classes: Callable[[Any], tuple[type[nn.Module], ...]]  # (config) -> classes
    flops_per_token: Callable[[Any, int], float]  # (config, seq_len) -> train FLOPs
    # (canonical name, shape, config, seed) -> the full initial fp32 tensor of one
    # parameter or buffer, for meta materialisation; None: meta init is unsupported.
    init_tensor: Callable[[str, Sequence[int], Any, int], torch.Tensor] | None = None
    no_decay: Callable[[str], bool] = default_no_decay  # (canonical name) -> bool
    seq_len: Callable[[Any], int] = lambda c: c.block_size  # the run's sequence length
    vocab_size: Callable[[Any], int] = lambda c: c.vocab_size  # the model's vocabulary
    # The ``model.*`` key of the vocabulary size, which the trainer sets from the
    # tokenizer (data.tokenizer) unless the user sets it; None: the family fixes it.
    vocab_key: str | None = "vocab_size"
    # Context parallelism (sharding.context_parallel): (config) -> None, or
    # ValueError naming the model where it cannot split its sequences; None: the
    # family cannot (its forward takes no ``positions=`` and ``cp=``: a
    # src.sharding.context_parallel.ContextParallel).
    context_parallel: Callable[[Any], None] | None = None
    # (config) -> the key (= value) width of one attention layer (kv heads x head
    # dim): what context parallelism gathers per layer, for the planner.
    kv_width: Callable[[Any], int] | None = None
    # (config) -> the feed-forward's hidden width: under context parallelism and
    # checkpointing, what a recomputed block's feed-forward frees before attention's
    # backward holds the gathered K/V's gradient (src/planner/activations.py). None:
    # the planner assumes it frees nothing.
    ffn_width: Callable[[Any], int] | None = None
    # model.lora.targets' default: the module names of its attention and MLP
    # projections (LoRA's usual targets). Empty: give model.lora.targets.
    lora_targets: tuple[str, ...] = ()
    # data.packing=documents: the forward takes ``docs=`` (B, T) document ids and
    # keeps attention and positions within them (src/models/attention.py).
    documents: bool = False
    # Optional: Hugging Face names and config (model.pretrained, trainer.export=hf).
    hf: HFAdapter | None = None
    # Optional, for the planner (src/planner/activations.py): (config, micro_batch,
    # seq_len, act_bytes, checkpointing, every) -> ActivationBytes (src/models/memory.py).
    activation_bytes: Callable[..., ActivationBytes] | None = None
    # Optional: (config) -> whether ``activation_bytes`` covers this config; where it
    # does not, the planner traces the model's activations as for a family without a
    # formula (src/planner/trace.py). None: the formula covers every config.
    formula_covers: Callable[[Any], bool] | None = None
    # Decoding (sample.py, trainer.sample_every; src/models/generate.py): the model's
    # forward takes ``cache=KVCache`` (only the new tokens each step); without it
    # each step recomputes the window.
    kv_cache: bool = False
    # Or the family decodes itself: (model, idx, max_new_tokens, temperature, top_k,
    # vocab_size) -> idx with the new tokens (Hugging Face's ``generate()``). It gets
    # the whole (unsharded) model on every rank.
    generate: Callable[..., torch.Tensor] | None = None
    # Optional: the tensor-parallel plan, (config, tp degree, sequence_parallel: bool
    # or None for the family's default) -> src.sharding.TPPlan; ValueError (one line)
    # if the shape does not split that many ways. None: no tensor parallelism.
    tp_plan: Callable[[Any, int, bool | None], Any] | None = None
    # How each module is parallelized as it is built, the steps in their order: the
    # family's function (src/sharding/parallelize.py); the decoders, twins, share one.
    parallelize: Parallelize = parallelize_decoder
    # Optional: how the model cuts into pipeline stages, (config) ->
    # src.sharding.pipeline.PipelineLayout (the blocks, the first stage's and the
    # last stage's modules), ValueError (one line) if it cannot be cut; the forward
    # of a model with a ``pp_stage`` runs only its stage (a later stage takes the
    # hidden states as ``idx``) and returns the last stage's logits, the others'
    # hidden states. None: no pipeline parallelism.
    pipeline: Callable[[Any], Any] | None = None
    # Optional: whether a config routes each token to some of its experts (MoE), so
    # the experts' matmul shapes change with every batch (the planner says what that
    # costs where it cannot count it).
    routes_tokens: Callable[[Any], bool] | None = None
    # Optional: (config) -> the routed experts of each MoE block, which expert
    # parallelism (sharding.expert_parallel) splits over its ranks; 0 for a config
    # without any. None: the family has no expert parallelism.
    num_experts: Callable[[Any], int] | None = None
    # Optional: (config, seq_len) -> ExpertShape of its routed experts, for the
    # planner's expert-parallel dispatch term. None: not planned (no EP term).
    expert_shape: Callable[[Any, int], ExpertShape] | None = None
    # Optional: (model, replicas) -> metrics, called on every rank after each
    # optimizer step: state kept outside autograd (a MoE's router bias, from the
    # step's token counts summed over the ranks; ``replicas``: the ranks that saw the
    # same tokens) and the step's metrics of the family (MoE routing).
    after_step: Callable[[nn.Module, int], dict[str, float]] | None = None
    # Modules the family imports beyond torch (the planner's process baseline grows
    # by their resident size: planner.IMPORT_BYTES).
    imports: tuple[str, ...] = ()
    # The ops one forward dispatches, (per block, outside the blocks), for the step
    # time's dispatch term (src/planner/step_time.py); counted with a dispatch mode
    # on the family's tiny preset (tests/test_step_time.py checks them).
    forward_ops: tuple[int, int] = (30, 25)
    # Optional: a context the planner traces the model's activations in (fake
    # tensors, src/planner/trace.py), for a family whose code branches on them.
    trace_context: Callable[[], contextlib.AbstractContextManager] | None = None
    # The --help line of each key of ``config_cls`` (src/config/cli_help.py), beyond
    # SHARED_KEY_HELP; the schema carries them as its fields' metadata.
    key_help: Mapping[str, str] = field(default_factory=dict)

    def make_config(self, model_cfg: Mapping) -> Any:
        """The family's config from the ``model`` node (shared keys are ignored).
        Raises ``ValueError`` starting with ``model.<key>`` for a bad value."""
        names = {f.name for f in fields(self.config_cls)}
        return self.config_cls(**{k: model_cfg[k] for k in model_cfg if k in names})

    def __reduce__(self) -> tuple:
        # Pickled by name (the ranks get it), as a class is: its functions may be lambdas.
        return get_spec, (self.name,)

    def num_params(self, config: Any) -> int:
        """Unique parameters of the model (counted on a meta-device build)."""
        with torch.device("meta"):
            return sum(p.numel() for p in self.build(config, 0).parameters())

    def schema(self) -> type:
        """The Hydra schema of ``model`` for this family: its config's fields, the shared
        :class:`ModelKeys` and ``family`` (registered in the ConfigStore as
        ``model/schema/<family>``; each conf/model/*.yaml picks one in its defaults).
        A module-level class of this module, so configs typed by it pickle (ranks)."""
        name = f"{self.name.capitalize()}ModelSchema"
        schema = globals().get(name)
        if schema is None or schema.__bases__[0] is not self.config_cls:
            family = described(
                lambda: f"the model family (src/models): {or_list(_REGISTRY)}",
                self.name,
            )
            schema = make_dataclass(
                name,
                [*self._keys_with_help(), ("family", str, family)],
                bases=(self.config_cls, ModelKeys),
            )
            schema.__module__ = __name__
            globals()[name] = schema
        return schema

    def _keys_with_help(self) -> list[tuple[str, Any, Any]]:
        """The fields of ``config_cls`` again, each with its --help line (its type
        and default unchanged)."""
        about = {**SHARED_KEY_HELP, **self.key_help}
        types = get_type_hints(self.config_cls)
        keys = []
        for f in fields(self.config_cls):
            if f.name not in about:
                continue
            again = field(
                default=f.default,
                default_factory=f.default_factory,
                metadata={**f.metadata, "help": about[f.name]},
            )
            keys.append((f.name, types[f.name], again))
        return keys


def import_module_class(path: str) -> type[nn.Module]:
    """The ``nn.Module`` subclass at the dotted ``path`` (``torch.nn.LayerNorm``);
    ``ValueError`` if there is none."""
    module_name, _, cls_name = str(path).rpartition(".")
    cls, why = None, ""
    if module_name and not module_name.startswith("."):  # relative: no package
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError, ValueError):
            cls = None
        except Exception as err:  # the module itself failed as it was imported
            why = f" (importing {module_name} raised {type(err).__name__}: {err})"
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(
            f"cannot import an nn.Module class from {path!r}{why}; "
            "give a dotted class path such as torch.nn.LayerNorm"
        )
    return cls


# ------------------------------------------------- init by name (shared by families)


def lm_loss(
    logits: torch.Tensor, targets: torch.Tensor | None, reduction: str = "mean"
) -> torch.Tensor | None:
    """Mean (or with ``reduction="sum"``, summed) next-token cross-entropy over all
    positions, in fp32; targets equal to -1 are ignored; None without targets."""
    if targets is None:
        return None
    loss = F.cross_entropy(
        logits.float().view(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=-1,
        reduction=reduction,
    )
    # Vocabulary-sharded logits (tensor parallelism's loss_parallel) give the loss as
    # a DTensor replicated on every tp rank: its value, differentiable, as a tensor
    # (a copy: FSDP2 warns about a root returning a view).
    return loss.to_local().clone() if isinstance(loss, DTensor) else loss


def check_tp_divides(tp: int, sizes: Mapping[str, int]) -> None:
    """``ValueError`` naming the first ``model.<key>`` of ``sizes`` that tensor
    parallelism over ``tp`` ranks cannot split evenly (heads, hidden widths)."""
    for key, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"tensor parallelism over {tp} ranks splits model.{key} ({size}) "
                f"{tp} ways; choose a degree that divides it"
            )


def default_device() -> torch.device:
    """Where a new tensor goes now (honours ``with torch.device(...)``)."""
    return torch.empty(()).device


class _SkipDefaultInit(TorchFunctionMode):
    """Returns the meta tensor that ``torch.nn.init``'s functions (and the fills
    behind its ``ones_`` and ``zeros_``) would fill, unfilled."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = args[0] if args else kwargs.get("tensor")
        if func in _DEFAULT_INITS and isinstance(out, torch.Tensor) and out.is_meta:
            return out
        return func(*args, **kwargs)


_DEFAULT_INITS = frozenset(
    (
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.kaiming_uniform_,
        torch.Tensor.fill_,
        torch.Tensor.zero_,
    )
)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built here are on the meta device, without torch's default init
    (``reset_parameters``): on meta it only costs time (over half of building a
    block, each time the planner builds a model) and ``normal_`` imports
    torch._dynamo (~1 s of a launcher's CPU). The family's ``init_tensor`` gives
    every value."""
    with torch.device("meta"), _SkipDefaultInit():
        yield


def check_positive_ints(config: Any, keys: Sequence[str]) -> None:
    """``ValueError`` naming ``model.<key>`` for the first of ``keys`` that is not an
    integer >= 1 (for a family config's ``__post_init__``)."""
    for key in keys:
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{key} must be a positive integer, got {value!r}")


#: A family's init by name: ``fill_(canonical name, out, config, seed)`` fills the CPU
#: fp32 contiguous tensor ``out`` in place with that parameter's initial value.
Fill = Callable[[str, torch.Tensor, Any, int], torch.Tensor]


def init_tensor_from(
    fill_: Fill,
) -> Callable[[str, Sequence[int], Any, int], torch.Tensor]:
    """The spec's ``init_tensor`` of a family: ``(name, shape, config, seed)`` -> the
    full fp32 initial value (on CPU) of that parameter or buffer, from ``fill_``."""

    def init_tensor(
        name: str, shape: Sequence[int], config: Any, seed: int
    ) -> torch.Tensor:
        return fill_(name, torch.empty(tuple(int(s) for s in shape)), config, seed)

    return init_tensor


@torch.no_grad()
def materialize(
    modules: Mapping[str, nn.Module],
    device: torch.device,
    fill_: Fill,
    config: Any,
    seed: int,
) -> None:
    """Give the parameters and buffers of each ``modules[prefix]`` (built on meta)
    storage on ``device`` and their initial value, ``fill_(prefix + local, ...)``. On
    the meta device nothing happens: the sharding layer materialises them later from
    the spec's ``init_tensor``."""
    if device.type == "meta":
        return
    for prefix, module in modules.items():
        module.to_empty(device=device)
        for local, t in [*module.named_parameters(), *module.named_buffers()]:
            name = prefix + local
            if (
                t.device.type == "cpu"
                and t.dtype == torch.float32
                and t.is_contiguous()
            ):
                fill_(name, t, config, seed)  # in place: no temporary, no copy
            else:
                t.copy_(fill_(name, torch.empty(t.shape), config, seed))


def tie_(head: nn.Module, embedding: nn.Module) -> None:
    """Make ``head.weight`` the very Parameter of ``embedding.weight``. Call it again
    after ``Module._apply`` (behind ``.to()``, ``.to_empty()``...), which gives each
    module a new Parameter when the tensor type changes (e.g. from meta), so the head
    would otherwise get its own, uninitialised copy."""
    if head.weight is not embedding.weight:
        head.weight = embedding.weight


_REGISTRY: Registry[ModelSpec] = Registry("model family")


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family to the registry (``ValueError`` if its name is taken)."""
    spec.schema()
    return _REGISTRY.add(spec.name, spec)


def families() -> list[str]:
    return sorted(_REGISTRY)


def get_spec(family: str) -> ModelSpec:
    """The spec of ``family``; ``ValueError`` naming ``model.family`` if unknown."""
    try:
        return _REGISTRY[family]
    except KeyError:
        raise ValueError(
            f"model.family: unknown model family {family!r}, expected one of: "
            f"{', '.join(families())}"
        ) from None


def muon_matrices(
    model: nn.Module, no_decay: Callable[[str], bool], vocab: int | None = None
) -> set[int]:
    """The ids of the parameters Muon trains (``trainer.optimizer=muon``): the trained
    2-D weights that decay (by canonical name, ``no_decay``), less the embedding tables
    and the output head (the model's last linear layer, when as wide as the model's
    vocabulary ``vocab``, default its largest embedding's; an MLP may be as wide too),
    which Moonlight's recipe leaves to AdamW with the norms, the biases and 3-D expert
    weights. A pipeline stage without the embedding names ``vocab`` for its head."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if vocab is None:
        vocab = max((m.num_embeddings for m in embeddings), default=None)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears and linears[-1].out_features == vocab:
        embeddings.append(linears[-1])
    adamw = {id(p) for m in embeddings for p in m.parameters()}
    return {
        id(p)
        for name, p in model.named_parameters()
        if p.requires_grad
        and p.ndim == 2
        and id(p) not in adamw
        and not no_decay(canonical_name(name, model))
    }
