"""One-line config errors: :func:`run_cli` turns every config error, Hydra's or
ours, into one line on stderr that names the key (exit status 2); train.py, sample.py
and eval.py run under it, and :func:`exit_on_config_error` does the same inside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hydra.errors import (
    HydraException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
)

from src.config.cli_help import (
    is_schema_option,
    option_keys,
    option_parents,
    user_groups,
    user_options,
)
from src.config.schema import Config
from src.config.validate import refuse_null_groups
from src.errors import FULL_ERROR_ENV, ConfigError, RunError
from src.observe.logs import error_line

log = logging.getLogger(__name__)


def _allowed_keys(cause: OmegaConfBaseException) -> list[str]:
    """The schema's keys next to the unknown key of ``cause`` (the family's schema for
    a ``model.*`` key)."""
    schema = getattr(cause, "object_type", None)
    if dataclasses.is_dataclass(schema):
        return [f.name for f in dataclasses.fields(schema)]
    parent = cause.full_key.rpartition(".")[0]
    node = OmegaConf.structured(Config)
    node = OmegaConf.select(node, parent) if parent else node
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _unchosen_group(key: str) -> str | None:
    """For a key of a group that no option was chosen for (eval.py's ``data`` is
    null: the run's own), what to add: the options whose YAML has that key."""
    group, _, rest = key.partition(".")
    if not rest or group not in user_groups():
        return None
    name = rest.split(".")[0]
    holders = [
        o
        for o in user_options(group)
        if not is_schema_option(o) and name in option_keys(group, o)
    ]
    if not holders:
        return None
    # the option the others extend first (data=files before its presets text, chat)
    among = set(holders)
    holders.sort(key=lambda o: bool(among.intersection(option_parents(group, o))))
    return (
        f"no {group}= option is chosen to hold it: add {group}={holders[0]} (the "
        f"{group}= options with this key: {', '.join(holders)})"
    )


def one_line(err: BaseException) -> str:
    """A config error as one line that starts with the key (Hydra's and OmegaConf's
    messages run over several lines and end with a hint about HYDRA_FULL_ERROR)."""
    if isinstance(err, ConfigError):
        return str(err)
    if isinstance(err, MissingConfigException) and err.options:
        group = (err.missing_cfg_file or "").rpartition("/")[0] or "config"
        wanted = (err.missing_cfg_file or "").rpartition("/")[2]
        options = [o for o in err.options if not is_schema_option(o)]
        return f"{group}: no option {wanted!r}, expected one of: {', '.join(options)}"
    if isinstance(err, OverrideParseException):
        line = f"{err.override}: {err.message.splitlines()[0]}"
        hint = _quoting_hint(err.override or "")
        return f"{line}; {hint}" if hint else line
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        msg = str(getattr(cause, "msg", cause)).strip().splitlines()[0]
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
            allowed = _allowed_keys(cause)
            if allowed:
                msg = f"unknown key, expected one of: {', '.join(allowed)}"
            else:
                msg = _unchosen_group(cause.full_key) or msg
        return f"{cause.full_key}: {msg}"
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _quoting_hint(override: str) -> str | None:
    """How to write an override whose value Hydra's lexer stops in (``(``, ``:``, a
    quote...): the value in Hydra's quotes, inside the shell's."""
    key, eq, value = override.partition("=")
    if not eq or not value or value[:1] in "'\"[{" or key.startswith("-"):
        return None  # already quoted, or a list/dict: the parse error says where
    if '"' not in value:
        inner = f'{key}="{value}"'
    elif "'" not in value:
        inner = f"{key}='{value}'"
    else:
        inner = key + '="' + value.replace('"', '\\"') + '"'
    shell = "'" + inner.replace("'", "'\\''") + "'"
    return f"quote the value for Hydra, and that for the shell: {shell}"


CONFIG_ERRORS = (ConfigError, HydraException, OmegaConfBaseException)

# An element of an override's value (the whole value, or an item of a list or of a
# sweep) that starts with ``~`` (a home path) or holds ``<``/``>`` (``<stdlib>``): the
# characters Hydra's override lexer has no token for.
_PATH_ELEMENT = re.compile(r"(?:(?<=^)|(?<=[\[,]))\s*([^,\[\]'\"]*[~<>][^,\[\]'\"]*)")


def quote_paths(args: Sequence[str]) -> list[str]:
    """The command line's overrides with home paths and ``<stdlib>`` made parseable.

    ``model.pretrained=~/ckpt``, ``data.paths=~/corpus/**/*.jsonl`` and
    ``data.paths=[~/a/*.parquet,~/b/*.parquet]`` (as the docs write them) stop in
    Hydra's lexer: ``~`` is not a character of an unquoted value. An override that
    Hydra cannot parse gets each such element expanded (``~`` -> the home directory,
    as a shell does) and quoted; every other argument is passed on as it is.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()

    def parses(arg: str) -> bool:
        try:
            parser.parse_override(arg)
        except HydraException:  # the lexer's and the parser's errors
            return False
        return True

    def quoted(match: re.Match) -> str:
        element = os.path.expanduser(match.group(1).strip())
        return f"'{element}'" if "'" not in element else f'"{element}"'

    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if arg.startswith("-") or not eq or parses(arg):
            out.append(arg)
            continue
        fixed = f"{key}={_PATH_ELEMENT.sub(quoted, value)}"
        out.append(fixed if parses(fixed) else arg)  # else Hydra reports the original
    return out


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Turn a config error raised inside into one line on stderr and exit status 2
    (a RunError, such as a damaged checkpoint found by sample.py's or eval.py's
    ranks: ``error: ...``, exit status 1).

    ``sys.exit`` (not an exception) also inside a Hydra job: Hydra would print its
    own "Error executing job" line first.
    """
    try:
        yield
    except (*CONFIG_ERRORS, RunError) as err:
        config = isinstance(err, CONFIG_ERRORS)
        line = f"{'config error' if config else 'error'}: {one_line(err)}"
        error_line(log, line)  # stderr (and train.log once Hydra set it up)
        exit_ = SystemExit(2 if config else 1)
        exit_.add_note(line)  # what a sweep records for the job (src/runs/sweep.py)
        raise exit_ from err


def run_cli(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function; a config error exits 2 with one line on stderr.

    Hydra prints override errors over several lines and strips tracebacks only for its
    own exceptions; with ``HYDRA_FULL_ERROR=1`` it re-raises instead, which lets us
    format them. A user who sets ``HYDRA_FULL_ERROR=1`` gets Hydra's full report.
    """
    sys.argv[1:] = quote_paths(sys.argv[1:])
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ[FULL_ERROR_ENV] = "1"  # the ranks show tracebacks too
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    with exit_on_config_error():
        refuse_null_groups(sys.argv[1:])
        try:
            main()
        except OSError as err:  # e.g. Hydra cannot create the run dir
            if isinstance(err, CONFIG_ERRORS):  # Hydra's missing option is an IOError
                raise
            error_line(log, f"error: {err}")
            sys.exit(1)
