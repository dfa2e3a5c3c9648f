"""Every file the project reads is data: a few dozen mutations per format (cut,
flipped bytes, wrong types, forged pickles whose payload would create a marker file,
path traversal), each read as the project reads it, in this process. Each must end in
the module's own one-line error (never another exception), never run the payload, and
never pass as intact. docs/reliability.md reports the counts."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from src.checkpoint.damage import CheckpointError
from src.checkpoint.dcp import Checkpointer
from src.checkpoint.folders import resolve_resume
from src.checkpoint.meta import read_checkpoint_meta
from src.checkpoint.values import checked_extra
from tests import forge
from tests.distributed import HANG_S
from tests.records import said

# ------------------------------------------------------------------ checkpoints


def _model() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    model, optimizer, scheduler = _model()
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    root = tmp_path_factory.mktemp("good")
    return Checkpointer(root).save(1, model, optimizer, scheduler, {"max_steps": 4})


FILES = [".metadata", "__0_0.distcp", "rng/rank_00000.safetensors", "meta.json"]


def checkpoint_cases(marker: Path) -> dict[str, tuple[str, object]]:
    """name -> (kind, mutation of a checkpoint dir). ``damaged``: bytes changed as a
    crash or a disk would (verify must say why); ``forged``: changed and resealed
    (every checksum recomputed), so loading itself must refuse, whether or not
    verify ran; ``load``: resealed JSON values of the wrong kind for this run's
    optimizer or scheduler, or a tensor's bytes that are not a tensor (refused by
    ``load``)."""
    cases: dict[str, tuple[str, object]] = {}
    for file in FILES:
        for how, mutate in forge.RAW.items():
            cases[f"{file}: {how}"] = (
                "damaged",
                lambda ckpt, f=file, m=mutate: m(ckpt / f),
            )
    cases["COMPLETE: flipped"] = ("damaged", lambda c: forge.flip(0.5)(c / "COMPLETE"))
    cases["COMPLETE: junk"] = ("damaged", lambda c: (c / "COMPLETE").write_text("x"))
    cases["a file no checksum covers"] = (
        "damaged",
        lambda c: (c / "evil.py").write_text("import os"),
    )

    def link(ckpt: Path, target: str) -> None:
        rng = ckpt / "rng" / "rank_00000.safetensors"
        rng.unlink()
        rng.symlink_to(target)

    cases["rng file -> /dev/zero"] = ("damaged", lambda c: link(c, "/dev/zero"))
    cases["rng file -> /etc/hostname"] = ("damaged", lambda c: link(c, "/etc/hostname"))

    def meta_field(key, value):
        return forge.edit_meta(lambda m: m.__setitem__(key, value))

    for key, value in [
        ("step", -5),
        ("step", "2; rm -rf /"),
        ("step", True),
        ("step", 7),  # not the directory's
        ("step", 1.0),
        ("world_size", 0),
        ("world_size", "2"),
        ("format_version", 1),
        ("format_version", 99),
        ("scheduler", "x"),
        ("model_objects", []),
        ("extra", None),
        ("extra", {"max_steps": 4, "step": -5}),  # load's {"step": ..., **extra}
        ("checksums", {}),
        ("checksums", []),
    ]:
        cases[f"meta.json: {key}={value!r}"] = ("forged", meta_field(key, value))
    for what, entry in [
        ("/dev/zero", "/dev/zero"),
        ("traversal", "../../../../etc/hostname"),
        ("dot", "./.metadata"),
        ("backslash", "rng\\..\\..\\x"),
    ]:
        cases[f"meta.json: checksum entry {what}"] = (
            "forged",
            forge.edit_meta(
                lambda m, e=entry: m["checksums"].__setitem__(
                    e, {"bytes": 1, "crc32": "00000000"}
                )
            ),
        )
    cases["meta.json: bytes=-1"] = (
        "forged",
        forge.edit_meta(lambda m: m["checksums"][".metadata"].__setitem__("bytes", -1)),
    )
    cases["meta.json: crc32 not hex"] = (
        "forged",
        forge.edit_meta(
            lambda m: m["checksums"][".metadata"].__setitem__("crc32", "zz")
        ),
    )
    cases["meta.json: a list"] = ("forged", forge.edit_meta(lambda m: [m]))
    cases["meta.json: a list nested 900 deep"] = (
        "forged",
        lambda c: forge.write_meta(c, json.loads("[" * 900 + "]" * 900)),
    )
    cases["meta.json: deeper than the parser"] = (
        "forged",
        lambda c: _write_sealed(c, "[" * 100000 + "]" * 100000),
    )
    cases["meta.json: a section nested 900 deep"] = (
        "forged",
        forge.edit_meta(
            lambda m: m["extra"].__setitem__("x", json.loads("[" * 900 + "]" * 900))
        ),
    )
    cases["meta.json: a tuple tag holding a number"] = (
        "forged",
        forge.edit_meta(
            lambda m: m["scheduler"].__setitem__("base_lrs", {"__tuple__": 1})
        ),
    )
    cases["meta.json: NaN"] = ("forged", lambda c: _write_sealed(c, '{"step": NaN}'))
    cases["meta.json: invalid UTF-8"] = ("forged", lambda c: _write_sealed(c, b"\xff{"))

    def optim(key_end: str, value):
        def change(m):
            key = next(k for k in m["optim_objects"] if k.endswith(key_end))
            m["optim_objects"][key] = value

        return forge.edit_meta(change)

    cases["optim lr a string"] = ("load", optim(".lr", "x"))
    cases["optim lr 1e400 (inf)"] = (
        "forged",
        lambda c: _write_sealed(
            c, (c / "meta.json").read_text().replace('lr": 0.01', 'lr": 1e400')
        ),
    )
    cases["optim betas of 3"] = ("load", optim(".betas", {"__tuple__": [1, 2, 3]}))
    cases["optim amsgrad a list"] = ("load", optim(".amsgrad", [True]))
    cases["optim key added"] = (
        "load",
        forge.edit_meta(lambda m: m["optim_objects"].__setitem__("evil", 1)),
    )
    cases["optim key dropped"] = (
        "load",
        forge.edit_meta(lambda m: [m["optim_objects"].popitem(), m][1]),
    )
    cases["rng: numpy's state of another generator"] = (
        "load",
        forge.rng_scalar("numpy_name", "PCG64"),
    )
    cases["rng: Python's state of another version"] = (
        "load",
        forge.rng_scalar("python_version", 2),
    )
    cases["scheduler last_epoch a string"] = (
        "load",
        forge.edit_meta(lambda m: m["scheduler"].__setitem__("last_epoch", "x")),
    )
    cases["scheduler base_lrs longer"] = (
        "load",
        forge.edit_meta(lambda m: m["scheduler"]["base_lrs"].append(1.0)),
    )

    touch = f"touch {marker}"
    for module, name in [
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.planner", "torch.serialization.os.system"),
        ("torch.distributed.checkpoint.metadata", "torch.serialization.os.system"),
        ("os", "system"),
        ("builtins", "exec"),
        ("torch", "serialization.os.system"),
        ("pathlib", "os.system"),
        ("collections", "os.system"),
    ]:
        cases[f"index pickle: {module} + {name}"] = (
            "forged",
            forge.index_bytes(
                lambda c, m=module, n=name: forge.global_call(m, n, touch)
            ),
        )
    cases["index pickle: a __reduce__ payload"] = (
        "forged",
        forge.index_bytes(lambda c: pickle.dumps(forge.Payload(marker))),
    )
    cases["index pickle: BUILD sets an attribute of an allowed class"] = (
        "forged",
        forge.index_bytes(lambda c: forge.build_on_class(*CLASS_ATTRIBUTE)),
    )
    cases["index: a bytes entry (torch.load, weights_only=False)"] = (
        "forged",
        forge.bytes_entry(marker),
    )
    cases["shard: a tensor's bytes are a pickle"] = (
        "load",
        forge.shard_payload(marker),
    )
    cases["index: a dict, not Metadata"] = (
        "forged",
        forge.edit_index(lambda md, c: {"state_dict_metadata": {}}),
    )
    cases["index: file ../../etc/hostname"] = (
        "forged",
        forge.storage(relative_path="../../../../etc/hostname"),
    )
    cases["index: file /dev/zero"] = (
        "forged",
        forge.storage(relative_path="/dev/zero"),
    )
    cases["index: file meta.json"] = (
        "forged",
        forge.storage(relative_path="meta.json"),
    )
    cases["index: offset past the file"] = ("forged", forge.storage(offset=1 << 40))
    cases["index: negative length"] = ("forged", forge.storage(length=-1))
    cases["index: a stream transform"] = (
        "forged",
        forge.storage(transform_descriptors=["zstd"]),
    )
    cases["index: a chunk outside its tensor"] = (
        "forged",
        forge.edit_index(forge.chunk_outside),
    )
    cases["index: chunks leaving a gap"] = (
        "forged",
        forge.edit_index(forge.chunks_gap),
    )
    cases["index: a tensor with no chunks"] = (
        "forged",
        forge.edit_index(forge.chunks_none),
    )
    # Work bombs: a few bytes that cost 2**60 steps to show, hash or compare, or
    # declare a value of 32 TiB; each refused in bounded time and memory.
    for name, data in [
        ("a dict key sharing itself 60 levels down", forge.shared_tuple_key),
        ("BUILD on a list sharing itself", forge.build_on_self_sharing),
        ("BINBYTES8 of 32 TiB", lambda: forge.huge_length(b"\x8e")),
        ("BINUNICODE8 of 32 TiB", lambda: forge.huge_length(b"\x8d")),
        ("BYTEARRAY8 of 32 TiB", lambda: forge.huge_length(b"\x96")),
        ("an out-of-band buffer", lambda: b"\x80\x05\x97."),
        ("a 20 MiB line (protocol 0)", lambda: b"S'" + b"a" * (20 << 20)),
        ("a list nested 200,000 deep", lambda: b"]" * 200000 + b"a" * 199999 + b"."),
    ]:
        cases[f"index pickle: {name}"] = (
            "forged",
            forge.index_bytes(lambda c, d=data: d()),
        )

    def first_storage(**fields):
        def change(md, ckpt):
            key = next(iter(md.storage_data))
            for f, v in fields.items():
                setattr(md.storage_data[key], f, v)

        return forge.edit_index(change)

    shared = forge.self_sharing
    for name, change in [
        ("planner_data", lambda md, c: setattr(md, "planner_data", shared())),
        ("storage_meta", lambda md, c: setattr(md, "storage_meta", shared())),
        (
            "a chunk",
            lambda md, c: next(
                iter(md.state_dict_metadata.values())
            ).chunks.__setitem__(0, shared()),
        ),
    ]:
        cases[f"index: {name} a list sharing itself 60 levels down"] = (
            "forged",
            forge.edit_index(change),
        )
    cases["index: a file name that is a list (unhashable)"] = (
        "forged",
        first_storage(relative_path=["__0_0.distcp"]),
    )
    cases["index: transforms sharing themselves"] = (
        "forged",
        first_storage(transform_descriptors=shared()),
    )
    cases["index: more chunks than ranks (one per column)"] = (
        "forged",
        forge.edit_index(forge.many_chunks),
    )
    cases["meta.json: a sparse file of 1 GiB"] = (
        "damaged",
        lambda c: os.truncate(c / "meta.json", 1 << 30),
    )
    cases["index: an extra tensor"] = (
        "forged",
        forge.edit_index(
            lambda md, c: md.state_dict_metadata.__setitem__(
                "model.evil", next(iter(md.state_dict_metadata.values()))
            )
        ),
    )
    return cases


#: What the BUILD case would set: (module, class, attribute); never set.
CLASS_ATTRIBUTE = ("torch.distributed.checkpoint.metadata", "Metadata", "forged")


def _write_sealed(ckpt: Path, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    (ckpt / "meta.json").write_bytes(data)

    (ckpt / "COMPLETE").write_text(f"meta.json crc32 {zlib.crc32(data):08x}\n")


def _refused(call) -> str:
    """The one-line CheckpointError ``call`` must raise."""
    with pytest.raises(CheckpointError) as err:
        call()
    line = str(err.value)
    assert "\n" not in line, line
    return line


def _check_refused(ckpt: Path, name: str, kind: str) -> None:
    checkpointer = Checkpointer(ckpt.parent)
    model, optimizer, scheduler = _model()
    if kind == "load":  # intact files, values this run's state cannot take
        _refused(lambda: checkpointer.load(ckpt, model, optimizer, scheduler, False))
        return
    reason = checkpointer.verify(ckpt)
    assert reason is not None and "\n" not in reason, (name, reason)
    line = _refused(lambda: resolve_resume("auto", ckpt.parent, checkpointer.verify))
    assert line.startswith("no usable checkpoint"), (name, line)
    _refused(lambda: checkpointer.load(ckpt, model, optimizer, scheduler))
    _refused(lambda: checkpointer.load_model(ckpt, model))
    if kind == "forged" and "checksum entry" not in name:
        _refused(lambda: checkpointer.load(ckpt, model, optimizer, scheduler, False))
        _refused(lambda: checkpointer.load_model(ckpt, model, verify=False))
    if name.startswith("meta.json: "):
        _refused(lambda: read_checkpoint_meta(ckpt))


def test_fuzz_checkpoints(checkpoint, tmp_path):
    """Each case: ``verify`` names the damage (resume=auto would skip it; the only
    checkpoint: one line), ``load`` and ``load_model`` refuse it in one line (forged
    ones also without verify, as after a verify that passed), and the payload never
    ran. The intact copy loads (the test can fail)."""
    marker = tmp_path / "MARKER"
    cases = checkpoint_cases(marker)
    counts: dict[str, int] = {}
    intact = forge.copy_of(checkpoint, tmp_path / "intact" / checkpoint.name)
    model, optimizer, scheduler = _model()
    assert Checkpointer(intact.parent).load(intact, model, optimizer, scheduler) == {
        "step": 1,
        "max_steps": 4,
    }
    for i, (name, (kind, mutate)) in enumerate(cases.items()):
        ckpt = forge.copy_of(checkpoint, tmp_path / f"case{i}" / checkpoint.name)
        mutate(ckpt)
        _check_refused(ckpt, name, kind)
        assert not marker.exists(), f"{name}: the payload ran"
        counts[kind] = counts.get(kind, 0) + 1
    module, cls, attribute = CLASS_ATTRIBUTE
    assert not hasattr(getattr(sys.modules[module], cls), attribute)
    assert sum(counts.values()) == len(cases) >= 90
    print(f"checkpoint mutations: {counts}")


# ------------------------------------------------------- the command lines


def test_forged_checkpoints_refused_by_train_sample_and_eval(
    tmp_path, monkeypatch, capsys
):
    """A run's checkpoint forged (an index pickle reaching os.system through a
    dotted name, the same through ``planner``, a bytes entry whose bytes are a
    pickle, a tensor's bytes that are a pickle; a recorded config naming a directory
    of code with model.trust_remote_code=true), each resealed:
    ``train.py trainer.resume=auto``, ``sample.py`` and ``eval.py`` refuse it in one
    line and the payload never runs. (train.py's rank refuses it, in a process of
    its own; sample.py and eval.py run in-process, tests/commands.py.)"""
    from tests.commands import in_process
    from tests.test_hf_inputs import custom_code_dir
    from tests.test_research_loop import train_run
    from tests.test_train import run_cmd

    run = [
        "model=tiny",
        "logger=none",
        "data.max_bytes=200000",
        "trainer.devices=1",
        "trainer.max_steps=2",
        "trainer.batch_size=2",
        "trainer.val_every=0",
        "trainer.ckpt_every=2",
        "trainer.progress=false",
        "trainer.peak_tflops=1",
    ]
    good = tmp_path / "good"
    train_run(good, *run)
    marker = tmp_path / "MARKER"
    touch = f"touch {marker}"
    code = custom_code_dir(tmp_path / "code", "tiny_custom_34")  # leaves code/ran
    hf = {"name": "hf", "family": "hf", "config": str(code), "block_size": 64}
    remote_code = forge.edit_meta(
        lambda m: m["extra"]["config"].__setitem__(
            "model", {**hf, "trust_remote_code": True, "vocab_size": None}
        )
    )
    index = ("is not a DCP index of tensors", "torch.load(weights_only=True) refuses")
    forgeries = [
        (
            "train",
            forge.index_bytes(
                lambda c: forge.global_call(
                    "torch.distributed.checkpoint.metadata", "os.system", touch
                )
            ),
        ),
        (
            "sample",
            forge.index_bytes(
                lambda c: forge.global_call(
                    "torch.distributed.checkpoint.planner",
                    "torch.serialization.os.system",
                    touch,
                )
            ),
        ),
        ("eval", forge.bytes_entry(marker)),
        ("eval", forge.shard_payload(marker)),  # passes verify; the rank refuses it
        *((command, remote_code) for command in ("train", "sample", "eval")),
    ]
    for i, (command, forged) in enumerate(forgeries):
        said = (
            ("records model.trust_remote_code=true",)
            if forged is remote_code
            else index
        )
        run_dir = tmp_path / f"{command}{i}"
        shutil.copytree(good, run_dir)
        forged(run_dir / "checkpoints" / "step_00000002")
        if command == "train":
            # extend: max_steps is a change a resume takes, so the load is reached
            args = ["train.py", *run, "trainer.max_steps=4", "trainer.resume=auto"]
            args.append("trainer.resume_schedule=extend")
            args.append(f"hydra.run.dir={run_dir}")
        else:
            args = [f"{command}.py", f"run={run_dir}"]
        if command == "train":
            out = run_cmd([sys.executable, *args], timeout=HANG_S)
            status, text = out.returncode, out.stdout + out.stderr
        else:
            status, *printed = in_process(monkeypatch, capsys, *args)
            text = "".join(printed)
        assert status != 0 and "Traceback" not in text, text
        lines = [ln for ln in text.splitlines() if "step_00000002" in ln]
        assert len(lines) == 1 and any(s in lines[0] for s in said), text
        assert not marker.exists(), f"{command}: the payload ran"
        assert not (code / "ran").exists(), f"{command}: the recorded code ran"


def test_checked_extra_refuses_wrong_kinds(checkpoint):
    """The trainer's own extra values (``max_steps``, the fp16 scaler's state) are
    checked against this run's before they are used."""
    scaler = {"scale": 65536.0, "growth_factor": 2.0, "_growth_tracker": 0}
    assert checked_extra(checkpoint, {"scaler": scaler}, "scaler", scaler) == scaler
    for extra, key, like in [
        ({"max_steps": "4"}, "max_steps", 4),
        ({"max_steps": 4.5}, "max_steps", 4),
        ({"max_steps": None}, "max_steps", 4),
        ({"scaler": {**scaler, "scale": "x"}}, "scaler", scaler),
        ({"scaler": {**scaler, "evil": 1}}, "scaler", scaler),
        ({"scaler": {"scale": 1.0}}, "scaler", scaler),
        ({"scaler": [1]}, "scaler", scaler),
    ]:
        line = _refused(
            lambda e=extra, k=key, v=like: checked_extra(checkpoint, e, k, v)
        )
        assert f"extra.{key}" in line, line


