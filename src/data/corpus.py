"""Local corpora: the documents of ``data.paths`` in ``text``, ``jsonl`` or ``parquet``
files, read as a stream so a corpus never has to fit in memory.

A corpus is a byte stream: every document's UTF-8 bytes followed by one end-of-document
mark. The validation split is the last ``val_fraction`` of that stream and
``max_bytes`` caps it, both counted in bytes, so the split is fixed before any
tokenizer exists (a BPE is trained on the training part only) and is the same for
every tokenizer. :meth:`Corpus.pieces` streams the pieces of both splits in one pass.

JSONL is read with the standard library's ``json``, line by line, so a bad line can be
reported by file and line number; Parquet with pyarrow, one record batch at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from src.data.chat import conversation_pieces, renderer, template_of
from src.errors import ConfigError, not_writable
from src.files import free_space, read_json, unwritable, write_json_atomic

#: JSONL conversations, rendered by ``data.chat_template`` with a loss mask
#: (``data=chat``, src/data/chat.py).
CHAT_FORMAT = "chat"
#: How a file holds its documents.
DATA_FORMATS = ("text", "jsonl", "parquet", CHAT_FORMAT)
#: ``data.format``: ``auto`` (the default) picks each file's format by its extension
#: (:data:`FORMAT_BY_EXTENSION`, else text); a format name reads every file in it.
FORMAT_CHOICES = ("auto", *DATA_FORMATS)
FORMAT_BY_EXTENSION = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}
STDLIB_PLACEHOLDER = "<stdlib>"
TEXT_CHUNK = 1 << 22  # bytes read at a time from a text file (cut after a newline)
PARQUET_BATCH = 1024  # rows per record batch
EOD = None  # the end-of-document mark in a stream of pieces


class CorpusError(ConfigError):
    """Bad data input, raised before any rank trains: ``str()`` is one line that starts
    with the key or the file (and line) at fault."""

    def __init__(self, message: str) -> None:
        key, _, rest = message.partition(": ")
        super().__init__(key, rest)


def resolve_files(paths: str | Sequence[str]) -> list[str]:
    """Expand ``data.paths`` (a glob or list of globs; ``<stdlib>`` is replaced by the
    standard library's directory) into a sorted, de-duplicated list of files."""
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise CorpusError("data.paths: empty list, give at least one glob")
    stdlib = sysconfig.get_paths()["stdlib"]
    files: set[str] = set()
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern).replace(STDLIB_PLACEHOLDER, stdlib))
        matched = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise CorpusError(f"data.paths: no files match {pattern!r}")
        files.update(os.path.abspath(p) for p in matched)
    return sorted(files)


def file_format(path: str, fmt: str = "auto") -> str:
    """How ``path`` holds its documents: ``fmt``, or with ``auto`` by its extension."""
    if fmt != "auto":
        return fmt
    return FORMAT_BY_EXTENSION.get(os.path.splitext(path)[1].lower(), "text")


