"""A command that starts no rank (refused before it trains, or plan-only), run
in-process: the script's own ``main`` through ``run_cli``, as ``python SCRIPT ARGS``
runs it (Hydra's callbacks, the job, its one-line error and exit status), without
starting a Python that imports torch again (and train.py's rank server beside it:
seconds of CPU a command on a loaded 2-core machine). Tests that need a real
process (signals, ranks, what a shell sees) start one."""

from __future__ import annotations

import importlib
import logging
import sys
from subprocess import CompletedProcess

PLAN_ONLY = "trainer.plan_only=true"


def in_process(
    monkeypatch, capsys, script: str, *args: str, one_rank: bool = False
) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``python script args`` (train.py,
    eval.py, sample.py), which must not train: a train.py that reaches its launch
    fails the test, unless ``args`` ask for plan-only (whose launch starts no rank)
    or ``one_rank`` says it trains on one rank (in the launching process, as
    ``trainer.devices=1`` does; ask for ``stop_handlers_restored``)."""
    from hydra.core.hydra_config import HydraConfig

    from src.config.cli import run_cli
    from src.observe.logs import PROJECT_LOGGER, ConsoleHandler

    module = importlib.import_module(script.removesuffix(".py"))
    if hasattr(module, "launch") and PLAN_ONLY not in args and not one_rank:

        def launch(*_, **__):
            raise AssertionError(f"{script} {' '.join(args)}: it would train")

        monkeypatch.setattr(module, "launch", launch)
    monkeypatch.setattr(sys, "argv", [script, *args])
    # Hydra finds conf/ beside the script's file, as for ``python script``
    monkeypatch.setenv("HYDRA_MAIN_MODULE", "__main__")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # run_cli sets it
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)
    # A command's lines reach the console through Hydra's root handler alone (the
    # session's console handler on the project logger would print them twice).
    project = logging.getLogger(PROJECT_LOGGER)
    ours = [h for h in project.handlers if isinstance(h, ConsoleHandler)]
    # Hydra's job logging replaces the root logger's handlers (caplog's among them)
    # as in the command's own process: the test's are back once it ends.
    root = logging.getLogger()
    test_handlers, test_level = root.handlers[:], root.level
    capsys.readouterr()
    code = 0
    try:
        for handler in ours:
            project.removeHandler(handler)
        run_cli(module.main)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        for handler in ours:
            project.addHandler(handler)
        for handler in root.handlers:
            if handler not in test_handlers:
                handler.close()  # the command's train.log, as its exit closes it
        root.handlers[:] = test_handlers
        root.setLevel(test_level)
    out, err = capsys.readouterr()
    if isinstance(code, str):  # sys.exit(message): as Python, the line and status 1
        code, err = 1, f"{err}{code}\n"
    return code or 0, out, err


def one_rank(monkeypatch, capsys, script: str, *args: str) -> CompletedProcess:
    """:func:`in_process` of a command that runs on one rank (in the launching
    process), as ``subprocess.run`` reports it (a test asks for
    ``stop_handlers_restored``)."""
    code, out, err = in_process(monkeypatch, capsys, script, *args, one_rank=True)
    return CompletedProcess([script, *args], code, out, err)
