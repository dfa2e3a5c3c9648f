"""Every command README.md and docs/*.md show, checked, so the docs cannot drift.

The commands are read from the Markdown itself: each line of a ```bash block (``\\``
continuations joined, ``&&`` chains split, comments dropped) and each ``$ `` line of
an unlabelled block, with the lines shown after it as its output. A command someone
adds to the docs is checked without touching this file:

- ``python train.py ...`` (also after ``torchrun``): its arguments go through what
  train.py does first (``quote_paths``), then Hydra's own override parser; each point
  of a sweep (``-m a=1,2``) is composed with conf/ (Hydra's settings included:
  launcher and sweeper keys are typed by their plugins) and validated, in-process.
- a ``$ `` command shown with its output: run in-process as train.py runs it
  (plan-only or a config error, never a training), and every line shown must be a
  line it prints (up to a trailing ``...``).
- a few commands are really run, shortened (:data:`EXECUTED`).
- another Hydra entry point (``python X.py``, ``python -m pkg.mod``): composed with its
  own config.
- anything else must be in :data:`SKIPPED` with the reason it cannot run here; an
  unknown program fails the test, naming the doc and line.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from src.config import CONFIG_ERRORS, one_line, quote_paths, validate
from src.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Programs (the start of a command) that cannot run here, and why. Kept small: a
#: command is skipped only for what this machine or a test cannot have.
SKIPPED = {
    ("pip", "install"): "installs packages from the network",
    ("python", "-m", "pytest"): "the test suite itself",
    ("wandb", "sync"): "uploads runs to wandb over the network",
    ("python", "-m", "src.runs.compare"): "reads earlier runs' dirs (run by "
    "tests/test_research_loop.py on two trained runs)",
}
#: Commands that read a run dir the user names (a placeholder such as <date>).
USER_RUN_DIR = re.compile(r"<date>|<time>|<run dir>")
#: Keys holding a path the user supplies (~/corpus, ~/ckpt/my-llama): such a
#: command is composed and validated, but its validation may stop at that path.
USER_PATH_KEYS = ("model.pretrained", "data.paths", "data.tokenizer", "model.config")

#: Commands really run (shortened by the extra overrides), one of each kind: a
#: training, the composed config, a config error's exit status.
EXECUTED = {
    "python train.py model=tiny trainer.devices=1 sharding=none trainer.max_steps=50": [
        "trainer.max_steps=3",
        "trainer.val_every=0",
        "logger=none",
    ],
    "python train.py --cfg job": [],
}


@dataclass(frozen=True)
class Command:
    where: str  # README.md:12
    argv: tuple[str, ...]
    output: tuple[str, ...] = ()  # the lines a `$ ` command is shown printing

    @property
    def text(self) -> str:
        return " ".join(self.argv)


def _split(line: str) -> list[list[str]]:
    """A shell line as its commands (``&&``/``;`` chains split, comments dropped)."""
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for token in tokens:
        if token in ("&&", ";", "||"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return _expand_loops([c for c in [*commands, current] if c])


def _expand_loops(commands: list[list[str]]) -> list[list[str]]:
    """``for v in a b; do cmd $v; done`` as ``cmd a`` and ``cmd b``."""
    out, loop = [], None
    for argv in commands:
        if argv[0] == "for" and len(argv) > 3 and argv[2] == "in":
            loop = (argv[1], argv[3:])
        elif argv[0] == "done":
            loop = None
        elif loop is not None:
            body = argv[1:] if argv[0] == "do" else argv
            var, values = loop
            for value in values:
                out.append([a.replace(f"${var}", value) for a in body])
        else:
            out.append(argv)
    return out


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    joined, start = "", None
    for number, line in lines:
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        out.append((start, joined + line))
        joined, start = "", None
    return out


def doc_commands() -> list[Command]:
    commands = []
    fence = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT).as_posix()
        for block in fence.finditer(text):
            first = text.count("\n", 0, block.start(2)) + 1
            lines = [
                (first + i, line)
                for i, line in enumerate(block.group(2).splitlines())
                if line.strip()
            ]
            if block.group(1) in ("bash", "sh", "shell"):
                for number, line in _logical_lines(lines):
                    for argv in _split(line):
                        commands.append(Command(f"{name}:{number}", tuple(argv)))
            elif block.group(1) in ("", "console"):
                commands.extend(_shown_commands(name, lines))
    return commands


def _shown_commands(name: str, lines: list[tuple[int, str]]) -> list[Command]:
    """``$ command`` lines of a console block, each with the output shown after it."""
    out, current, output = [], None, []
    for number, line in _logical_lines(lines):
        if line.startswith("$ "):
            if current:
                out.append(Command(current[0], current[1], tuple(output)))
            (argv,) = _split(line[2:])
            current, output = (f"{name}:{number}", tuple(argv)), []
        elif current:
            output.append(line.strip())
    if current:
        out.append(Command(current[0], current[1], tuple(output)))
    return out


# ------------------------------------------------------------------ train.py


@dataclass
class TrainArgs:
    overrides: list[str]
    multirun: bool


def train_args(argv: tuple[str, ...]) -> TrainArgs | None:
    """The train.py arguments of a command (also under torchrun), else None."""
    if "train.py" not in argv:
        return None
    i = argv.index("train.py")
    if argv[0] != "torchrun" and argv[:i] != ("python",):
        return None
    args = quote_paths(argv[i + 1 :])  # what train.py does before Hydra
    overrides, multirun, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in ("--cfg", "-c", "--package", "-p", "--info", "-i"):
            skip = arg not in ("--info", "-i")
        elif arg.startswith("-"):
            assert arg in ("--help", "-h", "--hydra-help", "--resolve"), arg
        else:
            overrides.append(arg)
    return TrainArgs(overrides, multirun)


def sweep_points(args: TrainArgs) -> list[list[str]]:
    """Each point of a sweep as plain overrides (one point without ``-m``), parsed by
    Hydra's override parser (a syntax error fails here, as it would in Hydra)."""
    parsed = OverridesParser.create().parse_overrides(args.overrides)
    choices = []
    for override in parsed:
        key = override.get_key_element()
        if args.multirun and override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
        choices.append([f"{key}={v}" for v in values])
    return [list(point) for point in itertools.product(*choices)]