# ------------------------------------------------------------------ token cache


def cache_cases() -> dict[str, object]:
    """name -> mutation of a token-cache entry dir (each one damages it)."""
    cases: dict[str, object] = {}
    for file in ("train.bin", "val.bin", "meta.json"):
        for how, mutate in forge.RAW.items():
            cases[f"{file}: {how}"] = lambda e, f=file, m=mutate: m(e / f)

    def meta_field(key, value):
        def change(entry: Path) -> None:
            meta = json.loads((entry / "meta.json").read_text())
            meta[key] = value
            (entry / "meta.json").write_text(json.dumps(meta))

        return change

    for key, value in [
        ("vocab_size", "256"),
        ("vocab_size", 300),
        ("dtype", "float64"),
        ("dtype", "object"),
        ("train_tokens", -1),
        ("train_tokens", 10**12),
        ("max_id", 10**9),
        ("eos_id", None),
        ("val_crc32", "00000000"),
        ("meta_crc32", None),
    ]:
        cases[f"meta.json: {key}={value!r}"] = meta_field(key, value)

    def out_of_vocab(entry: Path) -> None:
        """A token id above max_id (the ranks' vocabulary check takes max_id: past
        the vocabulary, an IndexError in a rank), the CRC-32 and the seal recomputed."""
        meta = json.loads((entry / "meta.json").read_text())
        tokens = np.fromfile(entry / "train.bin", meta["dtype"])
        top = min(meta["vocab_size"], np.iinfo(tokens.dtype).max)
        assert top > meta["max_id"]
        tokens[len(tokens) // 2] = top
        tokens.tofile(entry / "train.bin")
        meta["train_crc32"] = f"{zlib.crc32(tokens.tobytes()):08x}"
        del meta["meta_crc32"]
        text = json.dumps(meta, sort_keys=True).encode()
        meta["meta_crc32"] = f"{zlib.crc32(text):08x}"
        (entry / "meta.json").write_text(json.dumps(meta))

    cases["train.bin: an id above max_id, resealed"] = out_of_vocab
    cases["meta.json: a list"] = lambda e: (e / "meta.json").write_text("[]")
    cases["meta.json: deeper than the parser"] = lambda e: (e / "meta.json").write_text(
        "[" * 100000 + "]" * 100000
    )

    def link(entry: Path, file: str, target: str) -> None:
        (entry / file).unlink()
        (entry / file).symlink_to(target)

    cases["train.bin -> /dev/zero"] = lambda e: link(e, "train.bin", "/dev/zero")
    cases["val.bin -> /etc/hostname"] = lambda e: link(e, "val.bin", "/etc/hostname")
    cases["meta.json a directory"] = lambda e: [
        (e / "meta.json").unlink(),
        (e / "meta.json").mkdir(),
    ]

    def entry_is_a_file(entry: Path) -> None:
        shutil.rmtree(entry)
        entry.write_text("x")

    cases["the entry is a file"] = entry_is_a_file
    return cases


def test_fuzz_token_cache(tmp_path, caplog):
    """Each damaged entry is found when a run reads it again, rebuilt with one line
    saying why, and the run gets the same tokens as from the intact entry; a
    temporary dir left by a killed build is removed by the next build."""
    import logging

    from src.data.sources import prepare_data
    from tests.test_token_cache import cfg_for, stream, write_corpus

    cfg = cfg_for(tmp_path, write_corpus(tmp_path, "text"))
    first = prepare_data(cfg.data, progress=False)
    tokens = stream(cfg)
    (entry,) = [p for p in (tmp_path / "cache").glob("tokens-*") if p.is_dir()]
    killed = tmp_path / "cache" / f"{entry.name}.tmp-1234abcd"
    cases = cache_cases()
    for name, mutate in cases.items():
        mutate(entry)
        killed.mkdir(exist_ok=True)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="src.data.token_cache"):
            again = prepare_data(cfg.data, progress=False)
        assert {**again, "build_s": 0} == {**first, "build_s": 0}, name
        lines = said(caplog, "src.data.token_cache")
        damaged = [ln for ln in lines if ln.startswith("token cache: ")]
        damaged = [ln for ln in damaged if " is damaged (" in ln]
        assert len(damaged) == 1 and damaged[0].endswith("rebuilding it"), (
            name,
            lines,
        )
        assert "\n" not in damaged[0]
        assert not killed.exists(), name
        assert np.array_equal(stream(cfg), tokens), name
    assert len(cases) >= 40


