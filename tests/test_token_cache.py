"""Sources (text, jsonl, parquet), tokenizers (byte, bpe, a tokenizer.json or directory),
the token cache (reuse, invalidation, one builder) and bad input, on files made here."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from src.config.cli import CONFIG_ERRORS, one_line
from src.config.run_plan import resolve
from src.config.validate import validate
from src.data.sources import follow_tokenizer_vocab, load_splits, prepare_data
from src.data.tokenizer import BPE_EOS, load_path_tokenizer
from src.harness import compose_config
from tests.commands import in_process

CONF = Path(__file__).resolve().parents[1] / "conf"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
# Twelve documents of different lengths; the last one (in val) has a word of its own.
DOCS = [" ".join(WORDS[(i + j) % 12] for j in range(40 + 7 * i)) for i in range(11)]
DOCS.append("omicronomicron " * 30)


def cfg_for(tmp_path: Path, *overrides: str):
    """``data=files`` on ``tmp_path``'s corpus, cached in ``tmp_path/cache``."""
    cfg = compose_config(
        "data=files",
        f"data.cache_dir={tmp_path}/cache",
        "data.val_fraction=0.1",
        *overrides,
    )
    validate(cfg)
    return cfg


def write_corpus(tmp_path: Path, fmt: str, docs=DOCS) -> str:
    """``docs`` as text files (one each), one JSONL file or one Parquet file."""
    root = tmp_path / fmt
    root.mkdir()
    if fmt == "text":
        for i, doc in enumerate(docs):
            (root / f"{i:03d}.txt").write_text(doc)
        return f"data.paths={root}/*.txt"
    if fmt == "jsonl":
        lines = [json.dumps({"id": i, "text": d}) for i, d in enumerate(docs)]
        (root / "a.jsonl").write_text("\n".join(lines) + "\n")
        return f"data.paths={root}/*.jsonl"
    pq.write_table(pa.table({"text": docs}), root / "a.parquet", row_group_size=5)
    return f"data.paths={root}/*.parquet"


def stream(cfg) -> np.ndarray:
    train, val = load_splits(cfg.data, 1 << 20, seed=0)
    return np.concatenate([train.tokens, val.tokens]).astype(np.int64)


@pytest.mark.parametrize("fmt", ["text", "jsonl", "parquet"])
def test_each_format_gives_the_same_byte_stream(tmp_path, fmt):
    cfg = cfg_for(tmp_path, write_corpus(tmp_path, fmt), f"data.format={fmt}")
    expected = b"".join(d.encode() + b"\0" for d in DOCS)
    assert stream(cfg).astype(np.uint8).tobytes() == expected


def test_bpe_is_trained_on_train_split_and_cached(tmp_path, capsys):
    cfg = cfg_for(
        tmp_path,
        write_corpus(tmp_path, "jsonl"),
        "data.format=jsonl",
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=300",
    )
    meta = prepare_data(cfg.data)
    assert "token cache: built" in capsys.readouterr().out
    (bpe,) = (tmp_path / "cache").glob("bpe-*.json")
    tok = load_path_tokenizer(str(bpe))
    assert tok.eos_id == tok.hf.token_to_id(BPE_EOS) == 0
    assert meta["vocab_size"] == tok.vocab_size == 300
    assert meta["dtype"] == "uint16"
    ids = stream(cfg)
    docs = np.split(ids, np.flatnonzero(ids == tok.eos_id) + 1)[:-1]
    assert [tok.hf.decode(d[:-1].tolist()) for d in docs] == DOCS
    # Merges come from the training split: its words are single tokens, the val
    # document's word (last 10% of the bytes) is not in the vocabulary.
    assert tok.hf.token_to_id("Ġgamma") is not None
    assert tok.hf.token_to_id("omicron") is None

    prepare_data(cfg.data)
    out = capsys.readouterr().out
    assert "bpe tokenizer (300 tokens): from cache" in out
    assert "token cache: reusing" in out