def compose_run(overrides: list[str]):
    """The job config (without ``hydra``) and the full config, as train.py gets them."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        full = compose("config", overrides=overrides, return_hydra_config=True)
    cfg = OmegaConf.masked_copy(full, [k for k in full if k != "hydra"])
    return cfg, full


def check_train_command(command: Command, args: TrainArgs) -> None:
    user_paths = "~" in command.text
    for point in sweep_points(args):
        cfg, _ = compose_run(point)
        try:
            validate(cfg)
        except ConfigError as err:
            # A path the user supplies (~/ckpt/my-llama) is not on this machine.
            if not (user_paths and str(err).split(":")[0] in USER_PATH_KEYS):
                raise


def run_shown(command: Command, args: TrainArgs, run_dir: Path) -> list[str]:
    """What ``python train.py <overrides>`` prints for a plan-only run or a config
    error, run in-process as train.py's main() does."""
    from src.trainer.launch import launch, prepare

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cfg, full = compose_run(args.overrides)
            resolved = validate(cfg)
            assert cfg.trainer.plan_only, f"{command.where}: shown output of a training"
            HydraConfig.instance().set_config(full)  # the command line's keys
            cfg, resolved = prepare(cfg, resolved)
            launch(cfg, str(run_dir), resolved)
        except CONFIG_ERRORS as err:
            print(f"config error: {one_line(err)}")
        finally:
            HydraConfig.instance().cfg = None  # later tests see no Hydra job
    return out.getvalue().splitlines()


# ------------------------------------------------------------ other programs


def hydra_app(argv: tuple[str, ...]) -> tuple[Path, list[str]] | None:
    """``python X.py args`` or ``python -m pkg.mod args`` of a Hydra app in the repo:
    its file and arguments."""
    if argv[0] != "python" or len(argv) < 2:
        return None
    if argv[1] == "-m" and len(argv) > 2:
        path, args = ROOT / (argv[2].replace(".", "/") + ".py"), argv[3:]
    elif argv[1].endswith(".py"):
        path, args = ROOT / argv[1], argv[2:]
    else:
        return None
    if not path.is_file() or "@hydra.main(" not in path.read_text():
        return None
    return path, list(args)


