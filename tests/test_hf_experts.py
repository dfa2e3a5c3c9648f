"""The expert-parallel adapter of transformers' MoE models (src/models/hf_experts.py),
in one process: its dispatch path computes what transformers' experts compute, and
what it cannot split is refused in one line naming the key. The multi-rank parity is
in tests/test_expert_parallel.py's launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from src.models import hf_experts
from src.models.hf import HFConfig, build
from tests.test_config import config_error


@pytest.mark.parametrize("name", ["tiny_mixtral", "tiny_qwen3_moe"])
def test_dispatch_path_equals_transformers_forward_and_backward(name, one_rank_mesh):
    model = build(HFConfig(config=name), seed=0)
    experts = [m for m in model.modules() if isinstance(m, hf_experts.ExpertModule)]
    assert len(experts) == model.hf.config.num_hidden_layers
    m = experts[0]
    torch.manual_seed(1)
    x = torch.randn(24, m.hidden_dim, requires_grad=True)
    # ties and repeats: top-k index rows as a router gives them
    index = torch.randint(0, m.num_experts, (24, 2))
    index[:, 1] = (index[:, 0] + 1 + torch.randint(0, m.num_experts - 1, (24,))) % (
        m.num_experts
    )
    weights = torch.rand(24, 2)

    def run(mesh):
        m.parallel = None if mesh is None else SimpleNamespace(ep=mesh, tp=None)
        for p in (x, *m.parameters()):
            p.grad = None
        out = m(x, index, weights)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), x.grad.clone(), m.gate_up_proj.grad.clone()

    plain, split = run(None), run(one_rank_mesh)  # transformers' own, then dispatched
    for a, b in zip(plain, split, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_moe_without_an_ep_plan_or_a_dense_model_is_refused_naming_the_key(tmp_path):
    from transformers import DbrxConfig

    small = {"d_model": 32, "n_heads": 2, "n_layers": 1, "vocab_size": 64}
    DbrxConfig(**small, ffn_config={"moe_num_experts": 4}).save_pretrained(tmp_path)
    ep = "sharding.expert_parallel=2", "trainer.devices=2"
    err = config_error("model=hf", f"model.config={tmp_path}", *ep)
    assert err.startswith("sharding.expert_parallel:") and "'dbrx'" in err
    assert "base_model_ep_plan" in err and "\n" not in err
    err = config_error("model=hf", "model.config=tiny_llama", *ep)
    assert err.startswith("sharding.expert_parallel:") and "no MoE block" in err


@pytest.mark.parametrize("name", ["tiny_mixtral", "tiny_qwen3_moe"])
def test_routing_metrics_are_transformers_router_logits_counted(name):
    """The per-layer MoE metrics of an HF model (src/models/hf_routing.py) equal what
    transformers' own router logits give: tokens per expert from their top-k, the
    layer's balance loss from its load_balancing_loss_func, the mean entropy; counted
    in training only, reset by each step's metrics; none on a pipeline stage."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from src.models import get_spec

    model = build(HFConfig(config=name), seed=0)
    text = model.hf.config.get_text_config()
    idx = torch.randint(0, text.vocab_size, (3, 10), generator=torch.Generator())
    with torch.no_grad():
        model.eval()  # not counted
        logits = model.hf(idx, output_router_logits=True).router_logits
        model.train()
        model(idx)
    after_step = get_spec("hf").after_step
    rows = after_step(model, 1)
    k, E = text.num_experts_per_tok, logits[0].size(-1)
    for i, layer in enumerate(logits):
        counts = torch.bincount(layer.topk(k, -1).indices.reshape(-1), minlength=E)
        p = layer.float().softmax(-1)
        prefix = f"moe/layer{i}/"
        assert rows[prefix + "tokens_max"] == counts.max().item()
        assert rows[prefix + "tokens_mean"] == 3 * 10 * k / E
        assert rows[prefix + "dropped"] == 0
        aux = load_balancing_loss_func((layer,), E, k).item()
        assert abs(rows[prefix + "aux_loss"] - aux) < 1e-6
        entropy = -(p * p.log()).sum(-1).mean().item()
        assert abs(rows[prefix + "entropy"] - entropy) < 1e-6
    coef = text.router_aux_loss_coef
    assert rows["moe/aux_loss"] == pytest.approx(
        coef * sum(rows[f"moe/layer{i}/aux_loss"] for i in range(len(logits)))
    )
    assert after_step(model, 1) == {}  # counted once per step
    # a pipeline stage holds some of the routers: it logs none (so no rank reduces)
    with torch.no_grad():
        model(idx)
    model.hf.model.layers[1] = torch.nn.Identity()
    assert after_step(model, 1) == {}


@pytest.mark.parametrize("name", ["tiny_mixtral", "tiny_qwen3_moe"])
def test_the_router_aux_loss_is_in_the_gradient_as_transformers_adds_it(name):
    """Issue 57: in training the gradient is that of transformers' own loss with
    ``output_router_logits=True`` (the language model's plus ``router_aux_loss_coef``
    x ``load_balancing_loss_func`` over every layer's router logits); the returned
    loss stays the language model's. Across ranks: tests/test_expert_parallel.py."""
    from src.models.spec import lm_loss

    model = build(HFConfig(config=name), seed=0).train()
    text = model.hf.config.get_text_config()
    assert text.router_aux_loss_coef > 0
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, text.vocab_size, (3, 10), generator=gen)
    targets = torch.randint(0, text.vocab_size, (3, 10), generator=gen)

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    _, loss = model(idx, targets)
    loss.backward()
    ours = grads()
    out = model.hf(input_ids=idx, output_router_logits=True, use_cache=False)
    lm = lm_loss(out.logits, targets)
    assert loss.item() == pytest.approx(lm.item(), abs=1e-6)
    (lm + text.router_aux_loss_coef * out.aux_loss).backward()
    theirs = grads()
    routers = [n for n in theirs if ".gate.weight" in n and "experts" not in n]
    assert routers and all(ours[n].abs().sum() > 0 for n in routers)
    for n in theirs:
        torch.testing.assert_close(ours[n], theirs[n], rtol=1e-5, atol=1e-7)
