"""The README's key tables against the schema: every key a user can set is written in
the README or a doc it links, and the README's table row of each group names every key
of that group (the keys are read from the schema's dataclasses, not listed here)."""

from __future__ import annotations

import dataclasses
import re

from src.config import schema
from src.data.sources import DATA_SOURCES
from src.models import families, get_spec
from src.observe.loggers import LOGGERS
from tests.test_config import ROOT

README = (ROOT / "README.md").read_text()
#: The key that picks a group's option (``sharding=fsdp2``), written as the option.
SELECTORS = {"name", "backend", "family"}


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _group_keys() -> dict[str, set[str]]:
    """group -> its keys, from the schema (each data source's, logger's and model
    family's own schema)."""
    keys = {
        f.name: set(_fields(_schema_of(f)))
        for f in dataclasses.fields(schema.Config)
        if dataclasses.is_dataclass(_schema_of(f))
    }
    keys["data"] = {k for s in DATA_SOURCES.values() for k in _fields(s.schema)}
    keys["logger"] = {k for s in LOGGERS.values() for k in _fields(s.schema)}
    return {group: names - SELECTORS for group, names in keys.items()}


def _schema_of(f: dataclasses.Field):
    """A Config field's dataclass (the annotations are strings)."""
    return f.type if isinstance(f.type, type) else getattr(schema, str(f.type), None)


def _written(key: str, text: str) -> bool:
    """``key`` in ``text`` as a whole key (``trainer.keep_best``, not
    ``trainer.keep_best_x``; ``ckpt=`` also as ``ckpt=best``)."""
    end = "" if key.endswith("=") else r"(?![\w])"
    return re.search(rf"(?<![\w.]){re.escape(key)}{end}", text) is not None


def _linked_docs() -> str:
    docs = sorted(set(re.findall(r"\]\((docs/[^)#]+\.md)", README)))
    assert docs, "the README links no doc"
    return "".join((ROOT / d).read_text() for d in docs)


def test_every_schema_key_is_in_the_readme_or_a_linked_doc():
    text = README + _linked_docs()
    models = (ROOT / "docs/models.md").read_text()
    missing = [
        f"{group}.{key}"
        for group, names in _group_keys().items()
        for key in sorted(names)
        if not _written(f"{group}.{key}", text)
    ]
    for family in families():  # docs/models.md's table: one row per family
        row = re.search(rf"^\| `{family}` \|.*$", models, re.M)
        assert row, f"docs/models.md has no row for model.family={family}"
        missing += [
            f"model.{key} ({family})"
            for key in _fields(get_spec(family).schema())
            if key not in SELECTORS
            and not _written(f"model.{key}", text)
            and not _written(key, row.group(0))
        ]
    assert not missing, f"keys no doc names: {missing}"


def test_readme_tables_name_every_key_of_their_group():
    """The README's configuration table, row by row: ``sharding.expert_parallel``,
    ``trainer.keep_best``, ``data.weights``... each in its group's row; sample.py's and
    eval.py's keys (``ckpt=best``) in the README as ``key=``."""
    rows = {
        m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", README, re.M)
    }
    missing = [
        f"{group}.{key}"
        for group, names in _group_keys().items()
        if group in rows
        for key in sorted(names)
        if not _written(f"{group}.{key}", rows[group])
    ]
    assert {"sharding", "trainer", "data", "precision", "logger"} <= set(rows)
    for cls in (schema.SampleConfig, schema.EvalConfig):
        missing += [f"{k}=" for k in _fields(cls) if not _written(f"{k}=", README)]
    assert "ckpt=latest|best" in README
    assert not missing, f"keys the README's tables lack: {missing}"
