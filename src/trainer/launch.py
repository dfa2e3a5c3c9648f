"""Start the ranks of a run: N local processes, or the ones torchrun already started.

- ``trainer.devices=N`` (N > 1): torch's elastic launcher (``elastic_launch``, what
  ``torchrun --standalone`` runs) starts N local ranks on a private c10d rendezvous and
  restarts the group up to ``trainer.max_restarts`` times after a failure.
- ``trainer.devices=1``: the single rank runs in this process (a debugger works).
- Under ``torchrun`` (its environment is set): this process is one rank of a possibly
  multi-node job; the world comes from torchrun's rendezvous, and rank 0's run dir is
  broadcast so every rank writes its checkpoint shards to the same place.

The Hydra output dir is decided once, in the Hydra job, and handed to every rank.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import socket
import sys
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.agent.server import local_elastic_agent
from torch.distributed.elastic.agent.server.local_elastic_agent import (
    LocalElasticAgent,
)
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.multiprocessing.spawn import ProcessContext

from src.checkpoint.dcp import Checkpointer
from src.checkpoint.folders import run_checkpoints, step_of
from src.config.run_plan import RunPlan, resolve, under_torchrun, with_overrides
from src.data.pinning import DataPin, pinned_data
from src.data.sources import (
    check_split_sizes,
    follow_tokenizer_vocab,
    prepare_data,
    pretrained_tokenizer,
    split_sizes,
    tokenizer_of,
    training_splits,
)
from src.entry import die_with_launcher, rank_start_method, stop_rank_server
from src.errors import ConfigError, RunDirBusy, RunError, Stopped
from src.files import unwritable
from src.observe.attempts import set_aside_damaged_summary
from src.observe.logs import (
    LogSpec,
    debug_on,
    exit_with_error,
    log_spec,
    rank_bars_lock,
    rank_logging,
    set_log_level,
)
from src.observe.metrics import RUN_ROOT_ENV, set_malloc_mmap_threshold
from src.planner.profiles import cpu_threads
from src.planner.report import plan_only
from src.planner.run import machine_check, oversubscribed, plan_run
from src.trainer.eval_tasks import check_loop_tasks
from src.trainer.faults import (
    RANK_REPORTS,
    RESTART_CAUSE_ENV,
    STOP_SIGNALS,
    Heartbeat,
    StopNow,
    StopRequest,
    after_the_run,
    describe_holder,
    disk_full,
    finished_anyway,
    full_errors,
    holds,
    named_failures,
    ranks_start_blocked,
    record_rank,
    remove_interrupted_writes,
    requested,
    resume_hint,
    run_dir_lock,
    run_error_names,
    signal_point,
    stop_at_once,
    stopped_at_once,
    tell_ranks,
)
from src.trainer.loop import train

log = logging.getLogger(__name__)


def prepare(
    cfg: DictConfig,
    user_keys: set[str] | None = None,
    run_dir: str | None = None,
    splits: tuple[str, ...] | None = None,
    pin: DataPin | None = None,
) -> tuple[DictConfig, RunPlan]:
    """What the ranks start from, decided once before any starts: ``cfg`` resolved
    (ranks have no Hydra context), the data in the token cache (tokenized by a fresh
    run's ``model.pretrained``'s tokenizer.json if any), the vocabulary following the
    tokenizer, the fastest layout where asked, every ``auto`` chosen, its
    :class:`RunPlan`. ``user_keys``: the keys the user set (default: this Hydra
    job's command line); ``run_dir``: a training run's dir (:func:`admitted` writes
    its ``data.json``); ``splits``: the data's splits the command reads, each checked
    to hold a window (default: training's, :func:`training_splits`; none: no data is
    read, the tokenizer alone gives the vocabulary); ``pin``: a resume's pinned data
    (its tokenizer file read, its corpus still the data's). Bad input: ConfigError."""
    signal_point("prepare")
    cfg = copy.deepcopy(cfg)
    OmegaConf.resolve(cfg)
    set_log_level(cfg.trainer.log_level)
    user_keys = job_user_keys() if user_keys is None else user_keys
    if pin is None and splits is None:  # a training run: the checkpoint's tokenizer
        pretrained_tokenizer(cfg, user_keys, say=_is_rank0())
    cfg, chosen = _with_fastest_layout(cfg, splits is None)  # a resume keeps it
    composed = OmegaConf.to_container(cfg)  # what a checkpoint records
    resolved = resolve(cfg)
    if pin is not None:  # recorded as the run's config, read as its own file
        cfg.data = pinned_data(cfg.data, pin)
    meta = None
    if splits == ():  # reads no data (sample.py): a BPE's file needs no corpus
        tokenizer = tokenizer_of(cfg.data)
        meta = tokenizer and {"vocab_size": tokenizer.vocab_size}
    elif not cfg.trainer.plan_only:  # plan-only reads no data
        meta = prepare_data(
            cfg.data,
            _is_rank0(),
            cfg.trainer.progress,
            run_dir is not None and _is_rank0(),
            pin,
        )
    model = (resolved.spec, resolved.model_config)
    if meta is not None and follow_tokenizer_vocab(cfg, *model, meta, user_keys):
        # The model is final now: its run object is built from it, once.
        resolved = resolve(cfg)
    if splits != () and not cfg.trainer.plan_only:
        seq_len = resolved.spec.seq_len(resolved.model_config)
        sizes = split_sizes(cfg.data, meta)
        wanted = training_splits(cfg.trainer, sizes) if splits is None else splits
        check_split_sizes(cfg.data, sizes, seq_len, wanted)
    # The planner's choices go to the config and the plan; rank 0 says them, once.
    rank0 = _is_rank0()
    run = plan_run(
        as_ranks_start(resolved),
        user_keys,
        _world_from_env(),
        estimate=rank0 and not cfg.trainer.plan_only,
        say=log.info if rank0 else None,
        predict=splits is None,  # a training run's step time
    )
    cfg = with_overrides(cfg, run.overrides)  # the planner's choices, recorded
    resolved = replace(run.resolved, run_config=composed)
    if not rank0 or cfg.trainer.plan_only:
        return cfg, resolved
    if run.unplanned:  # training does not depend on it
        log.warning("planner: no estimate for this run (%s)", run.unplanned)
    if run.lower_bound:
        log.warning("planner: the estimate is a lower bound: %s", run.lower_bound)
    if splits is None:  # a training run: its tasks found, their data loaded
        _machine_checks(resolved, run.estimate)
        check_loop_tasks(cfg.trainer)
    return cfg, replace(
        resolved,
        **run.recorded(),
        layout_chosen=chosen,
        data_record=meta and meta.get("record"),
    )


def _machine_checks(resolved: RunPlan, estimate: Any) -> None:
    """A training run, on rank 0: no bigger than this machine (by the planner's
    ``estimate``), its ranks no more than its cores (a warning)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or resolved.world_size
    if estimate is not None:
        machine_check(resolved, estimate, local)
    if oversubscribed(local):
        log.warning("%s", oversubscribed(local))


def _with_fastest_layout(
    cfg: DictConfig, training: bool
) -> tuple[DictConfig, dict | None]:
    """``cfg`` in the planner's fastest layout that fits, and its record, where a
    ``training`` run asks (``trainer.layout=fastest``; plan-only lists them
    instead); else ``cfg``."""
    if not training or cfg.trainer.layout != "fastest" or cfg.trainer.plan_only:
        return cfg, None
    sets, record = _fastest_layout(resolve(cfg), _is_rank0())
    return with_overrides(cfg, sets), record


def _fastest_layout(resolved: RunPlan, say: bool) -> tuple[dict, dict]:
    """``trainer.layout=fastest``: the planner's fastest layout of the run's ranks
    that fits (src/planner/layouts.py) as the config keys to set and as recorded,
    said in one line (``say``). Every rank searches alike (formula work, no data)."""
    from src.planner.layouts import run_layouts

    found, _ = run_layouts(resolved, _world_from_env() or resolved.world_size)
    if not found:
        raise ConfigError(
            "trainer.layout", "no layout of these ranks fits: the planner found none"
        )
    best = found[0]
    if say:
        log.info("layout: trainer.layout=fastest: %s", best.line())
    group = {"precision": "precision.name"}  # a config group, set by its name
    return {group.get(k, k): v for k, v in best.overrides.items()}, best.record()


def as_ranks_start(resolved: RunPlan) -> RunPlan:
    """``resolved`` saying whether its ranks fork from this command's rank server
    (several local ranks started here, never under torchrun; plan-only plans the run
    it would start): their process baseline is smaller."""
    if rank_start_method() != "forkserver" or resolved.world_size == 1:
        return resolved
    return replace(resolved, budget=replace(resolved.budget, forked_ranks=True))


def _world_from_env() -> int | None:
    return int(os.environ.get("WORLD_SIZE", 0)) or None  # set under torchrun


def launch(cfg: DictConfig, run_dir: str, resolved: RunPlan) -> dict[str, Any] | None:
    """Run training for ``cfg`` (from :func:`prepare`) on its ranks and return the
    run's summary (rank 0's); exit non-zero, showing the first failed rank's error
    once, if any rank fails. With ``trainer.plan_only`` no rank starts: the wrap plan
    for that many ranks is printed instead (and None returned)."""
    world = _world_from_env()
    if cfg.trainer.plan_only or resolved.world_size == 1:
        stop_rank_server()  # no rank will be forked from it
    if cfg.trainer.plan_only:
        if _is_rank0():
            plan_only(resolved, run_dir, world_size=world or resolved.world_size)
        return None
    if under_torchrun():
        # A failed rank says so in one line, as the local launcher does (with
        # HYDRA_FULL_ERROR=1, record() hands its traceback to torchrun's summary).
        # Rank 0 holds the run dir (it is rank 0's; a restart finds the lock free).
        rank0 = _is_rank0()
        try:
            with own_run_dir(run_dir):
                return (record(run_rank) if full_errors() else run_rank)(
                    cfg, run_dir, resolved
                )
        except Stopped as stop:
            _stopped(stop, run_dir, report=rank0)
        except StopNow as now:  # one rank in all: no peer to wait for
            _stopped_at_once(now, run_dir)
        except RunDirBusy as err:
            exit_with_error(log, f"error: {err}")
        except Exception as err:
            if full_errors():
                raise
            exit_with_error(log, _in_process_failure(err, run_dir, _rank_from_env()))
    try:
        with own_run_dir(run_dir):
            return _launch_local(cfg, run_dir, resolved)
    except RunError as err:
        if full_errors():
            raise
        exit_with_error(log, f"error: {err}")


@contextlib.contextmanager
def own_run_dir(run_dir: str) -> Iterator[None]:
    """Hold ``run_dir`` (its lock: src/trainer/faults.py) for what follows, taken
    before the command writes anything there (``train.py`` holds it from before it
    reads the run's config until its ranks end; :func:`launch` takes it if it is not
    held yet); then remove what interrupted writes left there. A run dir in use is
    ``error: run dir ... is in use ...`` (exit 1), nothing written. Under torchrun
    rank 0 alone holds it."""
    if holds(run_dir) or (under_torchrun() and not _is_rank0()):
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stale = stack.enter_context(run_dir_lock(run_dir))
        except RunError as err:
            if full_errors():
                raise
            exit_with_error(log, f"error: {err}")
        if stale:
            log.info(
                "run dir lock of %s taken over (that run is no longer running)",
                describe_holder(stale),
            )
        remove_interrupted_writes(run_dir)
        yield


def admitted(run_dir: str, resolved: RunPlan) -> RunPlan:
    """The run passed every check before its ranks: write what it records of its
    data into ``run_dir`` (nothing is written there before: a refused command leaves
    no trace); ``resolved`` without it (the ranks need none of it)."""
    set_aside_damaged_summary(run_dir)
    if resolved.data_record is not None:
        resolved.data_record.write(run_dir)
    return replace(resolved, data_record=None)


def preflight(run_dir: str) -> None:
    """Checks that need no rank (the data is checked by :func:`prepare`): the run dir
    is writable, and its ``checkpoints/`` if there is one (a save found it only after
    training). Raises ConfigError (one line naming the key)."""
    problem = unwritable(run_dir)
    if problem:
        raise ConfigError("hydra.run.dir", f"{run_dir} is not writable: {problem}")
    checkpoints = run_checkpoints(run_dir)  # what a save would find at the end
    if checkpoints.exists() or checkpoints.is_symlink():
        problem = (
            unwritable(checkpoints)
            if checkpoints.is_dir()
            else "it is not a directory (a save writes step_N dirs there)"
        )
        if problem:
            raise ConfigError(
                "hydra.run.dir", f"{checkpoints} is not writable: {problem}"
            )


def _launch_local(
    cfg: DictConfig, run_dir: str, resolved: RunPlan
) -> dict[str, Any] | None:
    """The ranks on this machine: in this process (1) or under the elastic agent."""
    nprocs = resolved.world_size
    # the run's processes are this one and its descendants (metrics.run_root)
    os.environ[RUN_ROOT_ENV] = str(os.getpid())
    if nprocs == 1:
        try:
            summary = run_rank(cfg, run_dir, resolved)
        except Stopped as stop:
            _stopped(stop, run_dir)
        except StopNow as now:
            _stopped_at_once(now, run_dir)
        except (RunError, ConfigError):
            raise  # its message is the report (launch, or the command line's)
        except Exception as err:
            if full_errors():
                raise
            exit_with_error(log, _in_process_failure(err, run_dir))
        if requested():
            finished_anyway(requested())
        after_the_run()
        signal_point("finished")  # a test's signal once the run completed
        return summary
    # Ranks > 0 write to <run_dir>/ranks/...; only rank 0 talks to the console (at
    # debug every rank does, each line prefixed [rank N]).
    log_dir = None if debug_on() else os.path.join(run_dir, RANK_REPORTS)
    config = local_launch_config(nprocs, cfg.trainer.max_restarts, log_dir)
    _quiet_launcher_logs()
    # The ranks are new processes: they re-create this process's console and
    # train.log handlers (Hydra's job logging) from the spec.
    spec = log_spec()
    with (
        StopRequest(forward=tell_ranks, at_once="raise") as stop,
        _bounded_failure_grace(),
        _restart_cause(run_dir),
    ):
        try:
            with ranks_start_blocked(run_dir):
                summaries = _run_local_ranks(config, cfg, run_dir, resolved, spec)
            summary = _outcome(summaries.get(0) or {}, run_dir, stop.previous)
        except StopNow as now:  # the agent has ended the ranks on its way out
            _stopped_at_once(now, run_dir)
    after_the_run()
    signal_point("finished")
    return summary


def _run_local_ranks(
    config: LaunchConfig,
    cfg: DictConfig,
    run_dir: str,
    resolved: RunPlan,
    spec: LogSpec,
) -> dict[int, Any]:
    """The ranks' return values; a failed rank is reported in one line (exit 1), a
    rank ended by a stop signal as a second signal (:class:`StopNow`)."""
    try:
        return _start_local_ranks(config, _rank_entry, cfg, run_dir, resolved, spec)
    except ChildFailedError as err:
        # A rank takes its first stop signal as a stop request; one that a stop
        # signal ended had a second (the agent's own SIGTERMs come after failures).
        signals = [-f.exitcode for f in err.failures.values()]
        stopped = [s for s in signals if s in STOP_SIGNALS]
        if stopped:
            raise StopNow(stopped[0]) from None
        if not requested():
            exit_with_error(log, _failure_report(err, run_dir))
    except Exception:  # e.g. a rank's error file left empty by a full disk
        full = disk_full(run_dir)
        if full is None or full_errors():
            raise
        exit_with_error(log, f"error: {full}")
    return {}


def _outcome(summary: dict, run_dir: str, previous: dict) -> dict[str, Any]:
    """Rank 0's summary, or the end of a run stopped by a signal to any of its
    processes (rank 0 returned :data:`STOPPED`, or this launcher got the signal)."""
    signum = requested()
    if STOPPED in summary:
        _stopped(Stopped(*summary[STOPPED]), run_dir, previous=previous)
    if signum and summary:  # the last step had passed: a complete run, kept as one
        finished_anyway(signum)
    elif signum:  # no rank trained (e.g. the signal came as they started)
        latest = _latest(run_dir)
        stopped = latest and Stopped(signum, step_of(latest), latest)
        _stopped(stopped or None, run_dir, signum=signum, previous=previous)
    return summary


#: What a rank returns to the launcher instead of a summary when the run stopped on a
#: signal (its exit status is 0, so the elastic agent neither restarts nor reports
#: it): ``(signal, step, checkpoint)``.
STOPPED = "stopped"


def _stopped(
    stop: Stopped | None,
    run_dir: str,
    signum: int = 0,
    previous: dict | None = None,
    report: bool = True,
) -> NoReturn:
    """End a stopped run: its one line (``report``: this process says it), the
    signal's previous handler (e.g. submitit's SIGUSR2 handler requeues the job),
    exit status 128 + signal."""
    signum = stop.signum if stop else signum
    if report:
        log.info(resume_hint(stop, run_dir, signum))
    handler = (previous or {}).get(signum)
    if callable(handler) and handler not in (signal.default_int_handler, stop_at_once):
        handler(signum, None)
    sys.exit(128 + signum)


def _stopped_at_once(now: StopNow, run_dir: str) -> NoReturn:
    """A second signal: once no rank writes, say what was skipped and exit."""
    log.warning(stopped_at_once(now.signum, run_dir))
    sys.exit(128 + now.signum)


# Seconds the other ranks get to exit after one failed, then again after SIGTERM,
# before SIGKILL. A graceful stop does not go through it (the ranks exit by
# themselves), so it is short: a hung peer is named and the job ends within
# trainer.timeout_s plus a few seconds.
SHUTDOWN_S = 2


@contextlib.contextmanager
def _bounded_failure_grace():
    """When a rank fails, torch's spawn context gives the others a fixed 30 s to exit
    before it reports the failure (``ProcessContext.join`` without ``grace_period``),
    so a stopped or hung peer held the job 30 s past ``trainer.timeout_s``. Pass
    SHUTDOWN_S instead (torch is pinned; the patch is undone on the way out)."""
    join = ProcessContext.join

    def bounded_join(self, timeout=None, grace_period=None):
        grace = SHUTDOWN_S if grace_period is None else grace_period
        return join(self, timeout, grace)

    ProcessContext.join = bounded_join
    try:
        yield
    finally:
        ProcessContext.join = join


@contextlib.contextmanager
def _restart_cause(run_dir: str):
    """The elastic agent restarts the ranks after a failure without telling them
    which rank failed; this puts the failure's one line (:func:`_failure_report`) in
    :data:`RESTART_CAUSE_ENV` for the restarted ranks (a started rank gets this
    process's environment: :func:`_start_local_ranks`), who say it. Patched like :func:`_bounded_failure_grace`."""
    monitor = LocalElasticAgent._monitor_workers

    def monitored(self, worker_group):
        result = monitor(self, worker_group)
        if result.is_failed():
            failed = ChildFailedError(RANK_REPORTS, result.failures)
            os.environ[RESTART_CAUSE_ENV] = _failure_report(failed, run_dir)
        return result

    LocalElasticAgent._monitor_workers = monitored
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor
        os.environ.pop(RESTART_CAUSE_ENV, None)


def _latest(run_dir: str):
    return Checkpointer(run_checkpoints(run_dir)).latest()


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", 0))


def _is_rank0() -> bool:
    return _rank_from_env() == 0


def job_user_keys() -> set[str]:
    """The keys set on the command line of this Hydra job (empty outside Hydra)."""
    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:
        return set()
    return override_keys(overrides)


def override_keys(overrides: Sequence[str]) -> set[str]:
    """The keys of Hydra command-line overrides (``+k=v``, ``~k``, ``k=v``)."""
    return {str(o).split("=", 1)[0].lstrip("+~") for o in overrides}


def local_launch_config(
    nprocs: int, max_restarts: int = 0, log_dir: str | None = None
) -> LaunchConfig:
    """torch's elastic launcher set up as ``torchrun --standalone``: ``nprocs`` ranks
    on this machine, a private c10d rendezvous on a free port; with ``log_dir`` the
    output of ranks > 0 goes there instead of the console."""
    logs = {}
    if log_dir is not None:
        redirects = {r: Std.ALL for r in range(1, nprocs)}
        logs["logs_specs"] = DefaultLogsSpecs(log_dir=log_dir, redirects=redirects)
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port
        max_restarts=max_restarts,
        start_method=rank_start_method(),
        shutdown_timeout=SHUTDOWN_S,
        # The agent would turn a stop signal into killing the ranks; StopRequest
        # passes it on to them instead, and they stop after a checkpoint.
        signals_to_handle=",".join(
            n
            for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
            if getattr(signal, n) not in STOP_SIGNALS
        ),
        **logs,
    )


