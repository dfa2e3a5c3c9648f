"""Config composition (Hydra's compose API) and one-line errors for bad configs."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.config.cli import CONFIG_ERRORS, one_line
from src.config.run_plan import resolve_devices
from src.config.validate import refuse_null_groups, reject_non_finite, validate
from src.harness import compose_config
from src.sharding.policies import policy_names
from tests.commands import in_process
from tests.distributed import HANG_S

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")


def make_cfg(*overrides: str):
    return compose_config(*overrides)


def config_error(*overrides: str) -> str:
    """The one-line message for a config that must fail (compose or validate)."""
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(make_cfg(*overrides))
    return one_line(info.value)


def assert_fails_naming(overrides: list[str], key: str, says: str) -> None:
    """The config fails in one line that starts with ``key`` and says ``says``."""
    message = config_error(*overrides)
    assert message.startswith(f"{key}:") and says in message, message
    assert "\n" not in message


def test_default_config_composes_and_validates():
    cfg = make_cfg()
    validate(cfg)
    assert cfg.model.name == "small"
    assert cfg.sharding.backend == "fsdp2"
    assert cfg.precision.name == "fp32"
    assert cfg.data.name == "text"
    assert cfg.logger.backend == "wandb" and cfg.logger.mode == "offline"
    assert cfg.trainer.devices == 2


@pytest.mark.parametrize(
    ("override", "expected"),
    [("sharding.min_params=1e8", 100_000_000), ("sharding.min_params=2000", 2000)],
)
def test_min_params_int_or_float(override, expected):
    cfg = make_cfg(override)
    validate(cfg)
    assert isinstance(cfg.sharding.min_params, int | float)
    assert int(cfg.sharding.min_params) == expected


@pytest.mark.parametrize("backend", ["fsdp2", "fsdp1", "ddp"])
def test_sharding_group_sets_backend_and_keeps_knobs(backend):
    cfg = make_cfg(f"sharding={backend}", "sharding.min_params=1e6")
    validate(cfg)
    assert cfg.sharding.backend == backend
    assert cfg.sharding.min_params == 1e6
    assert cfg.sharding.policy == "size"


def test_groups_and_presets_compose():
    cfg = make_cfg(
        "sharding=none",
        "trainer.devices=1",
        "precision=bf16_mixed",
        "model=gpt2",
        "model.init_device=meta",
        "data=synthetic",
        "logger=none",
        "trainer.resume=auto",
    )
    validate(cfg)
    assert (cfg.model.n_layer, cfg.model.n_embd) == (12, 768)
    assert cfg.precision.name == "bf16_mixed"
    assert cfg.logger.backend == "none"


def test_policy_string_or_list_and_class_lists():
    cfg = make_cfg(
        "sharding.policy=[size,block]",
        "sharding.exclude_wrap_modules=[torch.nn.LayerNorm]",
        "sharding.force_leaf_modules=[src.models.gpt.MLP]",
    )
    validate(cfg)
    assert policy_names(cfg.sharding.policy) == ["size", "block"]
    assert policy_names("manual") == ["manual"]


def test_devices_auto_is_gpu_count_or_one():
    import torch

    assert resolve_devices("auto") == max(1, torch.cuda.device_count())
    assert resolve_devices(3) == 3


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["sharding.min_params=-1"], "sharding.min_params"),
        (["sharding.min_params=lots"], "sharding.min_params"),
        (["sharding.min_param=1e8"], "sharding.min_param"),
        (["sharding.policy=biggest"], "sharding.policy"),
        (["sharding.exclude_wrap_modules=[torch.nn.LayerNom]"], "sharding.exclude"),
        (["sharding.force_leaf_modules=[os.path]"], "sharding.force_leaf_modules"),
        (["sharding=fsdp3"], "sharding"),
        (["model.n_head=3"], "model.n_embd"),
        (["model.n_layer=0"], "model.n_layer"),
        (["model.init_device=tpu"], "model.init_device"),
        (["model.init_device=meta", "sharding=fsdp1"], "model.init_device"),
        (["trainer.devices=0"], "trainer.devices"),
        (["trainer.devices=many"], "trainer.devices"),
        (["trainer.batch_size=15"], "trainer.batch_size"),
        (["trainer.max_steps=1.5"], "trainer.max_steps"),
        (["trainer.grad_accum=0"], "trainer.grad_accum"),
        (["trainer.grad_accum=some"], "trainer.grad_accum"),
        (["trainer.grad_sync=sometimes"], "trainer.grad_sync"),
        (["trainer.mem_budget_gib=tpu_v9"], "trainer.mem_budget_gib"),
        (["trainer.mem_budget_gib=-1"], "trainer.mem_budget_gib"),
        (["trainer.betas=[0.9]"], "trainer.betas"),
        (["trainer.resume=/no/such/ckpt"], "trainer.resume"),
        (["sharding=none"], "trainer.devices"),
        (["precision=fp8"], "precision"),
        (["data=tokens", "data.train_path=/no/such.bin"], "data.train_path"),
        (["logger.mode=loud"], "logger.mode"),
        (["model.n_layr=3"], "model.n_layr: unknown key"),
        (["model.bias=maybe"], "model.bias"),
        (["model.family=mamba"], "model.family: unknown model family"),
        (["model=custom"], "model._target_"),
        (["model=custom", "model._target_=no.such.Model"], "model._target_"),
        # relative paths (a TypeError in importlib: 62 lines; issue 48)
        (["model=custom", "model._target_=.evil.Model"], "model._target_"),
        (["model=custom", "model._target_=..evil.Model"], "model._target_"),
        (["model=custom", "model._target_=Model"], "model._target_"),
        (["sharding.exclude_wrap_modules=[.evil.Block]"], "sharding.exclude_wrap"),
        (["model=custom", "model.n_layer=2"], "model.n_layer"),
        (
            [
                "model=custom",
                "model._target_=torch.nn.Linear",
                "model.init_device=meta",
            ],
            "model.init_device",
        ),
        (["trainer.devices=4", "sharding.replicate=3"], "sharding.replicate"),
        (["sharding.replicate=0"], "sharding.replicate"),
        (["sharding=ddp", "sharding.replicate=2"], "sharding.replicate"),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_key(overrides, key):
    message = config_error(*overrides)
    assert "\n" not in message
    assert message.startswith(key), message


def test_replicate_is_checked_against_torchruns_world(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "6")
    validate(make_cfg("trainer.batch_size=12", "sharding.replicate=3"))
    assert config_error("trainer.batch_size=12", "sharding.replicate=4") == (
        "sharding.replicate: 4 does not divide the 6 devices "
        "(each replica group shards over devices / replicate ranks)"
    )


def test_unknown_key_message_lists_the_allowed_keys():
    message = config_error("trainer.max_step=10")
    assert message.startswith("trainer.max_step: unknown key")
    assert "max_steps" in message


def test_unknown_model_key_lists_the_family_keys():
    message = config_error("model.n_layr=3")
    assert (
        "n_layer" in message and "block_size" in message and "_target_" not in message
    )
    message = config_error("model=custom", "model.n_layer=3")
    assert "_target_" in message and "n_embd" not in message


def test_wrong_type_message_says_what_is_allowed():
    assert "expected a number >= 0 (such as 1e8) or auto" in config_error(
        "sharding.min_params=x"
    )
    assert "expected an integer >= 1 or 'auto'" in config_error("trainer.devices=0")


def run_train(*args: str, timeout: float = HANG_S, cwd: Path = ROOT):
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("sharding.min_params=abc", "sharding.min_params"),
        ("trainer.devices=0", "trainer.devices"),
        ("sharding.exclude_wrap_modules=[torch.nn.LayerNom]", "sharding.exclude"),
    ],
)
def test_cli_config_error_is_one_line_on_stderr(
    override, key, tmp_path, monkeypatch, capsys
):
    """train.py in-process (tests/commands.py); a real process's one line:
    test_faults.py, test_run_dir.py."""
    code, out, err = in_process(
        monkeypatch, capsys, "train.py", override, f"hydra.run.dir={tmp_path}/run"
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"config error: {key}")
    assert "Traceback" not in err + out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("+trainer.nosuchkey=1", "trainer.nosuchkey"),
        ("+nosuchgroup=1", "nosuchgroup"),
        ("+logger.extra.deep=2", "logger.extra"),
    ],
)
def test_appended_unknown_key_fails_like_a_plain_one(override, key):
    """``+key=value`` opens the node for the append; validate() still names the key."""
    line = config_error(override)
    assert line.startswith(f"{key}: unknown key, expected one of: ")
    assert "\n" not in line


def test_every_registry_refuses_a_taken_name():
    """A plug-in cannot silently replace an entry: each registry's ``add`` (and the
    backends' class decorator, the model families' ``register``) refuses the name."""
    from src.data.sources import DATA_SOURCES
    from src.models import get_spec, register
    from src.observe.loggers import LOGGERS
    from src.sharding import BACKENDS, PRECISIONS
    from src.sharding.backends import register_backend
    from src.sharding.ddp import DDPBackend
    from src.sharding.policies import POLICIES

    again = type("AnotherDDP", (DDPBackend,), {"name": "ddp"})
    with pytest.raises(ValueError, match="backend 'ddp' is already registered"):
        register_backend(again)
    assert BACKENDS["ddp"] is DDPBackend
    for registry, name, kind in [
        (PRECISIONS, "fp32", "precision"),
        (POLICIES, "size", "wrap policy"),
        (LOGGERS, "csv", "logger"),
        (DATA_SOURCES, "tokens", "data source"),
    ]:
        before = registry[name]
        with pytest.raises(ValueError, match=f"{kind} '{name}' is already registered"):
            registry.add(name, before)
        assert registry[name] is before
    with pytest.raises(ValueError, match="model family 'gpt' is already registered"):
        register(get_spec("gpt"))


def test_an_option_whose_yaml_does_not_name_itself_says_so(
    tmp_path, monkeypatch, capsys
):
    """A new option's YAML (here on Hydra's search path) that leaves out the key
    naming it (``data.name``) fails in one line naming that key and the option, not
    as "an internal schema was picked" (train.py in-process, tests/commands.py)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text(
        "defaults:\n  - base_synthetic\n  - _self_\nnum_tokens: 20000\n"
    )
    code, _, err = in_process(
        monkeypatch, capsys, "train.py", f"hydra.searchpath=[file://{tmp_path}]",
        "data=mine", "trainer.plan_only=true", f"hydra.run.dir={tmp_path}/run",
    )  # fmt: skip
    assert code == 2
    assert err.strip().splitlines() == [
        "config error: data.name: not set by the data=mine option; its YAML must set "
        "it (docs/architecture.md, Where to add)"
    ]


