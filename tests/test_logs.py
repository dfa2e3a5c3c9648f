"""The run's log set-up in one process (src/observe/logs.py) and the profiler's table
arithmetic (src/observe/profiling.py); the end-to-end run is tests/test_profile.py."""

from __future__ import annotations

import logging

from src.observe.logs import FILE_ONLY, ConsoleHandler, LogSpec, rank_logging
from src.observe.profiling import step_table


def test_a_launched_rank_recreates_console_and_train_log_rank_0_only(
    tmp_path, monkeypatch, capsys
):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # a fresh rank process has none
    monkeypatch.setattr(logging.getLogger("src"), "handlers", [])  # conftest's
    train_log = tmp_path / "train.log"
    spec = LogSpec(
        handlers=(
            ("console", "%(message)s", None, 0, None),
            ("file", "[%(levelname)s] - %(message)s", None, 0, str(train_log)),
        ),
        root_level=logging.INFO,
        project_level=logging.INFO,
    )
    log = logging.getLogger("src.trainer.test")
    for rank in (0, 1):
        with rank_logging(spec, rank, world=2):
            log.info("hello from %d", rank)
            log.info("interval line %d", rank, extra=FILE_ONLY)
            log.debug("detail %d", rank)
        assert root.handlers == []  # taken away again
    assert capsys.readouterr().out == "hello from 0\n"
    assert train_log.read_text() == "[INFO] - hello from 0\n[INFO] - interval line 0\n"

    # At debug every rank's records pass, each prefixed once (two handlers).
    debug = LogSpec(spec.handlers, logging.INFO, logging.DEBUG)
    for rank in (0, 1):
        with rank_logging(debug, rank, world=2):
            log.debug("detail %d", rank)
    assert capsys.readouterr().out == "[rank 0] detail 0\n[rank 1] detail 1\n"
    assert train_log.read_text().endswith(
        "[DEBUG] - [rank 0] detail 0\n[DEBUG] - [rank 1] detail 1\n"
    )
    logging.getLogger("src").setLevel(logging.INFO)


def test_console_handler_sends_warnings_to_stderr(capsys):
    log = logging.getLogger("src.trainer.test_console")
    handler = ConsoleHandler()
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("careful")
        log.info("fine")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    out = capsys.readouterr()
    assert (out.out, out.err) == ("fine\n", "careful\n")


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_step_table_unions_overlapping_collectives_and_sums_unit_ranges():
    ms = 1000  # trace times are in microseconds
    trace = {
        "traceEvents": [
            _x("unit:h.0:forward", 0, 30 * ms, "user_annotation"),
            _x("unit:h.0:backward", 100 * ms, 50 * ms, "user_annotation"),
            _x("FSDP::all_gather (h.0)", 0, 10 * ms),  # holds the c10d op below
            _x("c10d::_allgather_base_", 2 * ms, 6 * ms),
            _x("gloo:all_gather", 5 * ms, 10 * ms),  # another thread: union 0..15
            _x("c10d::_reduce_scatter_base_", 140 * ms, 10 * ms),
            _x("c10d::allreduce_", 180 * ms, 5 * ms),
            _x("Optimizer.step#AdamW.step", 160 * ms, 20 * ms),
        ]
    }
    # 2 steps of 100 ms each (the trace above is their sum).
    rows = {r["part"]: r for r in step_table(trace, steps=2, step_s=0.1, cuda=False)}
    per_step = {part: r["ms_per_step"] for part, r in rows.items()}
    assert per_step["forward h.0"] == 15 and per_step["backward h.0"] == 25
    assert per_step["all-gather"] == 7.5  # the union 0..15 ms, over 2 steps
    assert per_step["reduce-scatter"] == 5 and per_step["all-reduce"] == 2.5
    assert per_step["collectives (any)"] == 15
    assert per_step["outside collectives"] == 85
    assert per_step["optimizer step"] == 10
    assert rows["optimizer step"]["share"] == "10.0%"


def test_no_print_in_src():
    """src/ talks through logging (console and train.log); print() would bypass both."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parent.parent / "src"
    calls = [
        f"{path.relative_to(src.parent)}:{node.lineno}"
        for path in sorted(src.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]
    assert calls == []


def test_step_table_on_cuda_counts_kernels_and_gpu_side_unit_ranges():
    ms = 1000
    trace = {
        "traceEvents": [
            _x("unit:h.0:forward", 0, 50 * ms, "user_annotation"),  # host: launch
            _x("unit:h.0:forward", 5 * ms, 20 * ms, "gpu_user_annotation"),
            _x("FSDP::all_gather (h.0)", 0, 30 * ms, "gpu_user_annotation"),
            _x("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 0, 10 * ms, "kernel"),
            _x("ampere_sgemm_128x64_tn", 5 * ms, 20 * ms, "kernel"),
            _x("ncclDevKernel_ReduceScatter_Sum_f32", 40 * ms, 5 * ms, "kernel"),
            _x("Optimizer.step#AdamW.step", 60 * ms, 10 * ms, "cpu_op"),
        ]
    }
    rows = {r["part"]: r for r in step_table(trace, steps=1, step_s=0.1, cuda=True)}
    per_step = {part: r["ms_per_step"] for part, r in rows.items()}
    assert per_step["forward h.0"] == 20  # the GPU side of the range
    assert per_step["all-gather"] == 10 and per_step["reduce-scatter"] == 5
    assert per_step["collectives (any)"] == 15
    # sgemm 5..25 overlaps the all-gather 0..10: 15 ms outside collectives.
    assert per_step["compute kernels (outside collectives)"] == 15
    assert per_step["optimizer step"] == 10


def test_log_level_is_set_per_job():
    """trainer.log_level sets the project loggers' level each time (a multirun job
    does not inherit the previous job's debug)."""
    from src.observe.logs import set_log_level

    project = logging.getLogger("src")
    try:
        for level in ("debug", "info", "warning"):
            set_log_level(level)
            assert project.level == getattr(logging, level.upper())
    finally:
        project.setLevel(logging.INFO)
        logging.captureWarnings(False)