def test_tokenizer_json_and_hf_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *WORDS, "omicronomicron"])}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    directory = tmp_path / "hf_dir"
    PreTrainedTokenizerFast(tokenizer_object=hf, eos_token="</s>").save_pretrained(
        directory
    )
    corpus = write_corpus(tmp_path, "text")
    # The val split starts mid-document (the last 10% of the bytes): each side of the
    # cut is tokenized on its own, so the cut word is two unknown halves.
    data = b"".join(d.encode() + b"\0" for d in DOCS)
    cut = len(data) - int(len(data) * 0.1)
    expected = [
        [vocab.get(w, 0) for w in piece.split()] + [1] * end
        for part in (data[:cut], data[cut:])
        for *pieces, last in [part.decode().split("\0")]
        for piece, end in [*((p, 1) for p in pieces), (last, 0)]
    ]
    expected = np.concatenate(expected)
    for path in (tmp_path / "tokenizer.json", directory):
        cfg = cfg_for(tmp_path, corpus, f"data.tokenizer={path}")
        assert np.array_equal(stream(cfg), expected)
    # An explicit eos_token wins over the directory's.
    cfg = cfg_for(tmp_path, corpus, f"data.tokenizer={directory}", "data.eos_token=mu")
    assert stream(cfg)[len(DOCS[0].split())] == vocab["mu"]


