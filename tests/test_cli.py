"""What a new user types: home paths on the command line, ``--help``, the internal
schema groups, and the sharding policy a big preset gets by default."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from src.config.cli import CONFIG_ERRORS, one_line, quote_paths
from src.config.cli_help import described_keys, is_schema_option, user_options
from src.config.run_plan import resolve, with_overrides
from src.config.validate import validate
from src.data.corpus import resolve_files
from src.planner.auto import default_policy
from tests.commands import in_process
from tests.test_config import CONF, ROOT, make_cfg


def test_home_paths_as_the_docs_write_them(tmp_path, monkeypatch):
    """``~`` in a value, in a list and in a sweep is expanded and quoted for Hydra's
    lexer; the globs then find the files under that home."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("corpus/x/a.jsonl", "corpus/b.jsonl", "a/1.parquet", "b/2.parquet"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "hi"}\n')
    args = [
        "data=files",
        "data.paths=~/corpus/**/*.jsonl",  # data.paths="~/corpus/**/*.jsonl" in bash
        "model.pretrained=~/ckpt/my-llama",
        "trainer.max_steps=5",
    ]
    fixed = quote_paths(args)
    assert fixed[0] == "data=files" and fixed[3] == "trainer.max_steps=5"
    cfg = make_cfg(*fixed)
    assert cfg.model.pretrained == f"{tmp_path}/ckpt/my-llama"
    assert resolve_files(cfg.data.paths) == [
        f"{tmp_path}/corpus/b.jsonl",
        f"{tmp_path}/corpus/x/a.jsonl",
    ]
    # The list form of docs/data.md, and a sweep over two corpora.
    (listed,) = quote_paths(["data.paths=[~/a/*.parquet,~/b/*.parquet]"])
    cfg = make_cfg("data=files", listed)
    assert list(cfg.data.paths) == [
        f"{tmp_path}/a/*.parquet",
        f"{tmp_path}/b/*.parquet",
    ]
    assert quote_paths(["data.paths=~/a/*.parquet,~/b/*.parquet"]) == [
        f"data.paths='{tmp_path}/a/*.parquet','{tmp_path}/b/*.parquet'"
    ]
    # <stdlib> needs no nested quotes either; what Hydra parses is left as it is.
    assert quote_paths(["data.paths=<stdlib>/json/*.py"]) == [
        "data.paths='<stdlib>/json/*.py'"
    ]
    kept = ["data.paths=\"'~/x'\"", "-m", "a=1,2", "~trainer.seed", "x=[1,2"]
    assert quote_paths(kept) == kept


def test_home_path_reaches_the_check_that_names_it(tmp_path, monkeypatch, capsys):
    """End to end through train.py (in-process, tests/commands.py): the documented
    form reaches validation, which names the expanded directory (nothing there),
    instead of Hydra's lexer error."""
    monkeypatch.setenv("HOME", str(tmp_path))
    code, _, err = in_process(
        monkeypatch, capsys, "train.py", "model=hf", "model.pretrained=~/ckpt/my-llama",
        "trainer.plan_only=true", f"hydra.run.dir={tmp_path}/run",
    )  # fmt: skip
    assert code == 2
    assert err.strip().splitlines() == [
        f"config error: model.pretrained: no such directory '{tmp_path}/ckpt/my-llama'"
    ]


@pytest.mark.parametrize(
    ("override", "group"),
    [
        ("model=schema/llama", "model"),
        ("data=base_files", "data"),
        ("logger=schema/wandb", "logger"),
    ],
)
def test_internal_schema_groups_are_refused_in_one_line(override, group):
    with pytest.raises(CONFIG_ERRORS) as info:
        validate(make_cfg(override))
    line = one_line(info.value)
    options = [o for o in user_options(group) if not is_schema_option(o)]
    assert line == (
        f"{group}: an internal schema was picked, not an option; expected {group}= "
        f"one of: {', '.join(options)}"
    )


