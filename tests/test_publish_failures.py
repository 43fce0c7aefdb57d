"""What a failing storage does to the trainer's side: nothing half-published, nothing deleted on a
guess, no root made again on the local disk, errors that say where and what to do, and a next
publish that is still right (checked bit for bit against a full publish of the same weights)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model
from rollout_service import checkpoint_writer, work_folders
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.checkpoint_writer import cleanup_stale_temp_dirs, publish_checkpoint
from rollout_service.delta_apply import materialize
from rollout_service.delta_writer import DeltaCheckpointWriter
from trainer_helpers import NoWaiter
from trainer_hooks.checkpoint_publisher import CheckpointPublisher
from trainer_hooks.checkpoint_retention import chain_dependencies, prune_checkpoints


def _publisher(
    root: Path, delta: DeltaCheckpointWriter | None = None, keep: int | None = None, sync_timeout_s: float = 5
) -> CheckpointPublisher:
    return CheckpointPublisher(
        root,
        NoWaiter(),
        config=CONFIG,
        dtype="bfloat16",
        max_shard_bytes=40_000,
        keep=keep,
        sync_timeout_s=sync_timeout_s,
        heartbeat_max_age_s=60,
        delta=delta,
    )


def _chain(root: Path, steps: range, model: Model) -> DeltaCheckpointWriter:
    writer = DeltaCheckpointWriter(full_every=100)
    for step in steps:
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    return writer


def _same_as_full(root: Path, step: int, model: Model, tmp_path: Path) -> None:
    """Step ``step`` rebuilds to exactly what a full publish of ``model``'s weights writes."""
    full = publish_checkpoint(
        tmp_path / f"full-{step}", step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000
    )
    made = tmp_path / f"made-{step}"
    materialize(root, step, made)
    for name, entry in Manifest.load(full.path).files.items():
        assert (made / name).read_bytes() == (full.path / name).read_bytes(), name
        assert entry.size == (made / name).stat().st_size


