"""What the project's own loggers said during a test, from pytest's caplog.

caplog holds every record that reached the root logger: torch's (DCP's DEBUG lines
once its logger is at DEBUG), Hydra's, transformers'. Their lines carry the test's
tmp path, which pytest names after the test, so an assertion on "a line with this
word in it" matched them (issue 55: test_keep_last_... counted DCP's lines holding
``test_keep_last_leaves_the_chec0``). Assertions read the project's records by
logger name instead, and match whole messages or their opening words."""

from __future__ import annotations

import logging

import pytest


def records(
    caplog: pytest.LogCaptureFixture, logger: str = "src"
) -> list[logging.LogRecord]:
    """caplog's records from ``logger`` or a logger below it."""
    return [
        r for r in caplog.records if r.name == logger or r.name.startswith(logger + ".")
    ]


def said(
    caplog: pytest.LogCaptureFixture, logger: str = "src", starts: str = ""
) -> list[str]:
    """The messages of :func:`records`, those that start with ``starts``."""
    return [
        m
        for m in (r.getMessage() for r in records(caplog, logger))
        if m.startswith(starts)
    ]
