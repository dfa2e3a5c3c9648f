"""``python train.py --help``: the groups a user picks from and every key with one line
saying what it does.

Hydra's ``--help`` prints its config groups (the internal schema groups included:
``data=base_files``, ``model=schema/llama``) and the config without a word per key.
conf/config.yaml sets ``hydra.help.template`` to ``${shardwrap_help:}``, the resolver
below, which renders the composed config (with the command line's overrides) with
each key's one-line description as a comment and lists only the options of conf/. A
key's description lives next to its type, in its schema dataclass's field metadata
(``described(help)``, src/registry.py; a model family's keys: ``ModelSpec.key_help``),
read here from the type of each node; tests/test_cli.py checks every key of every
option has one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from src.registry import key_help

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Groups of conf/ that are Hydra's own or hold config files, not options to pick.
NOT_GROUPS = ("hydra", "hf_configs")
# ConfigStore entries that type a group's options (src/config/schema.py); picking one
# gives an empty, untyped-by-a-preset node, so they are not options.
SCHEMA_PREFIXES = ("schema/", "base_")


def user_options(group: str) -> list[str]:
    """The options of ``group`` a user picks from: conf/<group>/*.yaml."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _option_yaml(group: str, option: str) -> dict:
    try:
        node = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return node if isinstance(node, dict) else {}


def option_parents(group: str, option: str) -> list[str]:
    """The options of ``group`` that ``option`` extends (its defaults list)."""
    return [
        p
        for p in _option_yaml(group, option).get("defaults") or ()
        if isinstance(p, str) and p in user_options(group)
    ]


def option_keys(group: str, option: str) -> set[str]:
    """The top-level keys an option's YAML sets (conf/<group>/<option>.yaml), those of
    the options it extends in its defaults list included."""
    keys = set(_option_yaml(group, option)) - {"defaults"}
    for parent in option_parents(group, option):
        keys |= option_keys(group, parent)
    return keys


def user_groups() -> list[str]:
    return sorted(
        p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in NOT_GROUPS
    )


def is_schema_option(option: str) -> bool:
    return option.startswith(SCHEMA_PREFIXES)


def _walk(node: DictConfig, depth: int = 0) -> Iterator[tuple[int, str, Any, Any]]:
    """Each key of ``node`` as --help shows it: ``(depth, key, child, description)``.
    A node without a description of its own is opened: it comes with ``description``
    ``...`` and its keys follow, one level deeper. ``None``: the schema has none."""
    for key in node.keys():
        child = node._get_node(key)
        about = key_help(OmegaConf.get_type(node), key)
        if isinstance(child, DictConfig) and about is None:
            yield depth, key, child, ...
            yield from _walk(child, depth + 1)
        else:
            yield depth, key, child, about


def described_keys(node: DictConfig) -> dict[str, str | None]:
    """Each key of ``node`` that --help shows on one line, by its full dotted name,
    with its description (None: its schema has none)."""
    out: dict[str, str | None] = {}
    path: list[str] = []
    for depth, key, _, about in _walk(node):
        path[depth:] = [key]
        if about is not ...:
            out[".".join(path)] = about
    return out


def _lines(node: DictConfig, indent: str) -> list[str]:
    out = []
    for depth, key, child, about in _walk(node):
        pad = indent + "  " * depth
        if about is ...:
            out.append(f"{pad}{key}:")
            continue
        if isinstance(child, DictConfig | ListConfig):
            container = OmegaConf.to_container(child, resolve=False)
            value = yaml.safe_dump(container, default_flow_style=True, width=1e9)
            value = value.strip()
        else:
            value = OmegaConf.to_yaml({key: child}).strip().partition(": ")[2]
        line = f"{pad}{key}: {value}"
        out.append(f"{line:<44} # {about}" if about else line)
    return out


def render_help(*, _root_: DictConfig) -> str:
    """The ``--help`` text for the composed config ``_root_`` (Hydra's, with its
    ``hydra`` node)."""
    groups = [
        f"  {g}: {', '.join(o for o in user_options(g) if not is_schema_option(o))}"
        for g in user_groups()
    ]
    choices = _root_.hydra.runtime.choices
    chosen = " ".join(f"{g}={choices[g]}" for g in user_groups() if g in choices)
    app = {k: _root_._get_node(k) for k in _root_.keys() if k != "hydra"}
    keys = []
    for name, node in app.items():
        keys.append(f"{name}:")
        keys.extend(_lines(node, "  "))
    text = "\n".join(
        [
            "python train.py [group=option ...] [key=value ...]   "
            "(README.md, docs/*.md)",
            "",
            "== Groups (group=option) ==",
            *groups,
            "",
            f"== Keys (key=value), as composed for {chosen} ==",
            *keys,
            "",
            "Lists: key=[a,b]; paths: data.paths=~/corpus/**/*.jsonl; a sweep: "
            "-m key=a,b (docs/sweeps.md).",
            "Flags: --cfg job (print the composed config), -m (multirun), "
            "--info (Hydra's search path, defaults), --hydra-help (Hydra's own).",
        ]
    )
    return text.replace("$", "$$")  # Hydra's string.Template keeps it as is


if not OmegaConf.has_resolver("shardwrap_help"):
    OmegaConf.register_new_resolver("shardwrap_help", render_help, use_cache=False)
