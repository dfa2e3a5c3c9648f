"""Session-wide test settings."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _token_cache_in_tmp(tmp_path_factory):
    """The token cache (data.cache_dir's default, $SHARDWRAP_CACHE) of every test and
    of the train.py subprocesses they start lives in a session tmp dir, not ~/.cache."""
    os.environ["SHARDWRAP_CACHE"] = str(tmp_path_factory.mktemp("token_cache"))
    yield


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves os.environ as it found it: a command run in-process sets
    variables for its own ranks (run_cli's HYDRA_FULL_ERROR, the stop file), which
    must not reach the train.py subprocesses of later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _project_console():
    """The project's log records reach the console as in a run (train.py's Hydra job
    logging), so a test reads what a user would see with capsys."""
    import logging

    from src.observe.logs import PROJECT_LOGGER, ConsoleHandler

    project = logging.getLogger(PROJECT_LOGGER)
    handler = ConsoleHandler()
    project.addHandler(handler)
    project.setLevel(logging.INFO)
    yield
    project.removeHandler(handler)