def _start_local_ranks(
    config: LaunchConfig, entry: Callable[..., Any], *args: Any
) -> dict[int, Any]:
    """``elastic_launch(config, entry)(*args)``: each rank's return value. A rank
    forked from the rank server (src/entry.py) would see the server's environment,
    this process's as the command started; each rank gets this process's environment
    as it is when the rank starts (restarts included: :func:`_restart_cause`), under
    the variables the agent sets for it, as a spawned rank did. Patched like
    :func:`_bounded_failure_grace` (torch is pinned)."""
    start = local_elastic_agent.start_processes

    def start_with_this_environment(*a: Any, envs: dict, **kw: Any) -> Any:
        envs = {rank: {**os.environ, **env} for rank, env in envs.items()}
        return start(*a, envs=envs, **kw)

    local_elastic_agent.start_processes = start_with_this_environment
    # torch's agent installs its handler for the signals it takes and never puts
    # the old ones back: a process that launches again (a sweep's next job) keeps them.
    handled = [getattr(signal, n) for n in config.signals_to_handle.split(",") if n]
    before = {s: signal.getsignal(s) for s in handled}
    try:
        return elastic_launch(config, entry)(*args)
    finally:
        local_elastic_agent.start_processes = start
        if threading.current_thread() is threading.main_thread():
            for s, handler in before.items():
                if handler is not None:  # None: not set from Python
                    signal.signal(s, handler)


