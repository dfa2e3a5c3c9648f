"""Every command README.md and docs/*.md show, checked, so the docs cannot drift.

The commands are read from the Markdown itself: each line of a ```bash block (``\\``
continuations joined, ``&&`` chains split, comments dropped), each ``$ `` line of an
unlabelled block, with the lines shown after it as its output (in an unlabelled
block without ``$ `` lines, each line that starts with ``python`` or ``torchrun``),
and each backticked ``python X.py ...`` or ``python -m pkg.mod ...`` in running text
that is not a template
(``...``, ``<config>``).
A command someone adds to the docs is checked without touching this file:

- ``python train.py ...`` (also after ``torchrun``), each point of a sweep
  (``-m a=1,2``): taken in-process as far as a run goes without training, as
  train.py's main() does: composed with conf/ (Hydra's settings included: launcher
  and sweeper keys are typed by their plugins), validated, ``launch.prepare``d (the
  token cache, the planner's choices and estimate) and, plan-only, the plan printed.
  A config error fails unless the docs show it, or it names a path the user
  supplies (``~/corpus``).
- the short ones (the planner's peak per rank <= :data:`SHORT_GIB`, up to
  :data:`SHORT_WORLD` ranks; a sweep's first point) are then trained for real,
  shortened (:data:`SHORTEN`): one launch of ranks per world size runs them all.
- a ``$ `` command shown with its output: every line shown must be a line it prints
  (``...`` stands for any text), plan-only, a config error or a training.
- another Hydra entry point (``python X.py``, ``python -m pkg.mod``): composed with its
  own config.
- ``python -m bench.<name> ...``: its arguments parsed by the benchmark's own parser
  (its ``main``, stopped once they parse: nothing is measured).
- anything else must be in :data:`SKIPPED` with the reason it cannot run here; an
  unknown program fails the test, naming the doc and line.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

import src.trainer.launch as launch_module
from src.config.cli import CONFIG_ERRORS, one_line, quote_paths
from src.config.run_plan import OVERRIDES
from src.config.validate import validate
from src.trainer.launch import override_keys
from tests.commands import in_process
from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Programs (the start of a command) that cannot run here, and why. Kept small: a
#: command is skipped only for what this machine or a test cannot have.
SKIPPED = {
    ("pip", "install"): "installs packages from the network",
    ("python", "-m", "pytest"): "the test suite itself",
    ("wandb", "sync"): "uploads runs to wandb over the network",
    ("python", "-c"): "a Python one-liner: makes or reads files for the commands "
    "beside it (docs/models.md's tiny Mixtral; tests/test_hf_inputs.py runs that "
    "round trip)",
    ("python", "compare.py"): "reads earlier runs' dirs (run by "
    "tests/test_research_loop.py on two trained runs, and by "
    "tests/test_research_data.py on a sweep dir and runs of two tokenizers)",
}
#: Commands that read a run dir the user names (a placeholder such as <date>).
USER_RUN_DIR = re.compile(r"<date>|<time>|<run dir>")
#: Keys holding a path the user supplies (~/corpus, ~/ckpt/my-llama), or that an
#: earlier command of the same doc writes (a ``python -c`` saving a model to
#: /tmp/tiny_mixtral): such a command is composed and validated, but its validation
#: may stop at that path.
USER_PATH_KEYS = ("model.pretrained", "data.paths", "data.tokenizer", "model.config")


@dataclass(frozen=True)
class Command:
    where: str  # README.md:12
    argv: tuple[str, ...]
    output: tuple[str, ...] = ()  # the lines a `$ ` command is shown printing

    @property
    def text(self) -> str:
        return " ".join(self.argv)


def _split(line: str) -> list[list[str]]:
    """A shell line as its commands (``&&``/``;`` chains split, comments dropped).
    The shell's operators are tokens of their own also where they touch a word
    (``for v in a b; do cmd $v; done``: ``shlex.split`` reads ``b;`` as one word)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
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


FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELLS = ("bash", "sh", "shell")


def _code_blocks(text: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """Each fenced block of ``text``: its language and its non-blank lines, numbered
    as in the file."""
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(2)) + 1
        lines = [
            (first + i, line)
            for i, line in enumerate(block.group(2).splitlines())
            if line.strip()
        ]
        yield block.group(1), lines


def doc_commands() -> list[Command]:
    commands = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT).as_posix()
        for lang, lines in _code_blocks(text):
            if lang in SHELLS:
                for number, line in _logical_lines(lines):
                    for argv in _split(line):
                        commands.append(Command(f"{name}:{number}", tuple(argv)))
            elif lang in ("", "console"):
                commands.extend(_shown_commands(name, lines))
                if not any(line.startswith("$ ") for _, line in lines):
                    commands.extend(_plain_commands(name, lines))
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        commands.extend(_inline_commands(name, prose))
    return commands


