"""``data.packing=documents`` (src/data/packing.py, src/models/attention.py): document
ids from the end-of-document token, positions that restart, attention that never
crosses a document (equal to running each document alone, fp32), no loss at a
document's first token, the step's loss as the mean over the global batch's counted
targets, the attention FLOPs counted (those of each document alone), sampling within
one document, an exact resume, eval.py's scoring, and what is refused in one line.
One process; the multi-rank layouts join the launches of tests/test_tensor_parallel.py
(TP2 x FSDP2), test_context_parallel.py (CP2), test_pipeline.py (PP2) and
test_expert_parallel.py (EP2 x FSDP2)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from src.data.packing import Documents
from src.models import get_spec
from src.models.attention import attention_kernel, document_positions
from src.models.memory import ActivationBytes
from src.trainer.step import counted_weights, within_documents
from tests.test_config import assert_fails_naming

EOS = 0
DOCS = Documents(EOS)
SHAPES = {
    "gpt": dict(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=32),
    "llama": dict(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
        multiple_of=16,
    ),
    "moe": dict(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
        multiple_of=16, num_experts=4, top_k=2, moe_hidden_dim=16,
        shared_hidden_dim=16, capacity_factor=None,
    ),
}  # fmt: skip
# Two rows of 20 tokens: three documents (7, 5 and 8 tokens, each ending with EOS
# but the last, cut by the window), and one that ends at the row's last token.
LENGTHS = ([7, 5, 8], [20])


def model_of(family: str) -> torch.nn.Module:
    spec = get_spec(family)
    return spec.build(spec.config_cls(**SHAPES[family]), 0).eval()


def packed(lengths=LENGTHS, seed: int = 0) -> torch.Tensor:
    """Rows of random tokens (never EOS) with an EOS ending every document but a
    row's last."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        x = torch.randint(1, 64, (sum(row),), generator=gen)
        for end in torch.tensor(row).cumsum(0)[:-1]:
            x[end - 1] = EOS
        rows.append(x)
    return torch.stack(rows)


