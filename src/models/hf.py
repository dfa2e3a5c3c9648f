"""Hugging Face causal LMs: ``model=hf model.config=DIR`` builds any causal LM that
``transformers`` can build from a config (``AutoModelForCausalLM.from_config``) inside
the wrap context.

- ``model.config``: a local directory with a ``config.json``, or the name of one shipped
  in ``conf/hf_configs/`` (``tiny_gpt2``, ``tiny_llama``, ``tiny_qwen2``,
  ``tiny_gpt_neox``, and the MoE ``tiny_mixtral``, ``tiny_qwen3_moe``).
- Block classes (``sharding.policy=block``): the model's own ``_no_split_modules``.
- Parameter names are the model's own, under ``hf.`` (the wrapper below); the
  Hugging Face adapter strips that prefix, so checkpoints and exports use the names
  ``from_pretrained`` knows.
- Init: ``model.init_device=cpu`` builds the whole model with transformers' own init
  (seeded by ``trainer.seed``, the same on every rank) and shards it after;
  ``meta`` (and ``model.pretrained``) never holds it whole: each parameter or buffer
  gets the value of the model's ``_init_weights`` applied to its own module, seeded by
  its name. Rules that a model's ``_init_weights`` applies from a parent module (GPT-2's
  scaled residual projections) are not reproduced on meta.
- Refused with one line (``model.config``): a config whose model is not causal (a tiny
  probe of the architecture: changing the last input token must leave the earlier
  positions' logits as they are), e.g. BERT's ``BertLMHeadModel`` with
  ``is_decoder=false`` (named an encoder-only config), and any encoder-decoder config
  (``is_encoder_decoder``: its CausalLM class is the decoder alone).
- ``model.trust_remote_code`` (default false): a config directory's own Python code
  (``auto_map`` in its config.json) never runs and such a config is refused, known
  model type or not; with true, its classes are built and the run says so.
  transformers is never left to prompt.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from src.entry import quiet_torchao
from src.files import read_json
from src.models import hf_experts, hf_routing
from src.models.attention import document_positions
from src.models.spec import HFAdapter, ModelSpec, lm_loss, name_generator, register
from src.sharding.context_parallel import ContextParallel
from src.sharding.pipeline import PipelineLayout, StageRole
from src.sharding.tensor_parallel import (
    ColwiseParallel,
    Shard,
    TPPlan,
    styles_from_strings,
)

SHIPPED = Path(__file__).resolve().parents[2] / "conf" / "hf_configs"
PREFIX = "hf."  # our parameter names: "hf." + the transformers model's own
log = logging.getLogger(__name__)
quiet_torchao()  # transformers' imports import torchao: only its real errors show


@dataclass
class HFConfig:
    # A local config directory, or a name in conf/hf_configs/ (conf/model/hf.yaml
    # defaults it to model.pretrained).
    config: str | None = None
    block_size: int = 128  # the run's sequence length (<= the config's max positions)
    vocab_size: int | None = None  # None: the config's
    # Run the config directory's own code (its config.json's auto_map)?
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        self.hf_config = load_hf_config(self.config, self.trust_remote_code)
        text = self.hf_config.get_text_config()
        if self.vocab_size is not None:
            if self.vocab_size < 1:
                raise ValueError(
                    f"model.vocab_size must be >= 1, got {self.vocab_size}"
                )
            text.vocab_size = self.vocab_size
        limit = getattr(text, "max_position_embeddings", None)
        if self.block_size < 1 or (limit and self.block_size > limit):
            raise ValueError(
                f"model.block_size {self.block_size} must be in [1, {limit}] "
                f"(the config's max_position_embeddings)"
            )

    def __getstate__(self) -> dict:
        # Sent to the ranks: the meta skeleton is rebuilt there on first use.
        return {k: v for k, v in self.__dict__.items() if k != "_skeleton"}

    def skeleton(self) -> nn.Module:
        """The transformers model on the meta device (cached): classes, names, shapes."""
        if not hasattr(self, "_skeleton"):
            with torch.device("meta"):
                self._skeleton = _from_config(self.hf_config, self.trust_remote_code)
        return self._skeleton


def config_dir(config: str | None) -> Path:
    """``model.config`` as a directory: a path, or a name in conf/hf_configs/."""
    shipped = sorted(p.name for p in SHIPPED.iterdir() if p.is_dir())
    if config is None:
        raise ValueError(
            "model.config: missing: give a Hugging Face config directory, one of "
            f"{', '.join(shipped)}, or model.pretrained=DIR"
        )
    for path in (Path(config).expanduser(), SHIPPED / config):
        if (path / "config.json").is_file():
            return path
    raise ValueError(
        f"model.config: no config.json in {config!r}; give a local Hugging Face "
        f"config directory or one of: {', '.join(shipped)}"
    )


def remote_code_dir() -> tuple[str, str]:
    """Where transformers copies a config directory's own code to run it
    (``model.trust_remote_code=true``), and the environment variable that moves it."""
    from transformers.utils import HF_MODULES_CACHE

    return "HF_MODULES_CACHE", HF_MODULES_CACHE


def load_hf_config(config: str | None, trust_remote_code: bool = False):
    """The ``transformers`` config of ``model.config`` (one-line ValueError if bad:
    unreadable, custom code not trusted, not a causal LM, not causal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = config_dir(config)
    file = path / "config.json"
    if os.path.lexists(file) and not file.is_file():  # a FIFO blocked the read
        raise ValueError(f"model.config: {file} is not a regular file")
    try:  # read once, as data, for the checks below
        raw = read_json(file)
    except (OSError, ValueError):
        raw = None  # AutoConfig says what is wrong
    auto_map = raw.get("auto_map") if isinstance(raw, dict) else None
    if auto_map and not trust_remote_code:
        raise ValueError(
            f"model.trust_remote_code: {str(path)!r} names its own code (auto_map: "
            f"{', '.join(sorted(auto_map))}), which runs only with "
            "model.trust_remote_code=true"
        )
    kernel = _hub_kernel(raw)
    if kernel and not trust_remote_code:
        raise ValueError(
            f"model.trust_remote_code: {str(path)!r} sets attn_implementation "
            f"{kernel!r}, a kernel from the Hugging Face Hub (its code, fetched and "
            "run by transformers), which runs only with model.trust_remote_code=true"
        )
    _check_sizes(raw, path)  # before transformers warns about them
    try:
        hf_config = AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code
        )
    except Exception as err:  # transformers raises ValueError, KeyError, OSError...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err)
        raise ValueError(
            f"model.config: transformers cannot read {str(path)!r}: {first}"
        ) from None
    custom = "AutoModelForCausalLM" in (auto_map or {})
    if not custom and type(hf_config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(
            f"model.config: {hf_config.model_type!r} in {str(path)!r} is not a "
            "causal LM that AutoModelForCausalLM can build"
        )
    if auto_map and path not in _TRUSTED:  # said once per process
        _TRUSTED.add(path)
        log.warning(
            "model.trust_remote_code=true: running the code in %s (%s)",
            path,
            ", ".join(f"{k}: {v}" for k, v in sorted(auto_map.items())),
        )
    hf_config.use_cache = False  # training: no KV cache
    dtype = getattr(hf_config, "dtype", None)
    if dtype not in (None, torch.float32) and path not in _TOLD_DTYPE:
        _TOLD_DTYPE.add(path)  # said once per process
        log.info(
            "model.config: %s says dtype %s; not used: precision sets the "
            "training dtype (parameters are built in float32)",
            path,
            str(dtype).removeprefix("torch."),
        )
    _check_causal(hf_config, path, trust_remote_code)
    return hf_config


def _check_sizes(raw: Any, path: Path) -> None:
    """ValueError naming the first of :data:`_POSITIVE` that ``path``'s config.json
    (``raw``, as read) or its ``text_config`` sets to anything but an integer >= 1."""
    for node in (raw, raw.get("text_config") if isinstance(raw, dict) else None):
        for key in _POSITIVE if isinstance(node, dict) else ():
            value = node.get(key)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f"model.config: {key} is {value!r} in {str(path)!r}, expected "
                    "an integer >= 1"
                )


