"""The semantic rules of enable_wrap / wrap / auto_wrap (single process).

A recording wrapper stands in for FSDP where only the wrap decisions are under test; the
tests that need real FSDP (double wrap, mixed precision, hooks) run on a one-rank gloo
process group, and the multi-rank numerics live in test_sharded_parity.py.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from src.sharding import (
    auto_wrap,
    build_backend,
    build_policy,
    build_sharded_model,
    choose_auto_wrap_units,
    enable_wrap,
    is_wrapped,
    wrap,
    wrap_enabled,
    wrap_plan,
)


class Recorder:
    """A wrapper that records each call (module, kwargs) and tags nothing itself."""

    def __init__(self):
        self.calls: list[tuple[nn.Module, dict]] = []

    def __call__(self, module, **kwargs):
        self.calls.append((module, kwargs))
        return module

    def wrapped(self) -> list[nn.Module]:
        return [m for m, _ in self.calls]


def lin(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)  # n_in * n_out parameters


@pytest.fixture(scope="module")
def one_rank_group():
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group(
            "gloo", store=dist.FileStore(path, 1), rank=0, world_size=1
        )
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- context and wrap()


def test_noop_outside_context():
    layer = lin(4, 4)
    model = nn.Sequential(lin(100, 100), lin(100, 100))
    assert wrap(layer) is layer
    assert auto_wrap(model, min_num_params=1) is model
    assert not wrap_enabled()
    assert not any(is_wrapped(m) for m in model.modules())


def test_precedence_overrides_beat_class_settings_beat_defaults():
    rec = Recorder()

    class Special(nn.Linear):
        pass

    settings = {nn.Linear: {"b": "linear", "c": "linear"}, Special: {"c": "special"}}
    with enable_wrap(
        rec, module_overrides=settings, a="ctx", b="ctx", c="ctx", d="ctx"
    ):
        wrap(nn.Linear(2, 2), d="call")
        wrap(Special(2, 2))
        wrap(nn.Conv1d(1, 1, 1))
    assert [kw for _, kw in rec.calls] == [
        {"a": "ctx", "b": "linear", "c": "linear", "d": "call"},
        {"a": "ctx", "b": "linear", "c": "special", "d": "ctx"},
        {"a": "ctx", "b": "ctx", "c": "ctx", "d": "ctx"},
    ]


def test_nested_context_raises_and_outer_stays_active():
    with enable_wrap(Recorder()):
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with enable_wrap(Recorder()):
                pass
        assert wrap_enabled()
    assert not wrap_enabled()


def test_context_reset_after_exception():
    with pytest.raises(ValueError):
        with enable_wrap(Recorder()):
            raise ValueError("boom")
    assert not wrap_enabled()
    layer = lin(2, 2)
    assert wrap(layer) is layer
    with enable_wrap(Recorder()):  # a new context can be entered again
        pass


def test_no_double_wrap_with_a_generic_wrapper():
    rec = Recorder()
    with enable_wrap(rec):
        layer = wrap(wrap(lin(2, 2)))
        auto_wrap(nn.Sequential(layer), min_num_params=0)
    assert rec.wrapped().count(layer) == 1


def test_no_double_wrap_fsdp2_and_fsdp1(one_rank_group):
    with enable_wrap(fully_shard):
        layer = wrap(lin(4, 4))
        assert isinstance(layer, FSDPModule)
        assert wrap(layer) is layer
    with enable_wrap(FSDP1, use_orig_params=True, device_id=torch.device("cpu")):
        layer = wrap(lin(4, 4))
        assert isinstance(layer, FSDP1)
        again = wrap(layer)
        assert again is layer
        assert not isinstance(layer.module, FSDP1)


def test_fsdp1_wrapper_returning_new_module_is_installed_in_parent(one_rank_group):
    model = nn.Sequential(nn.Sequential(lin(10, 10), lin(10, 10)), lin(10, 10))
    with enable_wrap(FSDP1, use_orig_params=True, device_id=torch.device("cpu")):
        out = auto_wrap(model, min_num_params=100)
    assert out is model  # root remainder is 0: not a unit
    assert isinstance(model[0][0], FSDP1) and isinstance(model[1], FSDP1)
    assert not isinstance(model[0], FSDP1)
    assert out(torch.randn(3, 10)).shape == (3, 10)


# ------------------------------------------------------------------------ auto_wrap


def units_of(model, **kwargs):
    return [m for _, _, m in choose_auto_wrap_units(model, **kwargs).units]


def test_remainder_rule_deepest_first():
    # inner: two 100-param leaves; outer adds a 64-param leaf.
    inner = nn.Sequential(lin(10, 10), lin(10, 10))
    model = nn.Sequential(inner, lin(8, 8))
    # threshold 100: both leaves are units; inner's remainder is 0; root remainder 64 < 100.
    assert units_of(model, min_num_params=100) == [inner[0], inner[1]]
    # threshold 150: leaves too small; inner (200) is a unit; root remainder 64 -> not.
    assert units_of(model, min_num_params=150) == [inner]
    # threshold 250: nothing but the root (264 params).
    assert units_of(model, min_num_params=250) == [model]
    # threshold above the total: nothing at all.
    assert units_of(model, min_num_params=1e6) == []


def test_child_below_threshold_is_not_explored_and_counts_for_parent():
    small = nn.Sequential(lin(5, 5), lin(5, 5))  # 50 params
    model = nn.Sequential(small, nn.Sequential(lin(5, 5), lin(5, 5)))  # 100 params
    # neither child reaches 60, so neither is explored; their 100 params make the root
    assert units_of(model, min_num_params=60) == [model]


def test_auto_wrap_inside_context_wraps_in_post_order():
    rec = Recorder()
    inner = nn.Sequential(lin(10, 10), lin(10, 10))
    model = nn.Sequential(inner, lin(10, 10))
    with enable_wrap(rec, x=1):
        out = auto_wrap(model, min_num_params=100, y=2)
    assert out is model
    assert rec.wrapped() == [inner[0], inner[1], model[1]]
    assert all(kw == {"x": 1, "y": 2} for _, kw in rec.calls)


def test_min_num_params_accepts_float_and_rejects_bad_values():
    model = nn.Sequential(lin(10, 10))
    assert units_of(model, min_num_params=1e2) == [model[0]]
    with pytest.raises(ValueError, match="min_num_params"):
        choose_auto_wrap_units(model, min_num_params=-1)
    with pytest.raises(TypeError, match="min_num_params"):
        choose_auto_wrap_units(model, min_num_params="1e8")


def test_default_excludes_modulelist_and_moduledict_but_not_their_children():
    blocks = nn.ModuleList([lin(10, 10), lin(10, 10)])
    table = nn.ModuleDict({"a": lin(10, 10)})
    model = nn.Sequential(blocks, table)
    got = units_of(model, min_num_params=100)
    assert blocks[0] in got and blocks[1] in got and table["a"] in got
    assert blocks not in got and table not in got
    # A ModuleList whose remainder reaches the threshold still is not a unit.
    # (its 128 parameters pass up to the root instead).
    small = nn.ModuleList([lin(8, 8), lin(8, 8)])
    root = nn.Sequential(small, lin(1, 1))
    assert units_of(root, min_num_params=100) == [root]


def test_user_exclusions_extend_the_defaults():
    inner = nn.Sequential(lin(10, 10), lin(10, 10))
    blocks = nn.ModuleList([lin(10, 10)])
    model = nn.Sequential(inner, blocks)
    got = units_of(model, min_num_params=150, exclude_wrap_modules={nn.Sequential})
    assert got == []  # inner excluded, root excluded, ModuleList still excluded
    got = units_of(model, min_num_params=100, exclude_wrap_modules={nn.Sequential})
    assert got == [inner[0], inner[1], blocks[0]]


def test_multihead_attention_is_a_forced_leaf_by_default():
    """A force-leaf module is never split and never a unit by itself (as in fairscale
    and torch: the wrap decision is made only while recursing, and force-leaf stops
    the recursion); its parameters land in the parent's remainder. Until issue 16 a
    large enough force-leaf module was made a unit of its own, unlike torch."""
    mha = nn.MultiheadAttention(16, 2)  # out_proj alone has 272 params
    model = nn.Sequential(mha, lin(4, 4))
    assert units_of(model, min_num_params=200) == [model]
    # As the root it is not explored, so nothing at all is a unit.
    assert units_of(nn.MultiheadAttention(16, 2), min_num_params=200) == []


def test_user_force_leaf_extends_the_defaults():
    """User force-leaf classes join {MultiheadAttention}: neither kind is split nor
    a unit by itself (before issue 16 both became units of their own)."""
    model = nn.Module()
    model.inner = nn.Sequential(lin(10, 10), lin(10, 10))
    model.mha = nn.MultiheadAttention(16, 2)
    model.tail = lin(10, 10)
    got = units_of(model, min_num_params=100, force_leaf_modules={nn.Sequential})
    # inner (200) and mha (1088) stay whole in the root's remainder.
    assert got == [model.tail, model]
    # A force-leaf root is not explored at all.
    root = nn.Sequential(model.inner, model.mha)
    assert units_of(root, min_num_params=100, force_leaf_modules={nn.Sequential}) == []


class Tied(nn.Module):
    """Embedding and head share one weight, with blocks in between."""

    def __init__(self, vocab=50, dim=8, n_blocks=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [nn.Sequential(lin(dim, dim), lin(dim, dim)) for _ in range(n_blocks)]
        )
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight


@pytest.mark.parametrize("threshold", [0, 1, 64, 128, 400, 500])
def test_tied_parameters_are_never_split_across_units(threshold):
    model = Tied()
    units = units_of(model, min_num_params=threshold)
    assert model.wte not in units and model.head not in units
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = choose_auto_wrap_units(model, min_num_params=threshold)
    if threshold <= 400:  # wte/head would have been units: the warning says why not
        assert plan.blocked_by_ties["wte"] == ["wte.weight"]
        assert plan.blocked_by_ties["head"] == ["wte.weight"]


def test_tied_warning_names_the_parameter():
    rec = Recorder()
    with pytest.warns(UserWarning, match=r"wte\.weight"):
        with enable_wrap(rec):
            auto_wrap(Tied(), min_num_params=100)


def test_module_registered_twice_is_not_its_own_unit():
    shared = nn.Sequential(lin(10, 10))
    model = nn.Module()
    model.a = nn.Sequential(shared, lin(10, 10))
    model.b = nn.Sequential(shared)
    got = units_of(model, min_num_params=100)
    assert shared not in got and model.a not in got and model.b not in got
    assert model.a[1] in got


def test_planning_is_linear_in_module_count():
    import time

    def timed(n):
        model = nn.Sequential(*[nn.Sequential(lin(2, 2), nn.ReLU()) for _ in range(n)])
        t0 = time.perf_counter()
        choose_auto_wrap_units(model, min_num_params=8)
        return time.perf_counter() - t0

    timed(100)
    small, large = (
        min(timed(2000) for _ in range(3)),
        min(timed(16000) for _ in range(3)),
    )
    assert large / small < 8 * 3  # 8x the modules; quadratic would be ~64x


# ------------------------------------------------------ policies and the wrap plan


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.fc1, self.fc2 = lin(dim, 4 * dim), lin(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class AnnotatedNet(nn.Module):
    def __init__(self, n=3, dim=8, vocab=50):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList([wrap(Block(dim)) for _ in range(n)])
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def plan_paths(policy, **kwargs):
    model = build_sharded_model(
        lambda: AnnotatedNet(**kwargs),
        build_backend("plan"),
        policy,
        init_device="meta",
    )
    return [u.path for u in wrap_plan(model, 2).units]


def test_policies_manual_block_size_and_composition():
    # Block has 512 params; the whole model 3*512 + 400.
    assert plan_paths(build_policy("manual")) == ["", "h.0", "h.1", "h.2"]
    assert plan_paths(build_policy("block", block_cls=Block)) == [
        "",
        "h.0",
        "h.1",
        "h.2",
    ]
    assert plan_paths(build_policy("size", min_num_params=256)) == [
        "",
        "h.0.fc1",
        "h.0.fc2",
        "h.1.fc1",
        "h.1.fc2",
        "h.2.fc1",
        "h.2.fc2",
    ]
    # 600 > one block: blocks are not units; the root takes everything.
    assert plan_paths(build_policy("size", min_num_params=600)) == [""]
    composed = build_policy(["block", "size"], min_num_params=256, block_cls=Block)
    assert plan_paths(composed) == ["", "h.0", "h.1", "h.2"]


def test_unknown_policy_and_block_without_class_fail_clearly():
    with pytest.raises(ValueError, match="sharding.policy"):
        build_policy("everything")
    with pytest.raises(ValueError, match="block class"):
        build_policy("block")


def test_plan_on_meta_allocates_nothing_and_reports_bytes_per_rank():
    model = build_sharded_model(
        lambda: AnnotatedNet(n=2, dim=16),
        build_backend("plan"),
        build_policy("manual"),
        init_device="meta",
    )
    assert all(p.is_meta for p in model.parameters())
    plan = wrap_plan(model, 4)
    block = next(u for u in plan.units if u.path == "h.0")
    assert block.numel == 2 * 16 * 64 and block.cls == "Block"
    assert block.bytes_per_rank == block.numel * 4 // 4
    assert plan.total_numel == sum(p.numel() for p in model.parameters())
    tree = plan.tree()
    assert "h.1 (Block)" in tree and "<root> (AnnotatedNet)" in tree


# ---------------------------------------------------- mixed precision and the hooks


class IdsAndDetached(nn.Module):
    """Takes integer ids; returns a float output, an int tensor and a detached one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.proj = lin(8, 8)

    def forward(self, idx):
        assert idx.dtype == torch.int64  # never cast by mixed precision
        h = self.proj(self.emb(idx))
        return h, idx.argmax(-1), h.detach() * 2


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = wrap(IdsAndDetached())
        self.frozen = wrap(lin(8, 8))
        self.frozen.requires_grad_(False)
        self.head = lin(8, 1)

    def forward(self, idx):
        h, ints, det = self.body(idx)
        with torch.no_grad():
            z = self.frozen(det)
        return self.head(h + z).sum(), ints


