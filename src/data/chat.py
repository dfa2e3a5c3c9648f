"""Conversations for supervised fine-tuning (``data=chat``, docs/finetune.md).

A conversation is a JSONL line ``{"messages": [{"role": ..., "content": ...}, ...]}``.
It is rendered to text by a chat template (Jinja, as Hugging Face tokenizers ship
them in ``tokenizer_config.json``) and cut into segments: what the assistant says
(its content and the template's end of its turn) is trained, the rest (system and
user turns, the template's headers) is context only. The cut comes from rendering
the conversation's prefixes (``add_generation_prompt`` before each assistant turn),
so it needs no markers in the template, only that a turn renders the same whatever
follows it; a template that does not is refused in one line.

Each segment is tokenized on its own (the token cache encodes each piece apart),
so a token never straddles a prompt and a reply. The template runs in Jinja's
sandbox (as transformers runs it): a template read from disk is data, not code.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from src.errors import ConfigError
from src.files import read_json_object

#: The template of a tokenizer without one of its own (byte, bpe, a tokenizer.json
#: with no ``chat_template``): ChatML's turns.
CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: ``data.chat_template``'s value for "the tokenizer's own, else :data:`CHATML`".
AUTO = "auto"
ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_KEY = "data.chat_template"


class Trained(bytes):
    """A piece of a conversation that the loss is computed on (the assistant's)."""


def tokenizer_config(directory: str) -> dict:
    """A Hugging Face ``tokenizer_config.json`` of ``directory`` ({} if none)."""
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.lexists(path):
        return {}
    try:
        return read_json_object(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("data.tokenizer", f"{path} is unreadable ({exc})") from None


def special_token(config: dict, key: str) -> str | None:
    """``key`` (``eos_token``, ``bos_token``...) of a ``tokenizer_config.json``."""
    token = config.get(key)
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_dir(tokenizer: str) -> str | None:
    """The directory of ``data.tokenizer`` when it is a path (None: byte, bpe)."""
    path = os.path.expanduser(tokenizer)
    if os.path.isdir(path):
        return path
    return os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else None


def template_of(setting: str, tokenizer: str) -> tuple[str, str, str, str]:
    """The chat template, the ``bos_token`` and ``eos_token`` it is rendered with,
    and where it came from: ``setting`` (``data.chat_template``) is ``auto`` (the
    ``tokenizer`` directory's ``chat_template``, in ``chat_template.jinja`` or
    ``tokenizer_config.json``, else :data:`CHATML`), a ``.jinja`` file, or the
    template itself."""
    directory = tokenizer_dir(tokenizer)
    config = tokenizer_config(directory) if directory else {}
    bos, eos = (special_token(config, k) or "" for k in ("bos_token", "eos_token"))
    if setting != AUTO:
        path = os.path.expanduser(setting)
        if setting.endswith(".jinja") and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read(), bos, eos, path
        return setting, bos, eos, TEMPLATE_KEY
    jinja = os.path.join(directory or "", "chat_template.jinja")
    if directory and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), bos, eos, jinja
    own = config.get("chat_template")
    if isinstance(own, list):  # named templates: the default one
        own = {t.get("name"): t.get("template") for t in own}.get("default")
    if isinstance(own, str):
        return own, bos, eos, os.path.join(directory, "tokenizer_config.json")
    return CHATML, bos, eos, "ChatML (the tokenizer has no chat template)"


@functools.lru_cache(maxsize=8)
def renderer(template: str, bos: str = "", eos: str = "") -> Callable[..., str]:
    """``render(messages, add_generation_prompt)`` of ``template`` in Jinja's
    immutable sandbox, with the tokenizer's ``bos_token`` and ``eos_token``."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def fail(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise ConfigError(TEMPLATE_KEY, f"not a Jinja template ({exc})") from None

    def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=eos,
            )
        except TemplateError as exc:
            raise ConfigError(TEMPLATE_KEY, f"rendering failed ({exc})") from None

    return render


def segments(
    messages: list[dict], render: Callable[..., str], where: str
) -> list[tuple[str, bool]]:
    """The rendered conversation as ``(text, trained)`` segments, in order: each
    assistant turn is what the conversation up to it adds to its prompt (the
    conversation before it with the generation prompt). ``where`` names the
    conversation in the error of a template whose prefixes do not line up."""
    out: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], add_generation_prompt=True)
        full = render(messages[: i + 1])
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise ConfigError(
                TEMPLATE_KEY,
                f"{where}: the template renders turn {i} differently once later "
                "turns follow (its prefixes do not line up), so the assistant's "
                "tokens cannot be told apart; give a template that renders each "
                "turn the same (data.chat_template=...)",
            )
        out += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
        done = full
    whole = render(messages)
    if not whole.startswith(done):
        raise ConfigError(
            TEMPLATE_KEY, f"{where}: the whole conversation does not start as its turns"
        )
    out.append((whole[len(done) :], False))
    return [(text, trained) for text, trained in out if text]


def read_messages(line: bytes, key: str, where: str) -> list[dict] | None:
    """A JSONL line's conversation (``key``: ``data.text_key``), each message a dict
    of a known role and string content, at least one of them the assistant's; None
    for a blank line; a ``ConfigError`` naming ``where`` (file:line) otherwise."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError as err:
        raise ConfigError(where, f"not valid JSON ({err})") from None
    messages = row.get(key) if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            where, f"no {key!r} list of messages (data.text_key, data=chat)"
        )
    for n, m in enumerate(messages):
        ok = isinstance(m, dict) and m.get("role") in ROLES
        if not ok or not isinstance(m.get("content"), str):
            raise ConfigError(
                where,
                f"message {n} is not {{'role': {'|'.join(ROLES)}, 'content': str}}: "
                f"{json.dumps(m)[:60]}",
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(where, "no assistant message: nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def conversation_pieces(
    path: str, key: str, render: Callable[..., str]
) -> Iterator[bytes]:
    """The conversations of a JSONL file as UTF-8 pieces (:class:`Trained` for the
    assistant's), each conversation followed by ``None`` (the end of a document)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            where = f"{path}:{number}"
            messages = read_messages(line, key, where)
            if messages is None:
                continue
            for text, trained in segments(messages, render, where):
                yield (Trained if trained else bytes)(text.encode())
            yield None


def prompt_text(render: Callable[..., str], prompt: Any) -> str:
    """What a model fine-tuned on conversations is given to answer ``prompt`` (a
    user's text, or a list of messages): the template's rendering with the
    generation prompt."""
    messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    )
    return render(list(messages), add_generation_prompt=True)