def _hub_kernel(raw: Any) -> str | None:
    """An ``attn_implementation`` in config.json (``raw``, as read) or a sub-config of
    it that names a Hub repository (``org/repo[:function]``): transformers loads that
    attention kernel's code from the Hub through the ``kernels`` package."""
    todo = [raw]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in ("attn_implementation", "_attn_implementation"):
                value = node.get(key)
                if isinstance(value, str) and "/" in value:
                    return value
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return None


#: The config keys transformers' MoE architectures give their expert count under.
EXPERT_KEYS = (
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "moe_num_experts",
)


def routed_experts(hf_config) -> int:
    """How many experts the text model routes each token among (0: a dense model).
    Read from the text config and from its sub-configs (DBRX keeps the count in
    ``ffn_config``)."""
    from transformers import PretrainedConfig

    text = hf_config.get_text_config()
    found = [text, *(v for v in vars(text).values() if isinstance(v, PretrainedConfig))]
    counts = (getattr(c, k, None) for c in found for k in EXPERT_KEYS)
    return max((n for n in counts if isinstance(n, int)), default=0)


def _check_causal(hf_config, path: Path, trust_remote_code: bool) -> None:
    """ValueError (one line, ``model.config``) for an encoder-decoder config, or a
    model that lets later input tokens change earlier positions' outputs."""
    where = f"{hf_config.model_type!r} in {str(path)!r}"
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"model.config: {where} is an encoder-decoder config: "
            "AutoModelForCausalLM would train its decoder alone; give a decoder-only "
            "causal LM config"
        )
    key = (json.dumps(hf_config.to_dict(), sort_keys=True, default=str), path)
    if key not in _PROBED:  # validation and every rank build the config
        _PROBED[key] = _later_inputs_reach(hf_config, trust_remote_code)
    reach = _PROBED[key]
    if reach is None:
        log.warning(
            "model.config: could not probe whether %s is causal; trusting "
            "AutoModelForCausalLM",
            where,
        )
    elif reach > 1e-5:  # float32 noise is ~1e-7; encoders move them ~1e-3 or more
        encoder = getattr(hf_config, "is_decoder", None) is False  # BERT-like
        kind = "an encoder-only config (is_decoder=false)" if encoder else "not causal"
        raise ValueError(
            f"model.config: {where} is {kind}: its model lets "
            "later tokens change earlier positions' logits, so next-token training "
            "would see the future; give a causal (decoder) config"
        )