# ------------------------------------------------- run records: eval.json, metrics


RECORD_MUTATIONS = {
    **forge.RAW,
    "a JSON object": lambda f: f.write_text('{"not": "a list"}'),
    "a list of numbers": lambda f: f.write_text("[1, 2]"),
    "null": lambda f: f.write_text("null"),
    "a string": lambda f: f.write_text('"x"'),
    "NaN": lambda f: f.write_text('[{"loss": NaN}]'),
    "1e400": lambda f: f.write_text('[{"loss": 1e400}]'),
    "invalid UTF-8": lambda f: f.write_bytes(b'[{"loss": "\xff"}]'),
    **forge.NOT_DATA,
}


def test_fuzz_eval_json_is_kept_aside_never_overwritten(tmp_path, caplog):
    """eval.py appends to eval.json: a damaged history is kept aside (same bytes),
    one line says so, and the new file holds the new record alone; an intact one
    grows by one record."""
    import logging

    from src.runs.evaluation import EVAL_FILE, write_record

    records = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
    new = {"step": 3, "loss": 2.0}
    intact = tmp_path / "intact"
    intact.mkdir()
    (intact / EVAL_FILE).write_text(json.dumps(records))
    write_record(intact, new)
    assert json.loads((intact / EVAL_FILE).read_text()) == [*records, new]
    for i, (name, mutate) in enumerate(RECORD_MUTATIONS.items()):
        if name == "delete":
            continue  # no history yet: nothing damaged
        run_dir = tmp_path / f"case{i}"
        run_dir.mkdir()
        path = run_dir / EVAL_FILE
        path.write_text(json.dumps(records))
        mutate(path)
        before = path.read_bytes() if path.is_file() else None
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="src.runs.evaluation"):
            write_record(run_dir, new)
        (line,) = said(caplog, "src.runs.evaluation")
        assert "is damaged" in line and "kept as eval.json.damaged-1" in line, line
        aside = run_dir / "eval.json.damaged-1"
        assert aside.is_symlink() or aside.exists(), name
        if before is not None:
            assert aside.read_bytes() == before, name
        assert json.loads(path.read_text()) == [new], name


