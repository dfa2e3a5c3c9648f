"""Tokenizers, chosen by ``data.tokenizer``:

- ``byte``: each UTF-8 byte is a token (vocab 256); byte 0 ends a document.
- ``bpe``: a byte-level BPE (GPT-2 style) trained with the ``tokenizers`` library on the
  training split of the corpus, ``data.bpe_vocab_size`` tokens, ``<|endoftext|>`` ends
  a document. It is cached in ``data.cache_dir`` under a hash of the corpus and the
  settings, so a run with the same corpus trains it once.
- a path: a ``tokenizer.json`` or a Hugging Face tokenizer directory (a model directory
  brings its own). Its end-of-document token is ``data.eos_token``, else the
  directory's ``eos_token``, else the first of :data:`EOS_CANDIDATES` it has.

Encoding runs in the ``tokenizers`` Rust thread pool (``encode_batch``): all cores.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from src.data.chat import renderer, special_token, tokenizer_config
from src.data.corpus import EOD, Corpus, CorpusError, build_lock, digest
from src.files import atomic_path, read_json_object

log = logging.getLogger(__name__)

BYTE_VOCAB = 256
BYTE_EOS = 0  # NUL: absent from text, so it marks document boundaries
BPE_EOS = "<|endoftext|>"
EOS_CANDIDATES = (BPE_EOS, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
BPE_VERSION = 1  # bump when the BPE recipe changes: invalidates cached BPEs


@dataclass
class Tokenizer:
    """What the token cache needs from a tokenizer; ``hf`` is a
    ``tokenizers.Tokenizer`` (None for bytes)."""

    name: str  # for logs and messages
    vocab_size: int
    eos_id: int
    hf: Any = None
    identity: dict = field(default_factory=dict)  # what a cache key hashes
    path: str | None = None  # the file it was read from (a tokenizer.json, a BPE's)
    # A tokenizer directory's own beginning-of-text and padding tokens (its
    # tokenizer_config.json), for the Hugging Face export; byte and bpe have none.
    bos_token: str | None = None
    pad_token: str | None = None
    #: a run on conversations (``data=chat``): its chat template and the ``bos_token``
    #: and ``eos_token`` it is rendered with (src/data/chat.py)
    chat_template: tuple[str, str, str] | None = None

    @property
    def chat(self) -> Any:
        """``render(messages, add_generation_prompt)`` by the run's chat template
        (None: not a run on conversations)."""
        return renderer(*self.chat_template) if self.chat_template else None

    def encode(self, pieces: list[bytes]) -> list[np.ndarray]:
        """Token ids of each piece (UTF-8 bytes; a character cut at a split edge is
        dropped), without special tokens."""
        if self.hf is None:
            return [np.frombuffer(p, dtype=np.uint8) for p in pieces]
        texts = [p.decode("utf-8", "ignore") for p in pieces]
        encodings = self.hf.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def encode_text(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens), as the corpus was tokenized."""
        return self.encode([text.encode("utf-8")])[0].tolist()

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (an incomplete UTF-8 sequence is shown as U+FFFD)."""
        if self.hf is None:
            return bytes(ids).decode("utf-8", "replace")
        return self.hf.decode(ids, skip_special_tokens=False)


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", BYTE_VOCAB, BYTE_EOS, identity={"kind": "byte"})


def _from_hf(hf: Any, name: str, eos_token: str | None, eos_hint: str | None):
    vocab = hf.get_vocab_size(with_added_tokens=True)
    wanted = [eos_token] if eos_token else [t for t in (eos_hint,) if t]
    for token in wanted or EOS_CANDIDATES:
        eos = hf.token_to_id(token)
        if eos is not None:
            break
    else:
        key = "data.eos_token" if eos_token else "data.tokenizer"
        raise CorpusError(
            f"{key}: {name} has no end-of-document token "
            f"{' or '.join(map(repr, wanted or EOS_CANDIDATES))}; "
            "set data.eos_token to one of its tokens"
        )
    return Tokenizer(
        name, vocab, eos, hf, identity={"json": digest(hf.to_str()), "eos": eos}
    )


def load_path_tokenizer(path: str, eos_token: str | None = None) -> Tokenizer:
    """A ``tokenizer.json`` file or a Hugging Face tokenizer/model directory."""
    from tokenizers import Tokenizer as HFTokenizer

    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise CorpusError(
            f"data.tokenizer: got {path!r}, expected byte, bpe, or a path to a "
            "tokenizer.json or tokenizer directory (no such path)"
        )
    directory = full if os.path.isdir(full) else os.path.dirname(full)
    config = tokenizer_config(directory)
    eos_hint = special_token(config, "eos_token")
    json_file = os.path.join(full, "tokenizer.json") if os.path.isdir(full) else full
    try:
        if os.path.isfile(json_file):
            hf = HFTokenizer.from_file(json_file)
        else:  # slow-tokenizer files only (vocab.json + merges.txt, sentencepiece)
            if config.get("auto_map"):
                raise CorpusError(
                    f"data.tokenizer: {path!r} needs its own Python code (auto_map in "
                    "tokenizer_config.json), which is never run; save it as a "
                    "tokenizer.json (tokenizer.backend_tokenizer.save(...)) and use that"
                )
            from transformers import AutoTokenizer

            # Never a tokenizer's own code, and never a prompt asking whether to
            # run it (transformers asks when the flag is left unset).
            hf = AutoTokenizer.from_pretrained(
                full, local_files_only=True, trust_remote_code=False
            )
            hf = hf.backend_tokenizer
    except CorpusError:
        raise
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CorpusError(
            f"data.tokenizer: {path!r} is not a tokenizer ({reason})"
        ) from None
    tokenizer = _from_hf(hf, path, eos_token, eos_hint)
    tokenizer.path = json_file if os.path.isfile(json_file) else full
    for key in ("bos_token", "pad_token"):
        token = special_token(config, key)
        if token is not None and hf.token_to_id(token) is not None:
            setattr(tokenizer, key, token)
    return tokenizer


def bpe_tokenizer(
    corpus: Corpus,
    vocab_size: int,
    cache_dir: str,
    verbose: bool = True,
    progress: bool = True,
) -> Tokenizer:
    """A byte-level BPE trained on the corpus's training split (cached)."""
    from tokenizers import Tokenizer as HFTokenizer

    if vocab_size <= BYTE_VOCAB + 1:
        raise CorpusError(
            f"data.bpe_vocab_size: got {vocab_size}, expected more than "
            f"{BYTE_VOCAB + 1} (the byte alphabet and {BPE_EOS})"
        )
    fingerprint = corpus.fingerprint(cache_dir)
    key = digest({"bpe": BPE_VERSION, "vocab": vocab_size, "corpus": fingerprint})
    path = os.path.join(cache_dir, f"bpe-{key}.json")
    with build_lock(path):  # one process trains, the others wait and load it
        if os.path.isfile(path):
            hf = HFTokenizer.from_file(path)
            verb = f"from cache {path}"
        else:
            start = time.perf_counter()
            hf = train_bpe(corpus, vocab_size, progress)
            with atomic_path(path) as tmp:  # a reader never sees half a file
                hf.save(str(tmp))
            verb = f"trained in {time.perf_counter() - start:.1f}s, saved to {path}"
    size = hf.get_vocab_size()
    if verbose:
        log.info("bpe tokenizer (%d tokens): %s", size, verb)
    if verbose and size < vocab_size:
        log.warning(
            "data.bpe_vocab_size=%d: the training split yields only %d tokens (the "
            "BPE ran out of pairs to merge); the tokenizer has %d",
            vocab_size,
            size,
            size,
        )
    # Named by its real size (the cache's line, data.json, the export's).
    tokenizer = _from_hf(hf, f"bpe-{size}", BPE_EOS, None)
    tokenizer.path = path
    return tokenizer


