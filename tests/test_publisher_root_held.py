"""The trainer's publisher over a whole run: the root it checks is the root it started with, even
on FUSE, and what killed writers left in it goes within the run, not only at the next start.

- sshfs (like FUSE file systems without ``use_ino``) numbers a folder's inode afresh once the
  kernel has dropped it from its cache, as memory pressure on a training node does; the
  publisher compared the root's (device, inode) with the start's before each publish, so the
  same root looked "another folder than at the start" and every later sync failed. The
  publisher now holds the root open (a folder in use stays cached and keeps its number); a root
  really replaced is still refused. The cache is dropped here as the kernel does under memory
  pressure (``/proc/sys/vm/drop_caches``: the tests run as root, as CI does).
- A trainer killed mid-publish in a container leaves a work folder that its restarted successor
  (a new PID namespace) cannot tell dead, so it is kept at the start while under an hour old;
  nothing looked again during the run: one model copy of disk stayed per crash. Publishes now
  hand such entries, once an hour old, to the background remover (every ``LEFTOVER_SWEEP_S``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from delta_helpers import Model
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.delta_writer import DeltaCheckpointWriter
from shared_fs import sshfs_mount
from test_publish_failures import _publisher
from trainer_hooks import checkpoint_publisher


@contextlib.contextmanager
def publisher_on_sshfs(tmp_path: Path, delta: bool = False) -> Iterator[tuple[Path, Path, Any]]:
    """(the server's side of the root, the root as the trainer mounts it, a publisher into it)."""
    with sshfs_mount(tmp_path / "fs") as (server, mount):
        root = mount / "shared" / "ckpts"
        root.mkdir(parents=True)
        publisher = _publisher(root, DeltaCheckpointWriter(full_every=100) if delta else None)
        try:
            yield server / "shared" / "ckpts", root, publisher
        finally:
            publisher.close()


def drop_cached_inodes() -> None:
    """What memory pressure does to folders nobody holds: the kernel forgets them."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


@pytest.mark.parametrize("delta", [False, True])
def test_a_root_on_sshfs_is_the_same_root_after_the_kernel_dropped_it(tmp_path: Path, delta: bool) -> None:
    with publisher_on_sshfs(tmp_path, delta) as (served, _, publisher):
        model = Model(lr=1e-3)
        publisher.publish_and_wait(1, model.tensors())
        for version in (2, 3):
            drop_cached_inodes()
            model.step()
            publisher.publish_and_wait(version, model.tensors())
        assert [c.step for c in list_checkpoints(served)] == [1, 2, 3]


def test_a_closed_publisher_publishing_again_still_holds_its_root(tmp_path: Path) -> None:
    """``train()`` closes the publisher at its end and ``evaluate()`` after it publishes again: the
    root stays held (released, its inode could be renumbered before the next publish)."""
    with publisher_on_sshfs(tmp_path) as (served, _, publisher):
        model = Model(lr=1e-3)
        publisher.publish_and_wait(1, model.tensors())
        publisher.close()
        drop_cached_inodes()
        model.step()
        publisher.publish_and_wait(2, model.tensors())
        assert [c.step for c in list_checkpoints(served)] == [1, 2]


def test_a_root_on_sshfs_replaced_is_still_refused(tmp_path: Path) -> None:
    """Replaced through the mount (moved away, a new folder made at its path): refused. (Replaced
    on the server behind sshfs's back, the new folder is what every client sees at that path, the
    replicas too: sshfs reports it as the folder held, and publishing there is what they watch.)"""
    with publisher_on_sshfs(tmp_path) as (served, root, publisher):
        model = Model(lr=1e-3)
        publisher.publish_and_wait(1, model.tensors())
        root.rename(root.parent / "old")  # another folder at the same path
        root.mkdir()
        drop_cached_inodes()
        model.step()
        with pytest.raises(FileNotFoundError, match="another folder than at the start"):
            publisher.publish_and_wait(2, model.tensors())
        assert list_checkpoints(served) == []


def test_a_killed_writers_folder_kept_at_the_start_goes_once_an_hour_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    # A work folder of a writer in another PID namespace (another host tag): not known dead.
    leftover = root / ".tmp-step-00000007-hb1be2d88p2-2c8567976bac"
    leftover.mkdir()
    (leftover / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    publisher = _publisher(root)
    try:
        assert leftover.exists(), "kept at the start: under an hour old, its writer not known dead"
        model = Model(lr=1e-3)
        publisher.publish_and_wait(1, model.tensors())
        publisher.join()
        assert leftover.exists()
        hour_ago = time.time() - 3700
        os.utime(leftover, (hour_ago, hour_ago))  # the run goes on: an hour later
        model.step()
        publisher.publish_and_wait(2, model.tensors())
        assert leftover.exists(), "looked for at most every LEFTOVER_SWEEP_S"
        monkeypatch.setattr(checkpoint_publisher, "LEFTOVER_SWEEP_S", 0.0, raising=False)
        with caplog.at_level(logging.INFO, logger=checkpoint_publisher.__name__):
            model.step()
            publisher.publish_and_wait(3, model.tensors())
            assert publisher._remover.join(10) == 0
        assert not leftover.exists()
        assert "left by a writer that was killed over an hour ago" in caplog.text
    finally:
        publisher.close()
    assert [c.step for c in list_checkpoints(root)] == [1, 2, 3]