#: A ``python X.py ...`` or ``python -m pkg.mod ...`` command in running text (a backticked span), unless it is a
#: template (``...``, ``<config>``, ``[overrides]``).
INLINE = re.compile(r"`(python (?:-m [\w.]+|[\w/.-]+\.py)(?: [^`]*)?)`")
TEMPLATE = re.compile(r"\.\.\.|<\w[^>]*>|\[overrides\]")


def _inline_commands(name: str, text: str) -> list[Command]:
    """The commands a doc names in running text (outside its code blocks)."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for span in INLINE.findall(line):
            if not TEMPLATE.search(span):
                out.extend(Command(f"{name}:{number}", tuple(a)) for a in _split(span))
    return out


#: The programs a line of an unlabelled block starts with when it is a command.
PROGRAMS = ("python ", "torchrun ")


def _plain_commands(name: str, lines: list[tuple[int, str]]) -> list[Command]:
    """The commands of an unlabelled block without ``$ `` lines (a shell session
    shown bare, as docs/models.md's tiny Mixtral round trip): each line that starts
    with a program (:data:`PROGRAMS`) and is not a template (docs/architecture.md's
    ``python train.py k=v ...`` above its call tree). The other lines are output or
    a diagram."""
    out = []
    for number, line in _logical_lines(lines):
        if line.startswith(PROGRAMS) and not TEMPLATE.search(line):
            out.extend(Command(f"{name}:{number}", tuple(a)) for a in _split(line))
    return out


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
    runs: bool = True  # False: Hydra prints (--cfg, --help, --info) and exits


def train_args(argv: tuple[str, ...]) -> TrainArgs | None:
    """The train.py arguments of a command (also under torchrun), else None."""
    if "train.py" not in argv:
        return None
    i = argv.index("train.py")
    if argv[0] != "torchrun" and argv[:i] != ("python",):
        return None
    args = quote_paths(argv[i + 1 :])  # what train.py does before Hydra
    overrides, multirun, skip, runs = [], False, False, True
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-m", "--multirun"):
            multirun = True
        elif arg in ("--cfg", "-c", "--package", "-p", "--info", "-i"):
            skip = arg not in ("--info", "-i")
            runs = runs and arg in ("--package", "-p")
        elif arg.startswith("-"):
            assert arg in ("--help", "-h", "--hydra-help", "--resolve"), arg
            runs = runs and arg == "--resolve"
        else:
            overrides.append(arg)
    return TrainArgs(overrides, multirun, runs)


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


@dataclass
class Outcome:
    """One documented train.py command (one point of a sweep) taken as far as a run
    goes without training: composed, validated, ``prepare``d (and, plan-only, the
    plan printed). ``lines``: what it printed; ``error``: why it stopped early."""

    command: Command
    point: list[str]
    lines: list[str]
    error: str | None = None
    world: int = 0
    planned_gib: float | None = None
    plan_only: bool = False
    min_steps: int = 1  # the fewest steps its config allows (a profiled window's end)


def _forked() -> str:
    """How ``python train.py`` starts its local ranks (src/entry.py)."""
    return "forkserver"


def prepare_point(command: Command, point: list[str], run_dir: Path) -> Outcome:
    """``point`` as train.py's main() takes it, in-process: compose, validate,
    ``prepare`` (the token cache, the planner's choices and estimate) and, for a
    plan-only run, ``launch`` (which prints the plan). A config error is printed as
    train.py prints it; one about a path the user supplies (~/corpus) ends the
    command there."""
    from src.trainer.launch import launch, prepare

    out, outcome = io.StringIO(), Outcome(command, point, [])
    with contextlib.redirect_stdout(out):
        try:
            cfg, full = compose_run(point)
            resolved = validate(cfg)
            if not train_args(command.argv).runs:
                return outcome  # Hydra prints the config or the help, and exits
            HydraConfig.instance().set_config(full)  # the command line's keys
            run_dir.mkdir(parents=True, exist_ok=True)
            # planned as the command plans: its ranks fork from its rank server
            with mock.patch.object(launch_module, "rank_start_method", _forked):
                cfg, resolved = prepare(cfg, run_dir=str(run_dir))
            outcome.world, outcome.plan_only = (
                resolved.world_size,
                cfg.trainer.plan_only,
            )
            outcome.planned_gib = resolved.planned_peak_gib
            t = cfg.trainer
            if t.profile:
                outcome.min_steps = t.profile_start + t.profile_steps - 1
            if cfg.trainer.plan_only:
                launch(cfg, str(run_dir), resolved)
        except CONFIG_ERRORS as err:
            print(f"config error: {one_line(err)}")
            key = str(err).split(":")[0]
            # a command for a bigger machine (GPUs, a cluster) than this one: the
            # machine check is prepare's last step, so all else went through
            bigger = key == OVERRIDES["budget.memory_check"]
            if not bigger and not (
                key in USER_PATH_KEYS and user_path(command, point, key)
            ):
                outcome.error = f"config error: {one_line(err)}"
        except Exception as err:  # noqa: BLE001 - reported with the command
            outcome.error = f"{type(err).__name__}: {one_line(err)}"
        finally:
            HydraConfig.instance().cfg = None  # later tests see no Hydra job
    outcome.lines = out.getvalue().splitlines()
    return outcome


def user_path(command: Command, point: list[str], key: str) -> bool:
    """Whether ``key``'s value in ``point`` is a path the user supplies (``~``) or
    one that an earlier command of the same doc writes (so it may not exist here)."""
    if "~" in command.text:
        return True
    value = next((p.split("=", 1)[1] for p in point if p.startswith(f"{key}=")), "")
    doc, line = command.where.rsplit(":", 1)
    return bool(value) and any(
        c.where.rsplit(":", 1)[0] == doc
        and int(c.where.rsplit(":", 1)[1]) < int(line)
        and value in c.text
        for c in COMMANDS
    )


def shown_mismatches(shown: tuple[str, ...], printed: list[str]) -> list[str]:
    """The lines shown in the docs that the command did not print; ``...`` in a shown
    line stands for any text (a figure that varies, the rest of a long line)."""
    missing = []
    for line in shown:
        pattern = ".*".join(map(re.escape, line.split("...")))
        if not any(re.fullmatch(pattern, p.strip()) for p in printed):
            missing.append(line)
    return missing


def train_commands(commands: list[Command]) -> list[Command]:
    """The documented train.py commands, each once (the first place that shows it)."""
    out: dict[tuple[str, ...], Command] = {}
    for command in commands:
        if train_args(command.argv) is not None and not skip_reason(command):
            out.setdefault(command.argv, command)
    return list(out.values())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """``prepared(command)``: its outcomes, one per point of its sweep, each taken
    through ``prepare`` once in this module (the tests below share them)."""
    root, done = tmp_path_factory.mktemp("prepared"), {}

    def outcomes(command: Command) -> list[Outcome]:
        if command.argv not in done:
            points = sweep_points(train_args(command.argv))
            done[command.argv] = [
                prepare_point(command, p, root / f"{len(done)}_{i}")
                for i, p in enumerate(points)
            ]
        return done[command.argv]

    return outcomes


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


class _Parsed(Exception):
    """Raised by the patched ``parse_args`` once a benchmark's arguments parse."""


def bench_args(argv: tuple[str, ...]) -> tuple[str, list[str]] | None:
    """``python -m bench.<name> args``: the module and its arguments."""
    if argv[:2] == ("python", "-m") and len(argv) > 2 and argv[2].startswith("bench."):
        return argv[2], list(argv[3:])
    return None


def check_bench_args(module: str, args: list[str]) -> None:
    """The benchmark's ``main`` parses ``args`` with its own parser and is stopped
    there (nothing measured); an argument it refuses raises, with argparse's line."""
    import argparse
    import importlib
    import inspect
    import sys
    from unittest import mock

    originals = {
        name: getattr(argparse.ArgumentParser, name)
        for name in ("parse_args", "parse_known_args")
    }
    depth = 0  # parse_args calls parse_known_args, as do subparsers: stop outermost

    def stopping(name):
        def parse_then_stop(self, *a, **kw):
            nonlocal depth
            depth += 1
            try:
                parsed = originals[name](self, *a, **kw)
            finally:
                depth -= 1
            if depth:
                return parsed
            raise _Parsed(parsed)

        return parse_then_stop

    main = importlib.import_module(module).main
    takes_argv = bool(inspect.signature(main).parameters)
    err = io.StringIO()
    with (
        mock.patch.object(
            argparse.ArgumentParser, "parse_args", stopping("parse_args")
        ),
        mock.patch.object(
            argparse.ArgumentParser, "parse_known_args", stopping("parse_known_args")
        ),
        mock.patch.object(sys, "argv", [module, *args]),
        contextlib.redirect_stderr(err),
    ):
        try:
            main(args) if takes_argv else main()
        except _Parsed:
            return
        except SystemExit:
            raise ValueError(err.getvalue().strip().splitlines()[-1]) from None
    raise AssertionError(f"{module}.main() returned without parsing its arguments")


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
    assert "python train.py --cfg job" in texts
    assert "python -m bench.pipeline --steps 8 --microbatches 8" in texts
    # an unlabelled block's bare commands (docs/models.md), not its diagrams' lines
    mixtral = "python train.py model=hf model.pretrained=/tmp/tiny_mixtral"
    assert any(t.startswith(mixtral) for t in texts)
    assert not any(t.startswith("python train.py k=v") for t in texts)
    for prefix in SKIPPED:
        assert any(c.argv[: len(prefix)] == prefix for c in COMMANDS), prefix
    # a one-line loop (docs/benchmarks.md: ``for lg in wandb none; do ...; done``)
    # is its commands; ``b;`` read as one word once made it none, unseen
    loop = "for v in a b; do python train.py x=$v; done  # c"
    assert _split(loop) == [["python", "train.py", f"x={v}"] for v in "ab"]
    where = {c.where for c in COMMANDS}
    silent = [
        f"{name}:{number}: {line}"
        for name, number, line in _shell_lines()
        if f"{name}:{number}" not in where and not line.lstrip().startswith("#")
    ]
    assert silent == [], "shell lines that yield no command"


def _shell_lines():
    """``(doc, line number, logical line)`` of each ```bash block line."""
    for doc in DOCS:
        for lang, lines in _code_blocks(doc.read_text()):
            if lang in SHELLS:
                for number, line in _logical_lines(lines):
                    yield doc.relative_to(ROOT).as_posix(), number, line


@pytest.mark.parametrize("command", train_commands(COMMANDS), ids=lambda c: c.where)
def test_train_command_goes_as_far_as_prepare(command, prepared):
    """Each train.py command (each point of a sweep) goes as far as a run goes
    without training: a config error only where the docs show one."""
    problems = [
        f"{' '.join(o.point) or 'python train.py'}: {o.error}"
        for o in prepared(command)
        if o.error and not command.output
    ]
    assert problems == []


def test_other_docs_commands_compose_or_are_skipped_with_a_reason():
    """Every other command is composed with its own app's config, parsed by its
    benchmark's parser, or skipped for a stated reason."""
    problems = []
    for command in COMMANDS:
        if skip_reason(command) or train_args(command.argv) is not None:
            continue
        try:
            bench = bench_args(command.argv)
            if bench is not None:
                check_bench_args(*bench)
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


#: A documented training is run for real when its model is this small (the planner's
#: peak per rank, GiB) on at most this many ranks, shortened to STEPS steps (and the
#: rest of :data:`SHORTEN`) that its config allows.
SHORT_GIB, SHORT_WORLD, STEPS = 0.5, 4, 2
README_PP2 = ("python", "train.py", "trainer.devices=4", "sharding.pipeline_parallel=2")
SHORTEN = [
    f"trainer.max_steps={STEPS}",
    "trainer.val_batches=1",
    "trainer.progress=false",
]
#: Added unless the command sets the key: no wandb process, no MFU probe.
QUIET = {"logger": "logger=none", "trainer.peak_tflops": "trainer.peak_tflops=1"}


def _short(o: Outcome) -> bool:
    return (
        o.error is None
        and not o.plan_only
        and o.command.argv[0] == "python"
        and o.planned_gib is not None
        and o.planned_gib <= SHORT_GIB
        and o.world <= SHORT_WORLD
        and o.min_steps <= STEPS
        and "trainer.resume" not in override_keys(o.point)  # needs an earlier run
    )


def _train_group(rank: int, world: int, runs: list[tuple]) -> dict | None:
    """The runs of one world size, one after another on the same ranks: each as
    launch's ranks run it (``loop.train``); rank 0 returns each run's summary and the
    lines it logged."""
    import logging

    from src.observe.logs import PROJECT_LOGGER
    from src.trainer.loop import train

    class Lines(logging.Handler):
        def emit(self, record):
            lines.extend(record.getMessage().splitlines())

    project, handler = logging.getLogger(PROJECT_LOGGER), Lines()
    project.setLevel(logging.INFO)
    project.addHandler(handler)
    out = {}
    for where, cfg, resolved, run_dir in runs:
        lines: list[str] = []
        try:
            summary = train(cfg, run_dir, torch.device("cpu"), resolved)
        except Exception as err:
            raise RuntimeError(f"{where}: {type(err).__name__}: {err}") from err
        out[where] = (summary, lines)
    project.removeHandler(handler)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def real_runs(prepared, tmp_path_factory) -> dict[tuple, tuple[dict, list[str]]]:
    """Each short documented training (its sweep's first point), shortened, run for
    real: one launch of ranks per world size. ``{argv: (summary, lines)}``."""
    from src.trainer.launch import prepare

    root, groups, first = tmp_path_factory.mktemp("real"), {}, {}
    for command in train_commands(COMMANDS):
        o = prepared(command)[0]  # a sweep's first point
        if not _short(o):
            continue
        keys = override_keys(o.point)
        extra = SHORTEN + [v for k, v in QUIET.items() if k not in keys]
        cfg, full = compose_run([*o.point, *extra])
        run = OmegaConf.to_yaml(cfg)  # a command that runs what another runs: once
        first[o.command.argv] = first.setdefault(run, o.command.argv)
        if first[run] != o.command.argv:
            continue
        HydraConfig.instance().set_config(full)
        try:
            validate(cfg)
            cfg, resolved = prepare(cfg)
        finally:
            HydraConfig.instance().cfg = None
        run_dir = str(root / str(len(first)))
        groups.setdefault(o.world, []).append((o.command.argv, cfg, resolved, run_dir))
    done = {}
    for world, runs in sorted(groups.items()):
        done.update(run_distributed(_train_group, world, runs, timeout=600)[0])
    return {a: done[b] for a, b in first.items() if isinstance(a, tuple)}


@pytest.mark.timeout(1500)  # one launch per world size runs them all (the fixture)
def test_short_docs_commands_really_run(real_runs):
    """Tiny models and a few steps: HSDP, TP, Llama, hf, custom, csv, sampling...
    each trains its 2 steps and reports a throughput window."""
    ran = {" ".join(argv[1:]) for argv in real_runs}
    assert {
        "train.py model=tiny trainer.devices=4 sharding.replicate=2",
        "train.py model=tiny trainer.devices=1 sharding=none trainer.max_steps=50",
        "train.py model=llama_tiny",
        "train.py trainer.devices=4 sharding.pipeline_parallel=2",
    } <= ran, ran
    # README's PP2 x FSDP2 says so: its wrap plan is one stage's (it read "world
    # size 2" for a 4-rank run), its run line names the schedule
    pp = real_runs[README_PP2][1]
    assert any(
        "(world size 4: pp 2 x 2 rank(s) per stage; the plan of" in x for x in pp
    )
    assert any(
        x.startswith("run: ") and ", PP2 1f1b x 2 micro-batches (units: " in x
        for x in pp
    ), pp
    for argv, (summary, lines) in real_runs.items():
        assert summary["steps"] == STEPS and 0 < summary["loss"] < 10, argv
        assert summary["tokens_per_s"] > 0, argv
        # The last window's MFU, or none where its line says n/a (docs/metrics.md).
        last = next(x for x in reversed(lines) if x.startswith(f"step {STEPS}: loss"))
        assert ("mfu n/a" in last) == ("mfu" not in summary), (argv, last)
        assert 0 < summary.get("mfu", 1) <= 1, argv


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if c.output], ids=lambda c: c.where
)
@pytest.mark.timeout(1500)  # the first of these alone (-k) starts the real runs
def test_shown_output_is_what_the_command_prints(command, prepared, real_runs):
    """docs/planner.md's verdicts, the README's config error, a training's lines...:
    each line shown after a ``$ `` command is a line the command prints."""
    assert train_args(command.argv) is not None, command.where
    printed = prepared(command)[0].lines + real_runs.get(command.argv, ({}, []))[1]
    assert shown_mismatches(command.output, printed) == [], printed


def test_the_composed_config_prints(monkeypatch, capsys):
    """``python train.py --cfg job`` (README), as a user runs it (in-process:
    tests/commands.py)."""
    code, out, err = in_process(monkeypatch, capsys, "train.py", "--cfg", "job")
    assert code == 0, err[-3000:]
    assert "trainer:\n" in out and "max_steps: 300" in out


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


def test_bench_args_are_parsed_and_stopped_whichever_parse_call(tmp_path, monkeypatch):
    """check_bench_args stops a benchmark after parsing, whether its main calls
    parse_args or parse_known_args (which would otherwise run it for real)."""
    (tmp_path / "fake_bench.py").write_text(
        "import argparse\n"
        "def main(argv=None):\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--steps', type=int)\n"
        "    p.parse_known_args(argv)\n"
        "    raise RuntimeError('ran for real')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    check_bench_args("fake_bench", ["--steps", "3"])
    with pytest.raises(ValueError, match="invalid int value"):
        check_bench_args("fake_bench", ["--steps", "three"])