# A probe model: the config at these sizes (those it has), per-layer lists cut to its
# layers. Widths first; the config's own widths (layers cut) if it is small enough.
_PROBE_SIZES = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rotary_dim": 16,
    # MoE
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    **dict.fromkeys(EXPERT_KEYS, 4),
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    # multi-head latent attention
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 16,  # = head_dim where a config ties them (DeepSeek)
    "qk_nope_head_dim": 16,
    "qk_head_dim": 32,
    "v_head_dim": 16,
}
_PROBE_MAX_PARAMS = 50_000_000
_PROBED: dict[tuple[str, Path], float | None] = {}
_TRUSTED: set[Path] = set()  # directories whose code this process was told runs
# A config's sizes that must be integers >= 1 where it has them (vocab_size=0 ended
# in "ValueError: high <= 0" after a page of warnings).
_POSITIVE = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
_TOLD_DTYPE: set[Path] = set()  # directories whose ignored dtype it was told of


# Tried in turn: widths and a short vocabulary (special ids past it break some), widths,
# layers alone.
_PROBE_TRIES = (
    {**_PROBE_SIZES, "vocab_size": 4096},
    _PROBE_SIZES,
    {"num_hidden_layers": 2},
)


def _probe_config(hf_config, sizes: dict[str, int]):
    """A copy of ``hf_config`` at ``sizes``: its text config and (widths) its other
    sub-configs (a vision tower)."""
    probe = copy.deepcopy(hf_config)
    text = probe.get_text_config()
    widths = "hidden_size" in sizes
    subs = [getattr(probe, k, None) for k in getattr(probe, "sub_configs", {})]
    for config in [text, *(c for c in subs if widths and c not in (None, text))]:
        _shrink(config, sizes)
    return probe