def test_retention_deletes_nothing_while_a_kept_step_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, model = tmp_path / "root", Model(lr=1e-3)
    writer = _chain(root, range(1, 5), model)  # full 1, deltas 2-4
    real_open = os.open

    def flaky(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(f"{step_dir_name(4)}/manifest.json"):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", flaky)
    assert prune_checkpoints(root, keep=1) == []  # step 4 might be a delta on 1-3: keep them
    monkeypatch.setattr(os, "open", real_open)
    assert [c.step for c in list_checkpoints(root)] == [1, 2, 3, 4]
    assert chain_dependencies(root, {4}) == {1, 2, 3}
    # Gone or not a manifest at all: protects nothing more (no one can apply it).
    (root / step_dir_name(4) / "manifest.json").write_text("{}")
    assert chain_dependencies(root, {4}) == set()
    writer.close()


def test_a_delta_is_written_only_on_a_chain_that_is_still_whole(tmp_path: Path) -> None:
    root, model = tmp_path / "root", Model(lr=1e-3)
    writer = _chain(root, range(1, 4), model)
    assert writer.last.kind == "delta"
    # The chain's full step vanishes (an operator, a stray prune): its base step is intact.
    shutil.rmtree(root / step_dir_name(1))
    model.step()
    writer.publish(root, 4, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    assert writer.last.kind == "full" and "chain of step 3" in writer.last.why_full
    _same_as_full(root, 4, model, tmp_path)
    # A delta between the full step and the base vanishes: the same.
    for step in (5, 6):
        model.step()
        writer.publish(root, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    assert writer.last.kind == "delta"
    shutil.rmtree(root / step_dir_name(5))
    model.step()
    writer.publish(root, 7, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    assert writer.last.kind == "full"
    model.step()
    writer.publish(root, 8, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN)
    assert writer.last.kind == "delta"
    _same_as_full(root, 8, model, tmp_path)
    writer.close()


@pytest.mark.parametrize("delta", [False, True])
def test_a_root_that_vanished_is_not_made_again_on_the_local_disk(tmp_path: Path, delta: bool) -> None:
    mount = tmp_path / "mnt"
    root = mount / "shared" / "ckpts"
    root.mkdir(parents=True)
    publisher = _publisher(root, DeltaCheckpointWriter(full_every=100) if delta else None)
    model = Model(lr=1e-3)
    publisher.publish_and_wait(1, model.tensors())
    shutil.rmtree(mount / "shared")  # the volume is unmounted: its mount point is empty
    model.step()
    with pytest.raises(FileNotFoundError, match=r"is gone \(deleted, replaced, or its volume unmounted\); version 2"):
        publisher.publish_and_wait(2, model.tensors())
    assert not (mount / "shared").exists()
    publisher.close()


@pytest.mark.parametrize("code,hint", [(errno.ENOSPC, "keep_checkpoints"), (errno.EIO, "I/O error")])
@pytest.mark.parametrize("delta", [False, True])
def test_a_storage_error_names_the_root_the_version_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, hint: str, delta: bool
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    publisher = _publisher(root, DeltaCheckpointWriter(full_every=100) if delta else None)
    model = Model(lr=1e-3)
    publisher.publish_and_wait(1, model.tensors())
    real_fsync, calls = os.fsync, []

    def failing(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # in the middle of the step's files
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    model.step()
    with pytest.raises(OSError) as err:
        publisher.publish_and_wait(2, model.tensors())
    monkeypatch.setattr(os, "fsync", real_fsync)
    message = str(err.value)
    assert err.value.errno == code and "version 2" in message and str(root) in message and hint in message
    if code == errno.ENOSPC:  # what retention holds whatever keep_checkpoints says
        assert "live replica" in message
        assert ("checkpoint_full_every" in message) == delta, message
    assert [c.step for c in list_checkpoints(root)] == [1]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    # The next publish is right (for deltas: not encoded against the version that failed).
    model.step()
    publisher.publish_and_wait(3, model.tensors())
    if publisher.delta is not None:
        assert publisher.delta.last.why_full == "the previous publish did not complete (its version is no base)"
    _same_as_full(root, 3, model, tmp_path)
    publisher.close()


def test_a_root_that_cannot_be_synced_after_the_rename_still_publishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    real = checkpoint_writer.fsync_dir

    def failing_on_root(path: Path) -> None:
        if Path(path) == root:
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(checkpoint_writer, "fsync_dir", failing_on_root)
    with caplog.at_level(logging.WARNING, logger="rollout_service"):
        result = publish_checkpoint(root, 1, [("w", torch.ones(4))], config=CONFIG)
    assert result.path == root / step_dir_name(1) and Manifest.load(result.path).step == 1
    assert "may not survive a power loss" in caplog.text


def test_a_stray_entry_holding_the_next_step_s_name_is_named(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / step_dir_name(1)).symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError, match="taken by something that is not a checkpoint"):
        publish_checkpoint(root, 1, [("w", torch.ones(4))], config=CONFIG)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_a_work_folder_of_a_writer_that_died_is_removed_at_the_next_start(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    code = f"""
import os, torch
from rollout_service.checkpoint_writer import publish_checkpoint
def dying():
    yield "w", torch.ones(4)
    os._exit(3)  # killed in the middle of the publish
publish_checkpoint({str(root)!r}, 1, dying(), config={{"model_type": "x"}})
"""
    died = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert died.returncode == 3, died.stderr
    left = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(left) == 1 and not list_checkpoints(root)
    ours = root / f".tmp-{step_dir_name(9)}-{work_folders.owner_tag()}-0123456789ab"
    ours.mkdir()  # this process's own work (alive): kept
    other_host = root / f".tmp-{step_dir_name(8)}-h00000000p1-0123456789ab"
    other_host.mkdir()  # another host's writer: this host cannot tell, kept until it is old
    assert cleanup_stale_temp_dirs(root) == left
    assert sorted(p.name for p in root.iterdir()) == sorted([ours.name, other_host.name])
    assert cleanup_stale_temp_dirs(root) == []


def test_unreadable_acks_skip_pruning_but_not_the_sync(tmp_path: Path, monkeypatch, caplog) -> None:
    """Retention is best effort: when the acks that say what replicas still read cannot be listed
    (EIO, ESTALE on NFS), nothing is pruned on a guess and the published, acknowledged sync stands."""
    from trainer_hooks import checkpoint_publisher

    root = tmp_path / "root"
    pub = _publisher(root, keep=1)
    pub.publish_and_wait(1, [("w", torch.ones(8))])

    def acks_unreadable(*args: Any, **kwargs: Any) -> dict:
        raise OSError(errno.EIO, "Input/output error", str(root / "acks"))

    monkeypatch.setattr(checkpoint_publisher, "list_acks", acks_unreadable)
    with caplog.at_level(logging.WARNING):
        record = pub.publish_and_wait(2, [("w", torch.full((8,), 2.0))])
    assert record.version == 2 and pub.confirmed_version == 2
    assert [c.step for c in list_checkpoints(root)] == [1, 2], "pruned without knowing what replicas read"
    assert "could not prune old checkpoints" in caplog.text


def test_ctrl_c_while_waiting_for_the_background_job_is_not_swallowed(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C while the next sync waits for the background one propagates, and the next version is
    not taken in while that job still writes from the held copy (it would write the next
    version's weights under this step's name, with valid digests)."""
    import signal
    import threading

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background CI shell ignores it
    try:
        release = threading.Event()

        class SlowWaiter(NoWaiter):
            def wait(self, version: int, timeout_s: float) -> list[Any]:
                release.wait(30)
                return []

        writer = DeltaCheckpointWriter(full_every=10)
        pub = CheckpointPublisher(
            tmp_path / "root",
            SlowWaiter(),
            config=CONFIG,
            dtype="bfloat16",
            max_shard_bytes=1 << 20,
            keep=None,
            sync_timeout_s=30,
            heartbeat_max_age_s=60,
            delta=writer,
        )
        w = torch.zeros(4096)
        pub.publish(1, [("w", w.clone())], background=True)
        taken_in_while_busy: list[bool] = []
        real_absorb = writer.absorb

        def absorb(*args: Any, **kwargs: Any) -> Any:
            taken_in_while_busy.append(pub.busy)
            return real_absorb(*args, **kwargs)

        monkeypatch.setattr(writer, "absorb", absorb)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()  # the user presses Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            pub.publish(2, [("w", w.clone() + 1)], background=True)
        assert taken_in_while_busy == [], "version 2 was taken in while version 1 was still being synced"
        assert pub.busy
        release.set()
        pub.close()  # the job finishes; nothing failed
        assert [c.step for c in list_checkpoints(tmp_path / "root")] == [1]
    finally:
        signal.signal(signal.SIGINT, previous)