def _rank_entry(
    cfg: DictConfig, run_dir: str, resolved: RunPlan, spec: LogSpec
) -> dict[str, Any]:
    # Module level so the spawned ranks can unpickle it.
    die_with_launcher()  # first: a rank never outlives its launcher
    rank_bars_lock()
    record_rank(run_dir)  # nor is its run dir taken over while it lives
    signal_point("rank_start")
    try:
        return run_rank(cfg, run_dir, resolved, spec)
    except Stopped as stop:
        return {STOPPED: (stop.signum, stop.step, stop.checkpoint)}


def _quiet_launcher_logs() -> None:
    """The launcher logs a failed rank's traceback at ERROR level and we report it
    ourselves (once); its INFO chatter would flood Hydra's INFO-level console."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
        logging.CRITICAL
    )
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # A rank's error file it cannot parse (left empty by a full disk): reported as
    # what caused it (launch), not as its parser's traceback.
    logging.getLogger("torch.distributed.elastic.multiprocessing.errors").setLevel(
        logging.CRITICAL
    )


def _failure_report(err: ChildFailedError, run_dir: str) -> str:
    """The first failed rank, where it ran and its error in one line (the traceback
    is in its error file; inline with HYDRA_FULL_ERROR=1)."""
    rank, failure = err.get_first_failure()
    host = socket.gethostname()  # this launcher's ranks all run here
    head = f"rank {rank} on {host} failed (exit code {failure.exitcode})"
    message = failure.message
    if isinstance(message, dict):  # the rank's error file, written by record()
        stack = message.get("extraInfo", {}).get("py_callstack")
        if full_errors() and stack:
            return f"{head}:\n{stack}".rstrip()
        kind, _, text = message["message"].partition(": ")
        return _one_line(head, kind, text, failure.error_file)
    if failure.exitcode < 0:
        message = f"killed by {signal.Signals(-failure.exitcode).name}"
    return f"{head}: {disk_full(run_dir) or message}".rstrip()


def _in_process_failure(err: Exception, run_dir: str, rank: int = 0) -> str:
    """The failure of the rank in this process (one rank, or one under torchrun) as
    the launcher reports a rank's (:func:`_failure_report`): one line, the traceback
    in a file under ``<run dir>/ranks``."""
    error_file: Any = Path(run_dir) / RANK_REPORTS / f"rank{rank}_error.txt"
    try:
        error_file.parent.mkdir(parents=True, exist_ok=True)
        error_file.write_text("".join(traceback.format_exception(err)))
    except OSError as why:  # e.g. the disk is full: the report still comes
        error_file = f"not written ({why.strerror}); HYDRA_FULL_ERROR=1 shows it"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    head = f"rank {rank} on {socket.gethostname()} failed"
    return _one_line(head, type(err).__name__, text, error_file)


def _one_line(head: str, kind: str, text: str, error_file: Any) -> str:
    """A failed rank's report: a RunError's or ConfigError's message says what
    happened and who or which key; any other error is named with its type."""
    if kind in run_error_names() | {ConfigError.__name__}:
        return f"error: {text} ({head}; traceback: {error_file})"
    return f"{head}: {kind}: {text} (traceback: {error_file})"


def init_distributed(timeout_s: float) -> tuple[torch.device, Heartbeat | None]:
    """Join the process group (NCCL on GPU, gloo on CPU) and pick this rank's device;
    with several ranks, also start this rank's heartbeat.

    On CPU each rank gets :func:`cpu_threads` threads.
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(local_world))
    return device, _join_group(timeout_s, "nccl" if cuda else "gloo")


