"""``choose_auto_wrap_units`` against torch's own recursion, ``_recursive_wrap`` driven by
``size_based_auto_wrap_policy`` and a wrapper that only records module paths.

Where no parameter (or module) is shared, the two plans must be the same units in the
same order. Where one is shared, torch may split it across units (which FSDP cannot
train); the project's plan must keep every shared parameter's users in one unit. The
only other difference is documented in docs/sharding.md: at ``min_num_params=0`` torch
also wraps modules that hold no parameters at all (a ``ReLU``); the project never does.
"""

from __future__ import annotations

import functools
import random
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

from src.sharding import choose_auto_wrap_units
from src.sharding.wrap import DEFAULT_EXCLUDE_WRAP_MODULES, DEFAULT_FORCE_LEAF_MODULES


def module_paths(model: nn.Module) -> dict[int, str]:
    """Module id -> path of its first registration (what both plans name it by)."""
    return {id(m): name for name, m in model.named_modules()}


def torch_plan(model, threshold, exclude=(), force_leaf=()) -> list[str]:
    paths = module_paths(model)
    recorded: list[str] = []

    def record(module, **_):
        recorded.append(paths[id(module)])
        return module

    policy = functools.partial(
        size_based_auto_wrap_policy,
        min_num_params=threshold,
        # torch's sets replace its defaults; the project's extend them.
        exclude_wrap_modules=DEFAULT_EXCLUDE_WRAP_MODULES | set(exclude),
        force_leaf_modules=DEFAULT_FORCE_LEAF_MODULES | set(force_leaf),
    )
    _recursive_wrap(model, policy, record, ignored_modules=set(), ignored_params=set())
    return recorded