@dataclass
class Corpus:
    """The documents of ``files``, each read in its format (``format``: one of
    :data:`FORMAT_CHOICES`; ``text_key`` names the JSONL field or Parquet column),
    split into train/val by bytes and capped at ``max_bytes``."""

    files: list[str]
    format: str = "auto"
    text_key: str = "text"
    val_fraction: float = 0.05
    max_bytes: int | None = None
    #: data=chat: (template, bos, eos): each line a conversation (src/data/chat.py)
    chat: tuple[str, str, str] | None = None
    _total: int | None = field(default=None, init=False, repr=False)
    _fingerprint: dict | None = field(default=None, init=False, repr=False)

    @property
    def formats(self) -> list[str]:
        """Each file's format, in the order of ``files``."""
        return [file_format(path, self.format) for path in self.files]

    def format_counts(self) -> dict[str, int]:
        """How many files of each format, e.g. ``{"text": 2, "jsonl": 1}``."""
        formats = self.formats
        return {f: formats.count(f) for f in DATA_FORMATS if f in formats}

    @classmethod
    def from_config(cls, cfg) -> Corpus:
        fmt = cfg.format
        if fmt not in FORMAT_CHOICES:
            raise CorpusError(
                f"data.format: got {fmt!r}, expected one of: {', '.join(FORMAT_CHOICES)}"
            )
        max_bytes = cfg.max_bytes
        if max_bytes is not None and max_bytes <= 0:
            raise CorpusError(f"data.max_bytes={max_bytes} must be positive or null")
        val_fraction = cfg.val_fraction
        if not 0.0 <= val_fraction < 1.0:
            raise CorpusError(
                f"data.val_fraction: got {val_fraction}, expected a fraction in "
                "[0, 1) (0: no validation split)"
            )
        chat = None  # conversations: the template they are rendered with
        if fmt == CHAT_FORMAT:
            chat = template_of(str(cfg.chat_template), str(cfg.tokenizer))[:3]
        return cls(
            files=resolve_files(cfg.paths),
            format=fmt,
            text_key=cfg.text_key,
            val_fraction=val_fraction,
            max_bytes=max_bytes,
            chat=chat,
        )

    def fingerprint(self, cache_dir: str | None = None) -> dict:
        """What identifies the corpus (a cache key, a run's record of its data): its
        settings and each file's path, size and SHA-256 of its contents
        (:func:`content_digests`, remembered in ``cache_dir``)."""
        if self._fingerprint is None:
            formats = self.formats
            self._fingerprint = {
                "formats": formats,
                "text_key": self.text_key if set(formats) != {"text"} else None,
                "val_fraction": self.val_fraction,
                "max_bytes": self.max_bytes,
                **({"chat": digest(self.chat)} if self.chat else {}),
                "files": content_digests(self.files, cache_dir),
            }
        return self._fingerprint

    def documents(self) -> Iterator[bytes | None]:
        """The corpus as pieces of UTF-8 bytes, each document followed by ``EOD``."""
        yield from self._documents(self.files, self.formats)

    def _documents(
        self, files: list[str], formats: list[str]
    ) -> Iterator[bytes | None]:
        reader = {
            "text": self._text,
            "jsonl": self._jsonl,
            "parquet": self._parquet,
            CHAT_FORMAT: self._conversations,
        }
        for path, fmt in zip(files, formats, strict=True):
            yield from reader[fmt](path)

    def _text(self, path: str) -> Iterator[bytes | None]:
        with open(path, "rb") as f:
            rest = b""
            while block := f.read(TEXT_CHUNK):
                block = rest + block
                cut = block.rfind(b"\n") + 1 or len(block)
                rest = block[cut:]
                yield block[:cut]
            if rest:
                yield rest
        yield EOD

    def _jsonl(self, path: str) -> Iterator[bytes | None]:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    row = json.loads(line)
                except ValueError as err:
                    raise CorpusError(f"{where}: not valid JSON ({err})") from None
                if not isinstance(row, dict) or self.text_key not in row:
                    raise CorpusError(
                        f"{where}: no {self.text_key!r} key (data.text_key)"
                    )
                text = row[self.text_key]
                if not isinstance(text, str):
                    raise CorpusError(
                        f"{where}: {self.text_key!r} is {type(text).__name__}, "
                        "expected a string"
                    )
                yield text.encode()
                yield EOD

    def _conversations(self, path: str) -> Iterator[bytes | None]:
        yield from conversation_pieces(path, self.text_key, renderer(*self.chat))

    def _parquet(self, path: str) -> Iterator[bytes | None]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as err:
            raise CorpusError(f"{path}: not a Parquet file ({err})") from None
        if self.text_key not in parquet.schema_arrow.names:
            raise CorpusError(
                f"{path}: no column {self.text_key!r} (data.text_key); columns: "
                f"{', '.join(parquet.schema_arrow.names)}"
            )
        row = 0
        for batch in parquet.iter_batches(
            batch_size=PARQUET_BATCH, columns=[self.text_key]
        ):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise CorpusError(
                        f"{path}: row {row}: {self.text_key!r} is "
                        f"{type(text).__name__}, expected a string"
                    )
                row += 1
                yield text.encode()
                yield EOD

    def num_bytes(self) -> int:
        """Length of the byte stream (documents + one mark each), after the cap.
        Counted once (text files by their size, other formats by reading them)."""
        if self._total is None:
            pairs = list(zip(self.files, self.formats, strict=True))
            text_files = [p for p, f in pairs if f == "text"]
            text = sum(os.path.getsize(p) for p in text_files)
            marks = len(text_files)
            others = [(p, f) for p, f in pairs if f != "text"]
            for piece in self._documents(
                [p for p, _ in others], [f for _, f in others]
            ):
                marks += piece is EOD
                text += 0 if piece is EOD else len(piece)
            if text == 0:
                raise CorpusError(
                    f"data.paths: the corpus is empty ({len(self.files)} file(s), "
                    f"{marks} document(s), no text)"
                )
            total = text + marks
            self._total = (
                total if self.max_bytes is None else min(total, self.max_bytes)
            )
        return self._total

    def split_at(self) -> int:
        """The byte where validation starts: the last ``val_fraction`` of the stream
        (the end of it for ``val_fraction=0``: no validation split)."""
        total = self.num_bytes()
        if self.val_fraction == 0:
            return total
        if total < 2:
            raise CorpusError(
                f"data.max_bytes: {total} byte(s), too few to split into train and "
                "validation"
            )
        return total - max(1, int(total * self.val_fraction))

    def pieces(self) -> Iterator[tuple[int, bytes | None]]:
        """The capped stream in one pass, as ``(split, piece)`` with split 0 (train)
        or 1 (validation); the piece that straddles the split is cut in two (of
        conversations, the one that straddles it stays whole in the training split).
        A cut keeps the piece's type (:class:`~src.data.chat.Trained`)."""
        cut, end = self.split_at(), self.num_bytes()
        pos, start = 0, 0  # start: where the current document began
        whole = self.chat is not None
        for piece in self.documents():
            if pos >= end:
                return
            split = int((start if whole else pos) >= cut)
            if piece is EOD:
                yield split, EOD
                pos += 1
                start = pos
                continue
            if len(piece) > end - pos:
                piece = type(piece)(piece[: end - pos])
            if not whole and pos < cut < pos + len(piece):
                yield 0, type(piece)(piece[: cut - pos])
                yield 1, type(piece)(piece[cut - pos :])
            else:
                yield split, piece
            pos += len(piece)


