"""Expert parallelism (src/sharding/expert_parallel.py) on the native MoE family, for
real on 4 CPU ranks (one launch that checks several things together):

- EP2 x FSDP2 (each expert on one of 2 ranks, FSDP-sharded over the other 2) trains
  with the fp32 losses of one rank within 1e-5, routing included (the
  auxiliary-loss-free bias and per-sequence capacity are on);
- its checkpoint resumes on FSDP4 alone (no expert parallelism), on HSDP (2
  replicas) x EP2, on EP4 (every rank an ep rank, the experts not FSDP-sharded, as
  EP2 is on 2 ranks) and on EP2 x TP2
  (sequence parallel: the ep group is the tp group, each tp rank dispatching half of
  the assignments; gradient norms equal too), whose checkpoint resumes on EP2 x
  FSDP2, each continuing one rank's losses within 1e-5: experts are stored as
  whole ``[num_experts, ...]`` tensors whatever the layout;
- the MoE metrics are in metrics.jsonl, the same on every layout;
- the planner's peak per rank is within 10% of the measured one on the EP run;
- with ``data.packing=documents`` (byte text, two micro-batches) EP2 x FSDP2 trains
  with one rank's losses within 1e-5 (each document alone: tests/test_documents.py);
- HF Mixtral (model=hf, its ``base_model_ep_plan``) on EP2 x TP2 and HF Qwen3-MoE on
  EP2 x FSDP2 train with one rank's fp32 losses and routing metrics within 1e-5,
  and Mixtral's ``trainer.export=hf`` (whole experts gathered) opens in
  transformers with one rank's exported weights.

The routing, grouped mm and bias update are unit-tested in tests/test_moe.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from src.config.run_plan import resolve
from src.config.validate import validate
from src.trainer.launch import prepare, run_rank, run_ranks
from src.trainer.loop import train
from tests.distributed import HANG_S
from tests.test_config import make_cfg

RUN = [
    "model=moe_tiny",
    "model.max_seq_len=32",
    "model.load_balance=aux_free",
    "model.bias_update_rate=0.01",
    "model.capacity_factor=1.5",
    "sharding.policy=block",
    "data=synthetic",
    "data.num_tokens=20000",
    "logger=none",
    "trainer.max_steps=4",
    "trainer.batch_size=8",
    "trainer.log_every=1",
    "trainer.val_every=0",
    "trainer.progress=false",
    "trainer.peak_tflops=1",
    "trainer.lr=3e-3",
    "trainer.warmup_steps=1",
]


#: HF Mixtral's run: the native run's trainer keys, its own model.
HF_RUN = (
    "model=hf",
    "model.config=tiny_mixtral",
    "model.block_size=32",
    "trainer.max_steps=2",
    "trainer.export=hf",
)
#: HF Qwen3-MoE's: Mixtral's, another architecture, no export.
QWEN_RUN = (*HF_RUN[:1], "model.config=tiny_qwen3_moe", *HF_RUN[2:4])
#: data.packing=documents on byte text (its documents end with EOS), two
#: micro-batches whose counted targets differ.
DOCS_RUN = [
    *(o for o in RUN if not o.startswith("data")),
    "data=text",
    "data.max_bytes=100000",
    "data.packing=documents",
    "trainer.grad_accum=2",
]
#: EP2 x TP2 (sequence parallel, the MoE family's default with tp).
EP_TP = ("sharding.expert_parallel=2", "sharding.tensor_parallel=2")


def _cfg(*overrides: str, base: list[str] = RUN):
    cfg = make_cfg(*base, *overrides)
    validate(cfg)
    return cfg


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


EP = ("sharding.expert_parallel=2", "trainer.ckpt_every=2")


def _step(run_dir: Path, step: int) -> str:
    return f"trainer.resume={run_dir / 'checkpoints' / f'step_{step:08d}'}"


def _layouts(device: torch.device, root: str, planned) -> dict:
    """EP2 x FSDP2 for 4 steps (checkpoints at 2 and 4; ``planned``: its config and
    run object as the launcher prepared them, with the planner's peak), FSDP4
    resumed from its step 2, and so are EP2 x TP2 (a checkpoint each step), HSDP
    (2 replicas) x EP2 and EP4 (every rank an ep rank: experts not FSDP-sharded, as
    EP2 on 2 ranks), EP2 x FSDP2 resumed from EP2 x TP2's step 3; HF Mixtral on EP2 x TP2, HF Qwen3-MoE on
    EP2 x FSDP2; EP2 x FSDP2 with documents."""
    root_dir = Path(root)
    cfg, resolved = planned
    summaries = {"ep": train(cfg, str(root_dir / "ep"), device, resolved)}
    runs = {
        "fsdp": (RUN, "sharding.expert_parallel=1", _step(root_dir / "ep", 2)),
        "tp": (RUN, *EP_TP, "trainer.ckpt_every=1", _step(root_dir / "ep", 2)),
        "back": (RUN, "sharding.expert_parallel=2", _step(root_dir / "tp", 3)),
        "hsdp": (RUN, "sharding.replicate=2", *EP[:1], _step(root_dir / "ep", 2)),
        "ep4": (RUN, "sharding.expert_parallel=4", _step(root_dir / "ep", 2)),
        "hf": (_hf_run(), *EP_TP),
        "qwen": (_hf_run(QWEN_RUN), "sharding.expert_parallel=2"),
        "docs": (DOCS_RUN, "sharding.expert_parallel=2"),
    }
    for name, (base, *overrides) in runs.items():
        cfg = _cfg("trainer.devices=4", *overrides, base=base)
        summaries[name] = train(cfg, str(root_dir / name), device, resolve(cfg))
    return summaries


def _hf_run(model: tuple[str, ...] = HF_RUN) -> list[str]:
    """``model`` (HF_RUN) over the native run's keys that are not its model's."""
    return [o for o in RUN if not o.startswith("model")] + list(model)


def test_expert_parallel_equals_one_rank_and_checkpoints_cross_layouts(tmp_path):
    ref_dir = tmp_path / "one"
    cfg = _cfg("trainer.devices=1")
    run_rank(cfg, str(ref_dir), validate(cfg))
    for name, model in (("hf_one", HF_RUN), ("qwen_one", QWEN_RUN)):
        cfg = _cfg("trainer.devices=1", base=_hf_run(model))
        run_rank(cfg, str(tmp_path / name), validate(cfg))
    cfg = _cfg("trainer.devices=1", base=DOCS_RUN)
    run_rank(cfg, str(tmp_path / "docs_one"), validate(cfg))
    cfg = _cfg("trainer.devices=4", *EP)
    validate(cfg)
    planned = prepare(cfg, user_keys=set())
    # as train.py starts its ranks (the planner models those processes)
    summary = run_ranks(_layouts, 4, HANG_S, str(tmp_path), planned)["ep"]

    one, ep, tp = (_rows(tmp_path / d) for d in ("one", "ep", "tp"))
    fsdp, back = _rows(tmp_path / "fsdp"), _rows(tmp_path / "back")
    hsdp, ep4 = _rows(tmp_path / "hsdp"), _rows(tmp_path / "ep4")
    assert sorted(ep) == [1, 2, 3, 4] and sorted(fsdp) == [3, 4]
    assert sorted(tp) == [3, 4] and sorted(back) == [4]
    assert sorted(hsdp) == sorted(ep4) == [3, 4]
    for step in (1, 2, 3, 4):
        assert abs(ep[step]["loss"] - one[step]["loss"]) < 1e-5, step
    for step in (3, 4):  # EP2 -> FSDP4, and -> EP2 x TP2: gradients counted once
        assert abs(fsdp[step]["loss"] - ep[step]["loss"]) < 1e-5, step
        assert abs(tp[step]["loss"] - one[step]["loss"]) < 1e-5, step
        assert abs(tp[step]["grad_norm"] / one[step]["grad_norm"] - 1) < 1e-5, step
        for other in (hsdp, ep4):  # EP under HSDP, and EP over every rank
            assert abs(other[step]["loss"] - one[step]["loss"]) < 1e-5, step
            assert abs(other[step]["grad_norm"] / one[step]["grad_norm"] - 1) < 1e-5
    assert abs(back[4]["loss"] - ep[4]["loss"]) < 1e-5  # EP2 x TP2 -> EP2 x FSDP2
    # documents: each rank's tokens dispatched with its own rows' masks
    docs_one, docs = _rows(tmp_path / "docs_one"), _rows(tmp_path / "docs")
    assert sorted(docs) == [1, 2, 3, 4] and docs_one[1]["loss"] != one[1]["loss"]
    for step in (1, 2, 3, 4):
        assert abs(docs[step]["loss"] - docs_one[step]["loss"]) < 1e-5, step

    # routing metrics: in metrics.jsonl, counted over all ranks, the same on every
    # layout (tokens per expert are whole numbers: equal, not close)
    E, tokens = 8, 8 * 32 * 2  # experts, assignments per step (batch x T x top_k)
    for row, step in ((ep[1], 1), (ep[4], 4), (tp[3], 3)):
        for layer in (0, 1):
            p = f"moe/layer{layer}/"
            assert row[p + "tokens_mean"] == tokens / E
            assert row[p + "tokens_max"] == one[step][p + "tokens_max"]
            assert row[p + "dropped"] == one[step][p + "dropped"]
            assert abs(row[p + "entropy"] - one[step][p + "entropy"]) < 1e-5
            assert abs(row[p + "aux_loss"] - one[step][p + "aux_loss"]) < 1e-5
        assert row["moe/load_max_over_mean"] >= 1.0
    assert back[4]["moe/layer1/tokens_max"] == ep[4]["moe/layer1/tokens_max"]

    # the planner's closing line on the EP run: within 10% of the measured peak
    planned, measured = summary["planned_peak_gib"], summary["peak_mem_gib"]
    assert abs(measured / planned - 1) < 0.10, (planned, measured)

    # HF Mixtral (EP2 x TP2) and Qwen3-MoE (EP2 x FSDP2), split by their
    # base_model_ep_plan: one rank's losses, and Mixtral's exported weights
    for one_dir, ep_dir in (("hf_one", "hf"), ("qwen_one", "qwen")):
        hf_one, hf_ep = _rows(tmp_path / one_dir), _rows(tmp_path / ep_dir)
        assert sorted(hf_ep) == [1, 2], ep_dir
        for step in (1, 2):
            one_row, row = hf_one[step], hf_ep[step]
            assert abs(row["loss"] - one_row["loss"]) < 1e-5, step
            # routing metrics from transformers' routers, counted over all ranks
            assert row["moe/layer1/tokens_max"] == one_row["moe/layer1/tokens_max"]
            for key in ("moe/layer0/aux_loss", "moe/entropy", "moe/aux_loss"):
                assert abs(row[key] - one_row[key]) < 1e-5, key
    from transformers import AutoModelForCausalLM

    one_w, ep_w = (
        AutoModelForCausalLM.from_pretrained(tmp_path / d / "hf").state_dict()
        for d in ("hf_one", "hf")
    )
    assert sorted(one_w) == sorted(ep_w)
    assert any("experts" in k for k in ep_w)
    for k, w in one_w.items():  # two Adam steps on sums in another order
        torch.testing.assert_close(ep_w[k], w, rtol=0, atol=1e-4, msg=k)


def test_selective_checkpointing_with_ep_refusal_names_what_works(
    tmp_path, monkeypatch, capsys
):
    """``sharding.activation_checkpointing=selective`` with expert parallelism: the
    refusal's advice does not loop (no sharding.policy=block, which EP's expert unit
    ignores); each thing it names plans (issue 57 item 14). train.py plan-only,
    in-process (tests/commands.py)."""
    from tests.commands import in_process

    def plan(*args: str) -> tuple[int, str, str]:
        return in_process(
            monkeypatch, capsys, "train.py", "model=moe_tiny", "trainer.devices=2",
            "trainer.plan_only=true", "logger=none", *args,
            f"hydra.run.dir={tmp_path}/{len(args)}{args[-1][-4:]}",
        )  # fmt: skip

    ep, selective = "sharding.expert_parallel=2", "sharding.activation_checkpointing"
    code, _, err = plan(ep, f"{selective}=selective")
    assert code == 2
    (line,) = err.strip().splitlines()
    assert "sharding.policy=block" not in line
    assert f"set {selective}=full" in line and "sharding.expert_parallel=1" in line
    assert plan(ep, f"{selective}=full")[0] == 0
    assert plan("sharding.expert_parallel=1", f"{selective}=selective")[0] == 0