def our_plan(model, threshold, exclude=(), force_leaf=()) -> list[str]:
    paths = module_paths(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tie warning
        plan = choose_auto_wrap_units(model, threshold, exclude, force_leaf)
    return [paths[id(m)] for _, _, m in plan.units]


def shared_users(model: nn.Module) -> list[list[str]]:
    """For each parameter reachable by more than one path: the paths of its users."""
    users: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                users.setdefault(id(p), []).append(name)
    return [u for u in users.values() if len(u) > 1]


def unit_of(model: nn.Module, path: str, units: list[str]) -> int | None:
    """Id of the innermost unit on the way to ``path`` (None: in no unit).

    By identity, not by path: a module registered twice is reached by two paths.
    """
    unit_ids = {id(model.get_submodule(u)) for u in units}
    held_by, m = None, model
    for name in [""] + (path.split(".") if path else []):
        m = m.get_submodule(name) if name else m
        held_by = id(m) if id(m) in unit_ids else held_by
    return held_by


def assert_plans_agree(model, levels, exclude=(), force_leaf=()) -> list[list[str]]:
    """Compare the two plans at each threshold in ``levels``; return the project's."""
    ties = shared_users(model)
    has_params = {
        n for n, m in model.named_modules() if next(m.parameters(), None) is not None
    }
    plans = []
    for threshold in levels:
        ours = our_plan(model, threshold, exclude, force_leaf)
        where = f"threshold={threshold} exclude={exclude} force_leaf={force_leaf}"
        for users in ties:
            held_by = {unit_of(model, u, ours) for u in users}
            assert len(held_by) == 1, f"{where}: {users} split across {held_by}"
        if not ties:
            theirs = torch_plan(model, threshold, exclude, force_leaf)
            if threshold == 0:  # torch also wraps modules without any parameter
                theirs = [p for p in theirs if p in has_params]
            assert ours == theirs, where
        plans.append(ours)
    return plans


def thresholds(model: nn.Module) -> list[float]:
    """Every module's size, and half a parameter either side: each boundary of the rule."""
    sizes = {sum(p.numel() for p in m.parameters()) for m in model.modules()}
    return sorted(
        {0, 0.5} | {s + d for s in sizes for d in (-0.5, 0, 0.5) if s + d > 0}
    )


# ---------------------------------------------------------------- the issue's cases


def lin(n_in, n_out):
    return nn.Linear(n_in, n_out, bias=False)


def test_issue_reproducers_give_torchs_answers():
    mha_first = nn.Sequential(nn.MultiheadAttention(16, 2), lin(4, 4))
    assert torch_plan(mha_first, 200) == our_plan(mha_first, 200) == [""]
    mha_root = nn.MultiheadAttention(16, 2)
    assert torch_plan(mha_root, 200) == our_plan(mha_root, 200) == []
    two = nn.Sequential(lin(10, 10), lin(5, 5))
    assert torch_plan(two, 100.5) == our_plan(two, 100.5) == [""]
    # At 0.5 a module without parameters is no unit, nor is a root holding none.
    for model, expected in (
        (nn.ReLU(), []),
        (nn.Sequential(nn.ReLU()), []),
        (nn.Sequential(nn.ReLU(), lin(1, 1)), ["1"]),
    ):
        assert torch_plan(model, 0.5) == our_plan(model, 0.5) == expected
    # At 0 torch wraps parameterless modules too; the project never does.
    relu_lin = nn.Sequential(nn.ReLU(), lin(1, 1))
    assert torch_plan(relu_lin, 0) == ["0", "1", ""]
    assert our_plan(relu_lin, 0) == ["1", ""]


class Box(nn.Module):
    """A container that may hold a parameter of its own."""

    def __init__(self, *children: nn.Module, own: int = 0):
        super().__init__()
        for i, c in enumerate(children):
            self.add_module(f"c{i}", c)
        if own:
            self.w = nn.Parameter(torch.empty(own))


class Leafy(Box):
    """Made force-leaf by some cases."""


class Skip(Box):
    """Made excluded by some cases."""


SETS = [
    {},
    {"force_leaf": (Leafy,)},
    {"exclude": (Skip,)},
    {"force_leaf": (Leafy, nn.Sequential), "exclude": (Skip, nn.LayerNorm)},
    {"exclude": (Box,)},
]


def nested_containers() -> nn.Module:
    return Box(
        nn.ModuleList([Box(lin(8, 8), own=3), nn.ModuleDict({"a": lin(8, 8)})]),
        nn.Sequential(nn.Sequential(nn.Sequential(lin(6, 6)), nn.ReLU()), lin(5, 5)),
        Leafy(Box(lin(9, 9)), lin(2, 2)),
        Skip(nn.ModuleList([lin(7, 7), Skip(lin(4, 4), own=1)]), nn.LayerNorm(8)),
        nn.MultiheadAttention(8, 2),
        own=5,
    )


@pytest.mark.parametrize("sets", SETS, ids=lambda s: ",".join(s) or "defaults")
def test_nested_containers_and_user_sets(sets):
    model = nested_containers()
    assert_plans_agree(model, thresholds(model), **sets)


# ---------------------------------------------------------------- random trees


def random_tree(rng: random.Random, depth: int = 0) -> nn.Module:
    if depth >= 4 or rng.random() < 0.3:
        n = rng.randint(1, 6)
        return rng.choice(
            [
                lambda: nn.Linear(n, rng.randint(1, 6), bias=rng.random() < 0.5),
                lambda: nn.ReLU(),
                lambda: nn.LayerNorm(n),
                lambda: nn.Embedding(rng.randint(1, 9), n),
                lambda: nn.MultiheadAttention(2 * n, 2),
            ]
        )()
    kids = [random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    kind = rng.choice(["seq", "list", "dict", "box", "leafy", "skip"])
    if kind == "seq":
        return nn.Sequential(*kids)
    if kind == "list":
        return nn.ModuleList(kids)
    if kind == "dict":
        return nn.ModuleDict({f"k{i}": k for i, k in enumerate(kids)})
    cls = {"box": Box, "leafy": Leafy, "skip": Skip}[kind]
    return cls(*kids, own=rng.choice([0, 0, rng.randint(1, 20)]))


def tie_something(rng: random.Random, model: nn.Module) -> bool:
    """Share a parameter, or register a submodule a second time; False if none can."""
    mods = [m for m in model.modules() if m._parameters]
    if len(mods) >= 2 and rng.random() < 0.6:
        a, b = rng.sample(mods, 2)
        name_a, name_b = (
            rng.choice(list(a._parameters)),
            rng.choice(list(b._parameters)),
        )
        if a._parameters[name_a] is None or b._parameters[name_b] is None:
            return False
        setattr(b, name_b, a._parameters[name_a])
        return True
    boxes = [m for m in model.modules() if isinstance(m, Box)]
    subs = [
        m
        for m in model.modules()
        if m is not model and next(m.parameters(), None) is not None
    ]
    if not boxes or not subs:
        return False
    sub = rng.choice(subs)
    inside = {id(m) for m in sub.modules()}
    outside = [b for b in boxes if id(b) not in inside]  # no cycle
    if not outside:
        return False
    rng.choice(outside).add_module("again", sub)
    return True


@pytest.mark.parametrize("seed", range(3))
def test_random_trees(seed):
    rng = random.Random(seed)
    compared = tied = 0
    for _ in range(50):
        with torch.device("meta"):
            model = Box(*(random_tree(rng, 1) for _ in range(rng.randint(1, 4))))
        sets = rng.choice(SETS)
        if rng.random() < 0.25 and tie_something(rng, model):
            tied += 1
        some = thresholds(model)
        some = rng.sample(some, min(6, len(some)))
        assert_plans_agree(model, some, **sets)
        compared += len(some)
    assert tied > 0 and compared > 200  # the generator did exercise both paths


# ---------------------------------------------------- Hugging Face architectures

# Each config maps these common names to its own (GPT-2: n_embd, T5: d_model...).
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=0,
)
ARCHS = {  # name: (head, config overrides)
    "gpt2": ("causal", {}),
    "llama": ("causal", {"tie_word_embeddings": False}),
    "llama_tied": ("causal", {"tie_word_embeddings": True}),
    "qwen2": ("causal", {}),
    "mistral": ("causal", {}),
    "opt": ("causal", {"ffn_dim": 64, "word_embed_proj_dim": 32, "pad_token_id": 1}),
    "bert": ("base", {"num_key_value_heads": None}),
    "t5": ("base", {"d_ff": 64, "d_kv": 8, "num_decoder_layers": 2}),
}


def build_hf(arch: str) -> nn.Module:
    """The architecture from a tiny config, on meta: nothing allocated or downloaded."""
    transformers = pytest.importorskip("transformers")
    kind, overrides = ARCHS[arch]
    kwargs = {k: v for k, v in {**TINY, **overrides}.items() if v is not None}
    cfg = transformers.AutoConfig.for_model(arch.removesuffix("_tied"), **kwargs)
    auto = (
        transformers.AutoModelForCausalLM
        if kind == "causal"
        else transformers.AutoModel
    )
    with torch.device("meta"):
        return auto.from_config(cfg)


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The model's own "do not split" classes (its decoder/encoder layers)."""
    names = set(model._no_split_modules or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


@pytest.mark.parametrize("arch", list(ARCHS))
def test_hugging_face_architectures(arch):
    model = build_hf(arch)
    blocks = block_classes(model)
    assert blocks, f"{arch}: no block class found"
    layer = max(
        sum(p.numel() for p in m.parameters())
        for m in model.modules()
        if isinstance(m, blocks)
    )
    plans = assert_plans_agree(model, thresholds(model) + [layer / 2])
    if arch == "gpt2":  # torch puts wte in `transformer`'s unit, lm_head outside it
        mlps = [f"transformer.h.{i}.mlp" for i in range(3)]
        assert torch_plan(model, layer / 2) == mlps + ["transformer"]
        assert plans[-1] == mlps + [""]  # the tie stays whole, in the root
    levels = [layer / 2, layer, layer + 0.5, 4 * layer]
    plans = assert_plans_agree(model, levels, force_leaf=blocks)
    if arch == "llama":  # the issue's reproducer: the layers stay whole in `model`
        assert plans[0] == ["model"]
    assert_plans_agree(model, levels, exclude=blocks)
