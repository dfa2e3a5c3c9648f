"""Words and tables for people: plurals, Markdown tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def plural(n: int, word: str) -> str:
    """``1 unit``, ``5 units``: a count and its noun."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows of ``{column: cell}`` (the first row's keys are the columns) as a Markdown
    table; a ``|`` inside a cell is escaped."""
    if not rows:
        return "(no rows)"
    keys = list(rows[0])

    def line(cells: Iterable[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    lines = [line(keys), "|" + "---|" * len(keys)]
    lines += [line(r.get(k, "") for k in keys) for r in rows]
    return "\n".join(lines)