def check_hydra_app(path: Path, args: list[str]) -> None:
    """Compose another entry point's config with the command's overrides."""
    source = path.read_text()
    found = {
        key: re.search(rf'{key}\s*=\s*"([^"]+)"', source)
        for key in ("config_path", "config_name")
    }
    conf = (path.parent / found["config_path"].group(1)).resolve()
    overrides = [a for a in quote_paths(args) if not a.startswith("-")]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        compose(found["config_name"].group(1), overrides=overrides)


def skip_reason(command: Command) -> str | None:
    for prefix, why in SKIPPED.items():
        if command.argv[: len(prefix)] == prefix:
            return why
    if USER_RUN_DIR.search(command.text):
        return "reads a run dir the user names"
    return None


# ------------------------------------------------------------------- the tests


COMMANDS = doc_commands()


def test_the_docs_show_commands():
    """The parser finds the commands (a change of the Markdown's shape would
    otherwise silently check nothing)."""
    texts = [c.text for c in COMMANDS]
    assert len(COMMANDS) > 30
    assert "python train.py model=llama_tiny" in texts
    assert any(c.output for c in COMMANDS)
    for executed in EXECUTED:
        assert executed in texts, f"EXECUTED lists {executed!r}, which no doc shows"
    for prefix in SKIPPED:
        assert any(c.argv[: len(prefix)] == prefix for c in COMMANDS), prefix


def test_every_docs_command_composes_validates_or_is_skipped_with_a_reason(tmp_path):
    problems = []
    for command in COMMANDS:
        try:
            if skip_reason(command) or command.output:
                continue  # shown with its output: the next test runs it
            args = train_args(command.argv)
            if args is not None:
                check_train_command(command, args)
                continue
            app = hydra_app(command.argv)
            if app is not None:
                check_hydra_app(*app)
                continue
            problems.append(
                f"{command.where}: {command.text}: a command this test cannot check; "
                "make it runnable here or add it to SKIPPED with the reason"
            )
        except Exception as err:  # noqa: BLE001 - every failing command is listed
            problems.append(f"{command.where}: {command.text}: {one_line(err)}")
    assert problems == []


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.output], ids=lambda c: c.where
)
def test_shown_output_is_what_the_command_prints(command, tmp_path):
    """docs/planner.md's verdicts, the README's config error...: each line shown after
    a ``$ `` command is a line the command prints (``...`` ends a shown prefix)."""
    args = train_args(command.argv)
    assert args is not None, f"{command.where}: shown output of {command.text}"
    printed = run_shown(command, args, tmp_path)
    for line in command.output:
        if line.endswith("..."):
            assert any(p.startswith(line[:-3]) for p in printed), (line, printed)
        else:
            assert line in printed, (line, printed)


def test_a_few_docs_commands_really_run(tmp_path):
    for text, extra in EXECUTED.items():
        run_dir = tmp_path / str(len(list(tmp_path.iterdir())))
        argv = [sys.executable, *shlex.split(text)[1:], *extra]
        if "--cfg" not in argv:
            argv.append(f"hydra.run.dir={run_dir}")
        out = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, (text, out.stderr[-3000:])
        if "--cfg" in argv:
            assert "trainer:\n" in out.stdout and "max_steps: 300" in out.stdout
        else:
            summary = json.loads((run_dir / "summary.json").read_text())
            assert summary["steps"] == 3 and summary["loss"] > 0


def test_python_blocks_import_what_exists_and_md_files_named_exist():
    """The docs' ```python blocks import names that exist (their other lines may need
    a run dir), and every Markdown file a doc links, or names as docs/X.md or
    README.md / ARCHITECTURE.md, exists."""
    import ast

    problems = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT).as_posix()
        for block in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            tree = ast.parse(block.group(1))
            imports = [
                n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)
            ]
            try:
                exec(compile(ast.Module(imports, []), name, "exec"), {})
            except ImportError as err:
                problems.append(f"{name}: {err}")
        links = re.findall(r"\]\(([^)#\s]+\.md)", text)
        named = re.findall(r"(?<![\w/.])(docs/[\w-]+\.md|[A-Z][A-Z_]*\.md)\b", text)
        for target in set(links + named):
            if not any((base / target).is_file() for base in (doc.parent, ROOT)):
                problems.append(f"{name}: names {target}, which does not exist")
    assert problems == []