def _join_group(timeout_s: float, backend: str) -> Heartbeat | None:
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # set by the launcher: env:// rendezvous
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        # After an elastic restart the store can still hold the dead attempt's gloo
        # addresses; a per-attempt prefix keeps the new ranks from dialling them.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"attempt_{attempt}", store),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        if world == 1:
            return None
        return Heartbeat(dist.PrefixStore(f"attempt_{attempt}", store), rank, world)
    # a single in-process rank
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return None


def _shared_run_dir(run_dir: str) -> str:
    """Rank 0's run dir on every rank (under torchrun each rank's Hydra chose its own)."""
    if not under_torchrun() or dist.get_world_size() == 1:
        return run_dir
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_ranks(fn: Callable[..., Any], nprocs: int, timeout_s: float, *args: Any) -> Any:
    """``fn(device, *args)`` on ``nprocs`` ranks that joined the process group as
    training ranks do (gloo on CPU, NCCL on GPU); returns rank 0's result. One rank
    runs in this process and under torchrun this process is one rank; else the
    elastic launcher starts them (no restarts; a failed rank exits with one line).
    For sample.py and eval.py: the ranks compute, this process reports (under
    torchrun only rank 0's process gets the result, the others None)."""
    if nprocs == 1 or under_torchrun():
        stop_rank_server()  # no rank will be forked from it
        result = _call_on_rank(fn, timeout_s, *args)
        return result if _is_rank0() else None
    _quiet_launcher_logs()
    try:
        results = _start_local_ranks(
            local_launch_config(nprocs), _call_on_rank, fn, timeout_s, *args
        )
    except ChildFailedError as err:
        sys.exit(_failure_report(err, os.getcwd()))
    return results[0]