def digest(obj: object) -> str:
    """A short stable hash of a JSON-serialisable object (cache keys)."""
    blob = json.dumps(obj, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@contextlib.contextmanager
def build_lock(path: str) -> Iterator[None]:
    """An exclusive lock on ``<path>.lock``: of the processes that find an entry
    missing (the local ranks under torchrun, jobs of a sweep), one builds it and the
    others wait here, then find it built. A cache dir that cannot be written (a shared
    read-only cache lacking this entry), or whose disk fills while the block writes,
    is a one-line error naming data.cache_dir (and the space left)."""
    cache = os.path.dirname(path)
    problem = unwritable(cache)
    if problem is not None:
        raise not_writable("data.cache_dir", cache, "the token cache", problem)
    try:
        with open(f"{path}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        full = f"no space left on device ({free_space(cache)} free)"
        raise not_writable("data.cache_dir", cache, "the token cache", full) from None


#: In ``data.cache_dir``: each corpus file's SHA-256 with the ``stat`` it was read at
#: (:func:`content_digests`).
DIGESTS_FILE = "digests.json"


def _stat_key(st: os.stat_result) -> list[int]:
    # A write changes ctime, which no tool can set back (a rewrite keeping size and
    # mtime has a new one); a rename or a chmod changes it too: then it is re-read.
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def file_digest(path: str) -> str:
    """The SHA-256 of the file's contents (hex)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _memo(path: str) -> dict[str, list]:
    """The remembered digests in ``path`` (data: an entry of the wrong shape, or a
    file that is not strict JSON, is forgotten, never trusted)."""
    try:
        memo = read_json(path) if os.path.lexists(path) else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {
        k: v
        for k, v in memo.items()
        if isinstance(v, list)
        and len(v) == 6
        and all(type(x) is int for x in v[:5])
        and isinstance(v[5], str)
        and len(v[5]) == 64
    }


def content_digests(files: Sequence[str], cache_dir: str | None) -> list[list]:
    """``[path, size, sha256]`` of each file. A digest is computed once per version
    of a file (a full read, at about 1 GB/s) and remembered in ``cache_dir``'s
    :data:`DIGESTS_FILE` under the file's size, mtime, ctime and inode, so a start
    on an unchanged corpus reads none of it; a cache dir that cannot be written only
    remembers nothing."""
    memo_path = os.path.join(cache_dir, DIGESTS_FILE) if cache_dir else None
    memo = _memo(memo_path) if memo_path else {}
    out, new = [], {}
    for path in files:
        key = _stat_key(os.stat(path))
        known = memo.get(path)
        sha = known[5] if known and known[:5] == key else None
        if sha is None:
            sha = file_digest(path)
            if _stat_key(os.stat(path)) == key:  # not written while it was read
                new[path] = [*key, sha]
        out.append([path, key[0], sha])
    if new and memo_path and unwritable(cache_dir) is None:
        with build_lock(memo_path):  # merged with what other processes remembered
            write_json_atomic(memo_path, {**_memo(memo_path), **new})
    return out