def test_a_tokenizer_that_needs_its_own_code_is_refused_never_run(tmp_path):
    """A tokenizer directory whose tokenizer_config.json maps AutoTokenizer to code of
    its own (auto_map) is refused in one line naming data.tokenizer; its code never
    runs, and no prompt asks whether to run it."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["my_tok.MyTok", None]}})
    )
    (tmp_path / "my_tok.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('')\n"
    )
    with pytest.raises(CONFIG_ERRORS) as err:
        load_path_tokenizer(str(tmp_path))
    assert one_line(err.value).startswith(
        f"data.tokenizer: {str(tmp_path)!r} needs its own Python code (auto_map"
    )
    assert not (tmp_path / "RAN").exists()


def test_cache_reused_and_rebuilt_on_any_change(tmp_path, capsys):
    paths = write_corpus(tmp_path, "text")
    cfg = cfg_for(tmp_path, paths)
    first = prepare_data(cfg.data)
    assert prepare_data(cfg.data) == first
    assert capsys.readouterr().out.count("token cache: reusing") == 1
    entries = lambda: sorted((tmp_path / "cache").glob("tokens-*[!k]"))  # noqa: E731
    assert len(entries()) == 1
    # Any change of settings, tokenizer or corpus is a new entry.
    prepare_data(cfg_for(tmp_path, paths, "data.val_fraction=0.2").data)
    prepare_data(cfg_for(tmp_path, paths, "data.max_bytes=500").data)
    bpe = cfg_for(tmp_path, paths, "data.tokenizer=bpe", "data.bpe_vocab_size=280")
    prepare_data(bpe.data)
    (tmp_path / "text" / "000.txt").write_text("changed " * 20)
    changed = prepare_data(cfg.data)
    assert capsys.readouterr().out.count("token cache: built") == 4
    assert len(entries()) == 5
    assert changed["bytes"] != first["bytes"]
    assert stream(cfg)[:8].astype(np.uint8).tobytes() == b"changed "


def test_concurrent_builders_build_once(tmp_path, capsys):
    cfg = cfg_for(tmp_path, write_corpus(tmp_path, "text"))
    metas = []
    threads = [
        threading.Thread(target=lambda: metas.append(prepare_data(cfg.data)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = capsys.readouterr().out
    assert out.count("token cache: built") == 1
    assert out.count("token cache: reusing") == 2
    assert metas[0] == metas[1] == metas[2]


def _error(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(CONFIG_ERRORS) as info:
        prepare_data(cfg_for(tmp_path, *overrides).data)
    message = one_line(info.value)
    assert "\n" not in message
    return message


def test_bad_inputs_fail_in_one_line(tmp_path):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n\n{"body": "no text key"}\n')
    assert _error(tmp_path, f"data.paths={jsonl}", "data.format=jsonl") == (
        f"{jsonl}:3: no 'text' key (data.text_key)"
    )
    parquet = write_corpus(tmp_path, "parquet")
    assert "no column 'body' (data.text_key); columns: text" in _error(
        tmp_path, parquet, "data.format=parquet", "data.text_key=body"
    )
    assert _error(tmp_path, f"data.paths={tmp_path}/none/*.txt").startswith(
        "data.paths: no files match"
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    assert _error(tmp_path, f"data.paths={tmp_path}/empty/*.txt") == (
        "data.paths: the corpus is empty (1 file(s), 1 document(s), no text)"
    )
    corpus = write_corpus(tmp_path, "text")
    not_a_tokenizer = tmp_path / "notes.json"
    not_a_tokenizer.write_text('{"hello": 1}')
    assert _error(tmp_path, corpus, f"data.tokenizer={not_a_tokenizer}").startswith(
        f"data.tokenizer: '{not_a_tokenizer}' is not a tokenizer"
    )
    assert "(no such path)" in _error(tmp_path, corpus, "data.tokenizer=nope.json")
    assert _error(tmp_path, corpus, "data.tokenizer=bpe", "data.bpe_vocab_size=100")
    with pytest.raises(CONFIG_ERRORS) as info:
        cfg_for(tmp_path)  # data=files without data.paths
    assert one_line(info.value).startswith("data.paths: required with data=files")


@pytest.mark.parametrize("model", ["small", "llama_tiny"])
def test_vocab_follows_tokenizer_unless_user_set(tmp_path, capsys, model):
    cfg = cfg_for(tmp_path, "data=text", "data.tokenizer=bpe", f"model={model}")
    follow_tokenizer_vocab(
        cfg, *_model(resolve(cfg)), {"vocab_size": 1000}, user_keys=set()
    )
    assert cfg.model.vocab_size == 1024  # padded to a multiple of 64
    assert (
        "model.vocab_size=1024: follows data.tokenizer=bpe" in capsys.readouterr().out
    )
    cfg.model.vocab_size = 999
    with pytest.raises(CONFIG_ERRORS) as info:
        follow_tokenizer_vocab(
            cfg, *_model(resolve(cfg)), {"vocab_size": 1000}, {"model.vocab_size"}
        )
    assert one_line(info.value) == (
        "model.vocab_size: vocabulary of 999 is smaller than data.tokenizer=bpe's "
        "(1000 ids, up to 999); drop the override or set it >= 1000"
    )
    follow_tokenizer_vocab(
        cfg, *_model(resolve(cfg)), {"vocab_size": 900}, {"model.vocab_size"}
    )
    assert cfg.model.vocab_size == 999  # the user's value stands
    # Loaded weights fix the vocabulary, whoever set it.
    cfg.model.pretrained = str(tmp_path)
    follow_tokenizer_vocab(
        cfg, *_model(resolve(cfg)), {"vocab_size": 900}, user_keys=set()
    )
    assert cfg.model.vocab_size == 999
    with pytest.raises(CONFIG_ERRORS) as info:
        follow_tokenizer_vocab(
            cfg, *_model(resolve(cfg)), {"vocab_size": 1000}, user_keys=set()
        )
    assert one_line(info.value).startswith("model.pretrained: vocabulary of 999 is")


def test_train_py_stops_on_bad_data_before_any_rank(tmp_path, monkeypatch, capsys):
    """train.py in-process up to its refusal (tests/commands.py: it fails if the
    command would reach its launch)."""
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    run_dir = tmp_path / "run"
    code, _, err = in_process(
        monkeypatch, capsys, "train.py", "data=files", f"data.paths={jsonl}",
        "data.format=jsonl", "logger=none", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert code == 2
    assert err.strip() == f"config error: {jsonl}:2: no 'text' key (data.text_key)"
    assert not (run_dir / "ranks").exists() and not (run_dir / "metrics.jsonl").exists()


def test_mixed_formats_are_read_by_extension_and_the_run_records_them(tmp_path, capsys):
    """A glob over .txt, .jsonl and .parquet files: with data.format=auto (the default)
    each file is read in its format, the "data ready" line counts the files of each,
    and the run dir's data.json records them and the tokenizer file; a format name
    still reads every file in it (the JSONL then as raw text)."""
    root = tmp_path / "mixed"
    root.mkdir()
    (root / "a.txt").write_text(DOCS[0])
    lines = [json.dumps({"text": d}) for d in DOCS[1:3]]
    (root / "b.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": DOCS[3:5]}), root / "c.parquet")
    cfg = cfg_for(tmp_path, f"data.paths={root}/*")
    assert cfg.data.format == "auto"
    expected = b"".join(d.encode() + b"\0" for d in DOCS[:5])
    assert stream(cfg).astype(np.uint8).tobytes() == expected

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    capsys.readouterr()
    prepare_data(cfg.data, record=True)["record"].write(run_dir)
    out = capsys.readouterr().out
    assert "data ready in " in out
    assert "s: 3 file(s): 1 text, 1 jsonl, 1 parquet" in out
    record = json.loads((run_dir / "data.json").read_text())
    assert record["files"] == {"text": 1, "jsonl": 1, "parquet": 1}
    assert record["tokenizer"] == "byte" and record["tokenizer_file"] is None

    bpe = cfg_for(
        tmp_path,
        f"data.paths={root}/*",
        "data.tokenizer=bpe",
        "data.bpe_vocab_size=300",
    )
    prepare_data(bpe.data, record=True)["record"].write(run_dir)
    record = json.loads((run_dir / "data.json").read_text())
    (trained,) = (tmp_path / "cache").glob("bpe-*.json")
    assert record["tokenizer_file"] == str(trained)

    forced = cfg_for(tmp_path, f"data.paths={root}/*.jsonl", "data.format=text")
    raw = stream(forced).astype(np.uint8).tobytes()
    assert raw == (root / "b.jsonl").read_bytes() + b"\0"


def test_the_cache_is_keyed_by_file_contents(tmp_path, capsys):
    """A rewrite that keeps a file's size and mtime builds a new entry (the stale
    one was reused when the key held mtimes); a touch reuses the entry; the
    remembered digests are data (a damaged file of them is read as none); the byte
    tokenizer of a run needs no corpus."""
    import os

    from src.data.corpus import DIGESTS_FILE
    from src.data.sources import tokenizer_of

    paths = write_corpus(tmp_path, "text")
    cfg = cfg_for(tmp_path, paths)
    first = prepare_data(cfg.data)
    target = tmp_path / "text" / "011.txt"  # in the val split
    st = os.stat(target)
    text = target.read_text()
    target.write_text(text.replace("omicron", "OMICRON"))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(target).st_size == st.st_size
    rewritten = prepare_data(cfg.data)
    assert rewritten["token_cache"] != first["token_cache"]
    assert capsys.readouterr().out.count("token cache: built") == 2
    val = load_splits(cfg.data, 1 << 20, seed=0)[1].tokens
    assert b"OMICRON" in np.asarray(val).astype(np.uint8).tobytes()

    os.utime(tmp_path / "text" / "000.txt")  # a new mtime, the same contents
    (tmp_path / "cache" / DIGESTS_FILE).write_text("{not json")
    assert prepare_data(cfg.data)["token_cache"] == rewritten["token_cache"]
    assert capsys.readouterr().out.count("token cache: reusing") == 1
    assert len(json.loads((tmp_path / "cache" / DIGESTS_FILE).read_text())) == 12

    gone = cfg_for(tmp_path, f"data.paths={tmp_path}/none/*.txt")
    assert tokenizer_of(gone.data).name == "byte"


def test_a_full_cache_disk_is_one_line_with_the_path_and_free_space(tmp_path):
    """Issue 48 item 6: a cache write that meets a full disk (ENOSPC, as the token
    entry, a BPE or the digests are written under their build lock) is one line
    naming data.cache_dir, the cache dir and its free space (it was [Errno 28]
    without a path)."""
    import errno

    from src.data.corpus import build_lock
    from src.errors import ConfigError

    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as err:
        with build_lock(str(cache / "tokens-0123")):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(err.value).startswith(
        f"data.cache_dir: the token cache writes to {cache}: no space left on device ("
    )
    assert str(err.value).endswith(
        " MiB free); set data.cache_dir to a writable directory"
    )
    with pytest.raises(OSError):  # any other failure is its own
        with build_lock(str(cache / "tokens-0123")):
            raise OSError(errno.EIO, "I/O error")


def _model(plan):
    """A run plan's model: its spec and config."""
    return plan.spec, plan.model_config
