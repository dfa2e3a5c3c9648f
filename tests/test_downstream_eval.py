"""Downstream tasks through lm-eval (docs/evaluation.md): the real harness on the
shipped tasks (conf/eval_tasks/), scored by the adapter over the run's model
(src/trainer/lm_adapter.py), in the loop and by eval.py; lm-eval's own Hugging Face
backend on the run's export; 1 and 2 ranks; the one-line refusals.

One tiny GPT is trained once in this process (4 steps, the shipped tasks scored at
the last, exported for transformers) and its run dir reused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from src.checkpoint.dcp import best_checkpoints
from src.config.validate import validate
from src.harness import run_distributed
from src.runs.compare import compare
from src.runs.from_run import load_model, run_tokenizer
from src.trainer.eval_tasks import check_tasks, task_specs
from src.trainer.launch import prepare, run_ranks
from src.trainer.sampling import SAMPLING_CHANGES
from tests.commands import in_process
from tests.test_research_loop import opened, train_run
from tests.test_researcher_ux import one_config_error
from tests.test_train import make_cfg, read_rows

TASKS = ["pycode_mc", "pycode_complete"]
RUN = [
    "model=tiny",
    "logger=none",
    "data.max_bytes=300000",
    "trainer.max_steps=4",
    "trainer.batch_size=16",
    "trainer.log_every=2",
    "trainer.val_every=0",
    "trainer.progress=false",
    "trainer.peak_tflops=1",  # skip the CPU matmul probe
    f"trainer.eval_tasks=[{','.join(TASKS)}]",  # at the last step (every: 0)
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("tasks_run")
    train_run(where, *RUN, "trainer.devices=1", "trainer.export=hf")
    return where


@pytest.fixture(scope="module")
def one_rank(run_dir) -> dict:
    """:func:`_scores` of the run's last checkpoint on one rank."""
    checkpoint, cfg, resolved = opened(run_dir, SAMPLING_CHANGES)
    return run_ranks(_scores, 1, 120, cfg, resolved, checkpoint, None)


def task_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    """``{step: {eval/<task>/<metric>: value}}`` of the run's metrics.jsonl."""
    out: dict[int, dict[str, float]] = {}
    for row in read_rows(run_dir):
        for k, v in row.items():
            if k.startswith("eval/"):
                assert k not in out.get(row["step"], {}), f"{k} twice at {row['step']}"
                out.setdefault(row["step"], {})[k] = v
    return out