def test_fuzz_metrics_jsonl_rows_on_resume(tmp_path, caplog):
    """Resuming drops the rows past the checkpoint's step; rows that are not UTF-8
    JSON with a step (not only a torn last line) are dropped too, with one line, and
    the file as it was is kept aside."""
    import logging

    from src.observe.loggers import METRICS_FILE, FileSink
    from src.runs.resume import run_progress

    rows = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)]
    damages = {
        "invalid UTF-8": b'{"step": 2, "x": "\xff\xfe"}\n',
        "not JSON": b"garbage\n",
        "no step": b'{"loss": 1}\n',
        "step a string": b'{"step": "2"}\n',
        "a list": b"[1, 2]\n",
        "NaN bytes": b"\x00\x00\x00\n",
    }
    for i, (name, bad) in enumerate(damages.items()):
        run_dir = tmp_path / f"case{i}"
        run_dir.mkdir()
        original = "".join(rows[:2]).encode() + bad + "".join(rows[2:]).encode()
        (run_dir / METRICS_FILE).write_bytes(original + b'{"step": 7, "lo')
        progress = run_progress(run_dir)  # what a fresh start or resume reads first
        assert progress is not None and progress.last_row == 6, name
        sink = FileSink(run_dir)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="src.observe.loggers"):
            # 5, 6, the torn one (the bad one is said apart)
            assert sink.drop_rows_after(4) == {METRICS_FILE: 3}, name
        sink.finish(0)
        (line,) = said(caplog, "src.observe.loggers")
        assert "1 damaged row(s)" in line and "metrics.jsonl.damaged-1" in line, line
        assert (run_dir / "metrics.jsonl.damaged-1").read_bytes().startswith(original)
        kept = (run_dir / METRICS_FILE).read_text()
        assert kept == "".join(rows[:4]), name


