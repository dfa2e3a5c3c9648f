"""The run's own model and tokenizer as an lm-eval model (``ShardedLM``, registered
as ``sharded``): loglikelihood, loglikelihood_rolling and greedy generate_until.

It goes through the model's forward as validation does (``step._eval_loss``: the
backend's autocast, the logits in fp32), whatever the family (GPT, Llama, MoE,
Hugging Face) and however the model is sharded. Every rank runs the harness on the
same tasks, so every rank asks for the same forwards in the same order (each is a
collective of the sharded model); rank 0's scores and tokens are broadcast, so the
ranks never drift apart. To lm-eval each rank is a one-process run (rank 0 of 1): its
own data-parallel mode would give each rank other requests, other forwards.

Imports lm-eval (pandas, sklearn, datasets): imported only when a task is asked for.
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  (before our name: see ShardedLM)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from torch.distributed.tensor import DTensor

from src.config.run_plan import RunPlan
from src.data.tokenizer import Tokenizer
from src.sharding import Backend
from src.trainer.sampling import continued

#: generate_until's new tokens when a task's generation_kwargs give no max_gen_toks
MAX_GEN_TOKS = 256


def _broadcast(values: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``values`` on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(values, src=0)
    return values


class _EvenShares(nn.Module):
    """Tensor parallelism's forward on rows of any length: padded on the right to a
    multiple of the tp degree (its sequence split takes equal shares; causal
    attention, so no earlier position changes), the logits cut back and gathered
    whole from their vocabulary shards."""

    def __init__(self, model: nn.Module, multiple: int) -> None:
        super().__init__()
        self.inner, self.multiple = model, multiple

    def forward(self, idx: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        length = idx.size(1)
        logits, loss = self.inner(F.pad(idx, (0, -length % self.multiple)), **kwargs)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[:, :length], loss


# lm-eval 0.4.13 fills its registry of built-in models (hf, vllm, ...) only while it
# is empty: registering a name first hid them (model="hf": "no model for this name"),
# hence lm_eval.models imported above.
@register_model("sharded")
class ShardedLM(TemplateLM):
    """The run's ``model`` (this rank's shards) and ``tokenizer`` for lm-eval;
    ``batch_size``: rows per forward of loglikelihood."""

    def __init__(
        self,
        model: nn.Module,
        backend: Backend,
        resolved: RunPlan,
        tokenizer: Tokenizer,
        batch_size: int = 8,
        kv_cache: bool = True,
    ) -> None:
        super().__init__()
        tp = backend.layout.tp
        self.model = _EvenShares(model, tp) if tp > 1 else model
        self.backend, self.resolved, self.tokenizer_ = backend, resolved, tokenizer
        self.context = resolved.spec.seq_len(resolved.model_config)
        # under tensor parallelism a cached token (one) is no even split either
        self.batch_size, self.kv_cache = batch_size, kv_cache and tp == 1
        self._device = backend.device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        return self.tokenizer_.encode_text(string)

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer_.decode(ids)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's logits (B, T, vocab) of ``x``, whole on this rank, in fp32."""
        self.model.eval()
        with self.backend.autocast():
            logits = self.model(x.to(self._device))[0]
        return logits.float()

    def rows(
        self, context: list[int], continuation: list[int]
    ) -> tuple[list[int], list[int]]:
        """The model's input and its targets (-1: not scored) for ``continuation``
        after ``context``, cut to the model's window from the left."""
        whole = (context + continuation)[-(self.context + 1) :]
        scored = min(len(continuation), len(whole) - 1)
        targets = [-1] * (len(whole) - 1 - scored) + whole[len(whole) - scored :]
        return whole[:-1], targets

    def score(
        self, pairs: list[tuple[list[int], list[int]]]
    ) -> list[tuple[float, bool]]:
        """``(log-probability, greedy)`` of each ``(context, continuation)`` pair:
        the summed log-softmax of the continuation's tokens, and whether each is
        the most likely one; one forward per ``batch_size`` pairs."""
        out = []
        for start in range(0, len(pairs), self.batch_size):
            rows = [self.rows(*p) for p in pairs[start : start + self.batch_size]]
            width = max(len(x) for x, _ in rows)
            x = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            y = torch.full((len(rows), width), -1, dtype=torch.long)
            for i, (inp, tgt) in enumerate(rows):
                x[i, : len(inp)], y[i, : len(tgt)] = (
                    torch.tensor(inp),
                    torch.tensor(tgt),
                )
            logits, y = self.logits(x), y.to(self._device)
            nll = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)),
                y.view(-1),
                ignore_index=-1,
                reduction="none",
            ).view(y.shape)
            greedy = ((logits.argmax(-1) == y) | (y == -1)).all(-1)
            both = torch.stack((-nll.double().sum(-1), greedy.double()), -1)
            out += [(float(s), bool(g)) for s, g in _broadcast(both).tolist()]
        return out

    def loglikelihood(
        self, requests: list, disable_tqdm: bool = True
    ) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(
        self, requests: list, disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self.score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(
        self, requests: list, disable_tqdm: bool = False
    ) -> list[float]:
        """Each text's log-probability, token by token, in windows of the model's
        context (lm-eval's rolling windows, as its Hugging Face backend makes them)."""
        out = []
        for (text,) in [r.args for r in requests]:
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.context,
                    context_len=1,
                ),
            )
            out.append(sum(s for s, _ in self.score(list(windows))))
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (src/trainer/sampling.py), cut at the first of the
        request's ``until`` strings (and the end-of-document token)."""
        out = []
        for context, kwargs in [r.args for r in requests]:
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until.append(self.tok_decode([self.eot_token_id]))
            new = int(kwargs.get("max_gen_toks", MAX_GEN_TOKS))
            ids = self.tok_encode(context)[-max(1, self.context - new) :]
            idx = torch.tensor([ids or [self.eot_token_id]], device=self._device)
            tokens = continued(
                self.model,
                self.resolved,
                idx,
                new,
                temperature=0.0,
                top_k=None,
                seed=0,
                vocab_size=self.tokenizer_.vocab_size,
                kv_cache=self.kv_cache,
            )
            text = self.tok_decode(tokens[0, idx.size(1) :].tolist())
            for stop in until:
                text = text.split(stop)[0] if stop else text
            out.append(text)
        return out
