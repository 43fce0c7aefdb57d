"""Every step of a delta chain is untrusted input, not only the step being loaded.

A sidecar rebuilding step N (and ``rollout-service materialize``) reads N's base, the base's
base, down to the chain's full step: each of those manifests and files was written by whoever
can write under the root. These tests spoil one step of a valid chain (full 1, deltas 2 and 3)
the way a consistent attacker would (sizes, digests and the chain's fingerprints all updated),
and check that the stage build and ``materialize`` of step 3 refuse it with a named reason,
write nothing outside their own folders, and keep to their deadline. No SGLang here: the
sidecar-level cases are in ``test_sidecar_untrusted.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model
from rollout_service import checkpoint_format, checkpoint_paths, delta_apply, delta_codec
from rollout_service.checkpoint_format import (
    MANIFEST_NAME,
    MAX_CHAIN_LENGTH,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    CheckpointError,
    Manifest,
    step_dir_name,
)
from rollout_service.delta_apply import (
    CHAIN_START_SLACK_BYTES,
    MAX_DELTA_FILES_PER_SHARD,
    ChainLink,
    materialize,
    resolve_chain,
)
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.digest import format_digest, new_hasher
from rollout_service.sidecar.staging import Stage, StageError
from rollout_service.untrusted_files import Deadline


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1 (full), 2 and 3 (deltas on 1 and 2) of a small model in several shards."""
    root = tmp_path / "root"
    model, writer = Model(lr=1e-3), DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    writer.close()
    assert [Manifest.load(root / step_dir_name(s)).kind for s in (1, 2, 3)] == ["full", "delta", "delta"]
    return root


def _dir(root: Path, step: int) -> Path:
    return root / step_dir_name(step)


def _digest(data: bytes) -> str:
    h = new_hasher()
    h.update(data)
    return format_digest(h)


