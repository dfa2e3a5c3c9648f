"""Named options of one kind (model families, data sources, loggers): a dict that
refuses a second entry under a taken name, so a plug-in cannot silently replace
another."""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")


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