# ------------------------------------------- Hugging Face weights and config


def _header_edit(change):
    """The safetensors header rewritten by ``change(header) -> header`` (the data
    left as it is)."""

    def forge_header(file: Path) -> None:
        data = file.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = change(json.loads(data[8 : 8 + n]))
        text = json.dumps(header).encode() if not isinstance(header, bytes) else header
        file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])

    return forge_header


def _first_tensor(header: dict) -> dict:
    return next(v for k, v in header.items() if k != "__metadata__")


def _overlapping(header: dict) -> dict:
    """The last tensor of the first one's byte length moved onto its bytes (the file
    keeps its length: only safetensors' own reader sees it)."""
    first = _first_tensor(header)
    begin, stop = first["data_offsets"]
    same = [
        v
        for k, v in header.items()
        if k != "__metadata__"
        and v is not first
        and v["data_offsets"][1] - v["data_offsets"][0] == stop - begin
    ]
    same[-1]["data_offsets"] = [begin, stop]
    return header


SAFETENSORS_MUTATIONS = {
    "empty": forge.truncate(0),
    "half": forge.truncate(0.5),
    "last byte cut": forge.truncate(0.999),
    "append": forge.append,
    "0xff": forge.fill(0xFF),
    "header length flipped": lambda f: forge.flip(0.0)(f),
    "header length huge": lambda f: f.write_bytes(
        (1 << 62).to_bytes(8, "little") + f.read_bytes()[8:]
    ),
    "header not JSON": _header_edit(lambda h: b"{not json" + b" " * 20),
    "header a list": _header_edit(lambda h: [1]),
    "header NaN": _header_edit(lambda h: b'{"x": NaN}'),
    "unknown dtype": _header_edit(
        lambda h: [_first_tensor(h).__setitem__("dtype", "OBJ"), h][1]
    ),
    "offsets past the file": _header_edit(
        lambda h: [_first_tensor(h).__setitem__("data_offsets", [0, 1 << 40]), h][1]
    ),
    "negative offset": _header_edit(
        lambda h: [_first_tensor(h).__setitem__("data_offsets", [-4, 0]), h][1]
    ),
    "shape larger than its bytes": _header_edit(
        lambda h: [_first_tensor(h).__setitem__("shape", [10**6]), h][1]
    ),
    "shape a string": _header_edit(
        lambda h: [_first_tensor(h).__setitem__("shape", "x"), h][1]
    ),
    "entry not an object": _header_edit(lambda h: {**h, "evil": 1}),
    "a FIFO": lambda f: [f.unlink(), os.mkfifo(f)],  # reading it would block
    # a sparse file whose header says 3 GiB: read whole, it took 6 GB and 39 s
    "header of 3 GiB in a sparse file": lambda f: [
        f.write_bytes((3 << 30).to_bytes(8, "little")),
        os.truncate(f, 8 + (3 << 30) + 16),
    ],
    "two tensors on the same bytes": _header_edit(_overlapping),
    "__metadata__ a number": _header_edit(lambda h: {**h, "__metadata__": {"x": 1}}),
}