def _pairs(lm) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) ids of each multiple-choice item's right answer, as
    lm-eval splits them (a context's trailing spaces go to the continuation)."""
    config = task_specs(["pycode_mc"], [], "tasks", "tasks_dirs")[0]
    path = Path(config["dataset_kwargs"]["data_files"]["test"])
    items = [json.loads(line) for line in path.read_text().splitlines()]
    return [lm._encode_pair(i["context"], i["choices"][i["answer"]]) for i in items]


def _scores(device, cfg, resolved, checkpoint, opts) -> dict:
    """On each rank: the adapter's log-likelihoods of the right answers, the model's
    own summed loss on the same tokens, and the shipped tasks' scores."""
    from src.trainer.downstream import run_tasks
    from src.trainer.lm_adapter import ShardedLM

    model, backend, step = load_model(resolved, checkpoint, device)
    tokenizer = run_tokenizer(cfg)
    lm = ShardedLM(model, backend, resolved, tokenizer)
    pairs = _pairs(lm)
    scored = lm.score(pairs)
    own = []
    with torch.no_grad():
        for context, continuation in pairs:
            x, y = lm.rows(context, continuation)
            loss = model(torch.tensor([x]), torch.tensor([y]))[1]
            own.append(-float(loss) * len(continuation))
    if opts is None:  # the log-likelihoods only
        return {"step": step, "scored": scored, "own": own}
    scores, _ = run_tasks(model, backend, resolved, tokenizer, TASKS, opts["specs"])
    return {"step": step, "scored": scored, "own": own, "tasks": scores}


def test_adapter_scores_equal_the_models_loss_and_the_loops_rows(
    run_dir, one_rank, tmp_path, monkeypatch, capsys
):
    """The adapter's log-likelihood of each continuation is the model's own summed
    loss on the same tokens; eval.py tasks=[...] on the last checkpoint gives the
    scores the loop logged at that step (eval.json's entry per task), and the loop
    logged them with tokens_seen and their seconds; compare shows them as columns
    and ranks by one."""
    rows = task_rows(run_dir)
    assert sorted(rows) == [4]
    assert set(rows[4]) == {
        "eval/pycode_mc/acc",
        "eval/pycode_mc/acc_norm",
        "eval/pycode_complete/exact_match",
    }
    logged = {r["step"]: r for r in read_rows(run_dir) if "eval_tasks_s" in r}
    assert logged[4]["tokens_seen"] == 4 * 16 * 64 and logged[4]["eval_tasks_s"] > 0

    out = one_rank
    assert out["step"] == 4
    for (logprob, _), own in zip(out["scored"], out["own"], strict=True):
        assert logprob == pytest.approx(own, rel=1e-5, abs=1e-5)

    code, _, err = in_process(
        monkeypatch, capsys, "eval.py", f"run={run_dir}", "tasks=[pycode_mc]"
    )
    assert code in (0, None), err
    entry = json.loads((run_dir / "eval.json").read_text())[-1]
    flat = {
        f"eval/{t}/{m}": v for t, ms in entry["tasks"].items() for m, v in ms.items()
    }
    assert entry["step"] == 4 and flat.items() <= rows[4].items()
    assert set(flat) == {"eval/pycode_mc/acc", "eval/pycode_mc/acc_norm"}
    # compare's columns, ranked by one
    rows = compare([run_dir], tmp_path, make_plot=False, metric="eval/pycode_mc/acc")
    assert rows[0]["best"] and rows[0]["eval/pycode_complete/exact_match"] == 0.0
    assert {k: rows[0][k] for k in flat} == flat


def test_hf_backend_on_the_export_equals_the_adapter(run_dir, one_rank):
    """lm-eval's own Hugging Face backend (``hf``, pretrained=the run's export)
    gives the adapter's task scores, and each request's log-likelihood within
    1e-4 (another implementation: transformers' GPT-2)."""
    from lm_eval import evaluator

    from src.trainer.downstream import task_metrics
    from src.trainer.eval_tasks import offline, task_manager

    specs = check_tasks(TASKS, [], "tasks", "tasks_dirs")
    with offline(), mock.patch.object(evaluator, "add_env_info", lambda _: None):
        results = evaluator.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(run_dir / "hf"), "dtype": "float32"},
            tasks=specs,
            task_manager=task_manager(specs),
            device="cpu",
            batch_size=8,
            bootstrap_iters=0,
        )
    hf = task_metrics(results)
    flat = {f"eval/{t}/{m}": v for t, ms in hf.items() for m, v in ms.items()}
    assert flat == task_rows(run_dir)[4]
    # each answer's log-likelihood: the samples of the multiple-choice task
    ours = one_rank
    samples = sorted(results["samples"]["pycode_mc"], key=lambda s: s["doc_id"])
    for sample, (logprob, _) in zip(samples, ours["scored"], strict=True):
        theirs = float(sample["resps"][sample["doc"]["answer"]][0][0])
        assert theirs == pytest.approx(logprob, abs=1e-4)


def _two_ranks(rank: int, world: int, runs: dict, opened_1: tuple, specs: list):
    """One launch of 2 ranks: the in-loop tasks of a FSDP2 run (steps 2 and 4), that
    run resumed from step 2, a TP2 run; and the 1-rank run's checkpoint scored on
    both ranks (FSDP2)."""
    import torch.distributed as dist

    from src.trainer.loop import train

    out = {}
    for name, (cfg, resolved, run_dir) in runs.items():
        train(cfg, run_dir, torch.device("cpu"), resolved)
        out[name] = task_rows(Path(run_dir)) if rank == 0 else None
        if name == "fsdp2":  # the checkpoints' scores; the last lost: resumed from 2
            found = best_checkpoints(Path(run_dir) / "checkpoints", 2)
            out["kept"] = {p.name: score for score, p in found}
            if rank == 0:
                shutil.rmtree(Path(run_dir) / "checkpoints" / "step_00000004")
            dist.barrier()
            again = OmegaConf.merge(cfg, {"trainer": {"resume": "auto"}})
            train(again, run_dir, torch.device("cpu"), resolved)
            out["resumed"] = task_rows(Path(run_dir)) if rank == 0 else None
    checkpoint, cfg, resolved = opened_1
    out["scores"] = _scores(torch.device("cpu"), cfg, resolved, checkpoint, specs)
    return out


