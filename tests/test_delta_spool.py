"""A delta's files written while the version is still being encoded (no SGLang here).

With ``publish_to`` (``publish()`` and the trainer's publisher pass it), each group of a
delta's blobs is written as its own file into the hidden folder that becomes the step, while
the encode threads work on the rest (``rollout_service/delta_spool.py``). What must hold: the
files exist before ``write()`` and nothing is visible under a step's name until its rename;
the rebuilt checkpoint is bit for bit a full publish's; and every way a version can end
without those files (full after all, a layout change, a failure while taking in or writing,
another destination, a second take-in) leaves no hidden folder behind.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from delta_helpers import CONFIG, RUN, Model, assert_same_files, publish_both, stage_through
from rollout_service import delta_spool
from rollout_service.checkpoint_format import TEMP_PREFIX, Manifest, step_dir_name
from rollout_service.checkpoint_reader import validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.sidecar.staging import Stage

# Two shards of 40 KB at most, 1 KB groups: every shard's blobs span several files.
SHAPES = {f"layer{i}.{k}": (64, 64) for i in range(4) for k in ("q", "mlp")} | {"norm": (64,)}
SHARD = 40_000


@pytest.fixture(autouse=True)
def small_groups(monkeypatch) -> None:
    monkeypatch.setattr(delta_spool, "GROUP_BYTES", 1024)


def _hidden(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith(TEMP_PREFIX)) if root.exists() else []


def _first(writer: DeltaCheckpointWriter, root: Path, model: Model) -> None:
    writer.publish(root, 1, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    model.step()


def test_a_deltas_files_are_written_before_the_write_and_rebuild_bit_for_bit(tmp_path: Path) -> None:
    root, full_root = tmp_path / "root", tmp_path / "full"
    model = Model(lr=1e-5, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100, threads=2)
    publish_both(writer, root, full_root, 1, model, max_shard_bytes=SHARD)
    for step in (2, 3, 4):
        model.step()
        writer.absorb(model.tensors(), dtype="bfloat16", max_shard_bytes=SHARD, publish_to=(root, step))
        (work,) = _hidden(root)  # being written, invisible: no step-N yet
        assert not (root / step_dir_name(step)).exists()
        result = writer.write(root, step, config=CONFIG, max_shard_bytes=SHARD, run_id=RUN)
        assert result.kind == "delta" and not work.exists() and not _hidden(root)
        publish_checkpoint(
            full_root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
        )
        manifest = Manifest.load(root / step_dir_name(step))
        assert manifest.delta is not None
        by_shard: dict[str, set[str]] = {}
        for t in manifest.delta.tensors.values():
            if t.delta_file is not None:
                by_shard.setdefault(t.shard, set()).add(t.delta_file)
        assert len(by_shard) == 2 and all(len(files) > 1 for files in by_shard.values())  # groups, per shard
        assert len({f for files in by_shard.values() for f in files}) == sum(len(f) for f in by_shard.values())
        validate_checkpoint(root / step_dir_name(step), check_digests=True)
    stage = Stage(tmp_path / "stage")
    try:
        built = stage_through(stage, root, 4)
        assert built is not None
        assert_same_files(built.path, full_root / step_dir_name(4))
    finally:
        stage.close()


def test_a_version_that_ends_up_full_leaves_no_hidden_folder(tmp_path: Path) -> None:
    """Too large for a delta (max_ratio), and a layout change mid-version: published in full."""
    root = tmp_path / "root"
    model = Model(lr=1e-5, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100, max_ratio=0.01)
    _first(writer, root, model)
    result = writer.publish(
        root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
    )
    assert result.kind == "full" and "checkpoint_delta_max_ratio" in writer.last.why_full
    assert not _hidden(root)
    writer.max_ratio = 1.0
    model.step()
    tensors = model.tensors()
    tensors[5] = (tensors[5][0], tensors[5][1][:-1])  # a shape changes after some blobs were spooled
    result = writer.publish(root, 3, tensors, config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    assert result.kind == "full" and "layout changed" in writer.last.why_full
    assert not _hidden(root)


def test_a_failure_while_taking_in_or_writing_leaves_nothing_and_the_next_version_recovers(
    tmp_path: Path, monkeypatch
) -> None:
    root = tmp_path / "root"
    model = Model(lr=1e-5, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100)
    _first(writer, root, model)

    def broken():
        for i, item in enumerate(model.tensors()):
            if i == 6:
                raise RuntimeError("the gather failed")
            yield item

    with pytest.raises(RuntimeError, match="the gather failed"):
        writer.absorb(broken(), dtype="bfloat16", max_shard_bytes=SHARD, publish_to=(root, 2))
    assert not _hidden(root)
    # Nothing valid was held after that: step 2 is full, step 3 a delta again.
    assert (
        writer.publish(
            root, 2, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
        ).kind
        == "full"
    )
    model.step()

    real_write = delta_spool._write_shard
    calls = {"n": 0}

    def disk_full_on_the_second_file(path, tensors):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, tensors)

    monkeypatch.setattr(delta_spool, "_write_shard", disk_full_on_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        writer.publish(root, 3, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN)
    assert calls["n"] >= 2 and not _hidden(root) and not (root / step_dir_name(3)).exists()
    monkeypatch.setattr(delta_spool, "_write_shard", real_write)
    kinds = []
    for step in (3, 4):
        result = writer.publish(
            root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=SHARD, run_id=RUN
        )
        kinds.append(result.kind)
        model.step()
    assert kinds == ["full", "delta"]  # the failed version was not a base: full, then deltas again
    assert not _hidden(root)


def test_a_write_to_another_step_or_a_second_take_in_drops_the_files_written_so_far(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = Model(lr=1e-5, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100)
    _first(writer, root, model)
    writer.absorb(model.tensors(), dtype="bfloat16", max_shard_bytes=SHARD, publish_to=(root, 2))
    assert len(_hidden(root)) == 1
    # Taken in again before any write: the first take-in's folder goes (and, as nothing valid is
    # held then, this version is full: no files are written ahead for it).
    writer.absorb(model.tensors(), dtype="bfloat16", max_shard_bytes=SHARD, publish_to=(root, 2))
    assert not _hidden(root)
    assert writer.write(root, 2, config=CONFIG, max_shard_bytes=SHARD, run_id=RUN).kind == "full"
    model.step()
    writer.absorb(model.tensors(), dtype="bfloat16", max_shard_bytes=SHARD, publish_to=(root, 3))
    assert len(_hidden(root)) == 1
    result = writer.write(root, 4, config=CONFIG, max_shard_bytes=SHARD, run_id=RUN)  # not the announced step
    assert result.kind == "delta" and (root / step_dir_name(4)).is_dir()
    assert not _hidden(root) and not (root / step_dir_name(3)).exists()
    validate_checkpoint(root / step_dir_name(4), check_digests=True)


def test_a_step_already_there_is_refused_by_the_write_as_before(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = Model(lr=1e-5, shapes=SHAPES)
    writer = DeltaCheckpointWriter(full_every=100)
    _first(writer, root, model)
    (root / step_dir_name(2)).mkdir()
    writer.absorb(model.tensors(), dtype="bfloat16", max_shard_bytes=SHARD, publish_to=(root, 2))
    assert not _hidden(root)
    with pytest.raises(FileExistsError):
        writer.write(root, 2, config=CONFIG, max_shard_bytes=SHARD, run_id=RUN)
    assert not _hidden(root)
