"""The run's parallel layout (src/sharding/layout.py): its degrees checked once, the
mesh built once with its named groups, and the one place the config meets it."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch.distributed as dist

from src.config.run_plan import LAYOUT_KEYS
from src.sharding import BACKENDS, LayoutError, ParallelLayout

from .test_config import config_error

SRC = Path(__file__).resolve().parents[1] / "src"


def _layouts(world: int):
    """Every layout of ``world`` ranks with degrees up to 4 (ep from 1, 2)."""
    for pp, r, cp, tp, ep in itertools.product(
        (1, 2, 4), (1, 2), (1, 2), (1, 2, 4), (1, 2)
    ):
        try:
            yield ParallelLayout(world, pp=pp, dp_replicate=r, cp=cp, tp=tp, ep=ep)
        except LayoutError:
            continue


def test_degrees_multiply_to_the_world_and_ranks_are_laid_out_row_major():
    seen = 0
    for layout in _layouts(16):
        seen += 1
        sizes = dict(layout.mesh_dims())
        assert layout.world_size == (
            layout.pp * layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp
        )
        assert list(sizes) == [
            d for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if d in sizes
        ]
        assert layout.dp == layout.dp_replicate * layout.dp_shard
        assert layout.fsdp_shard == layout.dp_shard * layout.cp
        # The data-parallel index is the rank's (dp_replicate, dp_shard) coordinate:
        # the ranks of a cp or tp group, and the pp stages, read the same rows.
        shape = [layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp]
        for rank in range(layout.world_size):
            coords, rest = [], rank
            for size in reversed(shape):
                coords.append(rest % size)
                rest //= size
            _, _, shard, replica, _ = coords
            assert layout.dp_rank(rank) == replica * layout.dp_shard + shard
        assert layout.stage().world_size == layout.stage_size
        assert layout.stage().dp_rank(0) == 0
    assert seen > 20
    # the start-up line names the degrees above 1
    assert ParallelLayout(16, dp_replicate=2, tp=2).describe() == ", 2 replicas, TP2"
    assert ParallelLayout(44, tp=11).describe() == ", TP11"
    assert ParallelLayout(2).describe() == ""


@pytest.mark.parametrize(
    ("degrees", "dim"),
    [
        ({"world_size": 6, "dp_replicate": 4}, "dp_replicate"),
        ({"world_size": 4, "tp": 3}, "tp"),
        ({"world_size": 8, "tp": 2, "cp": 3}, "cp"),
        ({"world_size": 4, "pp": 3}, "pp"),
        ({"world_size": 4, "tp": 2, "ep": 8}, "ep"),
        ({"world_size": 4, "tp": 0}, "tp"),
        ({"world_size": 4, "pp": True}, "pp"),
    ],
)
def test_a_degree_that_does_not_fit_names_its_dimension(degrees, dim):
    with pytest.raises(LayoutError) as err:
        ParallelLayout(**degrees)
    assert err.value.dim == dim


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["trainer.devices=4", "sharding.tensor_parallel=3"],
            "sharding.tensor_parallel",
        ),
        (
            ["trainer.devices=4", "sharding.pipeline_parallel=3"],
            "sharding.pipeline_parallel",
        ),
        (["trainer.devices=4", "sharding.replicate=3"], "sharding.replicate"),
        (["sharding=ddp", "sharding.tensor_parallel=2"], "sharding.tensor_parallel"),
        (
            ["sharding=fsdp1", "sharding.pipeline_parallel=2"],
            "sharding.pipeline_parallel",
        ),
    ],
)
def test_the_config_names_the_key_of_a_degree(overrides, key):
    message = config_error(*overrides)
    assert "\n" not in message and message.startswith(key + ":"), message


def test_backends_refuse_what_they_cannot_take_in_one_place():
    hsdp, tp = ParallelLayout(4, dp_replicate=2), ParallelLayout(4, tp=2)
    BACKENDS["fsdp2"].check_layout(hsdp)
    BACKENDS["fsdp2"].check_layout(tp)
    BACKENDS["fsdp1"].check_layout(hsdp)
    cp = ParallelLayout(4, cp=2)
    BACKENDS["fsdp2"].check_layout(cp)
    for name, layout, dim in (
        ("ddp", hsdp, "dp_replicate"),
        ("fsdp1", tp, "tp"),
        ("fsdp1", cp, "cp"),
        ("ddp", cp, "cp"),
    ):
        with pytest.raises(LayoutError, match=f"not sharding={name}") as err:
            BACKENDS[name].check_layout(layout)
        assert err.value.dim == dim
    with pytest.raises(LayoutError, match="with pipeline parallelism") as err:
        BACKENDS["fsdp2"].check_layout(ParallelLayout(4, cp=2, pp=2))
    assert err.value.dim == "cp"
    ep = ParallelLayout(4, ep=2)
    BACKENDS["fsdp2"].check_layout(ep)
    for name in ("fsdp1", "ddp"):
        with pytest.raises(LayoutError, match=f"not sharding={name}") as err:
            BACKENDS[name].check_layout(ep)
        assert err.value.dim == "ep"
    for other in ({"pp": 2}, {"cp": 2}):  # ep with pp or cp: refused
        with pytest.raises(LayoutError, match="not built yet") as err:
            BACKENDS["fsdp2"].check_layout(ParallelLayout(4, ep=2, **other))
        assert err.value.dim == "ep"
    BACKENDS["fsdp2"].check_layout(ParallelLayout(4, ep=2, tp=2))  # whole tp groups
    with pytest.raises(LayoutError, match="tp times") as err:
        ParallelLayout(8, ep=2, tp=4)  # an ep group would split a tp group
    assert err.value.dim == "ep"


@pytest.fixture
def fake_world():
    """A 16-rank process group that communicates nothing (torch's fake backend):
    meshes are built for real, in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=16)
    yield
    dist.destroy_process_group()