def test_fuzz_pretrained_safetensors_and_hf_config(tmp_path):
    """``model.pretrained`` with a damaged or forged model.safetensors, and
    ``model.config`` with sizes of zero or the wrong type: one line naming the key,
    before any rank starts (the file headers and sizes are checked, no tensor is
    read); the intact directory passes."""
    from src.config.cli import CONFIG_ERRORS, one_line
    from src.config.validate import validate
    from src.harness import compose_config
    from tests.test_pretrained import save_tiny

    good = save_tiny(tmp_path / "good", "tiny_llama")
    run = ["model=hf", "model.block_size=16"]
    validate(compose_config(*run, f"model.pretrained={good}"))

    def refused(*overrides: str) -> str:
        with pytest.raises(CONFIG_ERRORS) as info:
            validate(compose_config(*run, *overrides))
        line = one_line(info.value)
        assert "\n" not in line
        return line

    for i, (name, mutate) in enumerate(SAFETENSORS_MUTATIONS.items()):
        directory = shutil.copytree(good, tmp_path / f"st{i}")
        mutate(directory / "model.safetensors")
        line = refused(f"model.pretrained={directory}")
        assert line.startswith("model.pretrained: "), (name, line)
    for i, (key, value) in enumerate(
        [
            ("vocab_size", 0),
            ("vocab_size", "256"),
            ("hidden_size", -1),
            ("num_hidden_layers", 0),
            ("num_attention_heads", 2.5),
            ("max_position_embeddings", None),  # unset: the model's default
        ]
    ):
        directory = shutil.copytree(good, tmp_path / f"cfg{i}")
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**raw, key: value}))
        if value is None:
            continue
        line = refused(f"model.config={directory}")
        assert line.startswith(f"model.config: {key} is {value!r}"), line
    # attn_implementation naming a Hub repository: transformers would fetch that
    # kernel's code through the `kernels` package (here: no network, a ValueError
    # from kernels; with one, the code ran), in config.json or a sub-config
    for i, change in enumerate(
        [
            {"attn_implementation": "kernels-community/flash-attn"},
            {"text_config": {"_attn_implementation": "evil/kernel:fn"}},
        ]
    ):
        directory = shutil.copytree(good, tmp_path / f"kernel{i}")
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**raw, **change}))
        line = refused(f"model.config={directory}")
        assert line.startswith("model.trust_remote_code: ") and "Hub" in line, line
    directory = shutil.copytree(good, tmp_path / "fifo")
    (directory / "config.json").unlink()
    os.mkfifo(directory / "config.json")  # reading it would block for ever
    assert "config.json" in refused(f"model.config={directory}")
    # a value transformers takes but cannot build a model of (a rank's failure)
    from src.models.hf import _from_config, load_hf_config

    directory = shutil.copytree(good, tmp_path / "rope")
    raw = json.loads((directory / "config.json").read_text())
    junk = {"rope_scaling": {"type": "junk", "factor": 2.0}}
    (directory / "config.json").write_text(json.dumps({**raw, **junk}))
    with pytest.raises(ValueError, match="transformers cannot build the model of"):
        _from_config(load_hf_config(str(directory)))


# ------------------------------------- summary.json, the run lock, tokenizer config