def test_every_key_of_every_option_has_a_description():
    """Every key that any option of any group composes is described by its schema
    (``described(help)`` next to its type; a new key without a line fails here)."""
    seen = {}
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for group in ("model", "data", "logger", "sharding", "precision", "trainer"):
            for option in user_options(group):
                if not is_schema_option(option):
                    cfg = compose("config", overrides=[f"{group}={option}"])
                    seen.update(described_keys(cfg))
    assert sorted(k for k, about in seen.items() if not about) == []


def test_help_lines_that_list_names_read_the_registries(monkeypatch):
    """A new backend, precision, policy, logger, data source or model family shows
    in --help by itself: those lines are made from the registries when shown."""
    from src.config.schema import PrecisionConfig, ShardingConfig
    from src.data.sources import DATA_SOURCES, DataConfig
    from src.models import get_spec
    from src.models.spec import _REGISTRY
    from src.observe.loggers import LOGGERS, LoggerConfig
    from src.registry import key_help
    from src.sharding import BACKENDS, PRECISIONS
    from src.sharding.policies import POLICIES

    for registry, schema, name in [
        (BACKENDS, ShardingConfig, "backend"),
        (POLICIES, ShardingConfig, "policy"),
        (PRECISIONS, PrecisionConfig, "name"),
        (LOGGERS, LoggerConfig, "backend"),
        (DATA_SOURCES, DataConfig, "name"),
        (_REGISTRY, get_spec("gpt").schema(), "family"),
    ]:
        assert all(n in key_help(schema, name) for n in registry), (schema, name)
        monkeypatch.setitem(registry, "brand_new", None)
        assert "brand_new" in key_help(schema, name), (schema, name)


def test_help_lists_options_not_schemas_and_describes_every_key(monkeypatch, capsys):
    """``python train.py model=llama_tiny --help``, in-process (tests/commands.py)."""
    code, text, err = in_process(
        monkeypatch, capsys, "train.py", "model=llama_tiny", "--help"
    )
    assert code == 0, err
    groups = text.split("== Groups (group=option) ==")[1].split("==")[0]
    assert "schema" not in groups and "base_" not in groups
    # every option of conf/data/ (a new source's YAML included), none of its schemas
    options = sorted(p.stem for p in (ROOT / "conf" / "data").glob("*.yaml"))
    assert f"  data: {', '.join(options)}\n" in groups
    assert "model=llama_tiny" in text
    cfg = make_cfg("model=llama_tiny")
    for key, about in described_keys(cfg).items():
        leaf = key.rpartition(".")[2]
        assert f"  {leaf}: " in text and f"# {about}" in text, key
    assert "cache_dir: ${oc.env:SHARDWRAP_CACHE" in text  # no $-substitution mangled


@pytest.mark.parametrize(
    ("model", "policy"),
    [
        ("llama3_8b", "block"),
        ("gpt2", "block"),
        ("small", "size"),
        ("llama_tiny", "size"),
    ],
)
def test_big_presets_default_to_one_unit_per_block(model, policy):
    """The default min_params (1.5e5, one unit per block of the CPU models) would cut
    a big model's blocks into one unit per Linear; such a model gets the block policy
    unless the user chose the policy or the threshold. Selective checkpointing (which
    needs whole blocks) does not stop that choice."""
    cfg = make_cfg(
        f"model={model}",
        "trainer.plan_only=true",
        "sharding.activation_checkpointing=selective",
    )
    resolved = resolve(cfg)
    out_resolved, line, said = default_policy(resolved, set())
    out = with_overrides(cfg, said)  # as the launcher records it
    assert out.sharding.policy == policy
    assert out_resolved.wrap.policies == resolve(out).wrap.policies  # the plan follows
    assert bool(line) == (policy == "block")
    if line:
        assert line.startswith("sharding.policy=block: with sharding.min_params=150000")
    for key in ("sharding.policy", "sharding.min_params"):
        kept_resolved, line, said = default_policy(resolved, {key})
        assert said == {} and line == ""
        assert kept_resolved is resolved