def _shrink(config, sizes: dict[str, int]) -> None:
    layers = getattr(config, "num_hidden_layers", None)
    for key, value in sizes.items():
        if getattr(config, key, None) is not None:
            try:
                setattr(config, key, min(value, getattr(config, key)))
            except (AttributeError, TypeError):  # derived (a property), or a list
                pass
    kept = getattr(config, "num_hidden_layers", None)
    if layers and kept != layers:
        for key, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == layers:
                setattr(config, key, value[:kept])


def _later_inputs_reach(hf_config, trust_remote_code: bool) -> float | None:
    """How much the last 4 of 8 input tokens move the first 4 positions' logits (a
    seeded tiny probe model on CPU); None if no probe model could be built or run."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the probe's own warnings are not the run's
    try:
        for sizes in _PROBE_TRIES:
            try:
                probe = _probe_config(hf_config, sizes)
                with torch.device("meta"):
                    size = sum(
                        p.numel()
                        for p in _from_config(probe, trust_remote_code).parameters()
                    )
                if size > _PROBE_MAX_PARAMS:
                    continue
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    model = _from_config(probe, trust_remote_code).eval()
                    vocab = probe.get_text_config().vocab_size
                    # from the middle of the vocabulary: no special (image...) ids
                    x = torch.randint(vocab // 4, vocab // 2, (2, 8))
                x[1, :4] = x[0, :4]  # the same first 4 tokens, then others
                with torch.no_grad():
                    logits = model(input_ids=x, use_cache=False).logits.float()
                return (logits[0, :4] - logits[1, :4]).abs().max().item()
            except Exception:  # a probe transformers cannot build or run
                continue
        return None
    finally:
        hf_logging.set_verbosity(verbosity)


def _from_config(hf_config, trust_remote_code: bool = False) -> nn.Module:
    """The transformers model of ``hf_config``, in float32 whatever the config's
    ``dtype``/``torch_dtype`` says: ``precision`` is the one source of the training
    dtype (the backend casts from float32 master weights)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(
            hf_config, trust_remote_code=trust_remote_code, dtype=torch.float32
        )
    # A config.json value it cannot build: name the file. Other failures (a missing
    # package, out of memory) keep their own type and traceback.
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as err:
        where = getattr(hf_config, "_name_or_path", "") or hf_config.model_type
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"model.config: transformers cannot build the model of {str(where)!r} "
            f"({type(err).__name__}: {first}): a value in its config.json"
        ) from None


