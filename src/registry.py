"""Named options of one kind (model families, data sources, loggers, backends,
precisions, wrap policies): a dict that refuses a second entry under a taken name, so
a plug-in cannot silently replace another; and :func:`described`, a schema field with
its one-line ``--help`` text (src/config/cli_help.py reads it), so a key's type and its
meaning live together."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from omegaconf import MISSING

T = TypeVar("T")

#: A key's ``--help`` line, or a function returning it (for a text that lists a
#: registry's names, read when the help is shown, once every plug-in is registered).
Help = str | Callable[[], str]


class Registry(dict[str, T]):
    """``name -> entry``; :meth:`add` refuses a name already taken."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind  # what an entry is, for messages ("model family", "logger")

    def add(self, name: str, entry: T) -> T:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self[name] = entry
        return entry


def no_check(node: Any) -> None:
    """An option whose schema's types say everything."""


def described(help: Help, default: Any = MISSING) -> Any:
    """A schema dataclass field whose ``--help`` line is ``help``; its value lives in
    the group's YAML (``default`` MISSING) unless ``default`` is given."""
    return dataclasses.field(default=default, metadata={"help": help})


def key_help(schema: Any, name: str) -> str | None:
    """The ``--help`` line of field ``name`` of the dataclass ``schema`` (None: the
    field has none, or ``schema`` is no dataclass)."""
    if not dataclasses.is_dataclass(schema):
        return None
    for f in dataclasses.fields(schema):
        if f.name == name:
            about = f.metadata.get("help")
            return about() if callable(about) else about
    return None


def or_list(names: Iterable[str]) -> str:
    """``a, b or c``: the names of a registry, for a help line."""
    names = list(names)
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