SMALL_JSON_MUTATIONS = {
    **{k: v for k, v in forge.RAW.items() if k != "delete"},
    "a list": lambda f: f.write_text("[1]"),
    "NaN": lambda f: f.write_text('{"val_loss": NaN}'),
    "invalid UTF-8": lambda f: f.write_bytes(b'{"x": "\xff"}'),
    "nested too deep": lambda f: f.write_text("[" * 100000 + "]" * 100000),
    "a directory": lambda f: [f.unlink(), f.mkdir()],
    # refused by its size: read whole, it would fill memory (free to plant)
    "a sparse file of 1 GiB": lambda f: os.truncate(f, 1 << 30),
}


def test_fuzz_summary_lock_and_tokenizer_config(tmp_path, caplog):
    """summary.json (read by sweeps and compare.py): a damaged one is left out with
    a line naming it; the run lock's holder: a damaged one names no holder and the
    lock still works; tokenizer_config.json: one line naming data.tokenizer."""
    import logging

    from src.config.cli import CONFIG_ERRORS
    from src.data.tokenizer import byte_level_hf, load_path_tokenizer
    from src.runs.sweep import _read_json
    from src.trainer.faults import run_dir_lock

    summary = {"val_loss": 2.5, "steps": 4}
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    byte_level_hf().save(str(tokenizer_dir / "tokenizer.json"))
    tokenizer_config = json.dumps({"eos_token": "Ċ"})  # the byte-level newline
    (tokenizer_dir / "tokenizer_config.json").write_text(tokenizer_config)
    load_path_tokenizer(str(tokenizer_dir))  # intact
    structural = ("empty", "half", "last byte cut", "append", "0xff")
    for i, (name, mutate) in enumerate(SMALL_JSON_MUTATIONS.items()):
        path = tmp_path / f"s{i}" / "summary.json"
        path.parent.mkdir()
        path.write_text(json.dumps(summary))
        mutate(path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="src.runs.sweep"):
            assert _read_json(path) == {}, name
        (line,) = said(caplog, "src.runs.sweep")
        assert line.startswith(f"{path} is damaged"), line

        if name != "a directory":
            lock_dir = tmp_path / f"l{i}"
            lock_dir.mkdir()
            (lock_dir / "run.lock").write_text(json.dumps({"pid": 1, "host": "h"}))
            mutate(lock_dir / "run.lock")
            with run_dir_lock(lock_dir) as stale:
                assert stale is None or isinstance(stale, dict), name

        if name in structural or name not in forge.RAW:
            config = tokenizer_dir / "tokenizer_config.json"
            if config.is_dir():
                config.rmdir()
            config.write_text(tokenizer_config)
            mutate(config)
            with pytest.raises(CONFIG_ERRORS) as info:
                load_path_tokenizer(str(tokenizer_dir))
            line = str(info.value)
            assert line.startswith("data.tokenizer: ") and "\n" not in line, line


# ------------------------------------------------- a run's record: .hydra/*.yaml


def test_fuzz_run_record_yaml(tmp_path):
    """A run's record (``.hydra/config.yaml``, ``overrides.yaml``, ``hydra.yaml``),
    read by a resume, sample.py, eval.py and sweep summaries: each damaged file is
    either still a record of the right shape or refused in one line naming it
    (ValueError; a ConfigError on ``run`` for sample.py and eval.py), never a
    traceback of yaml's, and a ``!!python`` tag never runs (yaml's safe loader)."""
    from omegaconf import DictConfig, OmegaConf

    from src.errors import ConfigError
    from src.runs.from_run import run_config
    from src.runs.resume import run_record
    from src.runs.sweep import collect_dirs

    marker = tmp_path / "MARKER"
    files = {
        "config.yaml": {"model": {"name": "tiny"}, "trainer": {"max_steps": 4}},
        "overrides.yaml": ["model=tiny", "trainer.max_steps=4"],
        "hydra.yaml": {"hydra": {"runtime": {"choices": {"model": "tiny"}}}},
    }
    yaml_cases = {
        **forge.RAW,
        "a code tag": lambda f: f.write_text(
            f'x: !!python/object/apply:os.system ["touch {marker}"]\n'
        ),
        "a list": lambda f: f.write_text("- a\n- b\n"),
        "a mapping": lambda f: f.write_text("a: 1\n"),
        "a list of numbers": lambda f: f.write_text("[1, 2]\n"),
        "unclosed": lambda f: f.write_text("model: {name: [\n"),
        "invalid UTF-8": lambda f: f.write_bytes(b"model: \xff\xfe\n"),
        **forge.NOT_DATA,
    }
    refused = 0
    for file in files:
        for i, (name, mutate) in enumerate(yaml_cases.items()):
            run_dir = tmp_path / f"{file}-{i}"
            (run_dir / ".hydra").mkdir(parents=True)
            for other, content in files.items():
                OmegaConf.save(OmegaConf.create(content), run_dir / ".hydra" / other)
            mutate(run_dir / ".hydra" / file)
            for read in (run_record, run_config):
                try:
                    out = read(run_dir)
                except (ValueError, ConfigError) as err:
                    line = str(err)
                    assert "\n" not in line and file in line, (file, name, line)
                    refused += read is run_record
                    continue
                if out is None:  # run_record: no config.yaml, no record
                    assert file == "config.yaml" and name == "delete", name
                    continue
                config = out.config if read is run_record else out[0]
                overrides = out.overrides if read is run_record else out[1]
                assert isinstance(config, DictConfig), (file, name)
                assert all(isinstance(o, str) for o in overrides), (file, name)
            _, rows, _ = collect_dirs([run_dir])  # a sweep summary: a row, no raise
            assert len(rows) == 1, (file, name)
            assert not marker.exists(), f"{file}: {name}: the tag ran"
    assert refused >= 30, refused
    print(f"run record mutations: {3 * len(yaml_cases)}, refused {refused}")