def _fingerprint(step_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fingerprint an attacker writes into the next step, however odd the manifest's names."""
    with monkeypatch.context() as m:
        m.setattr(checkpoint_paths, "check_plain_file_name", lambda *a, **k: None)
        return Manifest.load(step_dir).fingerprint()


def spoil(root: Path, step: int, edit: Callable[[dict], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Edit step ``step``'s manifest, then point every later delta at the edited publication."""
    path = _dir(root, step) / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    for later in range(step + 1, 4):
        manifest = _dir(root, later) / MANIFEST_NAME
        data = json.loads(manifest.read_text())
        data["delta"]["base_fingerprint"] = _fingerprint(_dir(root, later - 1), monkeypatch)
        manifest.write_text(json.dumps(data))


def build_and_materialize(root: Path, tmp_path: Path, step: int = 3) -> list[CheckpointError]:
    """Step ``step`` staged and materialized: the error each raised (both must raise one)."""
    errors = []
    stage = Stage(tmp_path / "stage")
    try:
        with pytest.raises(CheckpointError) as staged:
            stage.build(root, _dir(root, step), Manifest.load(_dir(root, step)), Deadline(60))
        errors.append(staged.value)
    finally:
        stage.close()
    with pytest.raises(CheckpointError) as made:
        materialize(root, step, tmp_path / "made" / "model", timeout_s=60)
    errors.append(made.value)
    assert not (tmp_path / "made" / "model").exists()
    return errors


def _files_outside(tmp_path: Path, inside: tuple[str, ...]) -> dict[str, int]:
    """Every file under ``tmp_path`` but those in the folders named ``inside``: path -> mtime."""
    found = {}
    for dirpath, _, names in os.walk(tmp_path):
        rel = Path(dirpath).relative_to(tmp_path)
        if rel.parts and rel.parts[0] in inside:
            continue
        for n in names:
            found[str(rel / n)] = os.stat(Path(dirpath) / n).st_mtime_ns
    return found


# --- names -----------------------------------------------------------------------------
BAD_NAMES = ["../escaped", "../../escaped", "sub/model.safetensors", "/tmp/escaped", ".hidden", "a\x00b", "x" * 256]


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize(
    "step,field",
    [(1, "files"), (2, "files"), (3, "delta.target_files"), (3, "delta.tensors.delta_file")],
)
def test_every_file_name_a_manifest_gives_must_be_a_bare_name(root: Path, step: int, field: str, name: str) -> None:
    data = json.loads((_dir(root, step) / MANIFEST_NAME).read_text())
    if field == "files":
        data["files"][name] = data["files"].pop("config.json")
    elif field == "delta.target_files":
        data["delta"]["target_files"][name] = data["delta"]["target_files"].pop("config.json")
    else:
        changed = next(t for t in data["delta"]["tensors"].values() if t.get("delta_file"))
        changed["delta_file"] = name
    with pytest.raises(CheckpointError) as err:
        Manifest.from_json(json.dumps(data))
    assert err.value.reason == "path_escape" and "only bare file names" in str(err.value)


@pytest.mark.parametrize("target", ["../escaped", "../../escaped"])
def test_a_base_step_naming_files_outside_its_folder_writes_nothing_outside(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    # A consistent attacker: the full step lists config.json under a name that leads out of
    # the folder a copy is made in, and a file of that name and those bytes exists there.
    base = _dir(root, 1)
    (base / target).write_bytes((base / "config.json").read_bytes())
    spoil(root, 1, lambda d: d["files"].__setitem__(target, d["files"].pop("config.json")), monkeypatch)
    before = _files_outside(tmp_path, ("stage", "made"))
    errors = build_and_materialize(root, tmp_path)
    assert [e.reason for e in errors] == ["broken_chain", "broken_chain"], errors
    assert all("bad_manifest" in str(e) or "path_escape" in str(e) for e in errors), errors
    assert _files_outside(tmp_path, ("stage", "made")) == before
    for folder in (tmp_path / "stage", tmp_path / "made"):  # nothing landed beside the copies either
        assert not [p for p in folder.rglob("*") if p.name.endswith("escaped")], list(folder.rglob("*"))


# --- free-form fields ------------------------------------------------------------------
def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"k": value}
    return value


TEXT_EDITS: dict[str, Callable[[str], str]] = {
    # Each parses as JSON; none could be written back (fingerprint, stage copy) or read one way.
    "extra nested 600 deep": lambda t: t.replace('"extra": {}', '"extra": ' + json.dumps(_nested(600)), 1),
    "writer nested past the limit": lambda t: t.replace(
        '"writer": {', '"writer": {"deep": ' + json.dumps(_nested(MAX_TREE_DEPTH)) + ", ", 1
    ),
    "extra with too many values": lambda t: t.replace(
        '"extra": {}', '"extra": ' + json.dumps({"x": [0] * MAX_TREE_NODES}), 1
    ),
    "an infinite number in extra": lambda t: t.replace('"extra": {}', '"extra": {"x": 1e400}', 1),
    "created_at infinite": lambda t: t.replace('"created_at": ', '"created_at": 1e400, "_": ', 1),
    "created_at an integer past any float": lambda t: t.replace('"created_at": ', f'"created_at": {10**400}, "_": ', 1),
    "extra a list": lambda t: t.replace('"extra": {}', '"extra": []', 1),
    "extra false": lambda t: t.replace('"extra": {}', '"extra": false', 1),
    "extra null": lambda t: t.replace('"extra": {}', '"extra": null', 1),
    "extra with a megabyte of text": lambda t: t.replace('"extra": {}', '"extra": {"x": "' + "a" * (1 << 20) + '"}', 1),
    "extra with long keys": lambda t: t.replace(
        '"extra": {}', '"extra": ' + json.dumps({"k" * 40_000 + str(i): 0 for i in range(2)}), 1
    ),
    "base_model of a megabyte": lambda t: re.sub(
        r'"base_model": (null|"[^"]*")', '"base_model": "' + "m" * (1 << 20) + '"', t, count=1
    ),
    "a key twice": lambda t: t.replace('"step": ', '"step": 1, "step": ', 1),
    "dtype a list": lambda t: t.replace('"dtype": "BF16"', '"dtype": ["BF16"]', 1),
    "dtype an object": lambda t: t.replace('"dtype": "BF16"', '"dtype": {"BF16": 1}', 1),
}


@pytest.mark.parametrize("name", sorted(TEXT_EDITS))
@pytest.mark.parametrize("step", [1, 3])
def test_manifest_fields_that_cannot_be_written_back_or_compared_are_refused(root: Path, step: int, name: str) -> None:
    text = json.dumps(json.loads((_dir(root, step) / MANIFEST_NAME).read_text()))
    spoiled = TEXT_EDITS[name](text)
    assert spoiled != text, "the edit must apply"
    json.loads(spoiled)  # still JSON: the reader, not the parser, must refuse it
    with pytest.raises(CheckpointError) as err:
        Manifest.from_json(spoiled)
    assert err.value.reason == "bad_manifest"


@pytest.mark.parametrize("where", ["tensor", "top"])
def test_a_dtype_that_is_not_a_string_is_refused_in_a_delta_s_tensors(root: Path, where: str) -> None:
    data = json.loads((_dir(root, 3) / MANIFEST_NAME).read_text())
    if where == "tensor":
        next(iter(data["delta"]["tensors"].values()))["dtype"] = ["BF16"]
    else:
        data["dtype"] = {"BF16": 1}
    with pytest.raises(CheckpointError) as err:
        Manifest.from_json(json.dumps(data))
    assert err.value.reason == "bad_manifest" and "dtype" in str(err.value)


def test_free_form_fields_within_the_limits_round_trip(root: Path) -> None:
    text = json.dumps(json.loads((_dir(root, 3) / MANIFEST_NAME).read_text()))
    nested = _nested(MAX_TREE_DEPTH - 2)  # inside "extra", inside the manifest
    manifest = Manifest.from_json(text.replace('"extra": {}', '"extra": ' + json.dumps({"n": nested, "f": 0.5}), 1))
    again = Manifest.from_json(manifest.to_json())
    assert again.extra["n"] == nested and again.fingerprint() == manifest.fingerprint()


# --- the chain's shape -----------------------------------------------------------------
def _rename_a_tensor(d: dict) -> None:
    tensors = d["delta"]["tensors"]
    first = next(iter(tensors))
    tensors["renamed." + first] = tensors.pop(first)


CHAIN_EDITS: dict[str, tuple[int, Callable[[dict], Any], str]] = {
    "a middle step of another chain": (2, lambda d: d["delta"].update(chain_start=0), "another full step"),
    "a middle step with other tensors": (2, _rename_a_tensor, "other tensors"),
}


@pytest.mark.parametrize("name", sorted(CHAIN_EDITS))
def test_every_step_of_a_chain_must_belong_to_it(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    step, edit, says = CHAIN_EDITS[name]
    spoil(root, step, edit, monkeypatch)
    Manifest.load(_dir(root, step))  # each step parses on its own: only the chain is wrong
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "broken_chain" and says in str(err), err


def test_a_chain_must_end_at_the_full_step_it_names(root: Path, tmp_path: Path, monkeypatch) -> None:
    spoil(root, 2, lambda d: d["delta"].update(chain_start=0), monkeypatch)
    spoil(root, 3, lambda d: d["delta"].update(chain_start=0), monkeypatch)
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "broken_chain" and "reaches the full step 1" in str(err), err


def test_the_chain_walk_keeps_to_its_deadline(root: Path) -> None:
    deadline = Deadline(0.001)
    time.sleep(0.01)
    link = ChainLink(_dir(root, 3), Manifest.load(_dir(root, 3)))
    with pytest.raises(CheckpointError) as err:
        resolve_chain(root, link, None, deadline)
    assert err.value.reason == "validation_timeout"
    assert len(resolve_chain(root, link, None, Deadline(60)).deltas) == 2


# --- bytes that lie --------------------------------------------------------------------
def test_a_base_shard_header_whose_shape_does_not_span_its_bytes_is_refused(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _dir(root, 1)
    manifest = json.loads((base / MANIFEST_NAME).read_text())
    for fname in sorted(f for f in manifest["files"] if f.endswith(".safetensors")):
        data = (base / fname).read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        name = next((k for k, v in header.items() if k != "__metadata__" and v["shape"] == [64]), None)
        if name is not None:
            break
    else:
        pytest.fail("no 64-element tensor in the base")
    header[name]["shape"] = [32]  # same header length; the offsets still span 64 elements
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(raw) == length
    spoiled = data[:8] + raw + data[8 + length :]
    (base / fname).write_bytes(spoiled)
    spoil(root, 1, lambda d: d["files"][fname].update(digest=_digest(spoiled)), monkeypatch)
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "header_invalid" and name in str(err), err


@pytest.mark.parametrize("size,reason", [(1 << 44, "delta_corrupt"), ("+1", "truncated"), ("-1", "size_mismatch")])
def test_a_delta_file_size_is_checked_before_a_buffer_is_sized_by_it(
    root: Path, tmp_path: Path, size: Any, reason: str
) -> None:
    top = _dir(root, 3)
    data = json.loads((top / MANIFEST_NAME).read_text())
    fname = next(f for f in data["files"] if f.startswith("delta-"))
    real = data["files"][fname]["size"]
    data["files"][fname]["size"] = size if isinstance(size, int) else real + int(size)
    data["total_bytes"] += data["files"][fname]["size"] - real
    (top / MANIFEST_NAME).write_text(json.dumps(data))
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == reason and fname in str(err), err


def _rewrite_delta_header(root: Path, rewrite: Callable[[bytes], bytes]) -> str:
    """Give step 3's first delta file the header ``rewrite(its header)``, its manifest entry (size,
    digest, total_bytes) updated as a consistent attacker would; the file's name."""
    top = _dir(root, 3)
    data = json.loads((top / MANIFEST_NAME).read_text())
    fname = next(f for f in data["files"] if f.startswith("delta-"))
    blob = (top / fname).read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    raw = rewrite(blob[8 : 8 + length])
    spoiled = struct.pack("<Q", len(raw)) + raw + blob[8 + length :]
    (top / fname).write_bytes(spoiled)
    data["total_bytes"] += len(spoiled) - data["files"][fname]["size"]
    data["files"][fname].update(size=len(spoiled), digest=_digest(spoiled))
    (top / MANIFEST_NAME).write_text(json.dumps(data))
    return fname


def test_a_delta_file_header_larger_than_its_bound_is_refused_unread(root: Path, tmp_path: Path) -> None:
    def padded_metadata(raw: bytes) -> bytes:
        header = json.loads(raw)
        header["__metadata__"] = {"pad": "x" * (17 << 20)}
        return json.dumps(header).encode()

    fname = _rewrite_delta_header(root, padded_metadata)
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "delta_corrupt" and fname in str(err), err


def test_a_delta_file_header_padded_past_what_its_tensors_need_is_refused_unread(root: Path, tmp_path: Path) -> None:
    """Under the 16 MiB cap, but far past a few entries' worth: each such file would be buffered
    whole (a shard's delta files are all held until it is rebuilt)."""
    fname = _rewrite_delta_header(root, lambda raw: raw + b" " * (1 << 20))
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "delta_corrupt" and fname in str(err), err


def test_a_shard_whose_tensors_name_many_delta_files_is_refused(tmp_path: Path) -> None:
    """Each delta file a shard's tensors name is held open and buffered until the shard is
    rebuilt: past MAX_DELTA_FILES_PER_SHARD (the writer uses one) the delta is refused."""
    root = tmp_path / "root"
    model = Model(shapes={f"t{i:02d}": (32, 32) for i in range(MAX_DELTA_FILES_PER_SHARD + 2)})
    writer = DeltaCheckpointWriter(full_every=100)
    for step in (1, 2):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    writer.close()
    two = _dir(root, 2)
    data = json.loads((two / MANIFEST_NAME).read_text())
    assert data["kind"] == "delta"
    blobs = {}
    for fname in [f for f in data["files"] if f.startswith("delta-")]:
        raw = (two / fname).read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        for name, entry in json.loads(raw[8 : 8 + length]).items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                blobs[name] = raw[8 + length + start : 8 + length + end]
        (two / fname).unlink()
        del data["files"][fname]
    assert len(blobs) > MAX_DELTA_FILES_PER_SHARD
    for i, (tname, blob) in enumerate(sorted(blobs.items())):  # one file per tensor
        name = f"delta-{i:05d}.safetensors"
        header = json.dumps({tname: {"dtype": "U8", "shape": [len(blob)], "data_offsets": [0, len(blob)]}}).encode()
        content = struct.pack("<Q", len(header)) + header + blob
        (two / name).write_bytes(content)
        data["files"][name] = {"size": len(content), "digest": _digest(content), "tensors": 1}
        data["delta"]["tensors"][tname]["delta_file"] = name
    data["total_bytes"] = sum(e["size"] for e in data["files"].values())
    (two / MANIFEST_NAME).write_text(json.dumps(data))
    for err in build_and_materialize(root, tmp_path, step=2):
        assert err.reason == "delta_corrupt" and f"more than {MAX_DELTA_FILES_PER_SHARD} delta files" in str(err), err


def test_a_chain_start_listing_files_the_model_does_not_need_is_not_copied(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full step that starts a chain is not validated as the step being loaded is: one that
    lists a large extra file (a sparse one costs its writer nothing) would be copied into the
    stage (node RAM in /dev/shm) at every try. A chain keeps its tensors, so its full step is
    about the size of the model the chain rebuilds."""
    extra = CHAIN_START_SLACK_BYTES + (4 << 20)
    with open(_dir(root, 1) / "extra.bin", "wb") as f:
        f.truncate(extra)
    zeros = new_hasher()
    zeros.update(bytes(extra))

    def add(data: dict) -> None:
        data["files"]["extra.bin"] = {"size": extra, "digest": format_digest(zeros), "tensors": 0}
        data["total_bytes"] += extra

    spoil(root, 1, add, monkeypatch)
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "broken_chain" and "files it does not need" in str(err), err
    assert not [p for p in (tmp_path / "stage").rglob("*") if p.name == "extra.bin"]


def test_a_manifest_whose_total_bytes_is_not_what_its_files_add_up_to_is_refused(root: Path, tmp_path: Path) -> None:
    """Readers size the stage's room (and the chain start's copy) by total_bytes."""
    for step in (1, 3):
        data = json.loads((_dir(root, step) / MANIFEST_NAME).read_text())
        data["total_bytes"] -= 1
        with pytest.raises(CheckpointError) as err:
            Manifest.from_json(json.dumps(data))
        assert err.value.reason == "bad_manifest" and "total_bytes" in str(err.value)


def test_unchanged_tensors_are_rebuilt_in_large_parts_whatever_frame_size_a_delta_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delta naming 4 KiB frames made one job per 4 KiB of every tensor, changed or not."""
    root = tmp_path / "root"
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", 4 << 10)  # a writer with 4 KiB frames
    monkeypatch.setattr(checkpoint_format, "MIN_FRAME_BYTES", 4 << 10)  # (readers refuse them)
    model = Model(lr=1e-3, shapes={"big": (1024, 512), "small": (8, 8)})
    writer = DeltaCheckpointWriter(full_every=100)
    model.step()
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    with torch.no_grad():
        model.params["small"] += 1.0  # only the small tensor changes
    writer.publish(root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    writer.close()
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", 16 << 20)
    parts: list[int] = []
    real = delta_apply._rebuild_part
    monkeypatch.setattr(delta_apply, "_rebuild_part", lambda *a: parts.append(a[3]) or real(*a))
    stage = Stage(tmp_path / "stage")
    try:
        stage.build(root, _dir(root, 2), Manifest.load(_dir(root, 2)), Deadline(60))
    finally:
        stage.close()
    assert len(parts) <= 4, f"{len(parts)} parts for a 1 MiB tensor that did not change and a 128-byte one"


# --- materialize's output and the stage's room -----------------------------------------
def test_materialize_checks_its_output_and_the_step_before_any_work(root: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inside the checkpoint root"):
        materialize(root, 3, root / step_dir_name(9))
    with pytest.raises(ValueError, match="inside the checkpoint root"):
        materialize(root, 3, root / "models" / "m")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        materialize(root, 3, dangling)
    shutil.copytree(_dir(root, 1), root / step_dir_name(7))  # step 1's manifest under step 7's name
    with pytest.raises(CheckpointError) as err:
        materialize(root, 7, tmp_path / "seven")
    assert err.value.reason == "bad_manifest" and "says step 1" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == [
        "step-00000001",
        "step-00000002",
        "step-00000003",
        "step-00000007",
    ]
    assert not (tmp_path / "seven").exists() and not list(tmp_path.glob(".tmp-*"))
    assert not (tmp_path / "nowhere").exists()
    made = materialize(root, 3, tmp_path / "three")
    assert made.step == 3 and (tmp_path / "three" / "config.json").exists()


def test_a_step_larger_than_the_stage_is_rejected_and_one_that_needs_room_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage = Stage(tmp_path / "stage")
    try:
        total = shutil.disk_usage(stage.path).total
        with pytest.raises(CheckpointError) as err:
            stage._check_room(5, total)
        assert err.value.reason == "too_large_for_stage" and "step 5" in str(err.value)
        real = shutil.disk_usage

        def full(path: Any) -> Any:
            usage = real(path)
            return usage._replace(free=1 << 20)

        monkeypatch.setattr(shutil, "disk_usage", full)
        with pytest.raises(StageError, match="MiB free"):
            stage._check_room(5, 100 << 20)
    finally:
        stage.close()


def test_a_chain_whose_manifests_list_too_many_frames_is_refused_before_it_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk holds every link's manifest, and each lists a frame size per ``frame_bytes`` of the
    model (4 KiB frames: 262k per GiB): the frames a chain lists in all are bounded, as its length
    is. Here the bound is lowered to what two links of the test model list."""
    from rollout_service import delta_apply

    root, model, writer = tmp_path / "root", Model(), DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3, 4):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    per_link = sum(len(t.frames or ()) for t in Manifest.load(root / step_dir_name(4)).delta.tensors.values())
    assert per_link > 0
    link = ChainLink(root / step_dir_name(4), Manifest.load(root / step_dir_name(4)))
    monkeypatch.setattr(delta_apply, "MAX_CHAIN_FRAMES", 2 * per_link)
    assert (
        len(resolve_chain(root, ChainLink(root / step_dir_name(3), Manifest.load(root / step_dir_name(3)))).deltas) == 2
    )
    with pytest.raises(CheckpointError) as err:
        resolve_chain(root, link)
    assert (
        err.value.reason == "broken_chain" and "frames" in str(err.value) and "checkpoint_full_every" in str(err.value)
    )


def test_a_chain_whose_manifests_list_too_many_tensor_entries_is_refused_before_it_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each link's manifest lists every tensor of the model, changed or not: a chain of links
    listing 100,000 tensors each held ~59 MB of parsed manifest per link (30 links: 2 GB, 127 s).
    The tensor entries a chain lists in all are bounded; here the bound is lowered to what two
    links of the test model list, and the writer keeps its chains within it."""
    from rollout_service import delta_apply, delta_writer

    per_link = len(Model().tensors())
    for module in (delta_apply, delta_writer):
        monkeypatch.setattr(module, "MAX_CHAIN_TENSORS", 2 * per_link)
    root, model, writer = tmp_path / "root", Model(), DeltaCheckpointWriter(full_every=100)
    kinds = []
    for step in range(1, 8):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
        manifest = Manifest.load(root / step_dir_name(step))
        kinds.append(manifest.kind)
        resolve_chain(root, ChainLink(root / step_dir_name(step), manifest))  # a reader walks each
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    # A chain another writer made longer is refused by the reader, naming what to do.
    other = tmp_path / "other"
    writer = DeltaCheckpointWriter(full_every=100)
    monkeypatch.setattr(delta_writer, "MAX_CHAIN_TENSORS", 100 * per_link)
    for step in (1, 2, 3, 4):
        model.step()
        writer.publish(other, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    assert Manifest.load(other / step_dir_name(4)).kind == "delta"
    with pytest.raises(CheckpointError) as err:
        resolve_chain(other, ChainLink(other / step_dir_name(4), Manifest.load(other / step_dir_name(4))))
    assert err.value.reason == "broken_chain" and "tensor entries" in str(err.value), err.value
    assert "checkpoint_full_every" in str(err.value)


def test_a_chain_whose_manifests_hold_too_many_name_characters_is_refused_and_the_writer_keeps_within(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tensor entries a chain lists are bounded, their names' length was not: a chain whose
    links each name a tensor with ~15 MB of characters (within a manifest's 16 MiB) grew a walk by
    ~15 MB per link (~16 GB at the length cap), in ``validate`` and ``materialize``. The names a
    chain holds in all are bounded; here the bound is lowered to what ~2.5 links of a model with
    one long name hold (two deltas), and the writer keeps its chains within it."""
    from rollout_service import delta_apply, delta_writer

    def tensors(model: Model) -> list[tuple[str, torch.Tensor]]:
        return [(("x" * 5000 if i == 0 else "") + name, t) for i, (name, t) in enumerate(model.tensors())]

    model = Model()
    per_link = sum(len(n) for n, _ in tensors(model))
    for module in (delta_apply, delta_writer):
        monkeypatch.setattr(module, "MAX_CHAIN_NAME_CHARS", 2 * per_link + per_link // 2)
    root, writer = tmp_path / "root", DeltaCheckpointWriter(full_every=100)
    kinds = []
    for step in range(1, 6):
        model.step()
        writer.publish(root, step, tensors(model), config=CONFIG, dtype="bfloat16", run_id=RUN)
        manifest = Manifest.load(root / step_dir_name(step))
        kinds.append(manifest.kind)
        resolve_chain(root, ChainLink(root / step_dir_name(step), manifest))  # a reader walks each
    assert kinds == ["full", "delta", "delta", "full", "delta"], kinds
    other, writer = tmp_path / "other", DeltaCheckpointWriter(full_every=100)
    monkeypatch.setattr(delta_writer, "MAX_CHAIN_NAME_CHARS", 100 * per_link)
    for step in (1, 2, 3, 4):
        model.step()
        writer.publish(other, step, tensors(model), config=CONFIG, dtype="bfloat16", run_id=RUN)
    assert Manifest.load(other / step_dir_name(4)).kind == "delta"
    with pytest.raises(CheckpointError) as err:
        resolve_chain(other, ChainLink(other / step_dir_name(4), Manifest.load(other / step_dir_name(4))))
    assert err.value.reason == "broken_chain" and "characters of tensor and file names" in str(err.value)
    assert "checkpoint_full_every" in str(err.value)


def test_the_writer_starts_a_new_chain_before_its_frames_pass_what_a_reader_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frames a reader holds per chain (``MAX_CHAIN_FRAMES``) bound the chain the writer
    makes too, whatever ``full_every`` says: a chain of a 70B model's deltas ends at ~500 links,
    not at a broken_chain rejection on a late-joining replica. Here the bound is lowered to what
    two links of the test model list."""
    from rollout_service import delta_apply, delta_writer

    root, model, writer = tmp_path / "root", Model(), DeltaCheckpointWriter(full_every=100)
    per_link = len(model.tensors())  # one frame per tensor: each is smaller than a frame
    for module in (delta_apply, delta_writer):
        monkeypatch.setattr(module, "MAX_CHAIN_FRAMES", 2 * per_link + 1)
    kinds = []
    for step in range(1, 8):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
        manifest = Manifest.load(root / step_dir_name(step))
        kinds.append(manifest.kind)
        resolve_chain(root, ChainLink(root / step_dir_name(step), manifest))  # a reader walks each
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]


def test_full_every_is_bounded_by_the_longest_chain_a_reader_walks(tmp_path: Path) -> None:
    from trainer_hooks import GRPOConfig

    DeltaCheckpointWriter(full_every=MAX_CHAIN_LENGTH + 1).close()
    with pytest.raises(ValueError, match=str(MAX_CHAIN_LENGTH + 1)):
        DeltaCheckpointWriter(full_every=MAX_CHAIN_LENGTH + 2)
    with pytest.raises(ValueError, match="checkpoint_full_every"):
        GRPOConfig(
            output_dir=str(tmp_path),
            checkpoint_path=str(tmp_path),
            sglang_urls=["http://127.0.0.1:30000"],
            expected_replicas=1,
            use_cpu=True,
            bf16=False,
            report_to="none",
            checkpoint_full_every=MAX_CHAIN_LENGTH + 2,
        )


# --- every field, every wrong type -----------------------------------------------------
ODD_VALUES: list[Any] = [None, True, -1, 2**70, 0.5, 1e308, "", "x" * 300, [], [1, "a"], {}, {"a": [{}]}]


def _leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """The path to every value of a JSON document, containers included."""
    out = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _leaves(v, (*path, i))
    return out


@pytest.mark.parametrize("step", [1, 3])
def test_any_value_of_any_field_either_parses_or_is_refused_with_a_reason(root: Path, step: int) -> None:
    data = json.loads((_dir(root, step) / MANIFEST_NAME).read_text())
    paths = _leaves(data)
    assert len(paths) > 40
    tried = refused = 0
    for path in paths:
        for odd in ODD_VALUES:
            spoiled = json.loads(json.dumps(data))
            node = spoiled
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = odd
            tried += 1
            try:
                manifest = Manifest.from_json(json.dumps(spoiled))
            except CheckpointError:
                refused += 1
                continue
            again = Manifest.from_json(manifest.to_json())  # what parses can be written back
            assert again.fingerprint() == manifest.fingerprint(), (path, odd)
    assert refused > tried // 2, (refused, tried)


def test_a_model_config_with_a_key_twice_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    # Manifests never repeat a key (refused above); a model's config.json is the model's own,
    # and transformers and SGLang load one with a repeated key (the last counts): so does this.
    from rollout_service.checkpoint_reader import validate_checkpoint
    from rollout_service.checkpoint_writer import publish_checkpoint

    config = tmp_path / "config.json"
    config.write_text('{"model_type": "qwen2", "hidden_size": 64, "hidden_size": 64}')
    import torch

    path = publish_checkpoint(tmp_path / "root", 1, [("w", torch.ones(4))], config=config).path
    assert validate_checkpoint(path, root=tmp_path / "root").manifest.step == 1


def test_a_delta_file_holding_several_shards_tensors_is_refused(root: Path) -> None:
    """The writer gives each shard its own delta file; one file named by every shard's tensors
    would be read (and held whole) once per shard it serves."""
    data = json.loads((_dir(root, 3) / MANIFEST_NAME).read_text())
    changed = [t for t in data["delta"]["tensors"].values() if t.get("delta_file")]
    shards = {t["shard"] for t in changed}
    assert len(shards) > 1, "the fixture's delta must change tensors of several shards"
    Manifest.from_json(json.dumps(data))  # as written: accepted
    for t in changed:
        t["delta_file"] = changed[0]["delta_file"]
    with pytest.raises(CheckpointError) as refused:
        Manifest.from_json(json.dumps(data))
    assert refused.value.reason == "bad_manifest" and "delta_file" in str(refused.value)


@pytest.mark.parametrize("where", ["files", "target_files"])
def test_a_delta_listing_files_none_of_its_tensors_needs_is_refused(root: Path, where: str) -> None:
    """A chain's walk holds every link's manifest: a link may list no more files than its tensors
    name (10,000 padding entries per link, 1000 links, were gigabytes held)."""
    data = json.loads((_dir(root, 3) / MANIFEST_NAME).read_text())
    entry = dict(next(iter(data["files"].values())))
    padding = {f"pad-{i:05d}.safetensors": entry for i in range(50)}
    if where == "files":
        data["files"].update(padding)
        data["total_bytes"] += 50 * entry["size"]
    else:
        data["delta"]["target_files"].update(padding)
    with pytest.raises(CheckpointError) as refused:
        Manifest.from_json(json.dumps(data))
    assert refused.value.reason == "bad_manifest" and "pad-00000" in str(refused.value)


def test_a_file_name_holding_a_lone_surrogate_is_refused_naming_it(root: Path) -> None:
    text = (_dir(root, 1) / MANIFEST_NAME).read_text()
    data = json.loads(text)
    name = next(iter(data["files"]))
    spoiled = json.dumps(data).replace(json.dumps(name), '"model-\\ud800.safetensors"', 1)
    with pytest.raises(CheckpointError) as refused:
        Manifest.from_json(spoiled)
    assert refused.value.reason == "bad_manifest" and "lone surrogate" in str(refused.value)


def test_a_chain_whose_manifests_hold_too_much_free_text_is_refused_before_it_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link's ``writer`` and ``extra`` may each hold 10,000 nodes and 64 KiB of text (~2.2 MB
    parsed): 1,000 such links held ~2.2 GB in one walk. The text a chain holds in all is bounded;
    here the bound is lowered to what two and a half links of the test model's writer hold."""
    root, model, writer = tmp_path / "root", Model(), DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3, 4):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", run_id=RUN)
    four = Manifest.load(root / step_dir_name(4))
    per_link = len(json.dumps([four.writer, four.extra]))
    monkeypatch.setattr(delta_apply, "MAX_CHAIN_FREE_TEXT", int(2.5 * per_link))
    three = ChainLink(root / step_dir_name(3), Manifest.load(root / step_dir_name(3)))
    assert len(resolve_chain(root, three).deltas) == 2
    with pytest.raises(CheckpointError) as err:
        resolve_chain(root, ChainLink(root / step_dir_name(4), four))
    assert err.value.reason == "broken_chain" and "writer and extra" in str(err.value)


def test_a_base_shard_header_of_other_names_is_refused_before_it_is_parsed(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's full step whose shard declares thousands of other (tiny) tensors: refused as
    delta_layout_mismatch from a count of its header's names, before the header is parsed into
    Python objects (a 100 MB header of tiny entries costs ~1 GB so; session 26)."""
    from rollout_service import safetensors_header

    base = _dir(root, 1)
    manifest = json.loads((base / MANIFEST_NAME).read_text())
    fname = sorted(f for f in manifest["files"] if f.endswith(".safetensors"))[0]
    data = (base / fname).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    junk = {f"junk.{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(20_000)}
    raw = json.dumps(junk, separators=(",", ":")).encode()
    spoiled = struct.pack("<Q", len(raw)) + raw
    (base / fname).write_bytes(spoiled)

    def edit(d: dict) -> None:
        d["files"][fname].update(digest=_digest(spoiled), size=len(spoiled))
        d["total_bytes"] = sum(f["size"] for f in d["files"].values())

    spoil(root, 1, edit, monkeypatch)
    parsed: list[int] = []
    real_parse = safetensors_header.parse_entries

    def parse(raw: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(len(raw))
        return real_parse(raw, *args, **kwargs)

    monkeypatch.setattr(safetensors_header, "parse_entries", parse)
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "delta_layout_mismatch", err
    assert len(raw) not in parsed  # the junk header was counted, never parsed


# --- one verdict per step, whatever a replica has staged -----------------------------------------


def _follow(stage: Stage, root: Path, steps: tuple[int, ...]) -> None:
    """Build ``steps`` in turn, as a replica that followed the chain does (each copy kept)."""
    for step in steps:
        stage.build(root, _dir(root, step), Manifest.load(_dir(root, step)), Deadline(60))


def _verdicts(root: Path, tmp_path: Path, followed: tuple[int, ...], step: int = 3) -> list[CheckpointError]:
    """Step ``step`` built by a replica that staged ``followed`` before, by a late joiner, and
    materialized: the error each raised (each must raise one)."""
    errors = []
    for name, steps in (("following", followed), ("late", ())):
        stage = Stage(tmp_path / f"stage-{name}")
        try:
            _follow(stage, root, steps)
            with pytest.raises(CheckpointError) as err:
                stage.build(root, _dir(root, step), Manifest.load(_dir(root, step)), Deadline(60))
            errors.append(err.value)
        finally:
            stage.close()
    with pytest.raises(CheckpointError) as made:
        materialize(root, step, tmp_path / "made" / "model", timeout_s=60)
    return [*errors, made.value]


def test_a_step_naming_another_chain_start_is_refused_also_where_its_base_is_staged(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 3 says its chain starts at step 2 (a delta): a replica that had staged step 2 served
    it (its walk ended at the staged copy, unchecked), while a late joiner refused it."""
    stage = Stage(tmp_path / "stage-following")
    try:
        _follow(stage, root, (1, 2))
        spoil(root, 3, lambda d: d["delta"].update(chain_start=2), monkeypatch)
        with pytest.raises(CheckpointError) as err:
            _follow(stage, root, (3,))
        assert err.value.reason == "broken_chain" and "another full step" in str(err.value)
    finally:
        stage.close()
    for err_ in _verdicts(root, tmp_path, ()):
        assert err_.reason == "broken_chain" and "another full step" in str(err_), err_


def test_a_chain_must_start_at_a_full_step(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 relabelled an adapter step: only ``materialize`` refused the chain before."""
    adapter = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj"], "peft_type": "LORA"}
    spoil(root, 1, lambda d: d.update(kind="adapter", adapter=adapter), monkeypatch)
    assert Manifest.load(_dir(root, 1)).kind == "adapter"
    stage = Stage(tmp_path / "stage")
    try:
        with pytest.raises(CheckpointError) as err:
            stage.build(root, _dir(root, 3), Manifest.load(_dir(root, 3)), Deadline(60))
    finally:
        stage.close()
    with pytest.raises(CheckpointError) as made:
        materialize(root, 3, tmp_path / "made" / "model", timeout_s=60)
    for e in (err.value, made.value):
        assert e.reason == "broken_chain" and "is an adapter step, not a full one" in str(e), e


@pytest.mark.parametrize(
    "cap", ["MAX_CHAIN_TENSORS", "MAX_CHAIN_FRAMES", "MAX_CHAIN_NAME_CHARS", "MAX_CHAIN_FREE_TEXT"]
)
def test_every_chain_cap_counts_the_whole_chain_also_where_a_base_is_staged(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: str
) -> None:
    """A staged copy records what its chain's manifests held, so a walk ending at it counts from
    the full step for every cap, as a late joiner's walk does (there: each cap lowered to what one
    delta's manifest holds, so step 2 passes and step 3 does not)."""
    from rollout_service.delta_apply import ChainLoad

    one = ChainLoad().plus(Manifest.load(_dir(root, 2)))
    per_link = {
        "MAX_CHAIN_TENSORS": one.tensors,
        "MAX_CHAIN_FRAMES": one.frames,
        "MAX_CHAIN_NAME_CHARS": one.names,
        "MAX_CHAIN_FREE_TEXT": one.text,
    }[cap]
    stage = Stage(tmp_path / "stage-following")
    try:
        _follow(stage, root, (1, 2))
        monkeypatch.setattr(delta_apply, cap, per_link + per_link // 2)
        with pytest.raises(CheckpointError) as following:
            _follow(stage, root, (3,))
    finally:
        stage.close()
    late = Stage(tmp_path / "stage-late")
    try:
        with pytest.raises(CheckpointError) as joiner:
            _follow(late, root, (3,))
    finally:
        late.close()
    assert following.value.reason == joiner.value.reason == "broken_chain"
    assert str(following.value) == str(joiner.value)


def test_the_chain_length_cap_holds_also_where_a_base_is_staged(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged copy records how many deltas its chain applied, so a replica that followed a chain
    past the cap refuses its next step as a late joiner does (there: 2 deltas, cap 1)."""
    stage = Stage(tmp_path / "stage-following")
    try:
        _follow(stage, root, (1, 2))  # step 2: one delta, within the cap
        monkeypatch.setattr(delta_apply, "MAX_CHAIN_LENGTH", 1)
        with pytest.raises(CheckpointError) as err:
            _follow(stage, root, (3,))
    finally:
        stage.close()
    assert err.value.reason == "broken_chain" and "longer than 1 steps" in str(err.value), err.value


# --- what a frame may carry ------------------------------------------------------------------


def _rewrite_a_frame(root: Path, rewrite: Callable[[bytes], bytes]) -> tuple[str, str]:
    """Give the smallest changed tensor of step 3 the frame ``rewrite(its frame)``, its file's and
    manifest's entries updated as a consistent attacker would; (the tensor, its delta file)."""
    from safetensors.torch import load_file, save_file

    top = _dir(root, 3)
    data = json.loads((top / MANIFEST_NAME).read_text())
    tensors = data["delta"]["tensors"]
    name = min((n for n, t in tensors.items() if t.get("delta_file")), key=lambda n: sum(tensors[n]["frames"]))
    assert len(tensors[name]["frames"]) == 1
    fname = tensors[name]["delta_file"]
    blobs = load_file(str(top / fname))
    frame = rewrite(blobs[name].numpy().tobytes())
    blobs[name] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    save_file(blobs, str(top / fname))
    tensors[name]["frames"] = [len(frame)]
    spoiled = (top / fname).read_bytes()
    data["total_bytes"] += len(spoiled) - data["files"][fname]["size"]
    data["files"][fname].update(size=len(spoiled), digest=_digest(spoiled))
    (top / MANIFEST_NAME).write_text(json.dumps(data))
    return name, fname


def _skippable(size: int) -> bytes:
    return struct.pack("<II", 0x184D2A50, size) + bytes(size)


def _smallest_part(root: Path) -> int:
    """The bytes of the part :func:`_rewrite_a_frame` rewrites (one frame: the whole tensor)."""
    delta = Manifest.load(_dir(root, 3)).delta
    assert delta is not None
    name = min((n for n, t in delta.tensors.items() if t.frames), key=lambda n: sum(delta.tensors[n].frames or ()))
    part = checkpoint_format.DTYPE_SIZES[delta.tensors[name].dtype] * int(
        torch.tensor(delta.tensors[name].shape).prod()
    )
    assert part < delta.frame_bytes
    return part


def test_a_frame_larger_than_zstd_makes_of_its_own_part_is_refused(root: Path) -> None:
    """The bound on a frame's size was zstd's worst case for ``frame_bytes`` (16 MiB), whatever the
    part: a tiny tensor's frame could carry ~16 MiB of padding (a skippable frame after it) that
    every replica reads into memory, for each changed tensor. It is now that of its own part."""
    from rollout_service.checkpoint_format import frame_bound

    part = _smallest_part(root)
    _rewrite_a_frame(root, lambda frame: frame + _skippable(frame_bound(part) - len(frame) + 1 - 8))
    with pytest.raises(CheckpointError) as err:
        Manifest.load(_dir(root, 3))
    assert err.value.reason == "bad_manifest" and "frames" in str(err.value)


def test_a_frame_that_starts_with_a_skippable_frame_is_refused(root: Path, tmp_path: Path) -> None:
    """One as long as the part: zstd reports its length as the frame's content size."""
    part = _smallest_part(root)
    _rewrite_a_frame(root, lambda frame: _skippable(part) + frame)
    for err in build_and_materialize(root, tmp_path):
        assert err.reason == "delta_corrupt" and "zstd's magic" in str(err), err


@pytest.mark.parametrize("linked", [3, 2, 1], ids=["the-step", "its-delta-base", "its-full-step"])
def test_a_link_named_like_a_step_is_never_followed(root: Path, tmp_path: Path, linked: int) -> None:
    """The trainer's numbering and retention never count a link named like a step (a review,
    session 31): a reader that followed one served what it pointed at, a step the trainer does
    not know of (``ln -s .x step-00000099`` pinned every replica there). The link here points at
    the step's own folder, moved aside inside the root: nothing but the link is wrong."""
    aside = root / f".moved-{linked}"
    os.rename(_dir(root, linked), aside)
    os.symlink(aside.name, _dir(root, linked))
    if linked == 3:
        from rollout_service.checkpoint_reader import validate_checkpoint

        with pytest.raises(CheckpointError, match="symbolic link") as refused:
            validate_checkpoint(_dir(root, 3), root=root)
        assert refused.value.reason == "not_a_checkpoint"
        with pytest.raises(CheckpointError, match="symbolic link"):
            Manifest.load(_dir(root, 3), root=root)
        with pytest.raises(CheckpointError) as made:
            materialize(root, 3, tmp_path / "made" / "model", timeout_s=60)
        errors = [made.value]
        assert not (tmp_path / "made" / "model").exists()
    else:  # the link is a base the chain passes through: the replica's rebuild refuses it
        errors = build_and_materialize(root, tmp_path)
        assert errors[0].reason == "broken_chain" and "not_a_checkpoint" in str(errors[0]), errors[0]
    made_error = errors[-1]
    assert "symbolic link" in str(made_error) or "not_a_checkpoint" in str(made_error), made_error