def test_ctrl_c_while_a_command_imports_is_one_line():
    """Each command installs src/entry.py's handler before its first slow import; a
    SIGINT then (here sent by the process itself, right before importing torch) ends
    it with one line and exit 130, not a traceback through importlib."""
    for script, ends in (
        ("train.py", "stop_before_start()"),
        ("sample.py", "started()"),
        ("eval.py", "started()"),
        ("export.py", "started()"),
    ):
        body = ast.parse((ROOT / script).read_text()).body
        first, last = (ast.unparse(s) for s in (body[2], body[-1]))  # after imports
        assert first.startswith(
            "if __name__ == '__main__':\n    quiet_ctrl_c()\n    start_rank_server("
        ), script
        # Once imported, the command's own handler (or Python's) takes over.
        assert last.startswith(f"if __name__ == '__main__':\n    {ends}"), script
    # Importing a command (a test does; a spawned rank does) changes no handler.
    importing = subprocess.run(
        [
            sys.executable,
            "-c",
            # against the handler it started with: a SIGINT ignored by the test's
            # own process (inherited across exec) is not the import's doing. (The
            # worker found so was started in the background, `nohup pytest &`, whose
            # shell ignores SIGINT for it; tests/conftest.py now restores Python's
            # handler at start, and fails a test that leaves a handler changed.)
            "import signal\n"
            "before = signal.getsignal(signal.SIGINT)\n"
            "import eval, export, sample, train\n"
            "after = signal.getsignal(signal.SIGINT)\n"
            "assert after is before, (before, after)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert importing.returncode == 0, importing.stderr[-2000:]
    code = (
        "import os, signal\n"
        "from src.entry import quiet_ctrl_c\n"
        "quiet_ctrl_c()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "import torch\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 130
    assert run.stderr == "stopped by SIGINT while starting; nothing to resume\n"


def test_unparseable_prompt_says_how_to_quote_it(tmp_path, monkeypatch, capsys):
    """``sample.py prompt="def main("`` (the shell drops the quotes) is one line that
    gives the form that works (sample.py in-process, tests/commands.py); that form
    parses and keeps the prompt as it was."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    code, _, err = in_process(
        monkeypatch, capsys, "sample.py", f"run={tmp_path}", "prompt=def main("
    )
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "Error parsing override" in line and "quote" in line
    suggested = line.rpartition(": ")[2]
    assert suggested == "'prompt=\"def main(\"'"
    parser = OverridesParser.create()
    for prompt in ("def main(", 'say "hi" (x)', "it's (x)", "y = f(a, b)"):
        hint = one_line(_parse_error(f"prompt={prompt}"))
        (arg,) = shlex.split(hint.rpartition(": ")[2])  # what the shell passes on
        assert parser.parse_override(arg).value() == prompt


def _parse_error(override: str) -> BaseException:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        OverridesParser.create().parse_overrides([override])
    except OverrideParseException as err:
        return err
    raise AssertionError(f"{override} parsed")


def test_no_rank_server_where_the_command_line_says_no_rank_forks():
    """The rank server's imports (~4 s of CPU) are skipped where the command line
    says no rank will fork: train.py's plan-only and one-rank commands, and the
    tools (sample.py, eval.py, export.py) unless ``devices`` is given above one."""
    from src.entry import _no_rank_starts

    train = ("trainer.devices", False)
    assert _no_rank_starts(["trainer.plan_only=true"], *train)
    assert _no_rank_starts(["trainer.devices=1", "model=tiny"], *train)
    assert not _no_rank_starts(["model=tiny"], *train)  # devices=auto: maybe more
    assert not _no_rank_starts(["trainer.devices=2"], *train)
    tool = ("devices", True)
    assert _no_rank_starts(["run=runs/a"], *tool)
    assert _no_rank_starts(["run=runs/a", "devices=1"], *tool)
    assert not _no_rank_starts(["run=runs/a", "devices=2"], *tool)
    assert not _no_rank_starts(["run=runs/a", "devices=auto"], *tool)
