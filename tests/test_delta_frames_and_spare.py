"""Delta frames and the stage's spare copy, without SGLang.

A changed tensor's blob is one zstd frame per 16 MiB part (``checkpoint_format.DELTA_CODEC``):
parts that did not change have no frame, and frames whose sizes or contents lie are refused
with a reason. The stage keeps the copy it stopped serving as a hidden spare and writes the
next version over its files; what it writes is verified like any other copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both, stage_through
from rollout_service import checkpoint_format, delta_codec
from rollout_service.checkpoint_format import (
    DELTA_CODEC,
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    step_dir_name,
)
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar import staging
from rollout_service.sidecar.staging import SPARE_PREFIX, Stage
from rollout_service.untrusted_files import Deadline

TWO_PARTS = (4096, 2304)  # 18.9 MB in bf16: a full 16 MiB part and a partial one
PART_ELEMS = delta_codec.CHUNK_BYTES // 2


def _publish_pair(tmp_path: Path, change) -> tuple[Path, Path, Manifest]:
    """Version 1 of a two-part tensor, then version 2 with ``change`` applied to it; both also
    published in full (the reference). Returns the roots and version 2's delta manifest."""
    root, full_root = tmp_path / "root", tmp_path / "full"
    g = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(*TWO_PARTS, generator=g), "norm": torch.ones(64)}
    writer = DeltaCheckpointWriter(full_every=100)
    for step in (1, 2):
        if step == 2:
            change(state["embed"].view(-1))
        items = sorted(state.items())
        writer.publish(root, step, items, config=CONFIG, dtype="bfloat16", run_id=RUN)
        publish_checkpoint(full_root, step, items, config=CONFIG, dtype="bfloat16", run_id=RUN)
    manifest = Manifest.load(root / step_dir_name(2))
    assert manifest.kind == "delta"
    return root, full_root, manifest


def _build(tmp_path: Path, root: Path, step: int, stage: Stage | None = None):
    own = stage is None
    stage = stage or Stage(tmp_path / "stage")
    try:
        return stage_through(stage, root, step)
    finally:
        if own:
            stage.close()


@pytest.mark.parametrize("changed_part", [0, 1])
def test_a_part_that_did_not_change_has_no_frame_and_the_rebuild_is_exact(tmp_path: Path, changed_part: int) -> None:
    def change(flat: torch.Tensor) -> None:
        at = changed_part * PART_ELEMS + 1000
        flat[at : at + 50] += 1.0

    root, full_root, manifest = _publish_pair(tmp_path, change)
    assert manifest.delta is not None
    frames = manifest.delta.tensors["embed"].frames
    assert frames is not None and len(frames) == 2
    assert (frames[changed_part] > 0) and frames[1 - changed_part] == 0, frames
    assert manifest.delta.tensors["norm"].delta_file is None
    built = _build(tmp_path, root, 2)
    assert_same_files(built.path, full_root / step_dir_name(2))