def train_bpe(corpus: Corpus, vocab_size: int, progress: bool = True) -> Any:
    """Train a byte-level BPE on bytes ``[0, split)`` of ``corpus`` (the training
    split), with ``<|endoftext|>`` as token 0."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    texts = (
        p.decode("utf-8", "ignore")
        for _, p in itertools.takewhile(lambda sp: sp[0] == 0, corpus.pieces())
        if p is not EOD
    )
    hf.train_from_iterator(texts, trainer)
    return hf


def load_tokenizer(
    cfg: Any, corpus: Corpus | None, verbose: bool = True, progress: bool = True
) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names (``cfg`` is the ``data`` node;
    ``corpus``: its corpus, which only ``bpe`` reads)."""
    name = cfg.tokenizer
    if name == "byte":
        return byte_tokenizer()
    if name == "bpe":
        return bpe_tokenizer(
            corpus, int(cfg.bpe_vocab_size), cache_path(cfg), verbose, progress
        )
    return load_path_tokenizer(str(name), cfg.eos_token)


def cache_path(cfg: Any) -> str:
    """``data.cache_dir``, expanded."""
    return os.path.abspath(os.path.expanduser(str(cfg.cache_dir)))


# ---------------------------------------------------------- Hugging Face export


def byte_level_hf() -> Any:
    """The byte tokenizer as a ``tokenizers.Tokenizer`` that gives the same ids: a
    byte-level BPE without merges whose vocabulary is the 256 bytes, each named by
    the printable character GPT-2's byte-level alphabet gives it, at the byte's id
    (byte 0, the end-of-document token, is the NUL character itself, a special
    token). It is written this way
    because transformers rebuilds some families' tokenizers (Qwen2) from the
    vocabulary and merges alone with its own byte-level pipeline: with no merges,
    that pipeline gives each UTF-8 byte its own id too (text in NFC, which those
    pipelines normalize to)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab[chr(BYTE_EOS)] = vocab.pop(bytes_to_unicode()[BYTE_EOS])
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    # NUL is matched on the raw text, before the byte-level mapping (which has no NUL).
    hf.add_special_tokens([AddedToken(chr(BYTE_EOS), special=True, normalized=False)])
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def special_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """``eos_token_id`` (what the tokenizer ends documents with), ``bos_token_id``
    and ``pad_token_id`` (the tokenizer's own, else None) for a model config."""
    hf = tokenizer.hf

    def id_of(token: str | None) -> int | None:
        return None if token is None or hf is None else hf.token_to_id(token)

    return {
        "eos_token_id": tokenizer.eos_id,
        "bos_token_id": id_of(tokenizer.bos_token),
        "pad_token_id": id_of(tokenizer.pad_token),
    }


def save_hf_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``, so
    that ``transformers.AutoTokenizer.from_pretrained(directory)`` encodes text to
    the same ids as the run (without special tokens, as the run encodes documents),
    with the run's end-of-document token as ``eos_token`` (and the tokenizer
    directory's own ``bos_token`` / ``pad_token``, if it has them) and the chat
    template of a run on conversations."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    # A copy: marking the special tokens must not change the run's own tokenizer.
    hf = (
        HFTokenizer.from_str(tokenizer.hf.to_str()) if tokenizer.hf else byte_level_hf()
    )
    specials = {
        "eos_token": hf.id_to_token(tokenizer.eos_id),
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
    }
    fast = PreTrainedTokenizerFast(
        tokenizer_object=hf, **{k: v for k, v in specials.items() if v is not None}
    )
    if tokenizer.chat_template:  # a run on conversations: apply_chat_template works
        fast.chat_template = tokenizer.chat_template[0]
    fast.save_pretrained(str(directory))
    # transformers fills an unnamed special token with its family's own (Qwen2:
    # <|endoftext|>, a token the run never had): written as null, none is added.
    path = os.path.join(directory, "tokenizer_config.json")
    config = read_json_object(path)
    for key in ("bos_token", "pad_token", "unk_token"):
        config.setdefault(key, None)
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)


#: The text an exported tokenizer is checked on (src.checkpoint.export).
PROBE_TEXT = "def main():\n    return 42  # héllo, wörld 😀\n"


def hf_tokenizer_mismatch(tokenizer: Tokenizer, directory: str | os.PathLike) -> str:
    """How ``AutoTokenizer.from_pretrained(directory)`` (the installed transformers)
    encodes :data:`PROBE_TEXT` unlike the run's ``tokenizer`` (or why it cannot open
    it), or "" when the ids are the same: transformers picks some families' tokenizer class from config.json
    whatever tokenizer_config.json says, with that family's own pre-tokenization."""
    from transformers import AutoTokenizer

    try:
        auto = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # e.g. a config.json whose class needs its own code
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"AutoTokenizer cannot open {directory} ({type(exc).__name__}: {first})"
    ours = tokenizer.encode_text(PROBE_TEXT)
    theirs = auto(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if theirs == ours:
        return ""
    return (
        f"AutoTokenizer opens {directory} as {type(auto).__name__}, which encodes "
        f"{PROBE_TEXT!r} to {len(theirs)} ids unlike the run's {len(ours)}"
    )
