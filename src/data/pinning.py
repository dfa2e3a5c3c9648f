"""What a run trained on, pinned to its run dir.

At its start a training run records in ``<run dir>/data.json`` the fingerprint of its
corpus (:meth:`Corpus.fingerprint`: each file's path, size and SHA-256, the format,
split and cap) and the token cache entry it read, and keeps its tokenizer in
``<run dir>/tokenizer.json`` (a BPE trained on its corpus, or the file or directory
``data.tokenizer`` named; none for ``byte``), its SHA-256 in ``data.json``. Then:

- a resume reads the run's tokenizer file (a BPE is never trained again) and refuses,
  in one line naming the files, a corpus whose fingerprint differs
  (:func:`data_changes`);
- sample.py and eval.py read the run's tokenizer file, and need no corpus for it;
  eval.py on the run's own data config whose files changed since scores them, says
  so, and records that the score is not on the data the run trained on.

A run dir written before this has no pin: it behaves as before (the tokenizer from
``data.tokenizer``).
"""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from src.files import atomic_path, read_json_object, write_json_atomic

#: In the run dir: what the run's tokens were made from.
DATA_RECORD = "data.json"
#: In the run dir: the tokenizer the run trained with (a ``tokenizers`` JSON).
RUN_TOKENIZER = "tokenizer.json"
_SHOWN = 3  # files named in a refusal; the rest are counted


@dataclass(frozen=True)
class DataPin:
    """A run's pinned data: its corpus fingerprint, its tokenizer file (None: the
    byte tokenizer) and that tokenizer's end-of-document token."""

    corpus: dict
    tokenizer_file: str | None
    eos_token: str | None


@dataclass(frozen=True)
class DataRecord:
    """What a run records of its data (``data.json``'s fields) and the tokenizer it
    keeps (its ``tokenizers`` JSON; None for ``byte``): made by ``prepare_data``,
    written by :meth:`write` only once the run is admitted (its lock held, every
    check before its ranks passed), so a refused command leaves no trace."""

    fields: dict
    tokenizer_text: str | None

    def write(self, run_dir: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` (if any), then ``data.json``, into ``run_dir``."""
        if self.tokenizer_text is not None:
            with atomic_path(os.path.join(run_dir, RUN_TOKENIZER)) as tmp:
                tmp.write_text(self.tokenizer_text)
        write_json_atomic(os.path.join(run_dir, DATA_RECORD), self.fields)


def data_record(fields: dict, tokenizer: Any, corpus: dict) -> DataRecord:
    """The run's :class:`DataRecord`: ``fields`` with the pin (``tokenizer``: the
    :class:`~src.data.tokenizer.Tokenizer` its tokens were made with; ``corpus``:
    the corpus fingerprint)."""
    fields = {**fields, "corpus": corpus, "tokenizer_sha256": None, "eos_token": None}
    text = None
    if tokenizer.hf is not None:
        text = tokenizer.hf.to_str()
        fields["tokenizer_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        fields["eos_token"] = tokenizer.hf.id_to_token(tokenizer.eos_id)
    return DataRecord(fields, text)


def read_pin(run_dir: str | os.PathLike) -> DataPin | None:
    """The pin of the run in ``run_dir`` (None: no ``data.json``, or one written
    before pins). Read as data: a damaged record, or a tokenizer file that is not
    the one recorded, is a ``ValueError`` naming the file."""
    path = os.path.join(run_dir, DATA_RECORD)
    if not os.path.lexists(path):
        return None
    where = path
    try:
        record = read_json_object(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where} is damaged ({exc})") from None
    if "corpus" not in record:
        return None  # a run from before pins
    corpus, sha = record.get("corpus"), record.get("tokenizer_sha256")
    eos = record.get("eos_token")
    files = corpus.get("files") if isinstance(corpus, dict) else None
    if not isinstance(files, list) or not all(_is_file_entry(f) for f in files):
        raise ValueError(f"{where} is damaged (its corpus fingerprint)")
    if not isinstance(sha, str | None) or not isinstance(eos, str | None):
        raise ValueError(f"{where} is damaged (its tokenizer fields)")
    if sha is None:
        return DataPin(corpus, None, None)
    file = os.path.join(run_dir, RUN_TOKENIZER)
    try:
        if not os.path.isfile(file) or os.path.islink(file):
            raise OSError("missing or not a regular file")
        with open(file, "rb") as f:
            have = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise ValueError(
            f"{file}, the run's tokenizer, is unreadable ({exc})"
        ) from None
    if have != sha:
        raise ValueError(
            f"{file} is not the tokenizer the run trained with "
            f"(SHA-256 {have[:12]}..., {DATA_RECORD} records {sha[:12]}...)"
        )
    return DataPin(corpus, file, eos)


def _is_file_entry(entry: Any) -> bool:
    return (
        isinstance(entry, list)
        and len(entry) == 3
        and isinstance(entry[0], str)
        and type(entry[1]) is int
        and isinstance(entry[2], str)
    )


def pinned_data(data_cfg: DictConfig, pin: DataPin | None) -> DictConfig:
    """``data_cfg`` reading the run's own tokenizer file (a BPE is never trained
    again, and needs no corpus); as it is without a pin or for the byte tokenizer."""
    if pin is None or pin.tokenizer_file is None:
        return data_cfg
    data_cfg = copy.deepcopy(data_cfg)
    data_cfg.tokenizer = pin.tokenizer_file
    data_cfg.eos_token = pin.eos_token
    return data_cfg


def data_changes(pinned: dict, current: dict) -> str | None:
    """How the corpus fingerprint ``current`` differs from the run's ``pinned`` one,
    in a few words naming the files (None: the same data)."""
    if pinned == current:
        return None
    old = {f[0]: f for f in pinned.get("files", [])}
    new = {f[0]: f for f in current.get("files", [])}
    parts = [
        f"{p} (its contents changed)" for p in new if p in old and new[p] != old[p]
    ]
    parts += [f"{p} (added)" for p in new if p not in old]
    parts += [f"{p} (removed)" for p in old if p not in new]
    if not parts:  # the same files: a setting of their reading
        keys = [k for k in current if k != "files" and current[k] != pinned.get(k)]
        return f"the files are read otherwise ({', '.join(keys) or 'fingerprint'})"
    more = len(parts) - _SHOWN
    return ", ".join(parts[:_SHOWN]) + (f" and {more} more" if more > 0 else "")