def test_frames_are_one_per_part_and_a_big_tensor_encodes_on_every_thread(tmp_path: Path, monkeypatch) -> None:
    import threading

    seen: set[int] = set()
    original = DeltaCheckpointWriter._encode_part

    def recording(self, *args, **kwargs):
        seen.add(threading.get_ident())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DeltaCheckpointWriter, "_encode_part", recording)
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6, shapes={"embed": (4 * PART_ELEMS // 1024, 1024), "norm": (64,)})  # 4 parts
    writer = DeltaCheckpointWriter(full_every=100, threads=2)
    for step in (1, 2):
        publish_both(writer, root, full_root, step, model, max_shard_bytes=1 << 30)
        model.step()
    delta = Manifest.load(root / step_dir_name(2)).delta
    assert delta is not None and delta.frame_bytes == delta_codec.CHUNK_BYTES
    assert len(delta.tensors["embed"].frames or []) == 4
    assert len(seen) == 2, "the parts of one tensor ran on both encode threads"
    assert_same_files(_build(tmp_path, root, 2).path, full_root / step_dir_name(2))


def _edit_manifest(step_dir: Path, edit) -> None:
    data = json.loads((step_dir / MANIFEST_NAME).read_text())
    edit(data["delta"])
    (step_dir / MANIFEST_NAME).write_text(json.dumps(data))


@pytest.mark.parametrize(
    "edit,reason,where",
    [
        (lambda d: d["tensors"]["embed"].update(frames=[1]), "bad_manifest", "load"),
        (lambda d: d["tensors"]["embed"].update(frames=[0, 0]), "bad_manifest", "load"),
        (lambda d: d["tensors"]["embed"].update(frames=[-1, 5]), "bad_manifest", "load"),
        (lambda d: d["tensors"]["embed"].update(frames=[1 << 40, 5]), "bad_manifest", "load"),
        (lambda d: d["tensors"]["embed"].pop("frames"), "bad_manifest", "load"),
        (lambda d: d.update(frame_bytes=17), "bad_manifest", "load"),
        (lambda d: d.update(frame_bytes=4097), "bad_manifest", "load"),  # parts of half a bf16 element
        (lambda d: d.update(frame_bytes=3 << 12), "bad_manifest", "load"),  # not a power of two
        (lambda d: d.update(frame_bytes=1 << 19), "bad_manifest", "load"),  # too many parts to a tensor
        (lambda d: d.update(codec="xor+zstd"), "bad_manifest", "load"),
        # Sizes that do not add up to the blob, and sizes that cut it in the wrong places.
        (
            lambda d: d["tensors"]["embed"]["frames"].__setitem__(0, d["tensors"]["embed"]["frames"][0] + 1),
            "delta_corrupt",
            "validate",
        ),
        (lambda d: d["tensors"]["embed"]["frames"].reverse(), "delta_corrupt", "build"),
    ],
)
def test_frame_sizes_that_lie_are_refused_with_a_reason(tmp_path: Path, edit, reason: str, where: str) -> None:
    def change(flat: torch.Tensor) -> None:
        flat[::997] += 1.0  # both parts change

    root, _, manifest = _publish_pair(tmp_path, change)
    step_dir = root / step_dir_name(2)
    _edit_manifest(step_dir, edit)
    with pytest.raises(CheckpointError) as info:
        Manifest.load(step_dir)
        if where == "validate":
            validate_checkpoint(step_dir)
        elif where == "build":
            _build(tmp_path, root, 2)
    assert info.value.reason == reason, info.value
    if "codec" in str(info.value):
        assert DELTA_CODEC in str(info.value) and "same version" in str(info.value)


def _inodes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in path.iterdir() if p.name.endswith(".safetensors")}


def _spares(stage: Stage) -> list[Path]:
    return [p for p in stage.path.iterdir() if p.name.startswith(SPARE_PREFIX)]


def test_the_stage_writes_each_version_over_its_spare_copy(tmp_path: Path) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6)
    writer = DeltaCheckpointWriter(full_every=4)  # full 1 and 5, deltas between
    stage = Stage(tmp_path / "stage")
    try:
        spare_inodes: dict[str, int] = {}
        for step in range(1, 8):
            publish_both(writer, root, full_root, step, model)
            model.step()
            path = root / step_dir_name(step)
            built = stage.build(root, path, Manifest.load(path), Deadline(60))
            assert_same_files(built.path, full_root / step_dir_name(step))
            if spare_inodes:  # the new copy's shards are the spare's files, written over
                assert _inodes(built.path) == spare_inodes, step
                assert not _spares(stage)
            stage.prune({built.path})
            if step >= 2:
                (spare,) = _spares(stage)
                spare_inodes = _inodes(spare)
                assert spare_inodes
        assert {Manifest.load(root / step_dir_name(s)).kind for s in (1, 5)} == {"full"}
    finally:
        stage.close()
    # A restart removes the spare (it is only a saving): its name is hidden (.tmp-).
    again = Stage(tmp_path / "stage")
    try:
        assert not _spares(again)
    finally:
        again.close()