def test_document_ids_and_positions_restart_after_each_end_token():
    x = packed()
    docs = DOCS.ids(x)
    assert docs[0].tolist() == [0] * 7 + [1] * 5 + [2] * 8  # EOS ends its document
    assert docs[1].tolist() == [0] * 20
    pos = document_positions(docs)
    assert pos[0].tolist() == [*range(7), *range(5), *range(8)]
    assert pos[1].tolist() == list(range(20))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_document_does_not_see_the_one_before(family):
    """Changing the first document's tokens leaves the second's logits as they
    were with documents, and changes them with stream packing; a batch of single
    documents gives stream's logits."""
    model, x = model_of(family), packed()
    changed = x.clone()
    changed[0, :6] = (changed[0, :6] + 1) % 63 + 1  # still no EOS
    with torch.no_grad():
        same = [model(t, docs=DOCS.ids(t))[0][0, 7:] for t in (x, changed)]
        stream = [model(t)[0][0, 7:] for t in (x, changed)]
        one = x[1:]  # a row that is one document: plain causal attention
        torch.testing.assert_close(model(one, docs=DOCS.ids(one))[0], model(one)[0])
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=1e-6)
    assert (stream[0] - stream[1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gpt", "llama", "moe"])
def test_documents_equal_each_document_run_alone(family):
    """Per token, the logits and the gradients of the packed batch with documents
    are those of each document run alone (fp32, 1e-5)."""
    model, x = model_of(family), packed()
    logits, _ = model(x, docs=DOCS.ids(x))
    torch.autograd.backward(logits.square().sum())
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = []
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            alone.append(model(x[row : row + 1, start : start + n])[0])
            start += n
    alone = torch.cat(alone, dim=1).view_as(logits)
    torch.autograd.backward(alone.square().sum())
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", ["tiny_llama", "tiny_gpt2"])
def test_hugging_face_models_take_positions_that_restart(config):
    """transformers builds the mask of packed sequences from position ids that
    restart (RoPE, and GPT-2's learned positions): each document's logits and the
    gradients of its tokens' losses as alone (fp32, 1e-5)."""
    from src.models.hf import HFConfig, build

    model, x = build(HFConfig(config=config), seed=0).eval(), packed()[:1]
    y = x.roll(-1, 1)  # each token's loss, summed: the same targets both ways

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")

    logits = model(x, docs=DOCS.ids(x))[0]
    loss(logits).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = [model(x[:, a:b])[0] for a, b in ((0, 7), (7, 12), (12, 20))]
    alone = torch.cat(alone, 1)
    loss(alone).backward()
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5)


def test_loss_drops_each_documents_first_token_and_is_the_counted_mean():
    model, x = model_of("llama"), packed()
    y = torch.cat([x[:, 1:], torch.full((2, 1), 5)], dim=1)  # the next tokens
    targets = DOCS.targets(x, y)
    assert (targets == -1).nonzero().tolist() == [[0, 6], [0, 11]]  # after each EOS
    with torch.no_grad():
        logits, loss = model(x, targets, docs=DOCS.ids(x))
    logp = F.log_softmax(logits.double(), -1)
    counted = [
        -logp[b, t, y[b, t]] for b in range(2) for t in range(20) if x[b, t] != EOS
    ]
    assert len(counted) == 38
    assert abs(loss.item() - torch.stack(counted).mean().item()) < 1e-6


def one_rank() -> SimpleNamespace:
    """What :func:`counted_weights` reads of a one-rank backend."""
    return SimpleNamespace(
        world_size=1,
        dp_size=1,
        layout=SimpleNamespace(cp=1),
        device=torch.device("cpu"),
        shard_sequence=lambda *t: t,
    )


def test_micro_batch_weights_give_the_mean_over_the_global_batchs_targets():
    """Micro-batches with different counted targets weigh by their counts: the
    weighted sum of their means is the mean over all their targets (as one batch);
    the tp ranks that read the same rows are counted once."""
    y1 = torch.tensor([[1, -1, 2, 3]])  # 3 counted
    y2 = torch.tensor([[-1, -1, -1, 4]])  # 1 counted
    assert counted_weights([(None, y1), (None, y2)], one_rank()) == [0.75, 0.25]
    losses = torch.tensor([[0.5, 9.0, 1.5, 2.5], [9.0, 9.0, 9.0, 4.0]])
    means = [losses[0][[0, 2, 3]].mean(), losses[1][3]]
    weighted = means[0] * 0.75 + means[1] * 0.25
    assert abs(weighted.item() - (0.5 + 1.5 + 2.5 + 4.0) / 4) < 1e-6


def test_a_micro_batch_without_counted_targets_weighs_nothing_and_stays_finite():
    x = packed()
    ends = torch.full((1, 6), EOS)  # every target follows an end token
    batch, weights = within_documents(
        [(x, x.roll(-1, 1)), (ends, ends + 1)], DOCS, one_rank()
    )
    assert weights == [1.0, 0.0] and batch[1][1].tolist() == [[0] * 6]
    model = model_of("gpt")
    loss = model(*batch[1], docs=DOCS.ids(ends))[1] * weights[1]
    loss.backward()
    assert loss.item() == 0 and all(p.grad.isfinite().all() for p in model.parameters())


def test_mfu_counts_the_attention_each_document_computes():
    """A packed batch's FLOPs with documents (``flops_per_token`` at its attention
    span, what MFU counts) are those of running each document alone (what a kernel
    that skips the masked blocks computes: FlexAttention's block mask), counted by
    FlopCounterMode (SDPA's math backend: attention as bmm's); stream's (``T``) are
    the packed batch's, more by exactly the attention across documents."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    spec = get_spec("gpt")
    cfg = spec.config_cls(n_layer=1, n_head=2, n_embd=64, vocab_size=64, block_size=64)
    model, lengths = spec.build(cfg, 0), ([10, 20, 34], [64])
    x = packed(lengths)

    def counted(*rows: torch.Tensor) -> int:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            for row in rows:
                model(row)[0].sum().backward()
        return counter.get_total_flops()

    alone = counted(x[:1, :10], x[:1, 10:30], x[:1, 30:], x[1:])
    span = DOCS.attention_span(x)
    assert span == (100 + 400 + 34**2 + 64**2) / 128
    documents, stream = (spec.flops_per_token(cfg, s) * x.numel() for s in (span, 64))
    assert abs(alone / documents - 1) < 0.03, (alone, documents)
    assert counted(x) - alone == pytest.approx(stream - documents, rel=1e-9)


def test_sampling_decodes_within_one_document():
    """sample.py's and trainer.sample_every's decoding (``sample_texts``) of a run
    packed by documents: a prompt's earlier documents are not attended (its texts
    are the last document's, prompted alone), and each text ends before the first
    end token it draws (stream packing's texts, same draws, cut there)."""
    from src.config.run_plan import resolve
    from src.data.tokenizer import byte_tokenizer
    from src.harness import compose_config
    from src.trainer.sampling import sample_texts

    within, stream = (
        resolve(compose_config("model=tiny", f"data.packing={p}"))
        for p in ("documents", "stream")
    )
    model, tokenizer = within.spec.build(within.model_config, 0), byte_tokenizer()
    kw = dict(num_samples=16, max_new_tokens=16, temperature=1.0, seed=0)
    kw["device"] = torch.device("cpu")
    drawn = sample_texts(model, stream, tokenizer, ["second"], **kw)[0]
    assert sum("\0" in t for t in drawn) > 1  # the end token is drawn
    texts = sample_texts(model, within, tokenizer, ["first\0second", "second"], **kw)
    assert texts[0] == texts[1] == [t.split("\0")[0] for t in drawn]


def test_resume_and_eval_keep_the_runs_packing(tmp_path):
    """A run packed by documents (two micro-batches) resumed from its step 2 gives
    the uninterrupted run's losses exactly; eval.py scores it within documents, as
    the run validated (one rank, in this process)."""
    run = [
        "model=tiny", "model.block_size=32", "data=text", "data.max_bytes=100000",
        "data.packing=documents", *RESUMED_RUN,
    ]  # fmt: skip
    resumes_exactly_and_evaluates_as_validated(tmp_path, run)


#: Four steps of two micro-batches, checkpointed at 2, validated at 4, on one rank.
RESUMED_RUN = [
    "logger=none", "trainer.devices=1", "trainer.max_steps=4", "trainer.grad_accum=2",
    "trainer.val_every=4", "trainer.val_batches=2", "trainer.batch_size=4",
    "trainer.progress=false", "trainer.peak_tflops=1", "trainer.ckpt_every=2",
    "trainer.keep_last=0", "trainer.log_every=1",
]  # fmt: skip


def resumes_exactly_and_evaluates_as_validated(tmp_path: Path, run: list[str]) -> None:
    """``run`` (with :data:`RESUMED_RUN`) in ``tmp_path/whole``, resumed from its step
    2 in ``tmp_path/resumed``: the same losses at steps 3 and 4; eval.py's loss of
    the whole run equals its val loss."""
    import json

    from hydra import compose, initialize_config_dir

    import eval as eval_py
    from src.harness import CONF_DIR
    from tests.test_research_loop import train_run
    from tests.test_train import read_rows

    train_run(tmp_path / "whole", *run)
    step_2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    train_run(tmp_path / "resumed", *run, f"trainer.resume={step_2}")

    def rows(name: str) -> dict[int, tuple]:
        lines = read_rows(tmp_path / name)
        return {r["step"]: (r["loss"], r.get("val_loss")) for r in lines if "loss" in r}

    whole, resumed = rows("whole"), rows("resumed")
    assert sorted(resumed) == [3, 4] and all(whole[s] == resumed[s] for s in (3, 4))
    val_loss = json.loads((tmp_path / "whole" / "summary.json").read_text())["val_loss"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", [f"run={tmp_path / 'whole'}", "devices=1"])
        entry = eval_py.evaluate_run(cfg)
    assert entry["step"] == 4 and abs(entry["loss"] - val_loss) < 1e-6, entry


def test_attention_span_counts_the_documents_squares():
    # (7^2 + 5^2 + 8^2 + 20^2) / 40 tokens: what a token's query sees, full square
    assert DOCS.attention_span(packed()) == pytest.approx((49 + 25 + 64 + 400) / 40)
    assert attention_kernel(torch.device("cpu")) == "sdpa"


@pytest.mark.parametrize(
    "overrides, key, says",
    [
        (["data.packing=document"], "data.packing", "expected one of: stream"),
        (["data=synthetic", "data.packing=documents"], "data.packing", "data=text"),
        (
            ["model=custom", "model._target_=tests.test_models.TinyLM",
             "data.packing=documents"],
            "data.packing",
            "takes no document ids",
        ),
    ],
)  # fmt: skip
def test_what_documents_does_not_build_fails_in_one_line(overrides, key, says):
    assert_fails_naming(["model=tiny", *overrides], key, says)


def test_planner_counts_the_masks_autograd_keeps():
    """What autograd saves more with documents (the mask's fp32 copy SDPA keeps in
    each block, the per-row positions) is the planner's term less the boolean mask
    (alive through the forward) and plain packing's one row of positions."""
    from src.config.run_plan import resolve
    from src.harness import compose_config
    from src.planner.activations import documents_activations
    from src.planner.estimate import RunShape

    cfg = compose_config("model=tiny", "model.block_size=16", "data.packing=documents")
    resolved = resolve(cfg)
    model = resolved.spec.build(resolved.model_config, 0).train()
    B, T, layers = 2, 16, resolved.model_config.n_layer
    x = packed(([7, 9], [16]))

    def saved(**docs) -> int:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x, **docs)
        return sum(kept.values())

    zero = ActivationBytes(0, 0, 0, 0)
    shape = RunShape(backend="none", world=1, micro_batch=B, seq_len=T)
    planned = documents_activations(resolved, shape, zero, layers)
    assert planned.saved == layers * B * T * T * 4 + B * T * T + 8 * B * T
    measured = saved(docs=DOCS.ids(x)) - saved()
    assert measured == planned.saved - B * T * T - 8 * T
