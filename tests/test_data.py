"""The data layer: text / tokens / synthetic splits and per-rank shards of global batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from src.data.sources import GlobalBatches, TokenStream, load_splits
from src.harness import compose_config
from tests.distributed import run_distributed


def data_cfg(*overrides: str):
    """The ``data`` node composed through its schema, as train.py gets it."""
    return compose_config(*overrides).data


def _token_file(path: Path, tokens: np.ndarray) -> str:
    tokens.astype(np.uint16).tofile(path)
    return str(path)


def _tokens_cfg(tmp_path: Path, n: int = 10_000, vocab: int = 1000):
    # consecutive ids (mod vocab), so every real window is a run of +1 steps
    train = _token_file(tmp_path / "train.bin", np.arange(n) % vocab)
    val = _token_file(tmp_path / "val.bin", np.arange(n // 10) % vocab)
    return OmegaConf.create({"name": "tokens", "train_path": train, "val_path": val})


@pytest.fixture(scope="module")
def stdlib_splits():
    return load_splits(data_cfg(), vocab_size=256, seed=0)


def test_default_text_yaml_reads_stdlib(stdlib_splits):
    train, val = stdlib_splits
    assert len(train) > 1_000_000
    assert 0.04 < len(val) / (len(train) + len(val)) < 0.06
    assert train.tokens.dtype == np.uint8 and isinstance(train.tokens, np.memmap)
    assert b"def " in train.tokens[:100_000].tobytes()


def test_text_is_deterministic_sorted_and_capped(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"bbbb")
    (tmp_path / "a.txt").write_bytes(b"aaaa")
    over = [f"data.paths={tmp_path}/*.txt", f"data.cache_dir={tmp_path}/cache"]
    train, val = load_splits(data_cfg(*over, "data.val_fraction=0.2"), 256, seed=0)
    stream = bytes(train.tokens) + bytes(val.tokens)
    assert stream == b"aaaa\x00bbbb\x00"
    assert len(val) == 2
    train, val = load_splits(data_cfg(*over, "data.max_bytes=6"), 256, seed=0)
    assert bytes(train.tokens) + bytes(val.tokens) == b"aaaa\x00b"


def test_missing_glob_names_key(tmp_path):
    cfg = data_cfg(f"data.paths={tmp_path}/nope/*.txt")
    with pytest.raises(ValueError, match=r"^data\.paths: no files match .*nope") as e:
        load_splits(cfg, 256, seed=0)
    assert "\n" not in str(e.value)


def test_out_of_vocab_tokens_name_the_key():
    cfg = data_cfg("data.paths='<stdlib>/os.py'")
    with pytest.raises(ValueError, match=r"^data\.paths: token id \d+ .*vocab_size=64"):
        load_splits(cfg, 64, seed=0)
    with pytest.raises(
        ValueError, match=r"^data\.paths: token id 255 .*vocab_size=255"
    ):
        TokenStream(np.array([1, 255], dtype=np.uint8), 255, "data.paths")


def test_tokens_are_memmapped(tmp_path):
    train, val = load_splits(_tokens_cfg(tmp_path), vocab_size=1000, seed=0)
    assert isinstance(train.tokens, np.memmap) and isinstance(val.tokens, np.memmap)
    assert (len(train), len(val)) == (10_000, 1_000)
    x, y = GlobalBatches(train, 4, 16, seed=0).get(0, 0, 0, 1)
    assert ((x[:, 1:] - x[:, :-1]) % 1000 == 1).all()
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_tokens_yaml_and_errors(tmp_path):
    cfg = data_cfg("data=tokens")
    assert set(cfg) == {"name", "train_path", "val_path", "packing"}
    cfg.train_path = str(tmp_path / "missing.bin")
    with pytest.raises(ValueError, match=r"^data\.train_path: no such file .*missing"):
        load_splits(cfg, 1000, seed=0)
    cfg = _tokens_cfg(tmp_path, vocab=1000)
    with pytest.raises(
        ValueError,
        match=r"^data\.train_path: token id 9\d\d .*"
        r"model\.vocab_size=500",
    ) as e:
        load_splits(cfg, 500, seed=0)
    assert "\n" not in str(e.value)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    cfg.val_path = str(tmp_path / "odd.bin")
    with pytest.raises(ValueError, match=r"^data\.val_path: .* 3 bytes"):
        load_splits(cfg, 1000, seed=0)


def test_synthetic_deterministic_by_seed():
    cfg = data_cfg("data=synthetic")
    assert cfg.num_tokens == 1_000_000
    cfg.num_tokens = 20_000
    a, av = load_splits(cfg, 50_000, seed=1)
    b, _ = load_splits(cfg, 50_000, seed=1)
    c, _ = load_splits(cfg, 50_000, seed=2)
    assert len(a) + len(av) == 20_000
    assert np.array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    assert a.tokens.max() < 50_000 and a.tokens.max() > 40_000


def test_unknown_name():
    with pytest.raises(ValueError, match=r"data\.name='nope'"):
        load_splits(OmegaConf.create({"name": "nope"}), 256, seed=0)


@pytest.fixture
def batches(stdlib_splits):
    return GlobalBatches(stdlib_splits[0], global_batch_size=8, block_size=32, seed=3)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_shards_concatenate_to_global_batch(batches, world_size):
    x1, y1 = batches.get(5, 1, rank=0, world_size=1)
    shards = [batches.get(5, 1, r, world_size) for r in range(world_size)]
    assert all(x.shape == (8 // world_size, 32) for x, _ in shards)
    assert torch.equal(torch.cat([x for x, _ in shards]), x1)
    assert torch.equal(torch.cat([y for _, y in shards]), y1)


def test_batches_stateless_and_shifted(batches):
    x, y = batches.get(7, 0, 0, 1)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(batches.get(7, 0, 0, 1)[0], x)  # same step: same batch
    assert not torch.equal(batches.get(8, 0, 0, 1)[0], x)
    assert not torch.equal(batches.get(7, 1, 0, 1)[0], x)
    other_seed = GlobalBatches(batches.stream, 8, 32, seed=4)
    assert not torch.equal(other_seed.get(7, 0, 0, 1)[0], x)


def test_batch_errors(batches):
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        batches.get(0, 0, 0, 3)
    tiny = TokenStream(np.zeros(10, dtype=np.uint8), 256, "data.paths")
    with pytest.raises(ValueError, match=r"data\.paths: .*model\.block_size"):
        GlobalBatches(tiny, 2, 10, seed=0)


def test_val_batches_fixed_and_sharded(stdlib_splits):
    val = stdlib_splits[1]
    a = GlobalBatches(val, 4, 16, seed=0).val_batches(3, world_size=1, rank=0)
    b = GlobalBatches(val, 4, 16, seed=99).val_batches(3, world_size=1, rank=0)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    shards = [GlobalBatches(val, 4, 16, 0).val_batches(3, r, 2) for r in range(2)]
    for i, (x, _) in enumerate(a):
        assert torch.equal(torch.cat([shards[0][i][0], shards[1][i][0]]), x)


def _gather_shards(rank: int, world_size: int, cfg: dict) -> bool:
    train, _ = load_splits(OmegaConf.create(cfg), vocab_size=1000, seed=0)
    batches = GlobalBatches(train, global_batch_size=4, block_size=16, seed=0)
    x, _ = batches.get(3, 0, rank, world_size)
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.equal(torch.cat(parts), batches.get(3, 0, 0, 1)[0])


@pytest.mark.slow
def test_gloo_ranks_gather_the_global_batch(tmp_path):
    cfg = OmegaConf.to_container(_tokens_cfg(tmp_path))
    assert run_distributed(_gather_shards, 2, cfg) == [True, True]
