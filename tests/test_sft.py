"""Supervised fine-tuning on conversations (``data=chat``): the loss mask (the
assistant's tokens of each conversation, counted), rows of whole conversations, a
tokenizer's own chat template, the one-line refusals, and a run through train.py
that resumes exactly, which eval.py scores as it validated and sample.py asks as a
user (one rank, in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from src.config.cli import CONFIG_ERRORS, one_line
from src.config.validate import validate
from src.data.chat import CHATML, renderer, template_of
from src.data.mixture import make_batches
from src.data.sources import load_splits, prepare_data, tokenizer_of
from src.harness import compose_config
from tests.commands import in_process

CHATS = Path(__file__).resolve().parent / "fixtures" / "chat.jsonl"


def chat_cfg(tmp_path: Path, *overrides: str):
    cfg = compose_config(
        "data=chat",
        f"data.paths={CHATS}",
        f"data.cache_dir={tmp_path}/cache",
        "data.val_fraction=0.2",
        *overrides,
    )
    validate(cfg)
    return cfg


def trained_bytes(messages: list[dict]) -> bytes:
    """What ChatML trains of a conversation: each reply and its end of turn, and the
    end of the conversation (byte 0) after a last reply."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    end = b"\0" if messages[-1]["role"] == "assistant" else b""
    return b"".join(f"{r}<|im_end|>\n".encode() for r in replies) + end


def test_the_loss_is_on_each_conversations_replies_only(tmp_path):
    cfg = chat_cfg(tmp_path)
    prepare_data(cfg.data, verbose=False, progress=False)
    train, val = load_splits(cfg.data, 256, seed=0)
    conversations = [json.loads(line)["messages"] for line in CHATS.open()]
    tokens = np.concatenate([train.tokens, val.tokens])
    mask = np.concatenate([train.mask, val.mask]).astype(bool)
    ends = np.flatnonzero(tokens == 0) + 1
    assert len(ends) == len(conversations) == 80 and ends[-1] == len(tokens)
    # the split falls between two conversations
    assert len(train.tokens) in ends and 0 < len(val.tokens)
    for messages, start, end in zip(conversations, [0, *ends[:-1]], ends, strict=True):
        trained = tokens[start:end][mask[start:end]].tobytes()
        assert trained == trained_bytes(messages), messages
        assert tokens[start:end].tobytes().startswith(b"<|im_start|>")
    # Rows of whole conversations: every trained token is a target of one row
    # (none is a row's first token: a conversation starts with its prompt).
    batches = make_batches(train, 4, 512, seed=0)
    rows = range(batches.num_rows)
    targets = [batches._gather(np.array([r]))[1] for r in rows]
    assert sum(int((y != -1).sum()) for y in targets) == int(train.mask.sum())
    x, y = batches.get(step=3, micro_step=0, rank=1, world_size=2)
    assert x.shape == y.shape == (2, 512)
    assert batches.covering_batches() == -(-batches.num_rows // 4)


def test_a_tokenizers_own_template_is_used_and_a_bad_one_is_one_line(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from src.data.tokenizer import byte_level_hf

    own = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    directory = tmp_path / "tok"
    hf = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_hf(), eos_token="<|endoftext|>"
    )
    hf.chat_template = own
    hf.save_pretrained(directory)
    assert template_of("auto", str(directory))[0] == own
    assert template_of("auto", "byte")[0] == CHATML
    cfg = chat_cfg(tmp_path, f"data.tokenizer={directory}")
    prepare_data(cfg.data, verbose=False, progress=False)
    train, _ = load_splits(cfg.data, 1 << 16, seed=0)
    tokenizer = tokenizer_of(cfg.data)
    first = int(np.flatnonzero(train.tokens == tokenizer.eos_id)[0])
    text = tokenizer.decode(np.asarray(train.tokens[:first]).tolist())
    assert text == "[user] What is 21 + 10?\n[assistant] 21 + 10 = 31.\n"
    trained = np.asarray(train.tokens[: first + 1])[train.mask[: first + 1] == 1]
    assert tokenizer.decode(trained.tolist()) == "21 + 10 = 31.\n<|endoftext|>"
    # sample.py's prompt: the user's turn and the generation prompt
    assert tokenizer.chat([{"role": "user", "content": "hi"}], True) == (
        "[user] hi\n[assistant] "
    )
    # A template that renders a turn differently once later turns follow
    counted = tmp_path / "counted.jinja"
    counted.write_text("{{ messages|length }}" + own)
    with pytest.raises(CONFIG_ERRORS) as info:
        prepare_data(chat_cfg(tmp_path, f"data.chat_template={counted}").data)
    assert one_line(info.value).startswith(
        f"data.chat_template: {CHATS}:1: the template"
    )
    assert renderer(own)([{"role": "user", "content": "x"}]) == "[user] x\n"
    # an export's tokenizer renders as the run did (transformers' own)
    from transformers import AutoTokenizer

    from src.data.tokenizer import save_hf_tokenizer

    save_hf_tokenizer(tokenizer, tmp_path / "export")
    exported = AutoTokenizer.from_pretrained(tmp_path / "export")
    messages = json.loads(CHATS.open().readline())["messages"]
    assert exported.apply_chat_template(messages, tokenize=False) == (
        tokenizer.chat(messages)
    )


@pytest.mark.parametrize(
    "line, says",
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "message 0 is not"),
        ('{"text": "plain"}', "no 'messages' list of messages"),
    ],
)
def test_a_bad_conversation_is_one_line_naming_its_line(tmp_path, line, says):
    path = tmp_path / "bad.jsonl"
    good = CHATS.open().readline()
    path.write_text(good + line + "\n")
    with pytest.raises(CONFIG_ERRORS) as info:
        prepare_data(chat_cfg(tmp_path, f"data.paths={path}").data)
    assert one_line(info.value).startswith(f"{path}:2: {says}")


@pytest.mark.parametrize(
    "override, key",
    [("data.packing=stream", "data.packing"), ("data.weights=[1,1]", "data.weights")],
)
def test_what_conversations_cannot_take_is_one_line(tmp_path, override, key):
    paths = f"data.paths=[{CHATS},{CHATS}]"
    with pytest.raises(CONFIG_ERRORS) as info:
        chat_cfg(tmp_path, paths, override)
    assert one_line(info.value).startswith(f"{key}: ")


def test_sft_resumes_exactly_and_eval_and_sample_read_it_as_it_trained(
    tmp_path, monkeypatch, capsys
):
    from tests.test_documents import (
        RESUMED_RUN,
        resumes_exactly_and_evaluates_as_validated,
    )

    run = [
        "model=tiny", "model.block_size=256", "data=chat", f"data.paths={CHATS}",
        f"data.cache_dir={tmp_path}/cache", "data.val_fraction=0.2", *RESUMED_RUN,
    ]  # fmt: skip
    resumes_exactly_and_evaluates_as_validated(tmp_path, run)
    prompt = "What is 2 + 2?"
    code, out, err = in_process(
        monkeypatch, capsys, "sample.py", f"run={tmp_path / 'whole'}",
        f"prompt='{prompt}'", "max_new_tokens=3", "num_samples=1",
    )  # fmt: skip
    assert code == 0, err
    asked = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert asked in out + err