def _call_on_rank(fn: Callable[..., Any], timeout_s: float, *args: Any) -> Any:
    # Module level so the spawned ranks can unpickle it.
    die_with_launcher()  # a started rank (in this process: nothing)
    rank_bars_lock()
    device, heartbeat = init_distributed(timeout_s)
    try:
        if dist.get_rank() != 0:
            warnings.simplefilter("ignore")  # only rank 0 talks
        warnings.filterwarnings(
            "ignore", message=r"FSDP2-wrapped module .* view tensor"
        )
        return fn(device, *args)
    finally:
        if heartbeat is not None:
            heartbeat.close()
        dist.destroy_process_group()


def run_rank(
    cfg: DictConfig, run_dir: str, resolved: RunPlan, spec: LogSpec | None = None
) -> dict[str, Any]:
    """One rank: join the group, train, leave the group; returns the summary. A stop
    signal ends training after the current step with a checkpoint (:class:`Stopped`);
    a timed-out collective names the silent peer, a full disk says so (faults.py).
    ``spec``: the launching process's log set-up, for a rank started as a new process
    (see src/observe/logs.py)."""
    # First: every later allocation follows it (the planner models this process).
    set_malloc_mmap_threshold(cfg.trainer.malloc_mmap_threshold_kib)
    rank, world = _rank_from_env(), int(os.environ.get("WORLD_SIZE", 1))
    # A second signal ends a rank among peers at once (they see its connection
    # close); a rank alone raises StopNow, and its process reports it.
    at_once = "raise" if world == 1 else "die"
    with StopRequest(at_once=at_once), rank_logging(spec, rank, world):
        device, heartbeat = init_distributed(cfg.trainer.timeout_s)
        try:
            if dist.get_rank() != 0:
                warnings.simplefilter("ignore")  # only rank 0 talks
            # FSDP2 warns whenever a unit returns a view (any Linear on 3-D input)
            # because an in-place op on it would skip a hook; the model families'
            # forwards never modify outputs in place.
            warnings.filterwarnings(
                "ignore", message=r"FSDP2-wrapped module .* view tensor"
            )
            run_dir = _shared_run_dir(run_dir)
            with named_failures(heartbeat, run_dir, cfg.trainer.timeout_s):
                return train(cfg, run_dir, device, resolved)
        finally:
            if heartbeat is not None:
                heartbeat.close()
            dist.destroy_process_group()
