"""The expert-parallel adapter of transformers' MoE models (src/models/hf_experts.py),
in one process: its dispatch path computes what transformers' experts compute, and
what it cannot split is refused in one line naming the key. The multi-rank parity is
in tests/test_expert_parallel.py's launch."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from src.models import hf_experts
from src.models.hf import HFConfig, build
from tests.test_config import config_error


@pytest.fixture
def one_rank_mesh():
    started = not dist.is_initialized()
    if started:
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group(
            "gloo", store=dist.FileStore(path, 1), rank=0, world_size=1
        )
    yield init_device_mesh("cpu", (1,))
    if started:
        dist.destroy_process_group()


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
        m.ep_mesh = mesh
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
