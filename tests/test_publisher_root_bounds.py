"""The trainer's looks at the checkpoint root are bounded, and it publishes only into the root it
started with, on a real network file system (sshfs over loopback):

- a root whose server stops answering (its sshd frozen, as a hung NFS server) ends the config
  check, the publisher's start and its numbering of the next version within ``sync_timeout``
  with an error naming the root, where each used to block in the kernel for good (with several
  processes, the others then died in a collective's watchdog instead);
- a root that stops answering after the replicas acknowledged a version ends that publish's
  retention within ``sync_timeout`` (logged; the old checkpoints go at a later publish) where its
  listing and deletions used to block the training step for good;
- a root that is itself the mount point and is unmounted mid-run is not published into: the
  empty mount point left behind is another folder (another device), and a checkpoint written
  there would sit on the local disk where no replica looks.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from delta_helpers import Model
from rollout_service.sidecar.root_gate import RootUnresponsive
from shared_fs import server_frozen, sshfs_mount
from test_publish_failures import _publisher
from test_replica_wait_bounds import ends_within
from trainer_helpers import NoWaiter, make_config
from trainer_hooks.checkpoint_publisher import CheckpointPublisher, SyncRecord

SYNC_TIMEOUT_S = 3.0


def publisher(root: Path) -> CheckpointPublisher:
    return _publisher(root, sync_timeout_s=SYNC_TIMEOUT_S)


def raised_within(fn: Callable[[], object], limit_s: float) -> BaseException:
    """What ``fn`` raised (see ``ends_within``): it must raise, not return."""
    raised = ends_within(fn, limit_s)
    assert raised is not None, "returned instead of raising"
    return raised


def test_a_hung_root_ends_each_look_within_sync_timeout_naming_the_root(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1", "entry_timeout=1") as (_, mnt):
        root = mnt / "ckpts"
        working = publisher(root)
        assert working.next_version() == 1
        with server_frozen(fs):
            time.sleep(2.5)  # past the mount's caches: every look reaches the frozen server
            limit = SYNC_TIMEOUT_S + 10
            error = raised_within(working.next_version, limit)
            assert isinstance(error, RootUnresponsive) and str(root) in str(error), repr(error)
            error = raised_within(lambda: publisher(mnt / "other"), limit)
            assert isinstance(error, RootUnresponsive) and "is not answering" in str(error), repr(error)
            error = raised_within(
                lambda: make_config(
                    tmp_path, mnt / "third", ["http://127.0.0.1:9"], expected_replicas=1, sync_timeout=SYNC_TIMEOUT_S
                ),
                limit,
            )
            assert isinstance(error, ValueError) and "did not answer within sync_timeout=3 s" in str(error), repr(error)
        assert working.next_version() == 1  # the server answers again: so does the publisher


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_a_root_that_is_an_unmounted_mount_point_is_not_published_into(tmp_path: Path, delta: bool) -> None:
    from rollout_service.delta_writer import DeltaCheckpointWriter

    fs = tmp_path / "fs"
    with sshfs_mount(fs) as (srv, mnt):
        pub = publisher(mnt)
        if delta:
            pub.delta = DeltaCheckpointWriter(full_every=100)
        model = Model(lr=1e-3)
        pub.publish_and_wait(1, model.tensors())
        assert (srv / "step-00000001").is_dir()
        # The publisher holds the root open (a FUSE folder keeps its inode number only so): a plain
        # unmount is refused while it runs (busy), as for any folder in use; a lazy one detaches it.
        assert subprocess.run(["fusermount", "-u", str(mnt)], capture_output=True).returncode != 0
        subprocess.run(["fusermount", "-u", "-z", str(mnt)], check=True)
        assert mnt.is_dir() and not list(mnt.iterdir())  # what is left: the empty local mount point
        model.step()
        with pytest.raises(FileNotFoundError, match=r"is another folder than at the start .* version 2 was not"):
            pub.publish_and_wait(2, model.tensors())
        assert not list(mnt.iterdir()), "a checkpoint was written on the local disk under the mount point"
        pub.close()


class FreezingWaiter(NoWaiter):
    """Acknowledges each version, then, when asked to, leaves the root's server frozen behind it."""

    def __init__(self, fs: Path, frozen: contextlib.ExitStack) -> None:
        self.fs, self.frozen, self.freeze = fs, frozen, False

    def wait(self, version: int, timeout_s: float) -> list[object]:
        if self.freeze:
            self.frozen.enter_context(server_frozen(self.fs))
            time.sleep(2.5)  # past the mount's caches: retention's looks reach the frozen server
        return []


def test_a_root_hung_after_the_acks_ends_retention_within_sync_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fs = tmp_path / "fs"
    with (
        sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1", "entry_timeout=1") as (srv, mnt),
        contextlib.ExitStack() as frozen,
    ):
        waiter = FreezingWaiter(fs, frozen)
        pub = _publisher(mnt, keep=1, sync_timeout_s=SYNC_TIMEOUT_S)
        pub.waiter = waiter
        model = Model(lr=1e-3)
        assert pub.publish_and_wait(1, model.tensors()).pruned == 0
        model.step()
        waiter.freeze = True
        caplog.set_level(logging.WARNING, logger="trainer_hooks.checkpoint_publisher")
        records: list[SyncRecord] = []
        raised = ends_within(
            lambda: records.append(pub.publish_and_wait(2, model.tensors())), 2.5 + SYNC_TIMEOUT_S + 10
        )
        assert raised is None and records[0].pruned == 0, (raised, records)
        assert any(
            "could not prune old checkpoints" in r.getMessage() and "not answering" in r.getMessage()
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]
        frozen.close()  # the server answers again: the next publish deletes what retention left
        waiter.freeze = False
        model.step()
        assert pub.publish_and_wait(3, model.tensors()).pruned >= 1
        assert sorted(p.name for p in srv.glob("step-*")) == ["step-00000003"]
        pub.close()