# ------------------------------------------------ files planted in a run dir


def test_planted_run_dir_files_refused_before_anything_writes(tmp_path):
    """A run dir whose own files are links (to a file outside it, which the run
    would truncate or append to: run.lock, train.log, metrics.jsonl, an error
    report) or FIFOs (which block an open) is refused in one line naming the key and
    the file, before Hydra's logging opens train.log; the file pointed to is never
    touched. A linked directory (checkpoints on another disk) and wandb's own links
    are not refused. The run's lock itself never opens through a link."""
    from src.errors import ConfigError, RunError
    from src.harness import compose_config
    from src.runs.writable import check_writable
    from src.trainer.faults import run_dir_lock

    cfg = compose_config("model=tiny", "logger=none")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    cases = {
        "run.lock": lambda p: p.symlink_to(victim),
        "train.log": lambda p: p.symlink_to(victim),
        "metrics.jsonl": lambda p: p.symlink_to(victim),
        "metrics.csv": lambda p: p.symlink_to(tmp_path / "dangling"),
        "eval.json": lambda p: os.mkfifo(p),
        "ranks/rank0_error.txt": lambda p: p.symlink_to(victim),
        ".hydra/config.yaml": lambda p: p.symlink_to(victim),
    }
    for i, (name, plant) in enumerate(cases.items()):
        run_dir = tmp_path / f"run{i}"
        (run_dir / "ranks").mkdir(parents=True)
        (run_dir / ".hydra").mkdir()
        plant(run_dir / name)
        first = ("hydra.run.dir", str(run_dir), "the run")
        with pytest.raises(ConfigError) as err:
            check_writable(cfg, first, others=False)
        line = str(err.value)
        assert line.startswith("hydra.run.dir: ") and name in line, line
        assert "\n" not in line and line.endswith("to another directory)")
    # eval.py's run= is the run it evaluates: no other directory to suggest
    with pytest.raises(ConfigError) as err:
        check_writable(cfg, ("run", str(run_dir), "eval.json"), others=False)
    assert str(err.value).startswith("run: ") and str(err.value).endswith("remove it")
    fine = tmp_path / "fine"
    (fine / "wandb").mkdir(parents=True)
    (fine / "wandb" / "latest-run").symlink_to(tmp_path)
    (fine / "checkpoints").symlink_to(tmp_path)  # on another disk
    (fine / "metrics.jsonl").symlink_to("/dev/full")  # test_faults' full disk
    check_writable(cfg, ("hydra.run.dir", str(fine), "the run"), others=False)
    # the lock alone (torchrun's rank 0 takes it too)
    with pytest.raises(RunError, match="run.lock cannot be the run's lock"):
        with run_dir_lock(tmp_path / "run0"):
            pass
    os.mkfifo(fine / "run.lock")
    with pytest.raises(RunError, match="not a regular file"):
        with run_dir_lock(fine):
            pass
    assert victim.read_text() == "precious\n"


def test_recorded_config_read_from_meta_json_as_data(checkpoint, tmp_path):
    """checkpoint_config (the config a resume, sample.py and eval.py start from)
    reads meta.json as data: a FIFO (which blocked the resume before any rank
    started), a link, NaN, nesting past the parser (a RecursionError traceback), a
    sparse 1 GiB file: None (the ranks' verification names the damage), never a
    hang or a traceback."""
    from src.runs.resume import checkpoint_config

    damages = {
        "a FIFO": lambda c: [(c / "meta.json").unlink(), os.mkfifo(c / "meta.json")],
        "a link": lambda c: [
            (c / "meta.json").rename(tmp_path / "m.json"),
            (c / "meta.json").symlink_to(tmp_path / "m.json"),
        ],
        "NaN": lambda c: _write_sealed(c, '{"step": NaN}'),
        "nested too deep": lambda c: _write_sealed(c, "[" * 100000 + "]" * 100000),
        "a sparse file of 1 GiB": lambda c: os.truncate(c / "meta.json", 1 << 30),
    }
    for i, (name, damage) in enumerate(damages.items()):
        ckpt = forge.copy_of(checkpoint, tmp_path / f"case{i}" / checkpoint.name)
        damage(ckpt)
        assert checkpoint_config(ckpt) is None, name


def test_prune_removes_a_linked_checkpoint_dir_not_its_target(tmp_path):
    """keep_last pruning a step_N that is a link removes the link alone: the
    checkpoint it points to keeps its marker and files."""
    model, optimizer, scheduler = _model()
    root = tmp_path / "checkpoints"
    saved = Checkpointer(root).save(1, model, optimizer, scheduler, {})
    aside = tmp_path / "elsewhere" / saved.name
    aside.parent.mkdir()
    saved.rename(aside)
    saved.symlink_to(aside)
    Checkpointer(root, keep_last=1).save(2, model, optimizer, scheduler, {})
    assert not os.path.lexists(saved)
    assert (aside / "COMPLETE").is_file() and (aside / "meta.json").is_file()


def test_a_linked_checkpoint_dir_is_verified_and_loaded(checkpoint, tmp_path):
    """A step_N dir that is a link (a checkpoint moved to another disk and linked
    back) is a checkpoint: its files are verified where they are, and resume=auto
    takes it (it was refused as damage, a run that resumed before could not)."""
    ckpt = forge.copy_of(checkpoint, tmp_path / "run" / checkpoint.name)
    forge.linked_dir(ckpt)
    checkpointer = Checkpointer(ckpt.parent)
    assert checkpointer.verify(ckpt) is None
    assert resolve_resume("auto", ckpt.parent, checkpointer.verify) == ckpt
    model, optimizer, scheduler = _model()
    assert checkpointer.load(ckpt, model, optimizer, scheduler)["step"] == 1
