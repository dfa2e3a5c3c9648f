"""What tests/conftest.py puts back after each test (issue 55: a suite that passes in
any order): checked on the snapshot itself, in this process."""

from __future__ import annotations

import logging
import os
import signal

import torch

from tests.conftest import _State


def test_the_state_a_test_leaves_is_put_back_and_a_signal_handler_named(tmp_path):
    dcp = logging.getLogger("c10d-NullHandler-dcp_logger")  # torch's own, DEBUG
    handler = logging.StreamHandler()
    before = (
        signal.getsignal(signal.SIGUSR1),
        dcp.level,
        dcp.propagate,
        list(dcp.handlers),
        os.getcwd(),
        torch.get_num_threads(),
        torch.get_default_dtype(),
    )
    state = _State.take()

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    dcp.setLevel(logging.INFO)
    dcp.propagate = True  # its DEBUG lines would reach caplog
    dcp.addHandler(handler)
    logging.getLogger().addHandler(handler)
    os.environ["SHARDWRAP_ISOLATION_CHECK"] = "1"
    os.chdir(tmp_path)
    torch.set_num_threads(1 if before[5] != 1 else 2)
    torch.set_default_dtype(torch.float64)

    left = state.restore()
    assert left == [f"SIGUSR1 handler {before[0]!r} -> {signal.SIG_IGN!r}"]
    after = (
        signal.getsignal(signal.SIGUSR1),
        dcp.level,
        dcp.propagate,
        list(dcp.handlers),
        os.getcwd(),
        torch.get_num_threads(),
        torch.get_default_dtype(),
    )
    assert after == before
    assert handler not in logging.getLogger().handlers
    assert "SHARDWRAP_ISOLATION_CHECK" not in os.environ