class HFCausalLM(nn.Module):
    """A transformers causal LM with the trainer's interface:
    ``forward(idx, targets) -> (logits, loss)`` (targets already shifted, -1 ignored)."""

    #: The pipeline stage this model is (None: the whole model): set on a stage when
    #: it is cut (``src.sharding.pipeline.cut_stage``), never looked up in forward.
    pp_stage: StageRole | None = None

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        # Tied parameters (alias, kept), e.g. the head and the input embedding.
        first: dict[int, str] = {}
        self._ties = []
        for name, p in hf_model.named_parameters(remove_duplicate=False):
            kept = first.setdefault(id(p), name)
            if kept != name:
                self._ties.append((name, kept))

    def _context_parallel_attention(self, on: bool) -> None:
        """Switch the model's attention to context parallelism's function (``on``)
        or back to the one it was built with (a forward outside the cp group's
        context: sampling during a CP run)."""
        current = self.hf.config._attn_implementation
        if on and current != CP_ATTENTION:
            self._built_attention = current
            _register_cp_attention()
            self.hf.set_attn_implementation(CP_ATTENTION)
        elif not on and current == CP_ATTENTION:
            self.hf.set_attn_implementation(self._built_attention)

    def _apply(self, fn, recurse=True):
        # to_empty() from meta gives each module a new Parameter: re-tie (as the GPT).
        super()._apply(fn, recurse)
        for alias, kept in self._ties:
            module, _, leaf = alias.rpartition(".")
            owner = self.hf.get_submodule(module)
            if hasattr(owner, leaf):  # a pipeline stage may hold neither
                setattr(owner, leaf, self.hf.get_parameter(kept))
        return self

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        cp: ContextParallel | None = None,
        docs: torch.Tensor | None = None,
    ):
        """As the native families' (src/models/decoder.py): ``positions`` (T,) are
        the position ids (default: transformers' own, ``0..T-1``); with ``cp`` the
        attention layers run :data:`CP_ATTENTION`, which transformers hands the
        ``cp`` object as the keyword :data:`CP_KWARG` (its forward passes unknown
        keywords down to the attention functions). ``docs`` (B, T): the position
        ids restart at each document, from which transformers (5) builds its mask
        of packed sequences (attention within each)."""
        self._context_parallel_attention(cp is not None)
        kwargs: dict[str, Any] = {"use_cache": False}
        if docs is not None and positions is None:
            positions = document_positions(docs)
        if positions is not None:
            kwargs["position_ids"] = positions.expand(idx.size(0), -1)
        if cp is not None:
            kwargs[CP_KWARG] = cp
        stage = self.pp_stage
        if stage is not None:
            # a later stage's input is the previous one's hidden states; an earlier
            # stage's head is Absent, so its "logits" are its hidden states
            inputs = {"input_ids" if stage.first else "inputs_embeds": idx}
            out = self.hf(**inputs, **kwargs).logits
            hf_routing.drop_parts(self.hf)  # a stage's forward has no loss to add to
            return out
        logits = self.hf(input_ids=idx, **kwargs).logits
        loss = lm_loss(logits, targets)
        aux = hf_routing.balance_loss(self.hf) if self.training else None
        if loss is not None and aux is not None:
            loss = loss + (aux - aux.detach())  # the gradient, not the logged value
        return logits, loss


#: The name context parallelism's attention is registered under in transformers'
#: attention interface (not in its mask interface: the layers get no mask, the
#: function masks by global position).
CP_ATTENTION = "shardwrap_context_parallel"
#: The keyword the model's ``ContextParallel`` reaches :data:`CP_ATTENTION` under.
CP_KWARG = "shardwrap_cp"


def _cp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: this rank's queries over the
    keys and values gathered from its cp group (the ``ContextParallel`` the model's
    forward was given, in ``kwargs``), (B, T/C, heads, head_dim) out."""
    y = kwargs[CP_KWARG].attention(
        query,
        key,
        value,
        scale=scaling,
        dropout_p=dropout,
        enable_gqa=query.size(1) != key.size(1),
    )
    return y.transpose(1, 2).contiguous(), None


def _register_cp_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)


def kv_width(config: HFConfig) -> int:
    """Key heads x head dim of the text config (head dim: its own, or the width
    over the query heads)."""
    text = config.hf_config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return (getattr(text, "num_key_value_heads", None) or heads) * head_dim


def check_context_parallel(config: HFConfig) -> None:
    """``ValueError`` naming the architecture when it cannot split its sequences
    (transformers' ``supports_context_parallel``: attention through its attention
    interface, full causal attention in every layer)."""
    model = config.skeleton()
    if not (model._supports_attention_backend and model.supports_context_parallel):
        raise ValueError(
            f"model.config {config.config!r}: {type(model).__name__} cannot take "
            "context parallelism "
            "(its attention is not replaceable through transformers' attention "
            "interface, or a layer is not full causal attention)"
        )


def pipeline_layout(config: HFConfig) -> PipelineLayout:
    """The stages transformers ships for the architecture: its config's
    ``base_model_pp_plan`` (embeddings, the layers, the final norm, in order) and
    the causal LM's ``_pp_plan`` (the head); ValueError naming the architecture
    without one."""
    skeleton = config.skeleton()
    arch = type(skeleton).__name__
    plan = getattr(config.hf_config.get_text_config(), "base_model_pp_plan", None)
    if not plan:
        raise ValueError(
            f"{arch} has no pipeline plan in transformers (its config's "
            "base_model_pp_plan is empty)"
        )
    base = skeleton.base_model_prefix
    paths = [f"{base}.{name}" for name in plan]
    lists = [p for p in paths if isinstance(skeleton.get_submodule(p), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{arch}'s pipeline plan has no single list of layers")
    i = paths.index(lists[0])
    # the causal LM's own modules (its plan may repeat the base model's, prefixed)
    own = getattr(skeleton, "_pp_plan", None) or ()
    head = [p for p in own if not p.startswith(f"{base}.")]
    return PipelineLayout(
        blocks=PREFIX + paths[i],
        first=tuple(PREFIX + p for p in paths[:i]),
        last=tuple(PREFIX + p for p in [*paths[i + 1 :], *head]),
        annotated=False,  # transformers' constructor calls no wrap()
    )


def build(config: HFConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # transformers' own init (on CPU): the same on every rank
    hf_model = _from_config(config.hf_config, config.trust_remote_code)
    experts = routed_experts(config.hf_config)
    if experts > 1:  # splittable by sharding.expert_parallel
        hf_experts.split_ready(hf_model.base_model, config.hf_config)
        hf_routing.count_routing(hf_model.base_model, config.hf_config, experts)
    return HFCausalLM(hf_model)


def ep_experts(config: HFConfig) -> int:
    """The experts expert parallelism splits (0: a dense model); ValueError (one
    line) for an MoE model it cannot split (:func:`hf_experts.check`)."""
    experts = routed_experts(config.hf_config)
    if experts <= 1:
        return 0
    hf_experts.check(config.hf_config, lambda: config.skeleton().base_model)
    return experts


def block_classes(config: HFConfig) -> tuple[type[nn.Module], ...]:
    """The classes named by the model's ``_no_split_modules``."""
    skeleton = config.skeleton()
    names = set(getattr(skeleton, "_no_split_modules", None) or ())
    return tuple({type(m) for m in skeleton.modules() if type(m).__name__ in names})