def test_the_mesh_is_built_once_with_named_groups(fake_world):
    for layout in _layouts(16):
        mesh = layout.build_mesh("cpu")
        names = tuple(n for n, _ in layout.mesh_dims())
        assert mesh.world.mesh_dim_names == names
        assert tuple(mesh.world.shape) == tuple(n for _, n in layout.mesh_dims())
        # FSDP shards over dp_shard x cp, replicated over dp_replicate (HSDP)
        fsdp_shape = (layout.dp_replicate,) * (layout.dp_replicate > 1)
        assert tuple(mesh.fsdp.shape) == (*fsdp_shape, layout.fsdp_shard)
        for dim, group in (("tp", mesh.tp), ("pp", mesh.pp), ("cp", mesh.cp)):
            assert (group.size() if group is not None else 1) == layout.size(dim)
        # rank 5's place in the mesh is the one its data-parallel index assumes
        coords = dict(zip(names, mesh.world.get_coordinate(), strict=True))
        dp_index = coords.get("dp_replicate", 0) * layout.dp_shard + coords["dp_shard"]
        assert layout.dp_rank(5) == dp_index


def test_expert_parallel_groups_split_the_shard_ranks_ep_inner(fake_world):
    """EP4 on 2 replicas x 8 shard ranks: rank 5's experts are split over the 4
    consecutive ranks 4..7 and FSDP-sharded over 1 and 5 (behind the replicas)."""
    mesh = ParallelLayout(16, dp_replicate=2, ep=4).build_mesh("cpu")
    assert mesh.ep.mesh.tolist() == [4, 5, 6, 7] and mesh.ep.get_local_rank() == 1
    assert mesh.expert_fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep")
    assert mesh.expert_fsdp.mesh.tolist() == [[1, 5], [9, 13]]
    assert ParallelLayout(16).build_mesh("cpu").ep is None


def test_expert_parallel_groups_with_tp_are_whole_tp_groups(fake_world):
    """EP4 x TP2 on 16 ranks (8 shard ranks): rank 5 (shard rank 2, tp rank 1) splits
    experts over its own and the next shard rank's tp groups, 4..7, and each expert
    is FSDP-sharded over the 4 ranks of the same place in the other ep groups."""
    mesh = ParallelLayout(16, tp=2, ep=4).build_mesh("cpu")
    assert mesh.ep.mesh.tolist() == [4, 5, 6, 7] and mesh.ep.get_local_rank() == 1
    assert mesh.tp.mesh.tolist() == [4, 5]
    assert mesh.expert_fsdp.mesh.tolist() == [1, 5, 9, 13]


def _is_sharding(node: ast.AST, aliases: set[str]) -> bool:
    """``<...>.sharding``, or a name bound to one."""
    if isinstance(node, ast.Attribute):
        return node.attr == "sharding"
    return isinstance(node, ast.Name) and node.id in aliases


def _reads(path: Path, keys: set[str]) -> bool:
    """Whether ``path`` reads one of the ``sharding`` group's ``keys`` as an
    attribute: ``cfg.sharding.<key>``, or ``s.<key>`` after ``s = cfg.sharding``."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = [(node.targets[0], node.value)]
            if isinstance(node.value, ast.Tuple) and isinstance(
                node.targets[0], ast.Tuple
            ):
                pairs = list(zip(node.targets[0].elts, node.value.elts, strict=False))
            for target, value in pairs:
                if isinstance(target, ast.Name) and _is_sharding(value, set()):
                    aliases.add(target.id)
    return any(
        isinstance(n, ast.Attribute)
        and n.attr in keys
        and _is_sharding(n.value, aliases)
        for n in ast.walk(tree)
    )


def test_only_the_layout_builds_a_mesh_and_only_validation_reads_degree_keys():
    """The device mesh is built in src/sharding/layout.py alone; the config keys of
    the degrees (LAYOUT_KEYS, and sharding.sequence_parallel) are read as
    attributes only where the config is validated."""
    builders = {
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if "init_device_mesh" in p.read_text()
    }
    assert builders == {"sharding/layout.py"}
    keys = {k.split(".")[-1] for k in LAYOUT_KEYS.values()} | {"sequence_parallel"}
    readers = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if _reads(p, keys)}
    assert readers <= VALIDATION, readers - VALIDATION


#: Where the config's layout keys may be read as attributes: its validation
#: (validate.py, and the resolve() it calls, which makes the layout from them).
VALIDATION = {"config/validate.py", "config/run_plan.py"}