@pytest.mark.parametrize("backend_name", ["fsdp2", "fsdp1"])
@pytest.mark.parametrize("precision", ["bf16_mixed", "fp16_mixed", "fp32"])
def test_integer_inputs_and_outputs_without_grad(
    one_rank_group, backend_name, precision
):
    backend = build_backend(backend_name, precision, "cpu")
    model = build_sharded_model(Frozen, backend, build_policy("manual"))
    idx = torch.randint(0, 10, (2, 5))
    loss, ints = model(idx)
    assert ints.dtype == torch.int64
    loss.float().backward()
    assert model.head.weight.grad is not None
    expected = {"fp32": torch.float32, "bf16_mixed": torch.bfloat16}.get(
        precision, torch.float16
    )
    assert loss.dtype == expected


def test_second_wrap_of_an_fsdp1_inner_module_returns_its_wrapper(one_rank_group):
    layer = lin(4, 4)
    with enable_wrap(FSDP1, use_orig_params=True, device_id=torch.device("cpu")):
        first = wrap(layer)
        assert isinstance(first, FSDP1)
        assert wrap(layer) is first


def test_plan_tree_sorts_numeric_and_named_siblings():
    model = build_sharded_model(
        lambda: nn.ModuleDict(
            {"0": wrap(lin(4, 4)), "head": wrap(lin(4, 4)), "10": wrap(lin(4, 4))}
        ),
        build_backend("plan"),
        build_policy("manual"),
        init_device="meta",
    )
    tree = wrap_plan(model, 2).tree()
    assert tree.index("  0 (") < tree.index("  10 (") < tree.index("  head (")


def test_the_family_parallelize_function_runs_as_built_then_per_unit():
    """``build_sharded_model(parallelize=fn)``: ``fn`` sees each annotated module as
    it is built (``unit=False``), the root once the model exists, then each unit the
    policy picks (``unit=True``) before it is sharded, the root last."""
    calls = []

    def record(module, steps, *, unit):
        calls.append((type(module).__name__, unit, is_wrapped(module)))

    build_sharded_model(
        lambda: AnnotatedNet(n=2),
        build_backend("plan"),
        build_policy("manual"),
        init_device="meta",
        parallelize=record,
    )
    assert calls == [
        ("Block", False, False),
        ("Block", True, False),
        ("Block", False, False),
        ("Block", True, False),
        ("AnnotatedNet", False, False),
        ("AnnotatedNet", True, False),
    ]