def test_a_spare_longer_than_the_new_file_is_cut_and_a_damaged_spare_is_written_over(tmp_path: Path) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6)
    writer = DeltaCheckpointWriter(full_every=100)
    stage = Stage(tmp_path / "stage")
    try:
        for step in (1, 2, 3):
            publish_both(writer, root, full_root, step, model)
            model.step()
            path = root / step_dir_name(step)
            built = stage.build(root, path, Manifest.load(path), Deadline(60))
            stage.prune({built.path})
            if step == 2:
                for shard in _spares(stage)[0].glob("*.safetensors"):
                    with open(shard, "r+b") as f:  # garbage everywhere, and longer than before
                        f.write(os.urandom(4096))
                        f.seek(0, os.SEEK_END)
                        f.write(b"x" * 10_000)
        assert_same_files(built.path, full_root / step_dir_name(3))
        # A full step published smaller than the spare's files: written over and cut.
        small = publish_checkpoint(root, 4, [("norm", torch.ones(8))], config=CONFIG, run_id=RUN)
        built = stage.build(root, small.path, Manifest.load(small.path), Deadline(60))
        validate_checkpoint(built.path, check_digests=True)
    finally:
        stage.close()


def test_no_spare_is_kept_when_the_stage_would_run_short_of_room(tmp_path: Path, monkeypatch) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6)
    writer = DeltaCheckpointWriter(full_every=100)
    real = staging.shutil.disk_usage
    for step in (1, 2):
        publish_both(writer, root, full_root, step, model)
        model.step()
    stage = Stage(tmp_path / "stage")
    try:
        first = stage.build(root, root / step_dir_name(1), Manifest.load(root / step_dir_name(1)), Deadline(60))
        second = stage.build(root, root / step_dir_name(2), Manifest.load(root / step_dir_name(2)), Deadline(60))
        size = sum(p.stat().st_size for p in first.path.iterdir())

        def tight(path):
            usage = real(path)
            return usage._replace(free=size + staging.SPACE_MARGIN_BYTES - 1)

        monkeypatch.setattr(staging.shutil, "disk_usage", tight)
        stage.prune({second.path})
        assert not _spares(stage) and not first.path.exists()
        assert [p.name for p in stage.path.iterdir() if p.name.startswith("step-")] == [second.path.name]
    finally:
        stage.close()


def test_the_rebuild_follows_the_frame_size_the_manifest_names(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", 64 << 10)  # a writer with 64 KiB frames
    monkeypatch.setattr(checkpoint_format, "MIN_FRAME_BYTES", 64 << 10)  # (readers refuse them)
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6, shapes={"embed": (1000, 96), "norm": (64,)})  # 192 KB: 3 frames
    writer = DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3):
        publish_both(writer, root, full_root, step, model)
        model.step()
    delta = Manifest.load(root / step_dir_name(3)).delta
    assert delta is not None and delta.frame_bytes == 64 << 10 and len(delta.tensors["embed"].frames or []) == 3
    monkeypatch.setattr(delta_codec, "CHUNK_BYTES", 16 << 20)  # the reader's own size differs
    assert_same_files(_build(tmp_path, root, 3).path, full_root / step_dir_name(3))


def test_a_prune_without_a_spare_removes_the_spare_too(tmp_path: Path) -> None:
    """Adapter loads prune this way: they write no full copies, so a spare would only hold memory."""
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-6)
    writer = DeltaCheckpointWriter(full_every=100)
    for step in (1, 2, 3):
        publish_both(writer, root, full_root, step, model)
        model.step()
    stage = Stage(tmp_path / "stage")
    try:
        _build(tmp_path, root, 2, stage)
        assert _spares(stage)
        served = stage.build(root, root / step_dir_name(3), Manifest.load(root / step_dir_name(3)), Deadline(60))
        stage.prune({served.path}, keep_spare=False)
        assert not _spares(stage)
        assert [p.name for p in stage.path.iterdir() if p.name.startswith("step-")] == [served.path.name]
        # The next build has no spare to take, and is still exact.
        four = publish_both(writer, root, full_root, 4, model)[0]
        assert_same_files(
            stage.build(root, four.path, Manifest.load(four.path), Deadline(60)).path, full_root / step_dir_name(4)
        )
    finally:
        stage.close()