def init_tensor(
    name: str, shape: Sequence[int], config: HFConfig, seed: int
) -> torch.Tensor:
    """The initial value of parameter or buffer ``name``: the model's ``_init_weights``
    applied to a CPU copy of the module that owns it, with a generator seeded by the
    name (transformers' init functions draw from torch's default generator)."""
    skeleton = config.skeleton()
    local = name.removeprefix(PREFIX)
    owner_name, _, leaf = local.rpartition(".")
    owner = copy.deepcopy(skeleton.get_submodule(owner_name)).to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(name_generator(seed, name).initial_seed())
        skeleton._init_weights(owner)
    value = getattr(owner, leaf).detach().float()
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"init_tensor: {name} has shape {tuple(value.shape)}, not {tuple(shape)}"
        )
    return value


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``idx`` followed by ``max_new_tokens`` tokens from transformers' ``generate()``
    on the (unsharded) :class:`HFCausalLM` ``model``, with its KV cache: greedy when
    ``temperature`` is 0, else sampled (torch's default generator: seed it first) from
    the ``top_k`` most likely. Ids from ``vocab_size`` on are suppressed; generation
    does not stop early at an end-of-text id (as the native families')."""
    hf = model.hf
    hf.eval()
    total = hf.get_output_embeddings().weight.size(0)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": top_k or 0}
        if temperature
        else {"do_sample": False}
    )
    return hf.generate(
        input_ids=idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        use_cache=True,
        top_p=1.0,
        pad_token_id=0,
        suppress_tokens=list(range(vocab_size, total)) if vocab_size else None,
        **sampling,
    )


@contextlib.contextmanager
def eager_on_fake_tensors() -> Iterator[None]:
    """transformers takes a fake tensor for a graph being compiled (``is_tracing``)
    and then materialises the causal mask and repeats GQA's keys and values, which an
    eager run does not: the planner's fake-tensor trace (src/planner/trace.py) runs
    in this context, so it follows the eager path it measures. Packed sequences are
    looked for by reading the positions (data a fake tensor has not); the trainer's
    are never packed."""
    from transformers import masking_utils
    from transformers.utils import import_utils

    saved = import_utils.is_fake_tensor, masking_utils.find_packed_sequence_indices
    import_utils.is_fake_tensor = lambda x: False
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None
    try:
        yield
    finally:
        import_utils.is_fake_tensor, masking_utils.find_packed_sequence_indices = saved


def flops_per_token(config: HFConfig, seq_len: int) -> int:
    """``6 N + 12 n_layers hidden seq_len`` as for the GPT: N the parameters in
    matmuls (all but the input embedding, unless tied to the head)."""
    skeleton = config.skeleton()
    text = config.hf_config.get_text_config()
    n = sum(p.numel() for p in skeleton.parameters())  # a tied head counted once
    embed = skeleton.get_input_embeddings().weight
    out = skeleton.get_output_embeddings()
    if out is None or out.weight is not embed:
        n -= embed.numel()
    return 6 * n + 12 * text.num_hidden_layers * text.hidden_size * seq_len


def tp_plan(config: HFConfig, tp: int, sequence_parallel: bool | None) -> TPPlan:
    """The plan transformers ships for the architecture (``base_model_tp_plan`` in
    its config: colwise/rowwise projections, its style strings mapped onto torch's),
    plus the output layer colwise with vocabulary-sharded logits into the loss when
    it is not tied to an embedding the plan leaves whole. transformers' plans have
    no sequence-parallel norms, so neither has this one."""
    text = config.hf_config.get_text_config()
    arch = type(config.skeleton()).__name__
    base = getattr(text, "base_model_tp_plan", None)
    if not base:
        raise ValueError(
            f"{arch} has no tensor-parallel plan in transformers "
            "(its config's base_model_tp_plan is empty)"
        )
    if sequence_parallel:
        raise ValueError(
            f"transformers' tensor-parallel plan for {arch} has no sequence-parallel "
            "norms; use sequence parallelism off (its default for model=hf)"
        )
    heads = {"num_attention_heads": text.num_attention_heads}
    kv = getattr(text, "num_key_value_heads", None)
    if kv:
        heads["num_key_value_heads"] = kv
    for key, size in heads.items():
        if size % tp:
            raise ValueError(
                f"tensor parallelism over {tp} ranks splits {arch}'s {key} ({size}) "
                f"{tp} ways; choose a degree that divides it"
            )
    skeleton = config.skeleton()
    root = skeleton.get_submodule(skeleton.base_model_prefix)
    modules: dict[type, dict] = {type(root): styles_from_strings(base, arch)}
    out = skeleton.get_output_embeddings()
    tied = out is not None and out.weight is skeleton.get_input_embeddings().weight
    head = next((n for n, m in skeleton.named_children() if m is out), None)
    loss_parallel = head is not None and not tied
    if loss_parallel:
        modules[type(skeleton)] = {
            head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        }
    return TPPlan(modules, sequence_parallel=False, loss_parallel=loss_parallel)


register(
    ModelSpec(
        name="hf",
        config_cls=HFConfig,
        key_help={
            "config": "hf: a transformers config dir, or a name in conf/hf_configs",
            "trust_remote_code": "hf: run the config dir's own model code (auto_map)",
        },
        build=build,
        block_classes=block_classes,
        flops_per_token=flops_per_token,
        init_tensor=init_tensor,
        generate=generate,
        vocab_size=lambda config: config.hf_config.get_text_config().vocab_size,
        imports=("transformers",),
        trace_context=eager_on_fake_tensors,
        hf=HFAdapter(
            to_hf_name=lambda name: name.removeprefix(PREFIX),
            hf_config=lambda config: config.hf_config,
            skeleton=lambda config: config.skeleton(),
        ),
        tp_plan=tp_plan,
        context_parallel=check_context_parallel,
        documents=True,
        kv_width=kv_width,
        lora_targets=(
            *("q_proj", "k_proj", "v_proj", "o_proj"),
            *("gate_proj", "up_proj", "down_proj"),
        ),
        pipeline=pipeline_layout,
        routes_tokens=lambda config: routed_experts(config.hf_config) > 1,
        num_experts=ep_experts,
        after_step=hf_routing.after_step,
        expert_shape=lambda config, seq_len: hf_experts.expert_shape(
            config.hf_config, config.skeleton().base_model
        ),
    )
)