def _float_keys(node, prefix: str = "") -> list[str]:
    """Every key of the composed config that the schema types as a float (optional
    ones and lists of floats included)."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.nodes import FloatNode

    keys = []
    for key in node.keys():
        child = node._get_node(key)
        full = f"{prefix}{key}"
        if isinstance(child, FloatNode):
            keys.append(full)
        elif isinstance(child, ListConfig) and child._metadata.element_type is float:
            keys.append(f"{full}[0]")
        elif isinstance(child, DictConfig) and not child._is_missing():
            keys.extend(_float_keys(child, f"{full}."))
    return keys


def test_every_float_key_refuses_non_finite_numbers():
    """inf, nan and 1e400 (YAML's inf) at every float key of the schema: one line
    naming the key. Also trainer.timeout_s=1e30, which overflowed a timedelta."""
    keys = _float_keys(compose_config())
    assert {"trainer.lr", "trainer.betas[0]", "trainer.peak_tflops"} <= set(keys)
    keys += ["trainer.mem_budget_gib", "sharding.min_params"]  # typed Any: or auto
    for value in ("inf", "nan", "-inf", "1e400"):  # from the command line
        with pytest.raises(CONFIG_ERRORS) as info:
            validate(compose_config(f"trainer.lr={value}"))
        assert one_line(info.value).startswith("trainer.lr: got "), info.value
    base = compose_config()
    for i, key in enumerate(keys):  # each key, one value each (set in place: fast)
        cfg = copy.deepcopy(base)
        value = (math.inf, math.nan, -math.inf)[i % 3]
        name = key.removesuffix("[0]")
        OmegaConf.update(cfg, name, [value, value] if name != key else value)
        with pytest.raises(CONFIG_ERRORS) as info:
            reject_non_finite(cfg)
        line = one_line(info.value)
        assert line.startswith(f"{key}: got ") and "finite" in line, line
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(compose_config("trainer.timeout_s=1e30"))
    assert one_line(info.value).startswith("trainer.timeout_s: got 1e+30"), info.value


def test_a_group_set_to_null_is_one_line(monkeypatch, capsys):
    """``trainer=null`` failed inside Hydra's defaults list with a
    traceback: one line naming the group and its options, exit status 2, before
    Hydra runs anything."""
    from src.config.cli import run_cli
    from src.config.cli_help import user_groups

    def main() -> None:
        raise AssertionError("must not run")

    refuse_null_groups(["logger=none", "trainer=default", "+trainer.x=null"])  # fine
    for group in user_groups():
        for value in ("null", "NULL"):
            monkeypatch.setattr(sys, "argv", ["train.py", f"{group}={value}"])
            monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # run_cli sets it
            with pytest.raises(SystemExit) as exit_:
                run_cli(main)
            assert exit_.value.code == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(
                f"config error: {group}: got {value}, expected one of"
            )
            assert "\n" not in err


def test_malloc_threshold_is_kib_or_null():
    """trainer.malloc_mmap_threshold_kib: the ranks' glibc mmap threshold (null: glibc's
    own); out of glibc's range is one line naming the key."""
    from src.observe.metrics import set_malloc_mmap_threshold

    validate(make_cfg("trainer.malloc_mmap_threshold_kib=null"))
    assert "trainer.malloc_mmap_threshold_kib" in config_error(
        "trainer.malloc_mmap_threshold_kib=0"
    )
    assert set_malloc_mmap_threshold(None) is False
    assert set_malloc_mmap_threshold(64) is True  # glibc (Linux CI)


_REUSE = """
import ctypes, resource, sys
from src.observe.metrics import set_malloc_mmap_threshold
set_malloc_mmap_threshold(4096)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def block():  # 3 MiB: below the mmap threshold, so the heap's top
    p = libc.malloc(3 << 20)
    ctypes.memset(p, 1, 3 << 20)
    libc.free(p)
block()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_the_heap_top_a_rank_frees_is_reused_without_page_faults():
    """With the default threshold (4 MiB) a freed 3 MiB block at the heap's top stays
    (trim at twice the threshold) and the next one reuses its pages: no page faults.
    glibc's 128 KiB trim, which a fixed threshold alone leaves, handed it back at the
    free and faulted its 768 pages in again (issue 47: 2,000-3,000 faults a step)."""
    out = subprocess.run(
        [sys.executable, "-c", _REUSE], cwd=ROOT, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert int(out.stdout) < 100, out.stdout  # 736 before the trim threshold