def test_two_ranks_equal_one_and_log_in_the_loop(run_dir, one_rank, tmp_path):
    """On 2 ranks (one launch): the 1-rank run's checkpoint scores the same (each
    log-likelihood within 1e-6, the same task scores); in the loop under FSDP2 and
    TP2 the tasks are logged at their steps (eval_tasks_every=2), their checkpoints
    ranked by trainer.best_metric, and a run resumed from step 2 logs each step's
    row once, with the scores it had."""
    loop = [*RUN, "trainer.devices=2", "trainer.eval_tasks=[pycode_mc]"]
    runs = {}
    for name, extra in {
        "fsdp2": [
            "trainer.eval_tasks_every=2",
            "trainer.ckpt_every=2",
            "trainer.keep_best=1",
            "trainer.best_metric=eval/pycode_mc/acc_norm",
        ],
        "tp2": ["sharding.tensor_parallel=2", "trainer.max_steps=2"],
    }.items():
        cfg = make_cfg(*loop, *extra)
        validate(cfg)
        cfg, resolved = prepare(cfg, set())
        runs[name] = (cfg, resolved, str(tmp_path / name))
    changes = {**SAMPLING_CHANGES, "trainer.devices": 2}
    specs = {"specs": check_tasks(TASKS, [], "tasks", "tasks_dirs")}
    out = run_distributed(_two_ranks, 2, runs, opened(run_dir, changes), specs)[0]

    two = out["scores"]
    for (a, greedy_a), (b, greedy_b) in zip(
        two["scored"], one_rank["scored"], strict=True
    ):
        assert a == pytest.approx(b, abs=1e-6) and greedy_a == greedy_b
    flat = {f"eval/{t}/{m}": v for t, ms in two["tasks"].items() for m, v in ms.items()}
    assert flat == task_rows(run_dir)[4]
    keys = {"eval/pycode_mc/acc", "eval/pycode_mc/acc_norm"}
    assert sorted(out["fsdp2"]) == [2, 4] and set(out["fsdp2"][4]) == keys
    assert out["resumed"] == out["fsdp2"]  # step 4's row again, none doubled
    # trainer.best_metric: each checkpoint ranked by its acc_norm, the highest best
    acc = {s: r["eval/pycode_mc/acc_norm"] for s, r in out["fsdp2"].items()}
    assert out["kept"] == {"step_00000002": -acc[2], "step_00000004": -acc[4]}
    assert sorted(out["tp2"]) == [2] and set(out["tp2"][2]) == keys


def test_bad_tasks_are_one_line_before_any_rank(run_dir, tmp_path, monkeypatch, capsys):
    """An unknown task, a task whose data needs a download, a task dir holding no
    task: one line each naming the key and the task (train.py and eval.py), before
    any rank starts."""
    from lm_eval.tasks import TaskManager

    from src.trainer import eval_tasks

    # lm-eval's index of its own ~15,000 tasks takes ~15 s to read: an empty one
    monkeypatch.setattr(
        eval_tasks, "_lm_eval_index", lambda: TaskManager(include_defaults=False)
    )
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: no-such-org/no-such-dataset\n"
        "output_type: loglikelihood\ntest_split: test\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    train = [*RUN, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"]
    cases = [
        (
            "train.py",
            [*train, "trainer.eval_tasks=[nonesuch]"],
            "trainer.eval_tasks: unknown task 'nonesuch'",
        ),
        (
            "train.py",
            [
                *train,
                "trainer.eval_tasks=[hub_task]",
                f"trainer.eval_tasks_dirs=[{hub}]",
            ],
            "trainer.eval_tasks: task 'hub_task': its data could not be loaded offline",
        ),
        (
            "eval.py",
            [f"run={run_dir}", "tasks=[pycode_mc]", f"tasks_dirs=[{empty}]"],
            f"tasks_dirs: {empty} holds no lm-eval task",
        ),
        (
            "train.py",
            [*train, "trainer.eval_tasks=[pycode_mc]", "trainer.best_metric=eval/x/a"],
            "trainer.best_metric: got 'eval/x/a', expected val_loss or eval/<task>/",
        ),
        (
            "eval.py",
            [f"run={run_dir}", "tasks=[pycode_mc,pycode_mc]"],
            "tasks: got ['pycode_mc', 'pycode_mc'], expected a list of distinct",
        ),
    ]
    for script, args, start in cases:
        line = one_config_error(in_process(monkeypatch, capsys, script, *args))
        assert line.startswith(start), line


def test_lm_eval_is_imported_only_when_a_task_is_asked():
    """No module of the project imports lm-eval (pandas, sklearn, datasets: seconds)
    at its top but the adapter's, which is itself imported only inside functions:
    train.py and eval.py start without it."""
    import ast

    root = Path(__file__).resolve().parents[1]
    lazy = ("lm_eval", "datasets", "src.trainer.lm_adapter")
    found = []
    for path in [*root.glob("*.py"), *(root / "src").rglob("*.py")]:
        for node in ast.parse(path.read_text()).body:  # module-level statements
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == m or n.startswith(m + ".") for n in names for m in lazy):
                found.append(path.relative_to(root).as_posix())
    assert set(found) == {"src/trainer/lm_adapter.py"}, found
