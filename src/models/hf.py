"""Hugging Face causal LMs: ``model=hf model.config=DIR`` builds any causal LM that
``transformers`` can build from a config (``AutoModelForCausalLM.from_config``) inside
the wrap context.

- ``model.config``: a local directory with a ``config.json``, or the name of one shipped
  in ``conf/hf_configs/`` (``tiny_gpt2``, ``tiny_llama``, ``tiny_qwen2``,
  ``tiny_gpt_neox``).
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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from src.models.spec import HFAdapter, ModelSpec, lm_loss, name_generator, register

SHIPPED = Path(__file__).resolve().parents[2] / "conf" / "hf_configs"
PREFIX = "hf."  # our parameter names: "hf." + the transformers model's own


@dataclass
class HFConfig:
    # A local config directory, or a name in conf/hf_configs/ (conf/model/hf.yaml
    # defaults it to model.pretrained).
    config: str | None = None
    block_size: int = 128  # the run's sequence length (<= the config's max positions)
    vocab_size: int | None = None  # None: the config's

    def __post_init__(self) -> None:
        self.hf_config = load_hf_config(self.config)
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
                self._skeleton = _from_config(self.hf_config)
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


def load_hf_config(config: str | None):
    """The ``transformers`` config of ``model.config`` (one-line ValueError if bad)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = config_dir(config)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as err:  # transformers raises ValueError, KeyError, OSError...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err)
        raise ValueError(
            f"model.config: transformers cannot read {str(path)!r}: {first}"
        ) from None
    if type(hf_config) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(
            f"model.config: {hf_config.model_type!r} in {str(path)!r} is not a "
            "causal LM that AutoModelForCausalLM can build"
        )
    hf_config.use_cache = False  # training: no KV cache
    return hf_config


def _from_config(hf_config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config)


class HFCausalLM(nn.Module):
    """A transformers causal LM with the trainer's interface:
    ``forward(idx, targets) -> (logits, loss)`` (targets already shifted, -1 ignored)."""

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

    def _apply(self, fn, recurse=True):
        # to_empty() from meta gives each module a new Parameter: re-tie (as the GPT).
        super()._apply(fn, recurse)
        for alias, kept in self._ties:
            module, _, leaf = alias.rpartition(".")
            setattr(self.hf.get_submodule(module), leaf, self.hf.get_parameter(kept))
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.hf(input_ids=idx, use_cache=False).logits
        return logits, lm_loss(logits, targets)


def build(config: HFConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # transformers' own init (on CPU): the same on every rank
    return HFCausalLM(_from_config(config.hf_config))


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


SPEC = register(
    ModelSpec(
        name="hf",
        config_cls=HFConfig,
        build=build,
        block_classes=block_classes,
        flops_per_token=flops_per_token,
        init_tensor=init_tensor,
        generate=generate,
        vocab_size=lambda config: config.hf_config.get_text_config().vocab_size,
        hf=HFAdapter(
            to_hf_name=lambda name: name.removeprefix(PREFIX),
            hf_config=lambda config: config.hf_config,
            skeleton=lambda config: config.skeleton(),
        ),
    )
)
